"""Bad input, end to end: one line on stderr, exit 2, never a Python traceback."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys

import pytest
from helpers import refused, run_cli

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.sentinel_lines import UnsafeGlobal, format_line


def run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    return run_cli(*args, stdin=stdin, encoding="latin-1")


def test_missing_file(tmp_path):
    refused(run("diagnose", str(tmp_path / "missing.log")), "no such file or directory")


def test_folder_without_logs(tmp_path):
    (tmp_path / "readme.md").write_text("no logs here")
    refused(run("diagnose", str(tmp_path)), "no log files in this folder")


def test_corrupt_gzip(tmp_path):
    data = gzip.compress(b"iteration 1 | lm loss: 2.0\n" * 1000)
    (tmp_path / "rank_0.log.gz").write_bytes(data[:-20])
    refused(run("diagnose", str(tmp_path / "rank_0.log.gz")), "corrupt gzip data")


def test_binary_junk(tmp_path):
    (tmp_path / "core.log").write_bytes(bytes(range(256)) * 64)
    refused(run("diagnose", str(tmp_path / "core.log")), "not a text log")


def test_empty_stdin():
    refused(run("diagnose"), "stdin is empty")


def test_empty_stdin_without_command():
    refused(run(), "stdin is empty")


def run_unprivileged(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m unsafe_doctor ARGS` bound by file modes. Root reads any file through two
    capabilities; util-linux's setpriv starts the command without them. (Becoming another user
    instead would also need that user to read the interpreter and every `sys.path` entry.)"""
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []
    command = [*prefix, sys.executable, "-m", "unsafe_doctor", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def test_permission_denied(tmp_path):
    path = tmp_path / "train.log"
    path.write_text("x\n")
    path.chmod(0o644)
    readable = run_unprivileged("diagnose", str(path))
    assert readable.returncode == 0, readable.stderr
    path.chmod(0)
    refused(run_unprivileged("diagnose", str(path)), "permission denied")


def test_a_sys_path_folder_this_user_cannot_enter_is_passed_over(tmp_path):
    """A PYTHONPATH entry under a folder without search permission: Path.is_dir raises there."""
    locked = tmp_path / "locked"
    (locked / "lib").mkdir(parents=True)
    log = tmp_path / "train.log"
    log.write_text(" iteration 10/ 100 | lm loss: 2.0 |\n")
    locked.chmod(0)
    try:
        environment = {**os.environ, "PYTHONPATH": f"{os.environ.get('PYTHONPATH', '')}:{locked / 'lib'}"}
        result = run_unprivileged("diagnose", str(log), env=environment)
    finally:
        locked.chmod(0o755)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr


def test_clean_log_exits_zero_and_says_so(tmp_path):
    (tmp_path / "train.log").write_text(" iteration 10/ 100 | lm loss: 2.0 |\n")
    result = run("diagnose", str(tmp_path / "train.log"))
    assert result.returncode == 0
    assert "No 'There is unsafe data in the input tensor' error" in result.stdout


SENTINEL_LINE = format_line(
    UnsafeGlobal(3, "emulated", GlobalName("megatron.core.parallel_state", None, "_GLOBAL_MEMORY_BUFFER"), 2, (), 1, None, None)
)


@pytest.mark.parametrize(
    "text",
    [
        "[rank3]: Traceback (most recent call last):\n"
        '[rank3]:   File "/w/megatron/core/transformer/moe/moe_utils.py", line 172, in save_to_aux_losses_tracker\n'
        "[rank3]:     parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER[name][layer_number - 1] += loss.detach()\n"
        "[rank3]: RuntimeError: There is unsafe data in the input tensor.\n",
        f"[rank3]: {SENTINEL_LINE}\n",  # the sentinel's line, no traceback
    ],
    ids=["traceback", "sentinel"],
)
def test_diagnose_path_never_imports_torch(tmp_path, text):
    log = tmp_path / "train.log"
    log.write_text(text)
    probe = (
        "import sys\n"
        "from unsafe_doctor.cli import main\n"
        "try:\n"
        f"    main(['diagnose', {str(log)!r}, '--format', 'json'])\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        "heavy = sorted(name for name in sys.modules if name.split('.')[0] in ('torch', 'torch_npu', 'megatron', 'numpy'))\n"
        "print('IMPORTED', heavy, code, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert "IMPORTED [] 1" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("diagnose", "x.log", "--format", "bogus"), "Invalid value for '--format'"),
        (("fix", "x.log", "--no-such-option"), "No such option '--no-such-option'"),
        (("rules", "show"), "Missing argument 'RULE_ID'"),
    ],
)
def test_a_bad_option_is_one_line_not_a_usage_box(args, fragment):
    refused(run(*args), fragment)


@pytest.mark.parametrize(
    "args",
    [
        ("fix", "x.log", "--format", "sarif"),
        ("verify", "x.log", "--format", "sarif"),
        ("rules", "list", "--format", "sarif"),
        ("rules", "show", "megatron.grad-scaler", "--format", "sarif"),
    ],
)
def test_a_format_the_command_does_not_write_is_refused_by_the_parser(args):
    """Each command offers only its own formats: sarif is for diagnose and audit."""
    refused(run(*args), "Invalid value for '--format' / '-f': 'sarif' is not one of 'text', 'json'")
