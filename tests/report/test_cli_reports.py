"""Text reports a person can act on: code copied whole at any width, names never split, ranks as
ranges, nouns counted right, log text that cannot drive the terminal, and next steps that run as printed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import run_cli
from rich.console import Console

from unsafe_doctor.adaptor.plan import preview
from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.report import diagnosis_text as diagnosis_report
from unsafe_doctor.report.common import counted, printable, printable_lines, rank_ranges

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "samples" / "logs" / "toytrain_ema"
FRAMEWORK = ROOT / "samples" / "framework"
TOYTRAIN = FRAMEWORK / "toytrain"
CORPUS = ROOT / "tests" / "corpus"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def bare_environment(columns: int) -> dict[str, str]:
    """What the command sees of the environment: the width, and nothing of this shell's (colour, TERM, UNSAFE_DOCTOR_*)."""
    return {"COLUMNS": str(columns), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)}


def run(*args: str, columns: int = 80, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """`unsafe-doctor ARGS` in this process, with the bare environment (this test's own audit cache kept)."""
    saved = dict(os.environ)
    cache = {name: saved[name] for name in ("UNSAFE_DOCTOR_CACHE_DIR",) if name in saved}
    os.environ.clear()
    try:
        return run_cli(*args, stdin=stdin or b"", env={**bare_environment(columns), **cache})
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_in_a_process(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    """`unsafe-doctor ARGS` in a fresh Python, as a user starts it: what its first imports print is
    its own, and so are the modules its forked ranks inherit."""
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", *args],
        capture_output=True, text=True, timeout=180, env=bare_environment(columns), stdin=subprocess.DEVNULL,
    )  # fmt: skip


def fix_code_lines(diagnosis) -> list[str]:
    """Every line of every fix block the diagnosis offers, as `fix` would write it (adaptor.plan.preview)."""
    lines = []
    for item in diagnosis.findings:
        for block in preview(item, diagnosis.context):
            lines += [*block.imports, *textwrap.dedent("\n".join(block.lines)).splitlines()]
    return [line for line in lines if line.strip()]


PASTED = ROOT / "samples" / "logs" / "megatron_moe_tracker.log"


@pytest.mark.parametrize("columns", [60, 80])
def test_every_generated_code_line_appears_whole_in_the_text_report(columns):
    args = ["diagnose", str(PASTED), "--no-input"]  # no adaptor known: the code to paste is under the box
    lines = fix_code_lines(diagnose([str(PASTED)], groundwork((), ())))
    assert any(len(line) > 100 for line in lines)  # wider than either terminal: it would be wrapped in a box
    shown = run(*args, columns=columns).stdout.splitlines()
    for line in lines:
        assert line in shown, line


@pytest.mark.parametrize("columns", [60, 80])
def test_highlighted_code_on_a_colour_terminal_is_whole_too(columns):
    diagnosis = diagnose([str(PASTED)], groundwork((), ()))
    lines = fix_code_lines(diagnosis)
    console = Console(width=columns, force_terminal=True, color_system="truecolor", record=False)
    previews = [preview(item, diagnosis.context) for item in diagnosis.findings]
    with console.capture() as capture:
        console.print(diagnosis_report.diagnosis_text(diagnosis, 0.0, previews), crop=False)
    assert "\x1b[" in capture.get()  # highlighted
    shown = ANSI.sub("", capture.get()).splitlines()
    for line in lines:
        assert line in shown, line


def test_audit_at_60_columns_shows_each_global_name_and_module_unsplit():
    """The global's own name whole on its line, its module on the next: names are never cut."""
    result = run("audit", str(TOYTRAIN), "--adaptor", str(TOYTRAIN / "recovery.py"), columns=60)
    assert result.returncode == 1, result.stderr
    cells = [line.split("│")[1].strip() for line in result.stdout.splitlines() if line.startswith("│")]
    assert {"LOSS_LOG", "_EMA_GRAD_NORM"} <= set(cells) and "in toytrain.state" in cells


def test_a_title_cut_to_the_width_ends_with_an_ellipsis():
    result = run("rules", "show", "megatron.moe-aux-losses-tracker", columns=30)
    title = result.stdout.splitlines()[0]
    assert "…" in title and "megatron.moe-aux" in title
    assert "See: https://gitcode.com/Ascend/mind-cluster/issues/368" in result.stdout.splitlines()  # addresses whole


def test_ranks_are_ranges_and_nouns_are_counted():
    assert rank_ranges(range(512)) == "0-511"
    assert rank_ranges([32, *range(16)]) == "0-15, 32"
    assert rank_ranges([3]) == "3"
    assert (counted(1, "rank"), counted(2, "rank"), counted(0, "more frame")) == ("1 rank", "2 ranks", "0 more frames")


def traceback_on(rank: int, file: str = "/srv/job/toytrain/train.py", function: str = "clip_gradients",
                 line: str = "max_norm = CLIP_FACTOR * state._EMA_GRAD_NORM") -> str:  # fmt: skip
    return (
        f"[rank{rank}]: Traceback (most recent call last):\n"
        f'[rank{rank}]:   File "{file}", line 62, in {function}\n'
        f"[rank{rank}]:     {line}\n"
        f"[rank{rank}]: RuntimeError: There is unsafe data in the input tensor.\n"
    )


@pytest.mark.parametrize(("ranks", "shown"), [(range(512), "ranks 0-511"), ([*range(16), 32], "ranks 0-15, 32")])
def test_the_failing_ranks_of_a_large_job_print_as_ranges(tmp_path, ranks, shown):
    log = tmp_path / "train.log"
    log.write_text("".join(traceback_on(rank) for rank in ranks))
    result = run("diagnose", str(log), "--no-input")
    assert f"Finding 1 · {shown} " in result.stdout


def test_one_rank_one_frame_reads_in_the_singular(tmp_path):
    result = run("diagnose", str(LOG), "--source-root", str(FRAMEWORK), "--no-input", columns=120)
    assert "… 1 more frame (outer" in result.stdout and "4 ranks seen" in result.stdout
    log = tmp_path / "train.log"
    log.write_text(traceback_on(1))
    single = run("diagnose", str(log), "--no-input", columns=120).stdout
    assert "1 finding on 1 rank · 1 rank seen" in single and "1 ranks" not in single


def test_the_ranks_seen_in_a_large_log_are_counted_over_all_of_it(tmp_path):
    """An 8-rank log grown past the span parsed around its error (a long run of rank 0's
    iterations between the start-up and the fault) once reported only the ranks in that span."""
    log = tmp_path / "train.log"
    iteration = "[rank0]: iteration {:8d}/  200000 | lm loss: 2.500000E+00 | loss scale: 1.0 | grad norm: 1.000 |\n"
    with log.open("w") as out:
        out.write("".join(f"[rank{rank}]: > initialized, world size 8\n" for rank in range(8)))
        for start in range(0, 400_000, 10_000):  # about 40 MB: past the 33 MB before an error that is parsed
            out.write("".join(iteration.format(step) for step in range(start, start + 10_000)))
        out.write(traceback_on(3))
    text, as_json = run("diagnose", str(log), "--no-input", columns=120), run("diagnose", str(log), "--format", "json")
    assert "8 ranks seen" in text.stdout, text.stdout
    assert json.loads(as_json.stdout)["summary"]["ranks_seen"] == list(range(8))


HOSTILE = "\x1b]0;title\x07", "\x1b[2J", "\x9b"


def hostile_log(tmp_path: Path) -> Path:
    """A log whose file name, function, source line and message carry a title change, a screen clear,
    C1 CSI, a bell and a backspace of their own, and rich markup."""
    log = tmp_path / "hostile.log"
    title, clear, csi = HOSTILE
    log.write_text(
        traceback_on(1, file=f"/srv/job/{title}evil{csi}\x07/train.py", function=f"clip{clear}",
                     line=f"max_norm = CLIP_FACTOR * state._EMA_GRAD_NORM  # {clear}{csi}{title}\x08")
        .replace("input tensor.", f"input tensor. {title}{clear}{csi} [red]markup[/red]"),
        encoding="utf-8",
    )  # fmt: skip
    return log


def test_control_characters_from_a_log_never_reach_the_terminal_raw(tmp_path):
    """The log reader drops whole ESC sequences; what is left of them is escaped where it is shown."""
    adaptor = tmp_path / "recovery.py"
    shutil.copy(TOYTRAIN / "recovery.py", adaptor)
    result = run("diagnose", str(hostile_log(tmp_path)), "--adaptor", str(adaptor), "--no-input", columns=200)
    shown = result.stdout + result.stderr
    assert "evil\\x9b\\x07/train.py:62" in shown and "# \\x9b\\x08" in shown  # escaped, still readable
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", shown)
    assert "[red]markup[/red]" in shown  # shown as written, not as markup


def test_json_from_a_hostile_log_is_valid_utf8_with_the_text_kept(tmp_path):
    result = run_cli("diagnose", str(hostile_log(tmp_path)), "--format", "json", encoding=None)
    document = json.loads(result.stdout.decode("utf-8"))
    assert not re.search(rb"[\x00-\x08\x0b-\x1f]", result.stdout)  # json writes C0 as \u0007
    assert document["findings"][0]["culprit"]["file"] == "/srv/job/evil\x9b\x07/train.py"


def test_printable_escapes_c0_del_c1_and_line_ends_but_keeps_tabs_and_code_keeps_its_lines():
    assert printable("a\x1b[2Jb\x07\x7f\x9b\x85\tc\nd\re\u2028f") == "a\\x1b[2Jb\\x07\\x7f\\x9b\\x85\tc\\x0ad\\x0de\\u2028f"
    assert printable_lines("a\x1b[2Jb\tc\nd") == "a\\x1b[2Jb\tc\nd"


def test_with_the_log_on_stdin_the_suggested_fix_runs_as_printed(tmp_path):
    adaptor = tmp_path / "recovery.py"
    shutil.copy(TOYTRAIN / "recovery.py", adaptor)
    log = (LOG / "none_sample" / "attempt_0" / "1" / "stderr.log.gz").read_bytes()
    import gzip

    text = gzip.decompress(log)
    result = run("diagnose", "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), stdin=text)
    [line] = [line for line in result.stderr.splitlines() if "to apply" in line]
    prefix = "unsafe-doctor: not applied; to apply (pipe the same log in again): "
    assert line.startswith(prefix)
    words = shlex.split(line.removeprefix(prefix))
    assert words[:3] == ["unsafe-doctor", "fix", "-"]
    again = run(*words[1:], stdin=text)
    assert again.returncode == 0, again.stderr
    assert "unsafe-doctor: begin generic.replica-copy" in adaptor.read_text()


def test_diagnose_yes_without_an_adaptor_says_what_is_missing():
    result = run("diagnose", str(CORPUS / "logs" / "megatron-router-expert-bias.log"), "--yes")
    assert result.returncode == 1
    assert "no recovery adaptor is known" in result.stderr
    assert "--adaptor ADAPTOR.py" in result.stderr and "--source-root DIR" in result.stderr


def test_fix_dry_run_ends_with_the_command_that_writes_it(tmp_path):
    adaptor = tmp_path / "recovery.py"
    shutil.copy(TOYTRAIN / "recovery.py", adaptor)
    result = run("fix", str(LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--dry-run")
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("unsafe-doctor: dry run: nothing written; to write it: unsafe-doctor fix ")
    words = shlex.split(last.split("to write it: ", 1)[1])
    assert run(*words[1:]).returncode == 0
    assert "unsafe-doctor: begin generic.replica-copy" in adaptor.read_text()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="verify replays on torch")
def test_verify_no_fix_names_the_fix_command_and_megatron_stays_quiet(tmp_path, real):
    adaptor = tmp_path / "repair_callback.py"
    elastic = real / "mind-cluster-7.2rc1" / "taskd" / "python" / "adaptor" / "elastic_training"
    shutil.copy(elastic / "repair_callback.py", adaptor)
    log = str(CORPUS / "logs" / "megatron-router-expert-bias.log")
    result = run_in_a_process("verify", log, "--adaptor", str(adaptor))  # megatron-core imported afresh, as a user's run does
    assert result.returncode == 1
    assert "NO-FIX" in result.stdout
    assert "Warning" not in result.stderr, result.stderr  # megatron-core's Apex / Transformer Engine UserWarnings
    command = result.stdout.strip().splitlines()[-1]
    assert command == shlex.join(["unsafe-doctor", "fix", log, "--adaptor", str(adaptor), "--yes"])
    assert run(*shlex.split(command)[1:]).returncode == 0
