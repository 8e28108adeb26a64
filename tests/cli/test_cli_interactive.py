"""diagnose offers each fix at a real terminal (a pseudo-terminal), even when the log comes on stdin."""

from __future__ import annotations

import gzip
import re
import shutil
from pathlib import Path

import pytest
from helpers import run_cli
from terminal import at_terminal

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "samples" / "logs" / "toytrain_ema"
FRAMEWORK = ROOT / "samples" / "framework"


def converse(args: list[str], stdin_file: Path | None, answers: list[tuple[bytes, bytes]]) -> tuple[int, str]:
    """Run the CLI with a pty as terminal (stdout and /dev/tty); answer each prompt as it appears."""
    return at_terminal(args, answers=answers, stdin_file=stdin_file)


def test_yes_at_the_terminal_applies_the_fix_while_the_log_comes_on_stdin(tmp_path):
    adaptor = tmp_path / "recovery.py"
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    gz = LOG / "none_sample" / "attempt_0" / "1" / "stderr.log.gz"
    answers = [(b"[y/N]", b"y\n"), (VERIFY_QUESTION, b"n\n")]
    code, screen = converse(["--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)], gz, answers)
    shown = " ".join(screen.split())  # the question wrapped at the terminal's width
    assert f"Apply scenario-2 fix to {adaptor}::recv_rank_repair and {adaptor}::send_rank_repair?" in shown  # both patched
    assert code == 1  # findings
    assert "unsafe-doctor: begin generic.replica-copy:toytrain.state._EMA_GRAD_NORM" in adaptor.read_text()
    assert Path(str(adaptor) + ".unsafe-doctor.bak").read_bytes() == (FRAMEWORK / "toytrain" / "recovery.py").read_bytes()
    again = "to prove it (pipe the same log in again): unsafe-doctor verify -"
    assert f"{again} --source-root {FRAMEWORK} --adaptor {adaptor}" in screen  # verify declined
    assert f"done: 1 finding fixed in {adaptor}, not proven: not replayed (verify, above)" in shown  # and exit 1


VERIFY_QUESTION = b"unpatched then patched)? [y/N]"


def test_after_a_fix_the_terminal_is_offered_verify_and_it_proves_the_fix(tmp_path):
    adaptor = tmp_path / "recovery.py"
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    args = ["diagnose", str(LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)]
    code, screen = converse(args, None, [(b"[y/N]", b"y\n"), (VERIFY_QUESTION, b"y\n")])
    assert VERIFY_QUESTION.decode() in screen
    assert "PROVEN" in screen and "bit-identical to replica rank 3" in screen
    assert "backend: emulated (CPU, gloo)" in screen
    assert f"done: 1 finding fixed in {adaptor}, proven by the replay above (verify)" in " ".join(screen.split())
    assert code == 0  # every finding fixed and proven (it once exited 1, as if nothing had been done)


def test_no_at_the_terminal_leaves_the_adaptor_untouched(tmp_path):
    adaptor = tmp_path / "recovery.py"
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    before = adaptor.read_bytes()
    code, screen = converse(
        ["diagnose", str(LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)], None, [(b"[y/N]", b"n\n")]
    )
    assert "[y/N]" in screen
    assert adaptor.read_bytes() == before


def test_without_a_terminal_the_diff_is_shown_with_how_to_apply(tmp_path):
    adaptor = tmp_path / "recovery.py"
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    before = adaptor.read_bytes()
    args = ["diagnose", str(LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)]
    result = run_cli(*args)
    assert "+    # unsafe-doctor: begin generic.replica-copy" in result.stdout
    assert f"to apply: unsafe-doctor fix {LOG} --source-root {FRAMEWORK} --adaptor {adaptor} --yes" in result.stderr
    assert adaptor.read_bytes() == before


def test_yes_flag_applies_and_verifies_without_asking(tmp_path):
    adaptor = tmp_path / "recovery.py"
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    args = ["diagnose", str(LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--yes"]
    result = run_cli(*args)
    assert "wrote" in result.stderr
    assert "unsafe-doctor: begin generic.replica-copy" in adaptor.read_text()
    assert "PROVEN · toytrain.state._EMA_GRAD_NORM" in result.stdout  # --yes accepts the verify offer too
    compile(adaptor.read_text(), str(adaptor), "exec")
    done = f"unsafe-doctor: done: 1 finding fixed in {adaptor}, proven by the replay above (verify)"
    assert result.stderr.splitlines()[-1] == done
    assert result.returncode == 0  # every finding fixed and proven


CORPUS = ROOT / "tests" / "corpus"


def test_an_unclassified_finding_asks_for_the_scenario_then_offers_its_fix(tmp_path):
    """POSITION_TABLE's source shows neither a reset nor carried state: the person decides."""
    adaptor = tmp_path / "modellink_adaptor.py"
    shutil.copy(ROOT / "samples" / "adaptors" / "legacy" / "mindio_ttp" / "adaptor" / "modellink_adaptor.py", adaptor)
    args = [
        "diagnose", str(CORPUS / "logs" / "user-postable-table.log"),
        "--source-root", str(CORPUS / "frameworks" / "postable"), "--adaptor", str(adaptor),
    ]  # fmt: skip
    _, text = converse(args, None, [(b"Scenario [1/2/skip]:", b"1\n"), (b"[y/N]", b"y\n"), (VERIFY_QUESTION, b"n\n")])
    assert "POSITION_TABLE is unclassified" in text
    assert "Apply scenario-1 fix to" in text and "feature_rollback" in text
    assert "unsafe-doctor: begin generic.reinitialise:" in adaptor.read_text()


def test_fix_with_the_log_on_stdin_asks_at_the_terminal(tmp_path):
    """`cat log | unsafe-doctor fix ...` at a terminal: the question goes to /dev/tty, as diagnose's do."""
    adaptor = tmp_path / "recovery.py"
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    log = tmp_path / "train.log"
    log.write_bytes(gzip.decompress((LOG / "none_sample" / "attempt_0" / "1" / "stderr.log.gz").read_bytes()))
    args = ["fix", "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)]
    code, screen = converse(args, log, [(b"? [y/N]:", b"y\n")])
    assert code == 0, screen
    assert "unsafe-doctor: begin generic.replica-copy:toytrain.state._EMA_GRAD_NORM" in adaptor.read_text()


@pytest.mark.parametrize("command", ["diagnose", "fix"])
@pytest.mark.parametrize("key", [b"\x04", b"\x03"], ids=["eof", "ctrl-c"])
def test_end_of_input_or_ctrl_c_at_a_prompt_exits_130_and_writes_nothing(tmp_path, command, key):
    adaptor = tmp_path / "recovery.py"
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    before = adaptor.read_bytes()
    args = [command, str(LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)]
    code, screen = converse(args, None, [(b"[y/N]:", key)])
    assert code == 130, screen
    assert "Traceback" not in screen
    assert adaptor.read_bytes() == before


def test_a_scenario_given_for_a_finding_with_no_global_says_why_nothing_follows(tmp_path):
    adaptor = tmp_path / "recovery.py"
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    log = tmp_path / "train.log"
    log.write_text(
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "/srv/job/train.py", line 62, in clip\n'
        "[rank1]:     total = compute(a, b)\n"
        "[rank1]: RuntimeError: There is unsafe data in the input tensor.\n"
    )
    code, screen = converse(["diagnose", str(log), "--adaptor", str(adaptor)], None, [(b"Scenario [1/2/skip]:", b"1\n")])
    assert code == 1
    assert "a, scenario 1: no fix can be shown: the fix must import the module that holds the global" in screen


def test_a_log_pasted_at_the_terminal_is_asked_for_and_ends_at_one_ctrl_d():
    """`unsafe-doctor -` at a terminal once waited without a word, and took two Ctrl-D."""
    pasted = (ROOT / "samples" / "logs" / "faq_modellink.log").read_bytes().replace(b"\r\n", b"\n")
    code, screen = at_terminal(["-", "--no-input"], answers=[(b"Ctrl-D on an empty line", pasted + b"\x04")])
    assert code == 1, screen
    assert "reading the log from this terminal: paste it, then press Ctrl-D on an empty line" in screen
    assert "_MOE_AUX_LOSSES_LOGGING_TRACKER" in screen.split("Ctrl-D on an empty line", 1)[1].split("RuntimeError", 1)[1]


def test_a_diff_is_coloured_at_a_terminal_and_a_plain_patch_elsewhere():
    args = [
        "fix",
        "samples/logs/toytrain_ema",
        "--source-root",
        "samples/framework",
        "--adaptor",
        "samples/framework/toytrain/recovery.py",
        "--dry-run",
    ]
    code, screen = at_terminal(args, cwd=ROOT)
    assert code == 0, screen
    assert "\x1b[32m+    # unsafe-doctor: begin " in screen and "\x1b[1m--- a/" in screen
    piped = run_cli(*args, cwd=ROOT)
    assert "\x1b" not in piped.stdout and piped.stdout.startswith("--- a/")
    shown = re.sub(r"\x1b\[[0-9;]*m", "", screen).replace("\r\n", "\n")
    assert shown[shown.index("--- a/") :].startswith(piped.stdout)


def test_a_question_wider_than_the_terminal_is_wrapped_between_words_never_inside_its_choice(tmp_path):
    """At 120 columns the terminal once cut the question as `[y/` and `N]`."""
    adaptor = tmp_path / "recovery.py"  # named twice in the question: wider than 120 columns
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    args = ["diagnose", str(LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)]
    _, screen = at_terminal(args, answers=[(b"[y/N]: ", b"n\n")], columns=120)
    question = screen[screen.rindex("\r\n", 0, screen.index("Apply scenario-2 fix")) : screen.index("[y/N]: ") + 7]
    lines = question.lstrip().split("\r\n")
    assert len(lines) > 1 and all(len(line) <= 120 for line in lines), lines
    assert lines[-1].endswith("[y/N]: ")


def test_a_question_asked_at_dev_tty_is_wrapped_at_that_terminals_width_not_at_stdouts(tmp_path):
    """The width was once stdout's as shutil reads it (COLUMNS first, here 200), while the
    question goes to the controlling terminal (the log on stdin), which is 100 columns wide: the
    terminal cut the question itself, anywhere."""
    adaptor = Path("a_recovery_adaptor_folder_of_forty_letters") / "recovery.py"  # relative: each path fits in 100
    (tmp_path / adaptor.parent).mkdir()
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", tmp_path / adaptor)
    gz = LOG / "none_sample" / "attempt_0" / "1" / "stderr.log.gz"
    args = ["diagnose", "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)]
    _, screen = at_terminal(
        args, stdin_piped=gz.read_bytes(), answers=[(b"[y/N]: ", b"n\n")], columns=200, tty_columns=100, cwd=tmp_path
    )
    question = screen[screen.rindex("\r\n", 0, screen.index("Apply scenario-2 fix")) : screen.index("[y/N]: ") + 7]
    lines = question.lstrip().split("\r\n")
    assert len(lines) > 1 and all(len(line) <= 100 for line in lines), lines
    assert lines[-1].endswith("[y/N]: ")


def test_without_a_terminal_each_fix_block_is_printed_once_as_the_diff(tmp_path):
    """With a known adaptor, each block once came twice: as code under the box, then in the diff."""
    adaptor = tmp_path / "recovery.py"
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    args = ["diagnose", str(LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)]
    result = run_cli(*args)
    assert result.stdout.count("# scenario 2, replica rank: send toytrain.state._EMA_GRAD_NORM") == 1
    assert result.stdout.count("# scenario 2, faulty rank: receive toytrain.state._EMA_GRAD_NORM") == 1
    assert "+    # scenario 2, replica rank: send toytrain.state._EMA_GRAD_NORM" in result.stdout  # in the diff


def test_the_readme_first_command_ends_with_the_fix_command_for_its_log_not_no_fix_written():
    """A diagnosis that worked once ended with "no fix written", as if something had failed."""
    result = run_cli("samples/logs/megatron_moe_tracker.log", cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert "no fix written" not in result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("unsafe-doctor: to write the fix into your recovery adaptor"), last
    assert last.endswith(": unsafe-doctor fix samples/logs/megatron_moe_tracker.log --adaptor ADAPTOR.py --yes"), last


def test_two_adaptors_at_a_terminal_the_answer_continues_the_run_on_the_log_from_stdin(tmp_path):
    """The command once ran again with the answer, on a stdin already read: "stdin is empty".
    And the folder names in the list of candidates reach the terminal escaped, not as an OSC title or a clear screen."""
    shutil.copytree(FRAMEWORK / "toytrain", tmp_path / "toytrain", ignore=shutil.ignore_patterns("__pycache__"))
    hostile = tmp_path / "vendor\x1b]0;owned\x07\x1b[2J"
    hostile.mkdir()
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", hostile / "recovery.py")
    team = tmp_path / "toytrain" / "recovery.py"
    gz = LOG / "none_sample" / "attempt_0" / "1" / "stderr.log.gz"
    answers = [(b"Which is yours? [1-2]: ", b"1\n"), (b"[y/N]: ", b"y\n"), (VERIFY_QUESTION, b"n\n")]
    code, screen = at_terminal(["--source-root", "."], stdin_piped=gz.read_bytes(), cwd=tmp_path, answers=answers)
    assert "stdin is empty" not in screen
    assert code == 1, screen
    assert "1 = toytrain/recovery.py" in screen and "2 = vendor\\x1b]0;owned\\x07\\x1b[2J/recovery.py" in screen
    assert "\x1b]0;" not in screen and "\x1b[2J" not in screen
    assert "unsafe-doctor: begin generic.replica-copy:toytrain.state._EMA_GRAD_NORM" in team.read_text()
    assert "unsafe-doctor: begin" not in (hostile / "recovery.py").read_text()
