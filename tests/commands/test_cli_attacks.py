"""Attacks at the command line: each case once ended in a traceback, the wrong
exit code or the wrong shell's script, and now gets what it should. Run for real, in a
subprocess: closed standard streams, an ASCII terminal, a deleted working folder, hostile
pyproject.toml files, a read-only home, names too long for the file system, audits of what is
not Python.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from helpers import refused
from terminal import at_terminal

ROOT = Path(__file__).resolve().parents[2]
FAQ_LOG = ROOT / "samples" / "logs" / "faq_modellink.log"
FRAMEWORK = ROOT / "samples" / "framework"
COMMANDS = [["-V"], ["--help"], [str(FAQ_LOG)], ["rules", "list"], ["audit", str(FRAMEWORK)], ["fix", "--help"]]


def run(
    *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, close: int | None = None, encoding: str = "utf-8"
) -> subprocess.CompletedProcess[str]:
    """The command in a fresh process; `close`: the standard stream (1 or 2) it starts without;
    `encoding`: the one its output is read in."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("UNSAFE_DOCTOR_")}
    environment.update({"COLUMNS": "120", "PYTHONPATH": str(ROOT), **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", *args],
        capture_output=True,
        encoding=encoding,
        cwd=cwd,
        env=environment,
        stdin=subprocess.DEVNULL,
        timeout=120,
        preexec_fn=None if close is None else lambda: os.close(close),
    )


# --- standard streams ------------------------------------------------------------------------------


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_a_closed_stdout_is_one_line_and_exit_2_for_every_command(args):
    refused(run(*args, close=1), "standard output is closed")


def test_a_closed_stderr_keeps_each_outcomes_exit_code():
    assert run(str(ROOT / "no-such.log"), close=2).returncode == 2
    found = run(str(FAQ_LOG), close=2)
    assert found.returncode == 1 and "Finding 1" in found.stdout
    assert run("-V", close=2).returncode == 0


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_an_output_encoding_that_is_not_utf8_escapes_instead_of_failing(encoding):
    text = run(str(FAQ_LOG), env={"PYTHONIOENCODING": encoding}, encoding=encoding)
    assert text.returncode == 1 and "Traceback" not in text.stderr, text.stderr
    assert "_MOE_AUX_LOSSES_LOGGING_TRACKER" in text.stdout
    escaped = run(str(FAQ_LOG), "--format", "json", env={"PYTHONIOENCODING": encoding}, encoding=encoding)
    plain = run(str(FAQ_LOG), "--format", "json")
    assert escaped.returncode == 1 and escaped.stdout.isascii()
    assert json.loads(escaped.stdout)["findings"] == json.loads(plain.stdout)["findings"]


# --- where it runs ------------------------------------------------------------------------------------


def test_a_deleted_working_folder_is_one_line_and_exit_2(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    # started in the folder, which is then removed under it: as a user's shell is left in a folder deleted by `rm -rf`
    script = (
        f"import os, sys, runpy; os.rmdir({str(gone)!r}); sys.argv = ['unsafe-doctor', *sys.argv[1:]]; "
        "runpy.run_module('unsafe_doctor', run_name='__main__')"
    )
    for args in (["--help"], [str(FAQ_LOG)], ["audit", str(FRAMEWORK)], ["rules", "list"]):
        result = subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            cwd=gone,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=120,
        )
        refused(result, "the working folder no longer exists")
        gone.mkdir()


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        ("[tool.unsafe-doctor]\nrules = " + "[" * 20000 + "]" * 20000 + "\n", "nested too deep"),
        ('[tool.unsafe-doctor]\nsource-roots = ["a\\u0000b"]\n', "source-roots holds a NUL byte"),
        ('[tool.unsafe-doctor]\nadaptor = "recovery\\u0000.py"\n', "adaptor holds a NUL byte"),
        ('[tool.unsafe-doctor]\nfunctions = {rollback = "a\\u0000b"}\n', "functions.rollback holds a NUL byte"),
        ('[tool.unsafe-doctor]\nsource-root = "src"\n', "did you mean 'source-roots'?"),
    ],
    ids=["deep", "nul-root", "nul-adaptor", "nul-function", "misspelt-key"],
)
def test_a_hostile_pyproject_above_the_working_folder_is_one_line(tmp_path, table, fragment):
    (tmp_path / "pyproject.toml").write_text(table)
    inner = tmp_path / "job"
    inner.mkdir()
    refused(run(str(FAQ_LOG), cwd=inner), fragment)


def test_a_pyproject_whose_tool_is_no_table_holds_no_settings(tmp_path):
    (tmp_path / "pyproject.toml").write_text('tool = "x"\n')
    result = run(str(FAQ_LOG), "--format", "json", cwd=tmp_path)
    assert result.returncode == 1 and json.loads(result.stdout)["findings"], result.stderr


# --- shell completion ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shell", "marker"),
    [
        ("bash", "complete_bash"),
        ("zsh", "#compdef unsafe-doctor"),
        ("fish", "complete_fish"),
        ("powershell", "complete_powershell"),
    ],
)
def test_show_completion_prints_the_named_shells_script(shell, marker):
    for args in (["--show-completion", shell], [f"--show-completion={shell}"]):
        result = run(*args)
        assert result.returncode == 0 and marker in result.stdout, result.stderr


def test_install_completion_installs_the_named_shells_script(tmp_path):
    result = run("--install-completion", "zsh", env={"HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "zsh completion installed" in result.stdout
    assert "#compdef unsafe-doctor" in (tmp_path / ".zfunc" / "_unsafe-doctor").read_text()
    assert ".zfunc" in (tmp_path / ".zshrc").read_text()
    assert not (tmp_path / ".bashrc").exists()


def test_install_completion_into_a_home_it_cannot_write_is_one_line(tmp_path):
    refused(run("--install-completion", "bash", env={"HOME": os.devnull}), "cannot install bash completion")
    refused(run("--show-completion", "tcsh"), "no completion for 'tcsh'")


# --- names and inputs -------------------------------------------------------------------------------

LONG = "a" * 300


def test_an_adaptor_name_too_long_for_the_file_system_is_one_line(tmp_path):
    refused(run("audit", str(FRAMEWORK), "--adaptor", LONG), "file name too long")
    refused(run("audit", str(FRAMEWORK), env={"UNSAFE_DOCTOR_ADAPTOR": LONG}), "file name too long")
    (tmp_path / "pyproject.toml").write_text(f'[tool.unsafe-doctor]\nadaptor = "{LONG}"\n')
    refused(run("audit", str(FRAMEWORK), cwd=tmp_path), "file name too long")


def test_an_audit_with_no_python_file_to_read_is_a_usage_error(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("# x\n")
    archive = tmp_path / "code.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(FRAMEWORK / "toytrain" / "recovery.py", arcname="recovery.py")
    for given in (os.devnull, str(notes), str(archive)):
        refused(run("audit", given), "not a Python file")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(notes, empty)
    refused(run("audit", str(empty)), "no Python file (*.py) to audit")


# --- -o: where the report goes ------------------------------------------------------------------------


def test_output_to_a_device_or_fifo_is_written_through_not_replaced(tmp_path):
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    result = run(str(FAQ_LOG), "--format", "json", "-o", str(fifo))
    assert result.returncode == 1, result.stderr
    assert json.loads(reader.communicate(timeout=60)[0])["findings"]
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    if os.geteuid() == 0:  # device nodes of our own (/dev/null, /dev/full), so that a failure replaces no system file
        null, full = tmp_path / "null", tmp_path / "full"
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.mknod(full, stat.S_IFCHR | 0o666, os.makedev(1, 7))
        assert run(str(FAQ_LOG), "-o", str(null)).returncode == 1
        refused(run(str(FAQ_LOG), "-o", str(full)), f"cannot write the report to {full}: no space left on device")
        assert stat.S_ISCHR(null.lstat().st_mode) and stat.S_ISCHR(full.lstat().st_mode)


def test_output_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    target = tmp_path / "reports" / "latest.json"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "report.json"
    link.symlink_to(target)
    assert run(str(FAQ_LOG), "--format", "json", "-o", str(link)).returncode == 1
    assert link.is_symlink() and json.loads(target.read_text())["findings"]
    assert sorted(path.name for path in target.parent.iterdir()) == ["latest.json"]


def test_output_naming_the_commands_own_input_is_refused_and_the_input_kept(tmp_path):
    log = tmp_path / "train.log"
    shutil.copy(FAQ_LOG, log)
    refused(run(str(log), "-o", str(log)), "would replace the command's own input")
    refused(run(str(tmp_path), "-o", str(tmp_path / "report.log")), "would replace the command's own input")
    assert log.read_bytes() == FAQ_LOG.read_bytes() and not (tmp_path / "report.log").exists()

    adaptor = tmp_path / "recovery.py"
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    fix = ["fix", str(ROOT / "samples" / "logs" / "toytrain_ema"), "--source-root", str(FRAMEWORK), "--yes"]
    refused(run(*fix, "--adaptor", str(adaptor), "-o", str(adaptor)), "would replace the command's own input")
    assert adaptor.read_bytes() == (FRAMEWORK / "toytrain" / "recovery.py").read_bytes()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["recovery.py", "train.log"]  # no backup: nothing written

    package = tmp_path / "pkg"
    package.mkdir()
    shutil.copy(adaptor, package / "x.py")
    refused(run("audit", str(package), "-o", str(package / "x.py")), "would replace the command's own input")
    assert (package / "x.py").read_bytes() == adaptor.read_bytes()
    assert run("audit", str(package), "-o", str(tmp_path / "audit.txt")).returncode in (0, 1)  # beside it: written


# --- injection: names and fields that would start a line or drive the terminal ---------------------------

INJECTED = "\n::error file=x.py,line=1::injected"


def no_injected_line(*outputs: str) -> None:
    for output in outputs:
        assert "\x1b" not in output and "\x07" not in output, output
        assert not [line for line in output.splitlines() if "injected" in line and line.startswith("::")], output


def test_a_log_name_cannot_start_a_workflow_command_or_a_line_of_its_own(tmp_path):
    folder = tmp_path / f"job{INJECTED}"
    folder.mkdir()
    shutil.copy(FAQ_LOG, folder / f"rank3{INJECTED}.log")
    (folder / f"rank9{INJECTED}.log.gz").write_bytes(b"\x1f\x8b\x08\x00 a broken gzip")
    for args in ([str(folder), "--format", "github"], [str(folder)], [str(folder), "--format", "sarif"]):
        result = run(*args)
        assert result.returncode == 1 and "skipped" in result.stderr, result.stderr
        no_injected_line(result.stdout, result.stderr)
    missing = run(str(tmp_path / f"gone\x1b]0;title\x07{INJECTED}.log"))
    refused(missing, "no such file or directory")
    no_injected_line(missing.stderr)


def test_a_sentinel_field_cannot_start_a_line_of_the_text_report(tmp_path):
    record = {
        "schema": "unsafe-doctor/sentinel/v1",
        "rank": 0,
        "backend": "emulated",
        "mode": "raise",
        "tensors_checked": 18,
        "unsafe_tensors": 0,
        "unsafe_globals": 0,
        "seconds": 0.003,
        "stopped_early": f"budget\x1b[2J{INJECTED}",
        "event": "summary",
    }
    log = tmp_path / "train.log"
    log.write_text(
        f"WARNING unsafe_doctor.sentinel: [unsafe-doctor sentinel] rank 0: clean {json.dumps(record)}\n" + FAQ_LOG.read_text()
    )
    result = run(str(log))
    assert "stopped early: budget" in " ".join(result.stdout.split()), result.stdout
    no_injected_line(result.stdout, result.stderr)


def test_an_audited_file_name_cannot_drive_the_terminal(tmp_path):
    hostile = tmp_path / "pkg" / "a\x1b]0;title\x07\x1b[2Jx.py"
    hostile.parent.mkdir()
    shutil.copy(FRAMEWORK / "toytrain" / "state.py", hostile)
    result = run("audit", str(hostile.parent))
    assert result.returncode == 1 and "LOSS_LOG" in result.stdout, result.stderr
    no_injected_line(result.stdout, result.stderr)


# --- one adaptor discovery for every command ---------------------------------------------------------


def test_every_command_finds_the_adaptor_under_the_source_root_and_says_how(tmp_path):
    """audit once found toytrain's recovery.py by its functions, while fix and sentinel install
    said "no adaptor file found" under the same --source-root."""
    shutil.copytree(FRAMEWORK, tmp_path / "framework")
    root = tmp_path / "framework"
    adaptor = root / "toytrain" / "recovery.py"
    said = f"adaptor {adaptor} (found under the source roots as the module that defines the rollback and repair functions)"
    for args in (
        ["fix", str(ROOT / "samples" / "logs" / "toytrain_ema"), "--source-root", str(root), "--dry-run"],
        ["sentinel", "install", "--source-root", str(root), "--dry-run"],
    ):
        result = run(*args)
        assert result.returncode == 0 and said in result.stderr, result.stderr
        assert f"+++ b{adaptor}" in result.stdout
    audit = run("audit", str(root / "toytrain"))
    assert f"adaptor {adaptor} (mindspeed-llm-26; found under the source roots as the module" in " ".join(audit.stdout.split())


def two_adaptors(tmp_path: Path) -> tuple[Path, Path]:
    """A team's toytrain with its recovery.py, and a vendored copy of it elsewhere in the repository."""
    shutil.copytree(FRAMEWORK / "toytrain", tmp_path / "toytrain", ignore=shutil.ignore_patterns("__pycache__"))
    vendored = tmp_path / "third_party" / "vendor" / "recovery.py"
    vendored.parent.mkdir(parents=True)
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", vendored)
    return tmp_path / "toytrain" / "recovery.py", vendored


def test_two_adaptors_are_never_chosen_between_silently(tmp_path):
    """`audit --fix --yes` once wrote into the vendored copy, and the next audit said "covered"."""
    team, vendored = two_adaptors(tmp_path)
    before = team.read_bytes()
    for args in (
        ["audit", ".", "--fix", "--yes"],
        ["fix", str(ROOT / "samples" / "logs" / "toytrain_ema"), "--source-root", ".", "--yes"],
        ["sentinel", "install", "--source-root", ".", "--no-input"],
    ):
        refused(
            run(*args, cwd=tmp_path),
            "several recovery adaptors under the source roots "
            "(third_party/vendor/recovery.py, toytrain/recovery.py): "
            "name the one to use with --adaptor FILE",
        )
    assert team.read_bytes() == vendored.read_bytes() == before


def test_at_a_terminal_the_person_picks_the_adaptor_among_two(tmp_path):
    team, vendored = two_adaptors(tmp_path)
    before = vendored.read_bytes()
    code, screen = at_terminal(
        ["audit", ".", "--fix"], cwd=tmp_path, answers=[(b"Which is yours? [1-2]: ", b"2\n"), (b"? [y/N]: ", b"y\n")]
    )
    assert code == 0, screen
    assert "1 = third_party/vendor/recovery.py" in screen and "2 = toytrain/recovery.py" in screen
    assert "unsafe-doctor: begin " in team.read_text() and vendored.read_bytes() == before


def test_sentinel_install_and_audit_at_a_terminal_ask_which_adaptor_once_and_go_on_with_it(tmp_path):
    """Every command settles two adaptors found the one way, in its own run: asked once,
    the answer used, nothing run again (sentinel install and audit ran twice, on the answer)."""
    team, vendored = two_adaptors(tmp_path)
    before = vendored.read_bytes()
    which = (b"Which is yours? [1-2]: ", b"2\n")
    code, screen = at_terminal(
        ["sentinel", "install", "--source-root", "."], cwd=tmp_path, answers=[which, (b"? [y/N]: ", b"y\n")]
    )
    assert code == 0, screen
    assert screen.count("Which is yours?") == 1 and "adaptor toytrain/recovery.py (given)" in screen
    assert "# unsafe-doctor: begin unsafe_doctor.sentinel" in team.read_text() and vendored.read_bytes() == before
    code, screen = at_terminal(["audit", "."], cwd=tmp_path, answers=[which])
    assert code == 1, screen
    assert screen.count("Which is yours?") == 1
    assert "unsafe-doctor audit . --adaptor toytrain/recovery.py --fix" in screen  # runs as printed, not asked again
