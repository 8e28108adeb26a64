"""Installing shell completion: typer's scripts, in the places typer's installer puts them, but
installed so that a user's files and settings come to no harm. A shell's rc file or PowerShell's
profile is only ever appended to (typer's rewrites ~/.zshrc whole, stripped), and read as bytes (one
Latin-1 byte made typer's raise); PowerShell's execution policy is left as it is (typer's sets it to
Unrestricted without a word): what the user may run is said instead."""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from unsafe_doctor.errors import UsageError, os_reason

PROGRAM = "unsafe-doctor"
COMPLETE_VARIABLE = "_UNSAFE_DOCTOR_COMPLETE"
POLICY_ADVICE = (
    "PowerShell runs the profile only where its execution policy lets scripts run; if completion does not "
    "load, you may run: Set-ExecutionPolicy -Scope CurrentUser RemoteSigned"
)


@dataclass(frozen=True)
class Installed:
    script: Path  # the file that holds the completion script
    appended_to: Path | None  # the rc file or profile a line was added to; None when it held it already
    advice: str | None = None  # what the user may still have to do


def script(shell: str) -> str:
    from typer._completion_shared import get_completion_script

    return get_completion_script(prog_name=PROGRAM, complete_var=COMPLETE_VARIABLE, shell=shell)


def install_completion(shell: str) -> Installed:
    """Install completion for `shell` (bash, zsh, fish, powershell or pwsh) in the user's home.
    OSError where a file cannot be written; UsageError where PowerShell cannot tell its profile."""
    home = Path.home()
    if shell == "bash":
        completions = home / ".bash_completions" / f"{PROGRAM}.sh"
        _write(completions, script(shell))
        return Installed(completions, _append_once(home / ".bashrc", f"source {shlex.quote(str(completions))}"))
    if shell == "zsh":
        completions = home / ".zfunc" / f"_{PROGRAM}"
        _write(completions, script(shell))
        return Installed(completions, _append_once(home / ".zshrc", "fpath+=~/.zfunc; autoload -Uz compinit; compinit"))
    if shell == "fish":
        completions = home / ".config" / "fish" / "completions" / f"{PROGRAM}.fish"
        _write(completions, script(shell) + "\n")
        return Installed(completions, None)
    profile = _powershell_profile(shell)
    _append_once(profile, script(shell))
    return Installed(profile, None, POLICY_ADVICE)


def _write(path: Path, text: str) -> None:
    """One of our own files: its whole text is ours to write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _append_once(path: Path, text: str) -> Path | None:
    """Add `text` at the end of a user's file unless it holds it already; the file's own bytes are
    never read as text nor written back."""
    wanted = text.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as file:
        file.seek(0)
        held = file.read()
        if wanted in held:
            return None
        file.write((b"\n" if held and not held.endswith(b"\n") else b"") + wanted + b"\n")
    return path


def _powershell_profile(shell: str) -> Path:
    """The profile PowerShell reads, as it names it."""
    try:
        answer = subprocess.run(
            [shell, "-NoProfile", "-Command", "echo", "$profile"],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        reason = "it did not answer in 60 s" if isinstance(error, subprocess.TimeoutExpired) else os_reason(error)
        raise UsageError(f"cannot install {shell} completion: {shell} cannot be run ({reason})") from None
    profile = os.fsdecode(answer.stdout).strip()
    if answer.returncode != 0 or not profile or "\n" in profile:
        said = os.fsdecode(answer.stderr).strip().splitlines()
        why = f": {said[-1]}" if said else ""
        raise UsageError(f"cannot install {shell} completion: {shell} did not name its profile (exit {answer.returncode}{why})")
    return Path(profile)
