"""How fast `unsafe-doctor diagnose` reads a huge log, against grep on the same file, and its peak memory.

    python benchmarks/diagnose_speed.py              # 1 GB log
    python benchmarks/diagnose_speed.py --size 4G

Generates a deterministic log (64 ranks of Megatron-style iteration lines, interleaved, one
unsafe-data traceback near the end), then times whole processes, page cache warm, each the median
of --repeat runs taken in pairs with their baseline:
  grep -c -F "There is unsafe data" FILE      the baseline (rg -c -F too, when rg is installed)
  unsafe-doctor diagnose FILE                 target: <= 1.0x grep
  cat FILE | unsafe-doctor                    target: <= 1.1x cat FILE | grep -c -F
  unsafe-doctor < FILE                        target: <= 1.1x grep -c -F < FILE
and prints the ratios and the peak RSS of unsafe-doctor and the processes it waited for (target: <= 100 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quiet import add_loaded_option, require_quiet

RANKS = 64
FAULTY_RANK = 3
TRACEBACK = """Traceback (most recent call last):
  File "/workspace/MindSpeed-LLM/pretrain_gpt.py", line 271, in <module>
    main()
  File "/workspace/MindSpeed-LLM/mindspeed_llm/training/training.py", line 544, in train_step
    losses_reduced = forward_backward_func(
  File "/usr/local/lib/python3.10/site-packages/megatron/core/transformer/moe/router.py", line 272, in apply_z_loss
    save_to_aux_losses_tracker(
  File "/usr/local/lib/python3.10/site-packages/megatron/core/transformer/moe/moe_utils.py", line 172, \
in save_to_aux_losses_tracker
    parallel_state._MOE_LAYER_WISE_LOGGING_TRACKER[name][layer_number - 1] += loss.detach()
RuntimeError: There is unsafe data in the input tensor.
[ERROR] 2026-11-30-03:40:12 (PID:991527, Device:3, RankID:3) ERR00003 PTA invalid value
"""


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def generate(path: Path, size: int) -> None:
    """Iteration lines of 64 ranks in a shuffled but seeded order; the traceback in the last 1%."""
    rng = random.Random(1200)
    block_lines = []
    for i in range(4096):
        rank = rng.randrange(RANKS)
        block_lines.append(
            f"[rank{rank}]: [2026-11-30 03:{i % 60:02d}:{rng.randrange(60):02d}] iteration {1000 + i:8d}/  200000 | "
            f"consumed samples: {(1000 + i) * 512:12d} | elapsed time per iteration (ms): {rng.uniform(800, 900):.1f} | "
            f"learning rate: 1.500000E-04 | global batch size: 512 | lm loss: {rng.uniform(2, 3):.6E} | "
            f"loss scale: 1.0 | grad norm: {rng.uniform(0.5, 2):.3f} | number of skipped iterations: 0 |\n"
        )
    block = "".join(block_lines).encode()
    error = "".join(f"[rank{FAULTY_RANK}]: {line}\n" for line in TRACEBACK.splitlines()).encode()
    with path.open("wb") as out:
        written, placed = 0, False
        while written < size:
            if not placed and written >= size * 0.99:
                out.write(error)
                written += len(error)
                placed = True
            out.write(block)
            written += len(block)
        if not placed:
            out.write(error)


def timed(command: list[str], stdin_from: Path | None = None, *, redirect: bool = False) -> tuple[float, int, int]:
    """(seconds, exit code, peak RSS in KB) of one run of the last process in the pipeline; `redirect`:
    stdin is the file itself (`< FILE`), not a pipe from cat."""
    # Output into a file, not /dev/null: GNU grep stops at its first match when its output is /dev/null.
    sink = tempfile.TemporaryFile()
    started = time.perf_counter()
    feeder = None
    if stdin_from is not None and redirect:
        with stdin_from.open("rb") as stdin:
            process = subprocess.Popen(command, stdin=stdin, stdout=sink, stderr=subprocess.DEVNULL)
    elif stdin_from is not None:
        feeder = subprocess.Popen(["cat", str(stdin_from)], stdout=subprocess.PIPE)
        process = subprocess.Popen(command, stdin=feeder.stdout, stdout=sink, stderr=subprocess.DEVNULL)
        feeder.stdout.close()
    else:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.DEVNULL)  # the fix offer's line is no figure
    _, status, usage = os.wait4(process.pid, 0)
    if feeder is not None:
        feeder.wait()
    sink.close()
    return time.perf_counter() - started, os.waitstatus_to_exitcode(status), usage.ru_maxrss


def paired(runs: int, commands: list[tuple[list[str], Path | None, bool]]) -> list[tuple[float, int, int]]:
    """Per command (argv, stdin file, redirected): median seconds, last exit code, peak RSS; the commands run in turn,
    `runs` rounds."""
    results: list[list[tuple[float, int, int]]] = [[] for _ in commands]
    for _ in range(runs):
        for index, (command, stdin_from, redirect) in enumerate(commands):
            results[index].append(timed(command, stdin_from, redirect=redirect))
    return [(statistics.median(r[0] for r in rounds), rounds[-1][1], max(r[2] for r in rounds)) for rounds in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="log size, e.g. 2G, 500M (default 1G)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the median counts")
    parser.add_argument("--keep", type=Path, help="write the log here and keep it")
    add_loaded_option(parser)
    args = parser.parse_args()
    require_quiet(loaded_ok=args.loaded)
    doctor = shutil.which("unsafe-doctor") or str(Path(sys.executable).with_name("unsafe-doctor"))
    workdir = Path(tempfile.mkdtemp(prefix="unsafe-doctor-bench-"))
    log = args.keep or workdir / "train.log"
    try:
        started = time.perf_counter()
        generate(log, parse_size(args.size))
        size = log.stat().st_size
        print(f"log: {size / 2**30:.2f} GiB, {RANKS} ranks, generated in {time.perf_counter() - started:.1f} s")
        subprocess.run(["cat", str(log)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache

        grep = ["grep", "-c", "-F", "There is unsafe data"]
        rg = shutil.which("rg")
        commands = [
            (grep + [str(log)], None, False),
            (grep, log, False),
            (grep, log, True),
            ([doctor, "diagnose", str(log)], None, False),
            ([doctor], log, False),
            ([doctor], log, True),
        ]
        if rg:
            commands.append(([rg, "-c", "-F", "There is unsafe data", str(log)], None, False))
        timings = paired(args.repeat, commands)
        (grep_s, _, _), (grep_pipe_s, _, _), (grep_redirect_s, _, _) = timings[:3]
        (file_s, file_rc, file_rss), (pipe_s, pipe_rc, pipe_rss), (redirect_s, _, redirect_rss) = timings[3:6]
        found = json.loads(
            subprocess.run([doctor, "diagnose", str(log), "--format", "json"], capture_output=True, text=True).stdout
        )
        variables = [f["tensor"]["variable"] for f in found["findings"] if f["tensor"]]
        print(f"{'command':<34}{'seconds':>9}{'x grep':>8}{'GB/s':>7}{'peak RSS':>11}")
        print(f"{'grep -c -F':<34}{grep_s:>9.2f}{1:>8.2f}{size / grep_s / 1e9:>7.2f}{'':>11}")
        if rg:
            rg_s = timings[6][0]
            print(f"{'rg -c -F':<34}{rg_s:>9.2f}{rg_s / grep_s:>8.2f}{size / rg_s / 1e9:>7.2f}{'':>11}")
        print(
            f"{'cat FILE | grep -c -F':<34}{grep_pipe_s:>9.2f}{grep_pipe_s / grep_s:>8.2f}"
            f"{size / grep_pipe_s / 1e9:>7.2f}{'':>11}"
        )
        print(
            f"{'unsafe-doctor diagnose FILE':<34}{file_s:>9.2f}{file_s / grep_s:>8.2f}"
            f"{size / file_s / 1e9:>7.2f}{file_rss / 1024:>8.0f} MB"
        )
        print(
            f"{'cat FILE | unsafe-doctor':<34}{pipe_s:>9.2f}{pipe_s / grep_s:>8.2f}"
            f"{size / pipe_s / 1e9:>7.2f}{pipe_rss / 1024:>8.0f} MB"
        )
        print(
            f"{'grep -c -F < FILE':<34}{grep_redirect_s:>9.2f}{grep_redirect_s / grep_s:>8.2f}"
            f"{size / grep_redirect_s / 1e9:>7.2f}{'':>11}"
        )
        print(
            f"{'unsafe-doctor < FILE':<34}{redirect_s:>9.2f}{redirect_s / grep_s:>8.2f}"
            f"{size / redirect_s / 1e9:>7.2f}{redirect_rss / 1024:>8.0f} MB"
        )
        print(f"findings: {variables} (exit codes {file_rc}, {pipe_rc})")
        print(
            f"stdin against the same pipe into grep: {pipe_s / grep_pipe_s:.2f}x; "
            f"a redirected file against grep's: {redirect_s / grep_redirect_s:.2f}x"
        )
        if rg:
            print(f"file against rg: {file_s / rg_s:.2f}x")
        else:
            print("rg: not installed, no ratio to it")
        print("targets: file <= 1.0x grep, stdin <= 1.1x grep's (pipe and redirect), peak RSS <= 100 MB")
        ok = (
            file_s <= grep_s
            and pipe_s <= 1.1 * grep_pipe_s
            and redirect_s <= 1.1 * grep_redirect_s
            and max(file_rss, pipe_rss, redirect_rss) <= 100 * 1024
            and variables
        )
        print("result: " + ("within targets" if ok else "MISSED a target"))
    finally:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
