"""Input built to hang or crash reading it: log lines with runs that make a backtracking
pattern quadratic, and numbers longer than `int` converts (4,300 digits) in a log, a rules file or
pyproject.toml. Each runs the CLI on real files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli

from unsafe_doctor.log.arguments import read_arguments
from unsafe_doctor.log.lines import LogLine, normalise
from unsafe_doctor.log.recovery import catch_form

ROOT = Path(__file__).resolve().parents[2]
ERROR_LOG = ROOT / "samples" / "logs" / "faq_modellink.log"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
RUN = 1 << 20  # a 1 MB run: linear work is milliseconds, quadratic work is an hour
HUGE = "9" * 5000  # past `int`'s 4,300 digits


def doctor(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI in this process, for what the input holds."""
    return run_cli(*args, cwd=cwd, env={"NO_COLOR": "1"})


def job_log(tmp_path: Path, *lines: str) -> Path:
    """The sample error log with `lines` before it."""
    log = tmp_path / "job.log"
    log.write_text("".join(line + "\n" for line in lines) + ERROR_LOG.read_text())
    return log


def diagnose(tmp_path: Path, *lines: str) -> subprocess.CompletedProcess[str]:
    return doctor("diagnose", str(job_log(tmp_path, *lines)))


def diagnose_in_time(tmp_path: Path, *lines: str) -> subprocess.CompletedProcess[str]:
    """`diagnose` in a process of its own, killed past 60 s, far above what linear work takes: a
    quadratic reader fails the test instead of holding this process for an hour."""
    command = [sys.executable, "-m", "unsafe_doctor", "diagnose", str(job_log(tmp_path, *lines))]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=60)


DUMP_TITLE = "-------------------- arguments --------------------"
DUMP_END = "-------------------- end of arguments --------------------"


@pytest.mark.parametrize(
    "lines",
    [
        pytest.param((DUMP_TITLE, "  fp16 ........ False" + " " * RUN + "x", DUMP_END), id="value-then-spaces"),
        pytest.param((DUMP_TITLE, "-" * RUN + " x", DUMP_END), id="a-run-of-dashes"),
        pytest.param((DUMP_TITLE, "-------- " * (RUN // 9), DUMP_END), id="rule-openings"),
        pytest.param(
            ("rank:0 catch E exception, error_code:" * (RUN // 37) + " There is unsafe data in the input tensor.",),
            id="v26-catch-without-its-end",
        ),
        pytest.param(("rank:0 catch HBM MULTI BIT ECC " * (RUN // 31) + "ex instance:x",), id="catch-names-without-exception"),
        pytest.param(("[a" + "0" * RUN + "x]: rank 0 UCE ERROR",), id="role-prefix-digits"),
    ],
)
def test_a_hostile_line_is_read_in_linear_time(tmp_path, lines):
    result = diagnose_in_time(tmp_path, *lines)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "1 finding" in result.stdout


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(f'  File "/job/train.py", line {HUGE}, in step', id="frame-line"),
        pytest.param(f"[rank{HUGE}]: hello", id="rank-prefix"),
        pytest.param(f"[worker{HUGE}]: hello", id="role-prefix"),
        pytest.param(f"[pod/job-{HUGE}/main] hello", id="pod-ordinal"),
        pytest.param(f"rank:{HUGE} start to rollback callback", id="rank-colon"),
        pytest.param(f"[repair] rank 3, step:{HUGE}", id="step"),
        pytest.param(f"rank:3 successfully gather and rollback at iteration {HUGE}", id="iteration"),
    ],
)
def test_a_number_past_ints_limit_is_no_number(tmp_path, line):
    result = diagnose(tmp_path, line)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr


def test_a_number_past_ints_limit_in_the_error_lines_is_no_number(tmp_path):
    """The frame and the NPU error line of the traceback diagnose reads, not lines before it."""
    log = tmp_path / "job.log"
    text = ERROR_LOG.read_text().replace("line 172, in", f"line {HUGE}, in").replace("RankID:3", f"RankID:{HUGE}")
    log.write_text(text)
    result = doctor("diagnose", str(log))
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr


def test_the_linear_readers_read_what_the_patterns_read():
    """The rewritten readers keep their meaning: a dump's title, values and end; v26's catch line; a role's rank."""
    texts = [
        "x ------ no",
        "------------ MindSpeed-LLM Arguments ------------  ",
        "  fp16 ........ False   ",
        "  seq_length ... 4096",
        "-------- end of MindSpeed-LLM Arguments --------",
    ]
    lines = [LogLine(0, text, "log", offset) for offset, text in enumerate(texts)]
    arguments = read_arguments(lines)
    assert arguments is not None and arguments.title == "MindSpeed-LLM Arguments"
    assert arguments.values == {"fp16": "False", "seq_length": "4096"}
    assert read_arguments(lines[1:4]) is None  # no end line
    assert catch_form("rank:1 catch RuntimeError exception, error_code:1003， ex instance: unsafe") == "v26"
    assert catch_form("rank:1 catch RuntimeError exception, error_code:1003 ex instance: unsafe") is None
    assert normalise("[worker12]:text") == (12, "text")
    assert normalise("[worker12x]: text") == (None, "[worker12x]: text")


def test_a_number_past_ints_limit_in_a_rules_file_is_one_line_with_its_line(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"rules:\n  - id: acme.x\n    title: x\n    match: {{variable: X}}\n    scenario: {HUGE}\n")
    result = doctor("rules", "validate", str(rules))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == [f"{rules}:5: invalid YAML: an integer of 5000 characters is out of range"]


def test_a_number_past_ints_limit_in_another_tools_table_breaks_nothing(tmp_path):
    (tmp_path / "pyproject.toml").write_text(f'[tool.other]\nn = {HUGE}\n\n[tool.unsafe-doctor]\nrules = ["mine.yaml"]\n')
    result = doctor("rules", "list", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "mine.yaml" in result.stderr  # our table was read: the rules file it names is missing
    (tmp_path / "pyproject.toml").write_text(f"[tool.other]\nn = {HUGE}\n")
    result = doctor("rules", "list", cwd=tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


def test_a_number_past_ints_limit_in_our_table_is_one_line(tmp_path):
    (tmp_path / "pyproject.toml").write_text(f"[tool.unsafe-doctor]\nadaptor = {HUGE}\n")
    result = doctor("rules", "list", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    pyproject = tmp_path / "pyproject.toml"
    assert result.stderr.splitlines() == [f"unsafe-doctor: {pyproject}: [tool.unsafe-doctor] adaptor must be a path (a string)"]


def test_an_expression_holding_a_long_run_of_spaces_is_put_on_one_line_in_linear_time():
    """Not a log line but a framework file's text (a global's value in a report): a string of spaces."""
    code = (
        "from unsafe_doctor.source.syntax import one_line\n"
        f"print(one_line('x = \"' + ' ' * {RUN} + '\"  \\n\\n   + y').endswith('\" + y'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert result.stdout == "True\n", result.stderr
