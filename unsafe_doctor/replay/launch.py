"""Start the ranks of a replay and collect what each found.

On one machine, ``fork_ranks`` forks a launcher in a process group of its own, which imports the
user's modules and forks N ranks that meet in a gloo group on 127.0.0.1 (forking after torch and
those modules are imported saves each rank seconds of start-up); they always run the emulated
backend, since an NPU runtime does not survive a fork. This process never runs user code, and kills
the whole group on every way out. Under torchrun, ``join_torchrun`` runs this process's rank in the
group torchrun describes (hccl on an NPU) and gathers every rank's results. A rank that is still
running at the timeout is killed, and the error says where each rank was, so a send without its
receive ends as a message, never a stuck job.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import json
import os
import signal
import socket
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NoReturn

from unsafe_doctor.errors import UsageError
from unsafe_doctor.replay.plan import ReplayPlan
from unsafe_doctor.replay.processes import OutputTails, adopting_orphans
from unsafe_doctor.replay.results import Blame, Milestone, RankCrash, RankResult


@dataclass
class ReplayStopped(Exception):
    """Some ranks did not finish: a hang past the timeout, or a crash. (Not frozen: raising sets its traceback.)"""

    reason: Literal["timeout", "crash"]
    seconds: float
    histories: dict[int, tuple[Milestone, ...]]  # rank -> its progress, in order (empty: not started)
    output: str  # the tail of the ranks' own output
    exits: dict[int, int] = field(default_factory=dict)  # rank -> exit code (negative: the signal), for ranks that ended
    never_started: str | None = None  # why no rank started: a user module that exits or blocks at import
    crashes: dict[int, RankCrash] = field(default_factory=dict)  # rank -> the exception that ended it
    reported: frozenset[int] = frozenset()  # ranks that wrote their results

    def cause(self) -> tuple[int, RankCrash] | None:
        """The crash that stopped the replay: the first one of the adaptor's code, else the first one,
        when every rank that ended unasked ended by an exception (one ended by a signal or os._exit
        says nothing of whose it is: then None)."""
        ours = sorted(self.crashes.items(), key=lambda item: item[1].time)
        adaptor = [item for item in ours if item[1].blame == "adaptor"]
        if adaptor:
            return adaptor[0]
        unexplained = [rank for rank in self.exits if rank not in self.reported and rank not in self.crashes]
        return ours[0] if ours and not unexplained else None

    def place(self, rank: int) -> str:
        """Where the rank was last: "patched repair recv_rank_repair()", and how it ended if it ended unasked."""
        history = self.histories.get(rank, ())
        where = str(history[-1]) if history else "not started"
        code = self.exits.get(rank)
        if code is None or code == 1:  # 1: the rank caught an exception, and its output says which
            return where
        return f"{where}, then ended with {_exit_status(code)} before reporting"


def fork_ranks(plan: ReplayPlan, progress: Callable[[Milestone], None] | None = None) -> list[RankResult]:
    """Every rank's results, in rank order; ``progress`` hears each phase the faulty rank enters.

    The ranks are forked by a launcher in a process group of its own, which first imports the
    user's modules they share: this process never runs user code, so a module that exits or blocks
    at import is stopped by the timeout like any rank, and the whole group (ranks and whatever
    they spawned) is killed on every way out: done, crashed, timed out, an exception, SIGINT or
    SIGTERM (which is then passed on to this process's own handler)."""
    import torch  # noqa: F401  (imported once here, before the fork, for every rank)

    if plan.probe:  # a user's probe trains: torch's optimizers load dynamo on their first step (seconds),
        import torch._dynamo  # noqa: F401  (so once per command here, not once per replay in each launcher)

    port = _free_port()
    outputs = OutputTails(["launcher", *(f"rank{rank}" for rank in range(plan.world_size))])
    with _sigterm_raises(), tempfile.TemporaryDirectory(prefix="unsafe-doctor-replay-") as folder, adopting_orphans():
        work = Path(folder)
        start = time.monotonic()
        launcher = os.fork()
        if launcher == 0:  # pragma: no cover (the child's coverage is its results)
            _forked(outputs, "launcher", lambda: _launcher(plan, port, work, outputs))
        with contextlib.suppress(OSError):  # the launcher does it too: whichever comes first
            os.setpgid(launcher, launcher)
        outputs.start_reading()
        try:
            failed = _watch(launcher, harness_timeout(plan) + 5, work, _ProgressReader(work, plan.faulty, progress), outputs)
        finally:
            _end_group(launcher)
            outputs.read(0)  # what the pipes still hold
            outputs.close()
        seconds = time.monotonic() - start
        return _collect(plan, work, failed, seconds, outputs)


class _Terminated(BaseException):
    """SIGTERM arrived while the ranks ran: unwinds to the cleanup, then the signal is passed on."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM unwinds (so the ranks are killed), then reaches the handler this process had: by
    default it ends the process as SIGTERM does. Outside the main thread Python cannot take signals."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    if previous is None:  # a handler set outside Python: the default is the nearest it can be given back as
        previous = signal.SIG_DFL
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, previous)
        signal.raise_signal(signal.SIGTERM)
        raise KeyboardInterrupt from None  # a handler of the caller's that returns: stop all the same
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the cleanup short
    raise _Terminated


def _launcher(plan: ReplayPlan, port: int, work: Path, outputs: OutputTails) -> int:
    """The launcher process: imports the user's modules once, forks the ranks, reaps them."""
    os.setpgid(0, 0)
    for number in (signal.SIGINT, signal.SIGTERM):  # this group ends by SIGKILL from the parent, never by a handler
        signal.signal(number, signal.SIG_DFL)
    parent = os.getppid()
    if not _import_for_the_ranks(plan, work / "launcher.progress"):
        return 1
    from unsafe_doctor.npu.backend import frozen_heap  # torch's: this module loads without it

    children = {}
    with frozen_heap():  # what the ranks share stays shared
        for rank in range(plan.world_size):
            pid = os.fork()
            if pid == 0:
                _forked(outputs, f"rank{rank}", functools.partial(_child, plan, rank, port, work))
            children[pid] = rank
    outputs.close_writers()  # the ranks have theirs
    _reap(children, work, parent)
    return 0


def _forked(outputs: OutputTails, name: str, body: Callable[[], int]) -> NoReturn:
    """The rest of a forked process: its output into its pipe, then ``body``, whose result is the exit
    code (1, with the traceback in the output, when anything escapes it: the parent reports it)."""
    code = 1
    try:
        outputs.write_here(name)
        if name != "launcher":
            outputs.close_writers()  # the other ranks'
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        code = body()
    except BaseException:  # noqa: BLE001 (anything: the parent reports the output)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _import_for_the_ranks(plan: ReplayPlan, log: Path) -> bool:
    """The globals' modules (megatron-core takes seconds) and the user's probe imported once, for
    every rank to inherit. Each import is logged before it starts, so that the parent can name a
    module that blocks or ends the process. False when one raised SystemExit (logged too)."""
    sys.path[:0] = [root for root in plan.source_roots if root not in sys.path]
    wanted = [target.name.module for target in plan.targets if not target.as_main]  # the job has no second copy
    if plan.probe:
        wanted.append(plan.probe.partition(":")[0])
    with log.open("a", encoding="utf-8") as stream:
        for module in wanted:
            stream.write(json.dumps({"importing": module}) + "\n")
            stream.flush()
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001, S110 (the user's module may fail in any way; the rank says how)
                pass
            except BaseException as error:  # SystemExit, KeyboardInterrupt: the module ends the process
                stream.write(json.dumps({"exited": module, "error": f"{type(error).__name__}: {error}"}) + "\n")
                return False
            stream.write(json.dumps({"imported": module}) + "\n")
            stream.flush()
    return True


def _never_started(work: Path, failed: str | None, seconds: float) -> str | None:
    """Why the launcher forked no rank, read from its import log: the module that did not import."""
    try:
        last = json.loads((work / "launcher.progress").read_text(encoding="utf-8").splitlines()[-1])
    except (OSError, IndexError, ValueError):
        return None
    if "exited" in last:
        return f"importing {last['exited']} ends the process ({last['error']})"
    if "importing" not in last:
        return None
    if failed == "timeout":
        return f"importing {last['importing']} did not return within {seconds:.0f} s"
    return f"importing {last['importing']} ended the process"


def _child(plan: ReplayPlan, rank: int, port: int, work: Path) -> int:
    """One rank, in its forked process. An exception that ends it is written down (``rank_crash``)
    for the parent to say whose it is, then printed into the rank's output."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(plan.world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    progress = None
    try:
        import torch
        import torch.distributed as dist

        from unsafe_doctor.replay.harness import RankProgress, run_rank

        progress = RankProgress(str(work / f"rank{rank}.progress"))
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=plan.world_size,
            timeout=datetime.timedelta(seconds=harness_timeout(plan)),
        )
        outcome = run_rank(plan, rank, rank, progress, backend="emulated")
        (work / f"rank{rank}.json").write_text(outcome.to_json(), encoding="utf-8")
        dist.destroy_process_group()
    except BaseException as error:
        crash = rank_crash(error, progress.last if progress is not None else None)
        (work / f"rank{rank}.crash").write_text(crash.to_json(), encoding="utf-8")
        raise
    return 0


_OURS = str(Path(__file__).resolve().parents[1])  # unsafe_doctor/
_STANDARD_LIBRARY = tuple({str(Path(sysconfig.get_paths()[name]).resolve()) for name in ("stdlib", "platstdlib")})
_INSTALLED = tuple({str(Path(sysconfig.get_paths()[name]).resolve()) for name in ("purelib", "platlib")})  # may lie inside
_ADAPTORS_PHASES = ("repair", "rollback")  # where the adaptor's functions (or its fix blocks) run


def rank_crash(error: BaseException, last: Milestone | None) -> RankCrash:
    """Whose the exception that ended a rank is. The adaptor's code is caught where it runs (a
    FixFailure); what escapes is the adaptor's only when it passes through the user's code in a
    repair or a rollback (SystemExit from the adaptor), or in the first step after the *patched*
    recovery (a fix that leaves a global the step cannot use). Anything else is the replay's own or
    this machine's: an import that fails (numpy, a module of ours), a process group that does not
    start, a fault of the harness, a step that fails after the unpatched recovery in a way the
    replay does not model."""
    frames = traceback.extract_tb(error.__traceback__)
    at = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
    users = [frame for frame in frames if _is_users(frame.filename)]
    where = f"{users[-1].filename}:{users[-1].lineno}" if users else None
    blame: Blame = "replay"
    if (
        where
        and last is not None
        and not isinstance(error, ImportError)
        and (last.phase in _ADAPTORS_PHASES or (last.run == "patched" and last.phase == "resume"))
    ):
        blame = "adaptor"
    message = (str(error).splitlines() or [""])[0]
    return RankCrash(f"{type(error).__name__}: {message}" if message else type(error).__name__, at, where, blame, time.time())


def _is_users(filename: str) -> bool:
    """Not torch's (when it is imported), not unsafe-doctor's, not the standard library's (an installed
    package is the user's: a legacy adaptor lives in site-packages, which Python without a venv keeps
    inside the standard library's folder)."""
    if filename.startswith("<"):
        return False
    path = str(Path(filename).resolve())
    torch = sys.modules.get("torch")
    if path.startswith((_OURS, *([str(Path(torch.__file__).resolve().parent)] if torch and torch.__file__ else []))):
        return False
    return path.startswith(_INSTALLED) or not path.startswith(_STANDARD_LIBRARY)  # site-packages may lie in the stdlib's folder


def _reap(children: dict[int, int], work: Path, parent: int, grace: float = 3.0) -> None:
    """In the launcher: reap every rank, writing how each ended. A grace period after one crashed
    (the others often fail a moment later, each saying where it was) the rest are killed; all of
    them at once when the parent is gone (a `verify` killed by SIGKILL)."""
    pending = dict(children)
    deadline = None
    while pending:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pending:
            rank = pending.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            (work / f"rank{rank}.exit").write_text(str(code), encoding="utf-8")
            if (code != 0 or not (work / f"rank{rank}.json").exists()) and deadline is None:
                deadline = time.monotonic() + grace
            continue
        if os.getppid() != parent:
            os.killpg(0, signal.SIGKILL)
        if deadline is not None and time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for pid in pending:
        os.kill(pid, signal.SIGKILL)
    for pid in pending:
        os.waitpid(pid, 0)


def _watch(launcher: int, idle: float, work: Path, progress: _ProgressReader, outputs: OutputTails) -> str | None:
    """Wait for the launcher (without reaping it, so that its group's id stays its own) until no
    rank (nor the launcher's imports) has made progress for ``idle`` seconds: a slow machine only
    makes the replay slower, a stuck phase ends it. What went wrong, if anything."""
    started = time.time()
    while True:
        ended = os.waitid(os.P_PID, launcher, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        progress.read()
        if ended is not None:
            return None if ended.si_code == os.CLD_EXITED and ended.si_status == 0 else "crash"
        last = max((path.stat().st_mtime for path in work.glob("*.progress")), default=started)
        if time.time() - max(started, last) > idle:
            return "timeout"
        outputs.read(0.02)


def _end_group(launcher: int) -> None:
    """Kill the launcher's group (the ranks, and anything they started), then reap the launcher."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launcher, signal.SIGKILL)
    os.waitpid(launcher, 0)


class _ProgressReader:
    """The faulty rank's milestones, passed on as they are written."""

    def __init__(self, work: Path, rank: int, listener: Callable[[Milestone], None] | None) -> None:
        self.path, self.listener, self.done = work / f"rank{rank}.progress", listener, 0

    def read(self) -> None:
        if self.listener is None:
            return
        lines = _milestones(self.path)
        for milestone in lines[self.done :]:
            self.listener(milestone)
        self.done = len(lines)


def _collect(plan: ReplayPlan, work: Path, failed: str | None, seconds: float, outputs: OutputTails) -> list[RankResult]:
    results = {}
    crashes = {}
    for rank in range(plan.world_size):
        path = work / f"rank{rank}.json"
        if path.exists():
            results[rank] = RankResult.from_json(path.read_text(encoding="utf-8"))
        with contextlib.suppress(OSError, ValueError, TypeError):
            crashes[rank] = RankCrash.from_json((work / f"rank{rank}.crash").read_text(encoding="utf-8"))
    if failed or len(results) < plan.world_size:
        histories = {rank: _milestones(work / f"rank{rank}.progress") for rank in range(plan.world_size)}
        output = "".join(outputs.text(name, 2000) for name in ("launcher", *(f"rank{rank}" for rank in range(plan.world_size))))
        exits = {}
        for rank in range(plan.world_size):
            with contextlib.suppress(OSError, ValueError):
                exits[rank] = int((work / f"rank{rank}.exit").read_text(encoding="utf-8"))
        timed_out = failed == "timeout" or "Timed out" in output or "timed out" in output
        never_started = None if any(histories.values()) else _never_started(work, failed, seconds)
        raise ReplayStopped(
            "timeout" if timed_out else "crash", seconds, histories, output, exits, never_started, crashes, frozenset(results)
        )
    return [results[rank] for rank in range(plan.world_size)]


def _exit_status(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit status {code}"


def join_torchrun(plan: ReplayPlan) -> list[RankResult] | None:
    """This rank under torchrun; every rank's results on rank 0, None on the others."""
    import torch.distributed as dist

    from unsafe_doctor.npu.backend import select_backend
    from unsafe_doctor.replay.harness import RankProgress, gather_objects, run_rank

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank = int(os.environ.get("RANK", local_rank))
    progress = RankProgress(None)
    start = time.monotonic()
    try:
        backend = select_backend(device_index=local_rank)  # on an NPU, also makes it this process's device
        dist.init_process_group(
            "hccl" if backend.name == "npu" else "gloo", timeout=datetime.timedelta(seconds=harness_timeout(plan))
        )
        rank = dist.get_rank()
        outcome = run_rank(plan, rank, local_rank, progress)
        gathered = gather_objects(outcome, backend.device)
    except Exception as error:  # this rank reports its own crash (torchrun then stops the others)
        traceback.print_exc()
        crash = rank_crash(error, progress.last)
        history = (progress.last,) if progress.last else ()
        timed_out = "timed out" in str(error).lower()
        raise ReplayStopped(
            "timeout" if timed_out else "crash",
            time.monotonic() - start,
            {rank: history},
            traceback.format_exc()[-2000:],
            {},
            None,
            {rank: crash},
        ) from error
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
