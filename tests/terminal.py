"""The CLI run at a pseudo-terminal, as a person at a terminal runs it: what the screen showed."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import sys
import termios
import time
from collections.abc import Sequence
from pathlib import Path


def at_terminal(
    args: list[str],
    *,
    answers: Sequence[tuple[bytes, bytes]] = (),
    stdin_file: Path | None = None,
    stdin_piped: bytes | None = None,
    stdout_to_file: bool = False,
    columns: int = 200,
    tty_columns: int | None = None,
    cwd: Path | None = None,
    quiet_seconds: float = 300,
) -> tuple[int, str]:
    """Run `unsafe-doctor ARGS` with a pty as its controlling terminal (stdout, stderr and /dev/tty;
    stdin from `stdin_file`, or a pipe holding `stdin_piped` as `cat log |` gives it, read once; stdout to
    /dev/null when asked; COLUMNS=`columns`, and the pty's own window `tty_columns` wide where given, else
    none, as a bare pty's); answer each prompt (bytes awaited, bytes sent) once it is on the screen and
    the program waits at the terminal for the answer, as a person does: a Ctrl-C typed then reaches a
    program that is reading, however loaded the machine. Each awaited text is looked for after the
    one before it, so a question asked twice is answered twice; and the screen holds all it awaits
    before the key is typed (a Ctrl-C flushes what the terminal has not shown yet).
    A run silent for `quiet_seconds` (a safety net, not a timing) is killed: exit -9. Exit code and screen."""
    stdin = _pipe_holding(stdin_piped) if stdin_piped is not None else None
    if stdin_file is not None:
        stdin = os.open(stdin_file, os.O_RDONLY)
    pid, fd = pty.fork()
    if pid == 0:
        if stdin is not None:
            os.dup2(stdin, 0)
        if stdout_to_file:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        if cwd is not None:
            os.chdir(cwd)
        os.environ["COLUMNS"] = str(columns)
        _window(tty_columns)
        os.execv(sys.executable, [sys.executable, "-m", "unsafe_doctor", *args])
    if stdin is not None:
        os.close(stdin)
    screen, pending, seen = b"", list(answers), 0
    while True:
        if not select.select([fd], [], [], quiet_seconds)[0]:
            os.kill(pid, 9)
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        screen += chunk
        if pending and (found := screen.find(pending[0][0], seen)) >= 0:
            awaited, key = pending.pop(0)
            seen = found + len(awaited)
            _wait_until_reading(pid, quiet_seconds)
            os.write(fd, key)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), screen.decode(errors="replace")


def _window(columns: int | None) -> None:
    """The pty's window `columns` wide (24 rows), as a terminal emulator sets it; None: left 0 by 0."""
    if columns is not None:  # stderr is the pty in every run
        fcntl.ioctl(2, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))


def _pipe_holding(data: bytes) -> int:
    """The reading end of a pipe that holds `data`, then its end (within a pipe's buffer, 64 KiB on Linux)."""
    reading, writing = os.pipe()
    os.write(writing, data)
    os.close(writing)
    return reading


def _wait_until_reading(pid: int, seconds: float) -> None:
    """Until the program's main thread is asleep in a read of its terminal (Linux: the tty's read
    waits in `wait_woken`), at most `seconds`; at once where /proc does not tell (no /proc, or a
    kernel that shows no wait channel)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            channel = Path(f"/proc/{pid}/wchan").read_text().strip()
        except (OSError, IndexError):
            return
        if state == "S" and channel in ("wait_woken", "n_tty_read", "0", ""):  # "0": hidden, nothing to wait on
            return
        time.sleep(0.01)
