"""Regenerate the sample logs under samples/logs/ by running real multi-rank jobs.

Usage, from the repository root::

    .venv/bin/python samples/make_logs.py            # every generated sample
    .venv/bin/python samples/make_logs.py rollback_failed hccl_timeout

Each sample is a torchrun job on gloo/CPU (4 ranks) running a worker from samples/workers/ with
emulated torch_npu and MindIO (see those modules' docstrings; the unsafe-data rules are the replay's,
``unsafe_doctor/npu/backend.py``). Output is torchrun's combined stdout and stderr, captured as it
arrives. Only paths are rewritten (``cluster_paths``): the environment's to a cluster's site-packages
and the job's code to ``/home/user/job``, so no log names the machine it was made on.
``faq_modellink.log`` is hand-written and left alone.
"""

from __future__ import annotations

import gzip
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "samples" / "logs"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
MEGATRON_WORKER = "samples/workers/pretrain_moe.py"
TOYTRAIN_WORKER = "samples/workers/train_toy.py"
MAX_BYTES = 200_000
TIMEOUT = 300
CLUSTER_SITE_PACKAGES = "/usr/local/lib/python3.11/site-packages"
CLUSTER_BIN = "/usr/local/bin"
JOB = "/home/user/job"


def cluster_paths(text: str, folders: list[tuple[Path, str]]) -> str:
    """``text`` with this environment's paths and ``folders`` (local, cluster) as a cluster job prints them.
    ``folders`` come first, so a folder inside another is named before it."""
    replacements = [
        *((str(local), cluster) for local, cluster in folders),
        (sysconfig.get_paths()["purelib"], CLUSTER_SITE_PACKAGES),
        (str(Path(sys.executable).parent), CLUSTER_BIN),
    ]
    for local, cluster in replacements:
        text = text.replace(local + "/", cluster + "/")
    return text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(fault: str | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(["samples/workers", "samples/framework", str(ROOT)]))
    env.pop("SAMPLE_FAULT", None)
    if fault:
        env["SAMPLE_FAULT"] = fault
    return env


def torchrun(launcher_args: list[str], worker: list[str], fault: str | None = None) -> subprocess.Popen:
    return subprocess.Popen([TORCHRUN, *launcher_args, *worker], cwd=ROOT, env=worker_env(fault),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def single_node(worker: list[str], fault: str | None = None, extra: list[str] = ()) -> str:
    """Run a 4-rank job; return its console output."""
    job = torchrun(["--nproc-per-node", "4", "--master-port", str(free_port()), *extra], worker, fault)
    output, _ = job.communicate(timeout=TIMEOUT)
    return output


def job_paths(text: str) -> str:
    return cluster_paths(text, [(ROOT / "samples" / "workers", JOB), (ROOT / "samples" / "framework", JOB)])


def write(path: Path, text: str, must_contain: list[str]) -> None:
    text = job_paths(text)
    missing = [needle for needle in must_contain if needle not in text]
    if missing:
        kept = Path(tempfile.gettempdir()) / f"{path.name}.failed"
        kept.write_text(text)
        raise SystemExit(f"{path.name}: the run did not produce {missing!r}; its output is in {kept}")
    if len(text.encode()) > MAX_BYTES:
        raise SystemExit(f"{path.name}: {len(text.encode())} bytes, over the {MAX_BYTES} limit")
    path.write_text(text)
    print(f"wrote {path.relative_to(ROOT)} ({len(text.encode())} bytes)")


def megatron_moe_tracker() -> None:
    text = single_node([MEGATRON_WORKER], fault="121:1,3:uce:forward")
    write(LOGS / "megatron_moe_tracker.log", text,
          ["[rank1]: RuntimeError: There is unsafe data in the input tensor.",
           "[rank3]: RuntimeError: There is unsafe data in the input tensor.",
           "start notify all rank normal...", "ChildFailedError"])


def rollback_failed() -> None:
    text = single_node([MEGATRON_WORKER], fault="121:2:uce:after-optimizer")
    write(LOGS / "rollback_failed.log", text,
          ["An error occurred: There is unsafe data in the input tensor.", "rank:2 rollback failed, ret: 1",
           "in track_moe_metrics", "ChildFailedError"])


def hccl_timeout() -> None:
    text = single_node([TOYTRAIN_WORKER, "--case", "hccl-timeout"])
    write(LOGS / "hccl_timeout.log", text,
          ["[rank2]: torch.distributed.DistBackendError: [Rank 2] Watchdog caught collective operation timeout",
           "ChildFailedError"])


def toytrain_ema() -> None:
    """A torchrun --log-dir layout: <log-dir>/<run-id>_<suffix>/attempt_0/<local rank>/std{out,err}.log.

    torchrun picks a random suffix; it is renamed to ``sample`` so the paths stay stable. The
    faulty rank's stderr.log is gzip-compressed, as archived logs often are.
    """
    faulty_rank = 1
    target = LOGS / "toytrain_ema"
    with tempfile.TemporaryDirectory() as log_dir:
        console = single_node([TOYTRAIN_WORKER, "--case", "ema"], fault=f"21:{faulty_rank}:hbm:forward",
                              extra=["--log-dir", log_dir, "--redirects", "3"])
        (run_dir,) = Path(log_dir).iterdir()
        stderr = (run_dir / "attempt_0" / str(faulty_rank) / "stderr.log").read_text()
        if f"[rank{faulty_rank}]: RuntimeError: There is unsafe data in the input tensor." not in stderr:
            raise SystemExit(f"toytrain_ema: rank {faulty_rank} did not fail with the unsafe-data error")
        shutil.rmtree(target, ignore_errors=True)
        stable_run_dir = target / f"{run_dir.name.split('_')[0]}_sample"
        shutil.copytree(run_dir, stable_run_dir)
    for rank_log in stable_run_dir.rglob("*.log"):
        rank_log.write_text(job_paths(rank_log.read_text()))
    faulty_stderr = stable_run_dir / "attempt_0" / str(faulty_rank) / "stderr.log"
    with gzip.GzipFile(faulty_stderr.with_suffix(".log.gz"), "wb", mtime=0) as archive:
        archive.write(faulty_stderr.read_bytes())
    faulty_stderr.unlink()
    write(target / "console.log", console, ["ChildFailedError", f"rank      : {faulty_rank} (local_rank: {faulty_rank})"])


def toytrain_sentinel() -> None:
    """toytrain with the sentinel installed (``unsafe-doctor sentinel install --mode raise``) in a copy
    of its adaptor: after the fault on rank 1 the recovery stops at the end of the rollback, naming
    both globals it left unsafe; no step runs, so the log has no unsafe-data traceback at all."""
    with tempfile.TemporaryDirectory() as copy:
        framework = Path(copy) / "framework"
        shutil.copytree(ROOT / "samples" / "framework", framework, ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run([sys.executable, "-m", "unsafe_doctor", "sentinel", "install", "--adaptor",
                        str(framework / "toytrain" / "recovery.py"), "--mode", "raise", "--yes", "-q"],
                       check=True, cwd=ROOT)
        job = subprocess.Popen(
            [TORCHRUN, "--nproc-per-node", "4", "--master-port", str(free_port()), TOYTRAIN_WORKER, "--case", "ema"],
            cwd=ROOT, env=dict(worker_env("21:1:hbm:forward"),
                               PYTHONPATH=os.pathsep.join(["samples/workers", str(framework), str(ROOT)])),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output, _ = job.communicate(timeout=TIMEOUT)
        text = cluster_paths(output, [(framework, JOB), (ROOT / "samples" / "workers", JOB),
                                      (ROOT / "unsafe_doctor", f"{CLUSTER_SITE_PACKAGES}/unsafe_doctor")])
    write(LOGS / "toytrain_sentinel.log", text,
          ["[unsafe-doctor sentinel] rank 1: unsafe toytrain.state.LOSS_LOG",
           "[unsafe-doctor sentinel] rank 1: unsafe toytrain.state._EMA_GRAD_NORM",
           "rank:1 rollback failed, ret: 1"])


def kubectl_prefix() -> None:
    """Two torchrun "nodes" of 2 ranks, as ``kubectl logs -f --prefix`` shows two pods' output.

    Both launchers run here; each output line gets kubectl's ``[pod/<pod>/<container>] `` prefix
    and the lines are merged in the order they arrive, as ``kubectl logs -f`` merges streams.
    """
    port = free_port()
    lines: list[str] = []
    lock = threading.Lock()

    def pump(job: subprocess.Popen, prefix: str) -> None:
        for line in job.stdout:
            with lock:
                lines.append(prefix + line)

    jobs = []
    for node in range(2):
        job = torchrun(["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(port)],
                       [MEGATRON_WORKER], fault="121:1,3:uce:forward")
        thread = threading.Thread(target=pump, args=(job, f"[pod/llama-worker-{node}/pytorch] "))
        thread.start()
        jobs.append((job, thread))
    for job, thread in jobs:
        job.wait(timeout=TIMEOUT)
        thread.join()
    write(LOGS / "kubectl_prefix.log", "".join(lines),
          ["[pod/llama-worker-0/pytorch] [rank1]: RuntimeError: There is unsafe data in the input tensor.",
           "[pod/llama-worker-1/pytorch] [rank3]: RuntimeError: There is unsafe data in the input tensor."])


SAMPLES = {
    "megatron_moe_tracker": megatron_moe_tracker,
    "toytrain_ema": toytrain_ema,
    "rollback_failed": rollback_failed,
    "hccl_timeout": hccl_timeout,
    "kubectl_prefix": kubectl_prefix,
    "toytrain_sentinel": toytrain_sentinel,
}


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(SAMPLES))
    if unknown:
        raise SystemExit(f"unknown sample(s) {unknown}; choose from {sorted(SAMPLES)}")
    LOGS.mkdir(parents=True, exist_ok=True)
    for name in names or SAMPLES:
        SAMPLES[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
