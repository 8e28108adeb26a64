"""What several test files share: the command line run in this process, the one-line refusal, a
module loaded from a file, and scripts run in fresh children of one warm Python."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

TESTS = Path(__file__).resolve().parent


def run_cli(
    *args: str,
    stdin: bytes | None = b"",
    env: dict[str, str] | None = None,
    unset: tuple[str, ...] = (),
    cwd: Path | None = None,
    encoding: str | None = "utf-8",
) -> subprocess.CompletedProcess[Any]:
    """`unsafe-doctor ARGS` run in this process, as `python -m unsafe_doctor ARGS` would run it where
    the process itself is not what a test is about: `stdin` piped in (no terminal), the variables
    whose names start with one of `unset` taken out of the environment and `env` added to it, `cwd`
    the working folder; stdout and stderr read as bytes, then decoded with
    `encoding` (None: left bytes). What the command changes of the process (streams, argv, environment, working folder)
    is put back after. (`verify` too: its launcher, forked from this process, imports the user's
    modules; this process never does.)"""
    from unsafe_doctor.cli import main

    stdout, stderr = io.BytesIO(), io.BytesIO()
    streams = (
        io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8"),
        io.TextIOWrapper(stdout, encoding="utf-8", write_through=True),
        io.TextIOWrapper(stderr, encoding="utf-8", write_through=True),
    )
    saved = (sys.stdin, sys.stdout, sys.stderr, sys.argv, dict(os.environ), Path.cwd())
    try:
        sys.stdin, sys.stdout, sys.stderr = streams
        sys.argv = ["unsafe-doctor", *args]
        for name in [name for name in os.environ if name.startswith(unset)] if unset else []:
            del os.environ[name]
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        try:
            main(list(args))
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
        for stream in streams[1:]:
            with contextlib.suppress(ValueError):  # closed by the command
                stream.flush()
    finally:
        sys.stdin, sys.stdout, sys.stderr, sys.argv = saved[:4]
        os.environ.clear()
        os.environ.update(saved[4])
        os.chdir(saved[5])
    outputs = [stream.getvalue() for stream in (stdout, stderr)]
    if encoding is not None:
        return subprocess.CompletedProcess(["unsafe-doctor", *args], code, *(output.decode(encoding) for output in outputs))
    return subprocess.CompletedProcess(["unsafe-doctor", *args], code, *outputs)


def load_module(name: str, path: Path, *, register: bool = False) -> ModuleType:
    """The Python file at `path` run as module `name` (a fixture or a script: no package holds it);
    `register` puts it in sys.modules first, where its dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def refused(
    result: subprocess.CompletedProcess[str] | subprocess.CompletedProcess[bytes],
    fragment: str = "",
    prefix: str = "unsafe-doctor: ",
) -> str:
    """The command was refused: exit 2 and, on stderr, one line and nothing else (no traceback), that
    starts with `prefix` and holds `fragment`. The line, without its newline."""
    stderr = result.stderr.decode() if isinstance(result.stderr, bytes) else result.stderr
    assert result.returncode == 2, (result.returncode, result.stdout and result.stdout[-500:], stderr[-2000:])
    assert "Traceback" not in stderr, stderr
    assert stderr.count("\n") == 1 and stderr.endswith("\n"), stderr
    assert stderr.startswith(prefix) and fragment in stderr, stderr
    return stderr[:-1]


class WarmPython:
    """tests/fork_server.py: each script runs in a fresh child forked from a Python that ran only
    the prelude (imports that every script starts with), so the prelude is paid once."""

    def __init__(self, prelude: str, env: tuple[tuple[str, str], ...]) -> None:
        command = [sys.executable, str(TESTS / "fork_server.py"), prelude]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **dict(env)}
        )

    def run(self, script: str) -> subprocess.CompletedProcess[str]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"script": script}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the fork server ended with {self.process.wait()}"
        answer = json.loads(line)
        return subprocess.CompletedProcess(["<script>"], answer["returncode"], answer["stdout"], answer["stderr"])

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)
        if self.process.stdout is not None:
            self.process.stdout.close()


def close_warm_pythons() -> None:
    """End every warm Python this process started: tests that wait on their own children expect none."""
    for each in _WARM.values():
        each.close()
    _WARM.clear()


_WARM: dict[tuple[str, tuple[tuple[str, str], ...]], WarmPython] = {}


def warm_python(prelude: str, env: tuple[tuple[str, str], ...] = ()) -> WarmPython:
    """The one warm Python of this test module for `prelude` (run with `env` added to ours)."""
    if (prelude, env) not in _WARM:
        _WARM[prelude, env] = WarmPython(prelude, env)
    return _WARM[prelude, env]


def run_ranks(script: Path, world: int, env: dict[str, str], *, timeout: float = 240) -> list[tuple[int, str, str]]:
    """`python SCRIPT` once per rank of a gloo world on loopback (MASTER_ADDR, a free MASTER_PORT,
    WORLD_SIZE and RANK set over `env`): each rank's exit code, stdout and stderr. The ranks are
    forked from one Python that imported torch (tests/fork_ranks.py), which each would import anyway."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    shared = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, str(TESTS / "fork_ranks.py"), str(script), str(world), folder]
        launcher = subprocess.Popen(
            command, env=shared, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = launcher.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)  # the ranks too: they share its session's group
            launcher.communicate()
            raise
        assert launcher.returncode == 0, err
        codes = json.loads(out)
        return [
            (codes[str(rank)], *(Path(folder, f"{rank}.{suffix}").read_text(errors="replace") for suffix in ("out", "err")))
            for rank in range(world)
        ]
