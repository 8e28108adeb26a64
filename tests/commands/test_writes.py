"""Where the tool writes, attacked: `-o` onto a descriptor, over an input no
option names, over an existing file; two writers to one adaptor. Each case runs the command for real
in a subprocess, on real files; each once lost or replaced a user's file.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import refused

from unsafe_doctor.adaptor.write import BACKUP_SUFFIX

ROOT = Path(__file__).resolve().parents[2]
FAQ_LOG = ROOT / "samples" / "logs" / "faq_modellink.log"
EMA_LOG = ROOT / "samples" / "logs" / "toytrain_ema"
FRAMEWORK = ROOT / "samples" / "framework"
ADAPTOR = (FRAMEWORK / "toytrain" / "recovery.py").read_bytes()


def run(*args: str, cwd: Path = ROOT, **options) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("UNSAFE_DOCTOR_")}
    environment.update({"COLUMNS": "120", "PYTHONPATH": str(ROOT)})
    options = {"stdout": subprocess.PIPE, "stdin": subprocess.DEVNULL, **options}
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", *args],
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=environment,
        timeout=120,
        **options,
    )


def fix_ema(adaptor: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run("fix", str(EMA_LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--yes", *extra)


def rules_listed(text: str) -> bool:
    return "generic.cache-clear" in text


# --- -o onto a descriptor ----------------------------------------------------------------------------


def test_output_to_dev_stdout_appends_where_stdout_appends(tmp_path):
    """`cmd -o /dev/stdout >> all.txt` replaced all.txt: /dev/stdout was opened as the file behind it."""
    collected = tmp_path / "all.txt"
    collected.write_text("the earlier reports\n")
    with open(collected, "a") as appending:
        result = run("rules", "list", "-o", "/dev/stdout", stdout=appending)
    assert result.returncode == 0, result.stderr
    text = collected.read_text()
    assert text.startswith("the earlier reports\n") and rules_listed(text)


def test_output_to_dev_fd_n_writes_that_descriptor(tmp_path):
    collected = tmp_path / "all.txt"
    collected.write_text("the earlier reports\n")
    descriptor = os.open(collected, os.O_WRONLY | os.O_APPEND)
    try:
        result = run("rules", "list", "-o", f"/dev/fd/{descriptor}", pass_fds=(descriptor,))
    finally:
        os.close(descriptor)
    assert result.returncode == 0 and result.stdout == "", result.stderr
    text = collected.read_text()
    assert text.startswith("the earlier reports\n") and rules_listed(text)


def test_output_to_dev_stdout_when_stdout_is_a_pipe_writes_the_pipe():
    result = run("rules", "list", "-o", "/dev/stdout")
    assert result.returncode == 0, result.stderr
    assert rules_listed(result.stdout)


def test_output_to_a_descriptor_not_open_is_one_line():
    refused(run("rules", "list", "-o", "/dev/fd/57"), "cannot write /dev/fd/57: bad file descriptor")


# --- -o over an input no option names -------------------------------------------------------------------


def test_output_over_the_adaptors_sibling_file_is_refused_and_the_file_kept(tmp_path):
    """MindSpeed-LLM's adaptor is two files; `--adaptor` names one, and the report replaced the other."""
    folder = tmp_path / "mindspeed_llm" / "core" / "high_availability"
    folder.mkdir(parents=True)
    (folder / "tft_rollback.py").write_text("def feature_rollback(step, train_args):\n    pass\n")
    repair = folder / "tft_optimizer_data_repair.py"
    repair.write_text("def send_rank_repair(src_ranks, dest_ranks, optim_idxs, rank_list, train_args):\n    pass\n")
    before = repair.read_bytes()

    result = run("fix", "--revert", "--adaptor", "tft_rollback.py", "-o", "tft_optimizer_data_repair.py", cwd=folder)

    refused(result, "-o tft_optimizer_data_repair.py would replace the command's own adaptor file")
    assert repair.read_bytes() == before
    assert sorted(path.name for path in folder.iterdir()) == ["tft_optimizer_data_repair.py", "tft_rollback.py"]


def test_audit_output_over_the_adaptors_sibling_is_refused_and_the_file_kept(tmp_path):
    """An audit reads the adaptor it is given and its sibling, outside the folder audited: `-o` over
    the sibling replaced it, as only the files a fix edited were checked."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "model.py").write_text("import torch\n_CACHE = torch.zeros(3)\n")
    folder = tmp_path / "mindspeed_llm" / "core" / "high_availability"
    folder.mkdir(parents=True)
    rollback, repair = folder / "tft_rollback.py", folder / "tft_optimizer_data_repair.py"
    rollback.write_text("def feature_rollback(step, train_args):\n    pass\n")
    repair.write_text("# the job's own repair code\n")

    result = run("audit", "pkg", "--adaptor", str(rollback), "-o", str(repair), cwd=tmp_path)

    refused(result, f"-o {repair} would replace the command's own adaptor file")
    assert repair.read_text() == "# the job's own repair code\n"


def test_output_over_the_log_on_stdin_is_refused_and_the_log_kept(tmp_path):
    log = tmp_path / "job.log"
    shutil.copy(FAQ_LOG, log)
    for args in (["-o", "job.log"], ["-", "-o", "job.log"]):
        with open(log) as stdin:
            refused(run(*args, cwd=tmp_path, stdin=stdin), "would replace the command's own input (the log on standard input)")
    assert log.read_bytes() == FAQ_LOG.read_bytes()
    with open(FAQ_LOG) as stdin:  # another log on stdin: written
        assert run("-o", "job.log", cwd=tmp_path, stdin=stdin).returncode == 1
    assert log.read_bytes() != FAQ_LOG.read_bytes()


def test_output_over_the_backup_fix_writes_is_refused_before_the_adaptor_is_written(tmp_path):
    adaptor = tmp_path / "recovery.py"
    adaptor.write_bytes(ADAPTOR)
    backup = tmp_path / ("recovery.py" + BACKUP_SUFFIX)

    refused(fix_ema(adaptor, "-o", str(backup)), "would replace the command's own adaptor file's backup")

    assert adaptor.read_bytes() == ADAPTOR
    assert sorted(path.name for path in tmp_path.iterdir()) == ["recovery.py"]


# --- -o over an existing file ---------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_output_over_an_existing_report_writes_it_in_place_keeping_owner_mode_and_links(tmp_path):
    """As root, a 640 report of another user's became root's, and a second hard link kept the old text."""
    report = tmp_path / "report.txt"
    report.write_text("the last report\n")
    other_name = tmp_path / "latest.txt"
    os.link(report, other_name)
    os.chown(report, 4242, 4343)
    report.chmod(0o640)
    inode = report.stat().st_ino

    assert run("rules", "list", "-o", str(report)).returncode == 0

    status = report.stat()
    assert (status.st_ino, status.st_uid, status.st_gid, stat.S_IMODE(status.st_mode)) == (inode, 4242, 4343, 0o640)
    assert rules_listed(other_name.read_text()) and other_name.read_bytes() == report.read_bytes()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest.txt", "report.txt"]  # no temporary left


def test_output_through_a_symlink_loop_is_refused_and_the_link_kept(tmp_path):
    loop = tmp_path / "report.txt"
    loop.symlink_to(loop.name)
    refused(run("rules", "list", "-o", str(loop)), f"cannot write {loop}: too many levels of symbolic links")
    assert loop.is_symlink() and os.readlink(loop) == loop.name
    assert sorted(path.name for path in tmp_path.iterdir()) == ["report.txt"]


# --- two writers to one adaptor --------------------------------------------------------------------------


def test_a_fix_refuses_an_adaptor_another_writer_holds_locked_then_writes_it_once_free(tmp_path):
    """A sentinel install stalled between its write and its truncate, and a fix run then was cut.
    Every write takes the adaptor's lock (flock); this test process holds it as that install would."""
    adaptor = tmp_path / "recovery.py"
    adaptor.write_bytes(ADAPTOR)
    other_name = tmp_path / "vendored_recovery.py"
    os.link(adaptor, other_name)  # written in place, so both names see the write

    with open(other_name, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = fix_ema(adaptor)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"unsafe-doctor: {adaptor} is being written by another command (it holds the file's lock): nothing written; "
        "run this one again once that one ends"
    )
    assert adaptor.read_bytes() == ADAPTOR
    assert sorted(path.name for path in tmp_path.iterdir()) == ["recovery.py", "vendored_recovery.py"]

    written = fix_ema(adaptor)  # the lock let go
    assert written.returncode == 0, written.stderr
    assert other_name.read_bytes() == adaptor.read_bytes() != ADAPTOR
