"""`--install-completion` leaves a user's files and settings unharmed: an rc file in any
encoding is appended to, never rewritten; PowerShell's execution policy is never changed, only named;
a PowerShell that fails is one line. Run for real, in a subprocess with its own home; PowerShell, not
installed here, is a script on PATH that records how it was called."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USERS_RC = b"export GREETING=caf\xe9   \n# the user's own trailing blank lines\n\n\n"  # Latin-1, not UTF-8


def install(home: Path, shell: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT), "PATH": path or os.environ["PATH"]}
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", "--install-completion", shell],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )


@pytest.mark.parametrize("shell, rc", [("bash", ".bashrc"), ("zsh", ".zshrc")])
def test_an_rc_file_is_only_appended_to(tmp_path, shell, rc):
    users = tmp_path / rc
    users.write_bytes(USERS_RC)
    inode = users.stat().st_ino
    result = install(tmp_path, shell)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert f"a line added at the end of {users}" in result.stdout
    after = users.read_bytes()
    assert after.startswith(USERS_RC) and after.count(b"\n") == USERS_RC.count(b"\n") + 1
    assert users.stat().st_ino == inode
    again = install(tmp_path, shell)
    assert again.returncode == 0 and "a line added" not in again.stdout and users.read_bytes() == after


def fake_powershell(folder: Path, body: str) -> str:
    """A PATH whose `pwsh` runs `body` after logging its arguments to $HOME/pwsh-calls."""
    folder.mkdir()
    pwsh = folder / "pwsh"
    pwsh.write_text(f'#!/bin/sh\necho "$@" >> "$HOME/pwsh-calls"\n{body}\n')
    pwsh.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def test_powershell_completion_changes_no_policy_and_says_what_to_run(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    profile = home / "profile.ps1"
    profile.write_bytes(b"Set-Alias ll Get-ChildItem\n")
    path = fake_powershell(tmp_path / "bin", f'echo "{profile}"')
    result = install(home, "pwsh", path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "ExecutionPolicy" not in (home / "pwsh-calls").read_text()
    assert "you may run: Set-ExecutionPolicy -Scope CurrentUser RemoteSigned" in result.stdout
    text = profile.read_bytes()
    assert text.startswith(b"Set-Alias ll Get-ChildItem\n") and b"unsafe-doctor" in text


def test_a_powershell_that_fails_is_one_line(tmp_path):
    path = fake_powershell(tmp_path / "bin", 'echo "pwsh: broken" >&2\nexit 3')
    result = install(tmp_path, "pwsh", path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == [
        "unsafe-doctor: cannot install pwsh completion: pwsh did not name its profile (exit 3: pwsh: broken)"
    ]
