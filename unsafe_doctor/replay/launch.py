"""Start the ranks of a replay and collect what each found.

On one machine, ``fork_ranks`` forks N processes that meet in a gloo group on 127.0.0.1 (forking
after torch is imported saves each rank seconds of start-up); they always run the emulated backend,
since an NPU runtime does not survive a fork. Under torchrun, ``join_torchrun``
runs this process's rank in the group torchrun describes (hccl on an NPU) and gathers every rank's
results. A rank that is still running at the timeout is killed, and the error says where each rank
was, so a send without its receive ends as a message, never a stuck job.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from unsafe_doctor.errors import UsageError
from unsafe_doctor.replay.plan import ReplayPlan
from unsafe_doctor.replay.results import Milestone, RankResult


@dataclass(frozen=True)
class ReplayStopped(Exception):
    """Some ranks did not finish: a hang past the timeout, or a crash."""

    reason: Literal["timeout", "crash"]
    seconds: float
    histories: dict[int, tuple[Milestone, ...]]  # rank -> its progress, in order (empty: not started)
    output: str  # the tail of the ranks' own output

    def place(self, rank: int) -> str:
        """Where the rank was last: "patched repair recv_rank_repair()"."""
        history = self.histories.get(rank, ())
        return str(history[-1]) if history else "not started"


def fork_ranks(plan: ReplayPlan) -> list[RankResult]:
    """Every rank's results, in rank order."""
    import torch  # noqa: F401  (imported once here, before the fork, for every rank)

    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="unsafe-doctor-replay-") as folder:
        work = Path(folder)
        children = {}
        with _imported_for_the_ranks(plan):
            for rank in range(plan.world_size):
                pid = os.fork()
                if pid == 0:  # pragma: no cover (the child's coverage is its results)
                    _child(plan, rank, port, work)
                children[pid] = rank
        start = time.monotonic()
        failed = _wait(children, start + harness_timeout(plan) + 5)
        seconds = time.monotonic() - start
        results = {}
        for rank in range(plan.world_size):
            path = work / f"rank{rank}.json"
            if path.exists():
                results[rank] = RankResult.from_json(path.read_text(encoding="utf-8"))
        if failed or len(results) < plan.world_size:
            histories = {rank: _milestones(work / f"rank{rank}.progress") for rank in range(plan.world_size)}
            output = "".join(_tail(work / f"rank{rank}.out") for rank in range(plan.world_size))
            timed_out = failed == "timeout" or "Timed out" in output or "timed out" in output
            raise ReplayStopped("timeout" if timed_out else "crash", seconds, histories, output)
        return [results[rank] for rank in range(plan.world_size)]


@contextlib.contextmanager
def _imported_for_the_ranks(plan: ReplayPlan) -> Iterator[None]:
    """The globals' modules (megatron-core takes seconds) imported once, for every rank to inherit;
    afterwards this process gets its import path back and forgets the user's modules (a library
    caller, or the next replay, may hold another copy of them)."""
    path, modules = list(sys.path), set(sys.modules)
    sys.path[:0] = [root for root in plan.source_roots if root not in sys.path]
    wanted = [target.module for target in plan.targets]
    if plan.probe:  # a user's probe trains: torch's optimizers load dynamo on their first step (seconds)
        wanted += ["torch._dynamo", plan.probe.partition(":")[0]]
    for module in wanted:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001, S110 (the user's module may fail in any way; the rank says how)
            pass
    try:
        yield
    finally:
        sys.path[:] = path
        roots = tuple(plan.source_roots)
        for name in set(sys.modules) - modules:
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(roots):
                del sys.modules[name]


def _child(plan: ReplayPlan, rank: int, port: int, work: Path) -> None:
    """One rank, in the forked process; never returns."""
    code = 1
    try:
        output = os.open(work / f"rank{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(output, 1)
        os.dup2(output, 2)
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(plan.world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch
        import torch.distributed as dist

        from unsafe_doctor.replay.harness import Progress, run_rank

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=plan.world_size, timeout=datetime.timedelta(seconds=harness_timeout(plan)))
        outcome = run_rank(plan, rank, rank, Progress(str(work / f"rank{rank}.progress")), backend="emulated")
        (work / f"rank{rank}.json").write_text(outcome.to_json(), encoding="utf-8")
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001 (anything: the parent reports the rank's output)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(children: dict[int, int], deadline: float, grace: float = 3.0) -> str | None:
    """Reap every child; past the deadline, or a grace period after one crashed (the others often
    fail a moment later, each saying where it was), kill the rest. What went wrong, if anything."""
    pending = dict(children)
    problem = None
    while pending:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pending:
            del pending[pid]
            if os.waitstatus_to_exitcode(status) != 0 and problem is None:
                problem = "crash"
                deadline = min(deadline, time.monotonic() + grace)
            continue
        if time.monotonic() > deadline:
            problem = problem or "timeout"
            break
        time.sleep(0.02)
    for pid in pending:
        os.kill(pid, signal.SIGKILL)
    for pid in pending:
        os.waitpid(pid, 0)
    return problem


def join_torchrun(plan: ReplayPlan) -> list[RankResult] | None:
    """This rank under torchrun; every rank's results on rank 0, None on the others."""
    import torch.distributed as dist

    from unsafe_doctor.replay.backend import select_backend
    from unsafe_doctor.replay.harness import Progress, run_rank

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = select_backend(device_index=local_rank)  # on an NPU, also makes it this process's device
    dist.init_process_group("hccl" if backend.name == "npu" else "gloo",
                            timeout=datetime.timedelta(seconds=harness_timeout(plan)))
    rank = dist.get_rank()
    outcome = run_rank(plan, rank, local_rank, Progress(None))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    dist.destroy_process_group()
    return gathered if rank == 0 else None


def harness_timeout(plan: ReplayPlan) -> float:
    """The default group's: longer than the repair group's, so that a repair transfer that waits
    in vain times out first, on the rank that waits, while the others are still waiting for it."""
    return 2 * plan.timeout + 5


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_world_size() -> int:
    """torchrun's WORLD_SIZE, refused unless it is a whole number (a hand-set one may be anything)."""
    text = os.environ["WORLD_SIZE"]
    if not text.strip().isdigit():
        raise UsageError(f"WORLD_SIZE={text!r} under torchrun is not a number of ranks")
    return int(text)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _milestones(path: Path) -> tuple[Milestone, ...]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return ()
    return tuple(Milestone.from_json(line) for line in lines if line.endswith("}"))  # not a line cut by a kill


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-limit:]
    except OSError:
        return ""
