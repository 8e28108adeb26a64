"""`unsafe-doctor verify` against hostile or broken user code and hostile options.

`verify` runs the user's code: their globals' modules, their probe, in adaptor mode their adaptor.
None of it may end, hang or outlive `verify`: each run here is the command as a user types it (in
this process, but in a process of its own where that process is what a test is about: what it
leaves behind, looked for in /proc, a signal to it, its memory, its terminal).
"""

from __future__ import annotations

import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import run_cli

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.replay.plan import Block, ReplayPlan, Target
from unsafe_doctor.replay.results import RankResult, RunResult, StepOutcome
from unsafe_doctor.replay.verify import judge_replay

ROOT = Path(__file__).resolve().parents[2]
EMA_LOG = ROOT / "samples" / "logs" / "toytrain_ema"
PROBES = Path(__file__).parents[2] / "samples" / "framework"

ENDINGS = {
    "os._exit": "import os\nos._exit(0)\n",
    "sys.exit": "import sys\nsys.exit(0)\n",
    "never returns": "import threading\nthreading.Event().wait()\n",  # as code stuck waiting on a peer
}


def timeout_for(ending: str) -> str:
    """The replay's --timeout: 5 s where the code never returns (the replay ends after 2 x 5 + 10 s
    without progress, and each step before it, a module's import, makes progress well inside that on
    a loaded machine); code that ends by itself gets all the time a loaded machine needs to import
    torch: the outcome never depends on timing."""
    return "5" if ending == "never returns" else "300"


PROBE = """
import os
import subprocess
import time
from pathlib import Path

from toytrain import state


def step(device):
    '''Builds toytrain's _EMA_GRAD_NORM and reads it; on rank 1 it also starts a `sleep 300`
    (its pid written under SPAWNED), and with BLOCK set it then waits for ever, saying so first
    (a file rank<N> in the folder BLOCK names).'''
    if state._EMA_GRAD_NORM is None:
        state.init_state(device)
        if os.environ["RANK"] == "1":
            child = subprocess.Popen(["sleep", "300"], start_new_session=bool(os.environ.get("NEW_SESSION")))
            Path(os.environ["SPAWNED"], str(child.pid)).touch()
        if os.environ.get("FLOOD") == os.environ["RANK"]:  # then dies unreported: verify reads what it printed
            line = "x" * 1023 + "\\n"
            for _ in range(int(os.environ["FLOOD_MB"]) << 10):
                os.write(1, line.encode())
            os.write(1, b"flooded\\n")
            os._exit(3)
    if os.environ.get("BLOCK"):
        Path(os.environ["BLOCK"], "rank" + os.environ["RANK"]).touch()
        time.sleep(300)
    state._EMA_GRAD_NORM.add_(1)
"""


@pytest.fixture
def toytrain(tmp_path) -> Path:
    shutil.copytree(ROOT / "samples" / "framework" / "toytrain", tmp_path / "toytrain")
    return tmp_path


def verify(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`unsafe-doctor verify ARGS`, run in this process: the ranks are forked by the launcher either way."""
    return run_cli("verify", *args, env={"COLUMNS": "300", **(env or {})}, cwd=ROOT)


def verify_process(*args: str, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    """`unsafe-doctor verify ARGS` in a process of its own, where that process is what a test is about."""
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", "verify", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "300", **(env or {})},
    )


def on_toytrain(toytrain: Path, *options: str) -> list[str]:
    return [str(EMA_LOG), "--source-root", str(toytrain), "--adaptor", str(toytrain / "toytrain" / "recovery.py"), *options]


def one_line(text: str) -> str:
    """The words of stdout on one line, out of the report's panels."""
    return " ".join(text.replace("│", " ").split())


def alive_in_group(pgid: int) -> list[int]:
    """Processes of the group that are not zombies (this machine's init may be slow to reap them)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(name))
    return found


def gone(pgid: int, within: float = 30.0) -> bool:  # a safety net for a loaded machine
    deadline = time.monotonic() + within
    while alive_in_group(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# --- user code that ends or blocks at import ---------------------------------------------------------


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_probe_module_that_ends_or_blocks_at_import_is_not_modelled_and_named(toytrain, tmp_path, ending):
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "ending_probe.py").write_text(ENDINGS[ending] + "\ndef step(device):\n    pass\n")
    start = time.monotonic()
    result = verify(
        *on_toytrain(
            toytrain, "--source-root", str(tmp_path / "probes"), "--probe", "ending_probe:step", "--timeout", timeout_for(ending)
        )
    )
    assert result.returncode == 2, result.stdout + result.stderr
    text = one_line(result.stdout)
    assert "NOT-MODELLED" in text and "no rank started: importing ending_probe" in text
    expected = {
        "os._exit": "ended the process",
        "sys.exit": "ends the process (SystemExit: 0)",
        "never returns": "did not return within",
    }[ending]
    assert expected in text
    if ending != "never returns":  # a process that ended is not waited for until the timeout
        assert time.monotonic() - start < float(timeout_for(ending))


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_globals_module_that_ends_or_blocks_at_import_is_not_modelled_and_named(toytrain, ending):
    state = toytrain / "toytrain" / "state.py"
    state.write_text(state.read_text() + "\n" + ENDINGS[ending])
    result = verify(*on_toytrain(toytrain, "--timeout", timeout_for(ending)))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no rank started: importing toytrain.state" in one_line(result.stdout)


@pytest.mark.parametrize(
    ("ending", "code", "expected"),
    [
        (
            "sys.exit",
            2,
            "the unpatched adaptor does not import here, even with stand-ins for what this machine lacks (SystemExit: 0)",
        ),
        ("os._exit", 1, "then ended with exit status 0 before reporting"),
        ("never returns", 1, "the replay stopped at the 5 s timeout"),
    ],
)
def test_an_adaptor_that_ends_or_blocks_at_import_in_adaptor_mode_is_reported(toytrain, ending, code, expected):
    adaptor = toytrain / "toytrain" / "recovery.py"
    adaptor.write_text(adaptor.read_text() + "\n" + ENDINGS[ending])
    result = verify(
        *on_toytrain(
            toytrain,
            "--source-root",
            str(PROBES),
            "--mode",
            "adaptor",
            "--probe",
            "toytrain_probe:train_one_step",
            "--timeout",
            timeout_for(ending),
        )
    )
    assert result.returncode == code, result.stdout + result.stderr
    assert expected in one_line(result.stdout)


# --- processes the ranks start, and signals to verify ------------------------------------------------


def spawning_probe(tmp_path: Path) -> tuple[Path, Path]:
    """The probe's folder, and the folder where it leaves the pid of the `sleep 300` it starts."""
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "spawning_probe.py").write_text(PROBE)
    (tmp_path / "spawned").mkdir()
    return tmp_path / "probes", tmp_path / "spawned"


@pytest.mark.parametrize("session", ["its group", "a session of its own"])
def test_what_a_rank_starts_does_not_outlive_a_verify_that_ends_normally(toytrain, tmp_path, session):
    """A `sleep` started with start_new_session=True is out of the ranks' group, and 8 were once
    left running after verify; now verify adopts and kills what its ranks leave."""
    probes, spawned = spawning_probe(tmp_path)
    result = verify_process(
        *on_toytrain(toytrain, "--source-root", str(probes), "--probe", "spawning_probe:step"),
        env={"SPAWNED": str(spawned), **({"NEW_SESSION": "1"} if session != "its group" else {})},
    )
    assert result.returncode == 1, result.stdout + result.stderr  # reproduced, no fix present
    pids = [int(path.name) for path in spawned.iterdir()]
    assert pids  # rank 1 started one in each run
    assert all(
        not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        for pid in pids
    )


@pytest.mark.parametrize(("number", "code"), [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_a_signal_to_verify_stops_its_ranks_and_what_they_started(toytrain, tmp_path, number, code):
    probes, spawned = spawning_probe(tmp_path)
    command = [
        sys.executable,
        "-m",
        "unsafe_doctor",
        "verify",
        *on_toytrain(toytrain, "--source-root", str(probes), "--probe", "spawning_probe:step", "--timeout", "300"),
    ]  # verify's own timeout does not race the signal on a loaded machine
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "SPAWNED": str(spawned), "BLOCK": str(blocked)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # ready: rank 1 has started its `sleep` and waits in the step, so verify is watching its ranks
        # (the deadlines are a safety net for a loaded machine, not a timing)
        deadline = time.monotonic() + 300
        while not (blocked / "rank1").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (blocked / "rank1").exists(), f"rank 1 never reached the step (verify: {process.poll()})"
        [grandchild] = [int(path.name) for path in spawned.iterdir()]
        group = os.getpgid(grandchild)
        assert group not in (os.getpgrp(), process.pid)  # the ranks' own group, not verify's
        process.send_signal(number)
        assert process.wait(timeout=300) == code
    finally:
        process.kill()
        process.wait()
    assert gone(group), alive_in_group(group)


PEAK_AT_EXIT = """
import atexit, os, sys
def _peak():
    with open(os.environ["PEAK_FILE"], "w") as out:
        out.write(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")))
atexit.register(_peak)
sys.argv[0] = "unsafe-doctor"
from unsafe_doctor.cli import main
main(sys.argv[1:])
"""


def verify_peak(toytrain: Path, tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, int]:
    """A verify run with the spawning probe, and its own peak memory in MB (not its ranks')."""
    run = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    run.mkdir()
    probes, spawned = spawning_probe(run)
    peak = run / "peak"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            PEAK_AT_EXIT,
            "verify",
            *on_toytrain(toytrain, "--source-root", str(probes), "--probe", "spawning_probe:step"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "300", "SPAWNED": str(spawned), "PEAK_FILE": str(peak), **env},
    )
    return result, int(peak.read_text()) // 1024


def test_a_rank_that_floods_its_output_costs_verify_no_more_memory(toytrain, tmp_path):
    """Each rank's output once went to a file read whole on failure: 300 MB per rank took
    verify to 839 MB. Now it is read from a pipe, and only its last 8 KB kept."""
    plain, baseline = verify_peak(toytrain, tmp_path, {})
    assert plain.returncode == 1, plain.stdout + plain.stderr
    flooded, peak = verify_peak(toytrain, tmp_path, {"FLOOD": "1", "FLOOD_MB": "300"})
    assert "ended with exit status 3 before reporting" in one_line(flooded.stdout), flooded.stdout + flooded.stderr
    assert "Traceback" not in flooded.stderr
    assert peak < baseline + 100, (baseline, peak)


# --- numbers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "environment", "message"),
    [
        (["--timeout", "nan"], {}, "--timeout must be a number of seconds above 0 and at most 86400, not nan"),
        (["--timeout", "inf"], {}, "not inf"),
        (["--timeout", "-1"], {}, "not -1"),
        (["--timeout", "0"], {}, "not 0"),
        (["--timeout", "1e300"], {}, "not 1e+300"),
        (["--ranks", "0"], {}, "--ranks must be between 2 and 16 on this machine, not 0"),
        ([], {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' under torchrun is not a number of ranks"),
    ],
)
def test_bad_numbers_are_refused_in_one_line_with_exit_2(toytrain, options, environment, message):
    result = verify(*on_toytrain(toytrain, *options), env=environment)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


# --- adaptor mode: the global the next step dies on --------------------------------------------------


def test_adaptor_mode_names_the_global_the_next_step_dies_on(toytrain):
    """docs/verify.md's adaptor-mode run: with only _EMA_GRAD_NORM fixed, the step after recovery dies on
    LOSS_LOG, and the verdict says so rather than blaming the fix that held."""
    adaptor = toytrain / "toytrain" / "recovery.py"
    fixed = run_cli("fix", *on_toytrain(toytrain, "--yes"), cwd=ROOT)
    assert fixed.returncode == 0, fixed.stderr
    assert "_EMA_GRAD_NORM" in adaptor.read_text()
    result = verify(
        *on_toytrain(toytrain, "--source-root", str(PROBES), "--mode", "adaptor", "--probe", "toytrain_probe:train_one_step")
    )
    assert result.returncode == 1, result.stdout + result.stderr
    text = one_line(result.stdout)
    assert re.search(
        r"the fix of toytrain\.state\._EMA_GRAD_NORM held, but the first step after recovery dies on "
        r"toytrain\.state\.LOSS_LOG at \S+/toytrain/state\.py:28, a global the log does not name",
        text,
    ), text


# --- progress on a terminal --------------------------------------------------------------------------


def test_progress_goes_to_stderr_on_a_terminal_and_nowhere_else(toytrain):
    quiet = verify_process(*on_toytrain(toytrain))  # stderr a pipe, where the terminal's run has a terminal
    adaptor = toytrain / "toytrain" / "recovery.py"
    assert quiet.returncode == 1 and quiet.stderr == f"unsafe-doctor: adaptor {adaptor} (given)\n"  # no progress
    reader, writer = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "unsafe_doctor", "verify", *on_toytrain(toytrain)],
        cwd=ROOT,
        env={**os.environ, "TERM": "xterm"},
        stdout=subprocess.PIPE,
        stderr=writer,
    )
    os.close(writer)
    drawn = b""
    while True:
        try:
            chunk = os.read(reader, 65536)
        except OSError:  # the terminal's other side closed: verify ended
            break
        if not chunk:
            break
        drawn += chunk
    os.close(reader)
    assert process.wait(timeout=120) == 1
    process.stdout.close()
    shown = drawn.decode(errors="replace")
    assert "replay on 4 ranks: starting" in shown  # then each phase the faulty rank enters, as the spinner redraws
    assert re.search(r"replay on 4 ranks: patched (build|fault|repair|rollback|check|resume)", shown)


# --- judging what the ranks found (results as ranks write them, no process group) ----------------------


EMA = Target(
    "generic.replica-copy:toytrain.state._EMA_GRAD_NORM",
    GlobalName("toytrain.state", None, "_EMA_GRAD_NORM"),
    2,
    "generic.replica-copy",
)
LOSS = Target(
    "generic.reinitialise:toytrain.state.LOSS_LOG", GlobalName("toytrain.state", None, "LOSS_LOG"), 1, "generic.reinitialise"
)
FUNCTIONS = {"rollback": "feature_rollback", "send": "send_rank_repair", "recv": "recv_rank_repair"}
UNSAFE = "There is unsafe data in the input tensor."


def judged(targets: tuple[Target, ...], unpatched: RunResult, patched: RunResult) -> list:
    blocks = tuple(
        Block(target.key, "recv", "recv_rank_repair", "/job/recovery.py", 40, "pass\n", (), None) for target in targets
    )
    plan = ReplayPlan(targets, blocks, (), FUNCTIONS, {}, (), "adaptor", 2, 1, 0, ())
    clean = RunResult(resume={target.key: StepOutcome() for target in targets})
    results = [RankResult(0, "emulated", clean, clean), RankResult(1, "emulated", unpatched, patched)]
    return list(judge_replay(plan, (), results, "gloo", 1.0).verdicts)


def red(*targets: Target) -> RunResult:
    return RunResult(resume={target.key: StepOutcome(UNSAFE, "/job/train.py:62", target.name.dotted) for target in targets})


def test_a_fix_block_that_breaks_the_adaptors_import_fails_rather_than_not_modelled():
    [verdict] = judged((EMA,), red(EMA), RunResult(adaptor_unavailable="SyntaxError: invalid syntax"))
    assert (verdict.outcome, verdict.patched) == ("failed", "the patched adaptor does not import: SyntaxError: invalid syntax")


def test_a_step_that_dies_on_another_findings_global_names_it_and_says_the_fix_held():
    died_on_loss = StepOutcome(UNSAFE, "/job/state.py:28", LOSS.name.dotted)
    patched = RunResult(resume={EMA.key: died_on_loss, LOSS.key: died_on_loss}, equal={EMA.key: True})
    ema, loss = judged((EMA, LOSS), red(EMA, LOSS), patched)
    assert ema.outcome == loss.outcome == "failed"
    assert ema.patched == (
        "rank 1: the fix of toytrain.state._EMA_GRAD_NORM held, but the first step after recovery dies on "
        "toytrain.state.LOSS_LOG at /job/state.py:28, another finding's global (see its verdict)"
    )
    assert loss.patched == "rank 1: the first step after recovery still fails reading toytrain.state.LOSS_LOG at /job/state.py:28"
