"""`verify` where the machine lacks what the replay might lean on, and whose a crash is.

torch's CPU wheel does not require numpy, and `pip install torch==2.13.0 .` installs none: the replay
must prove a fix without it, on forked ranks and under torchrun. Here numpy is made unimportable in
every process (a ``sitecustomize`` on PYTHONPATH whose import hook refuses it, as a missing package
does), and the commands run as a user types them. A rank that crashes for the replay's own reason or
this machine's (a process group that cannot start) is NOT-MODELLED, exit 2, never a failed fix; one
that the adaptor's code ends is FAILED, exit 1. Real process groups throughout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.replay.launch import ReplayStopped, rank_crash
from unsafe_doctor.replay.plan import ReplayPlan, Target
from unsafe_doctor.replay.results import Blame, Milestone, RankCrash
from unsafe_doctor.replay.verify import _stopped

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples"
EMA_LOG = SAMPLES / "logs" / "toytrain_ema"
SENTINEL_LOG = SAMPLES / "logs" / "toytrain_sentinel.log"

NO_NUMPY = '''
import sys


class _NoNumpy:
    """numpy cannot be imported: every import of it fails as that of a package not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoNumpy())
'''


@pytest.fixture
def no_numpy(tmp_path) -> dict[str, str]:
    """The environment of a process in which numpy cannot be imported (nor by torch at its import)."""
    shim = tmp_path / "no_numpy"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(NO_NUMPY)
    path = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


@pytest.fixture
def toy(tmp_path) -> Path:
    """A copy of samples/framework, as the README has the user make one: fix writes into it."""
    shutil.copytree(SAMPLES / "framework", tmp_path / "toy")
    return tmp_path / "toy"


def command(*args: str, environment: dict[str, str], timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=environment
    )


def sample(log: Path, toy: Path) -> list[str]:
    return [str(log), "--source-root", str(toy), "--adaptor", str(toy / "toytrain" / "recovery.py")]


def one_line(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_numpy_is_really_unimportable_under_the_shim(no_numpy):
    probe = "import torch\ntry:\n    torch.zeros(1).numpy()\nexcept RuntimeError as error:\n    print(error)\n"
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True, env=no_numpy, timeout=120
    )
    assert result.stdout.strip() == "Numpy is not available", result.stderr


@pytest.mark.parametrize("log", [EMA_LOG, SENTINEL_LOG], ids=["toytrain_ema", "toytrain_sentinel"])
def test_both_samples_go_red_then_green_without_numpy(no_numpy, toy, log):
    """The README's commands: verify (NO-FIX, exit 1), fix --yes, verify (PROVEN, exit 0)."""
    red = command("verify", *sample(log, toy), environment=no_numpy)
    assert red.returncode == 1, red.stdout + red.stderr
    assert "NO-FIX" in red.stdout and "crashed" not in red.stdout
    fixed = command("fix", *sample(log, toy), "--yes", environment=no_numpy)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    green = command("verify", *sample(log, toy), environment=no_numpy)
    assert green.returncode == 0, green.stdout + green.stderr
    assert green.stdout.count("PROVEN") == (2 if log == SENTINEL_LOG else 1)
    assert "NumPy" not in green.stderr  # torch's import-time warning about it is the replay's to drop


def test_torchrun_proves_the_fix_without_numpy(no_numpy, toy):
    fixed = command("fix", *sample(EMA_LOG, toy), "--yes", environment=no_numpy)
    assert fixed.returncode == 0, fixed.stderr
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "-m", "unsafe_doctor.replay", *sample(EMA_LOG, toy)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=no_numpy,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.count("PROVEN") == 1  # rank 0 reports for all


# --- whose a crash is ---------------------------------------------------------------------------------


def test_a_process_group_that_cannot_start_is_not_modelled_never_a_failed_fix(toy):
    """gloo told to use a network interface this machine does not have: every rank fails to start."""
    run_cli("fix", *sample(EMA_LOG, toy), "--yes", cwd=ROOT)
    result = run_cli("verify", *sample(EMA_LOG, toy), env={"GLOO_SOCKET_IFNAME": "no-such-nic0"}, cwd=ROOT)
    assert result.returncode == 2, result.stdout + result.stderr
    text = one_line(result.stdout)
    assert "NOT-MODELLED · toytrain.state._EMA_GRAD_NORM" in text and "FAILED" not in text
    assert "the replay could not run here, which says nothing of the fix: rank" in text
    assert "crashed while starting, before its first phase, with RuntimeError:" in text


def test_a_fix_that_ends_its_rank_is_a_failed_fix(toy):
    """SystemExit from the patched receive block (the harness catches Exception only): the adaptor's."""
    adaptor = toy / "toytrain" / "recovery.py"
    assert run_cli("fix", *sample(EMA_LOG, toy), "--yes", cwd=ROOT).returncode == 0
    head, recv = adaptor.read_text().split("def recv_rank_repair", 1)
    receive = "            dist.recv(recv_tensor, src=src_rank, group=repair_group)\n"
    assert receive in recv
    adaptor.write_text(head + "def recv_rank_repair" + recv.replace(receive, "            raise SystemExit(3)\n"))
    result = run_cli("verify", *sample(EMA_LOG, toy), "--timeout", "10", cwd=ROOT)
    assert result.returncode == 1, result.stdout + result.stderr
    text = one_line(result.stdout)
    assert "FAILED · toytrain.state._EMA_GRAD_NORM" in text
    assert "a rank crashed in the adaptor's code" in text and "rank 1: SystemExit: 3 at " in text


def _raised(function) -> BaseException:
    try:
        function()
    except BaseException as error:  # noqa: BLE001
        return error
    raise AssertionError("did not raise")


def _users_code(tmp_path: Path, body: str):
    """A function whose frame is the user's: compiled from a file outside torch and unsafe-doctor."""
    path = tmp_path / "users_adaptor.py"
    path.write_text(f"def call():\n    {body}\n")
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace["call"]


def test_whose_a_crash_is_is_read_from_the_exception_and_the_phase(tmp_path):
    import torch

    numpy_missing = _raised(lambda: torch.zeros(1).numpy()) if _numpy_missing() else RuntimeError("Numpy is not available")
    fault = Milestone("unpatched", "fault")
    assert rank_crash(numpy_missing, fault).blame == "replay"
    assert rank_crash(_raised(lambda: __import__("no_such_module_here")), Milestone("patched", "rollback")).blame == "replay"
    exits = _raised(_users_code(tmp_path, "raise SystemExit(3)"))
    crash = rank_crash(exits, Milestone("patched", "repair", "recv_rank_repair"))
    assert (crash.blame, crash.error, crash.where) == ("adaptor", "SystemExit: 3", f"{tmp_path / 'users_adaptor.py'}:2")
    assert rank_crash(exits, None).blame == "replay"  # before any phase: the adaptor's code has not run
    step_fails = _raised(_users_code(tmp_path, "raise ValueError('shape mismatch')"))
    assert rank_crash(step_fails, Milestone("patched", "resume")).blame == "adaptor"  # the fix left what the step cannot use
    assert rank_crash(step_fails, Milestone("unpatched", "resume")).blame == "replay"  # a failure the replay does not model


def _numpy_missing() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return True
    return False


def _plan() -> ReplayPlan:
    target = Target(
        "generic.replica-copy:toytrain.state._EMA_GRAD_NORM", GlobalName("toytrain.state", None, "_EMA_GRAD_NORM"), 2, None
    )
    functions = {"send": "send_rank_repair", "recv": "recv_rank_repair", "rollback": "feature_rollback"}
    return ReplayPlan((target,), (), (), functions, {}, (), "block", 2, 1, 0, (), timeout=3.0)


def _crash(blame: Blame, time: float, error: str = "RuntimeError: Numpy is not available") -> RankCrash:
    return RankCrash(
        error, "/x/unsafe_doctor/replay/harness.py:449", None if blame == "replay" else "/job/adaptor.py:9", blame, time
    )


def test_a_crash_of_the_replays_own_is_not_modelled_and_the_adaptors_fails():
    histories = {0: (Milestone("unpatched", "fault"),), 1: (Milestone("unpatched", "fault"),)}
    ours = ReplayStopped("crash", 1.0, histories, "", {0: 1, 1: 1}, None, {0: _crash("replay", 2.0), 1: _crash("replay", 1.0)})
    [verdict] = _stopped(_plan(), (), ours, "emulated", 1.0).verdicts
    assert (verdict.outcome, verdict.patched) == ("not-modelled", None)
    assert verdict.unpatched.startswith(
        "the replay could not run here, which says nothing of the fix: rank 1 crashed in "
        "unpatched fault with RuntimeError: Numpy is not available at "
    )
    theirs = ReplayStopped(
        "crash", 1.0, histories, "", {0: 1, 1: 1}, None, {0: _crash("replay", 1.0), 1: _crash("adaptor", 2.0, "SystemExit: 3")}
    )
    [verdict] = _stopped(_plan(), (), theirs, "emulated", 1.0).verdicts
    assert verdict.outcome == "failed"
    assert verdict.patched.endswith("rank 1: SystemExit: 3 at /job/adaptor.py:9")
    # a rank ended by a signal says nothing of whose it is: as before, the check failed
    signalled = ReplayStopped("crash", 1.0, histories, "Killed", {0: 1, 1: -9}, None, {0: _crash("replay", 1.0)})
    [verdict] = _stopped(_plan(), (), signalled, "emulated", 1.0).verdicts
    assert verdict.outcome == "failed"


def test_a_crash_record_round_trips_as_json():
    crash = _crash("adaptor", 3.5)
    assert RankCrash.from_json(crash.to_json()) == crash
