"""Where the tool writes, attacked (issue 36's data loss): two writers to one adaptor. Each case runs
the command for real in a subprocess, on real files; each once lost or replaced a user's file.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EMA_LOG = ROOT / "samples" / "logs" / "toytrain_ema"
FRAMEWORK = ROOT / "samples" / "framework"
ADAPTOR = (FRAMEWORK / "toytrain" / "recovery.py").read_bytes()


def run(*args: str, cwd: Path = ROOT, **options) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("UNSAFE_DOCTOR_")}
    environment.update({"COLUMNS": "120", "PYTHONPATH": str(ROOT)})
    options = {"stdout": subprocess.PIPE, "stdin": subprocess.DEVNULL, **options}
    return subprocess.run([sys.executable, "-m", "unsafe_doctor", *args], stderr=subprocess.PIPE, text=True, cwd=cwd,
                          env=environment, timeout=120, **options)


def fix_ema(adaptor: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run("fix", str(EMA_LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--yes", *extra)


# --- two writers to one adaptor --------------------------------------------------------------------------


def test_a_fix_refuses_an_adaptor_another_writer_holds_locked_then_writes_it_once_free(tmp_path):
    """A sentinel install stalled between its write and its truncate, and a fix run then was cut.
    Every write takes the adaptor's lock (flock); this test process holds it as that install would."""
    adaptor = tmp_path / "recovery.py"
    adaptor.write_bytes(ADAPTOR)
    other_name = tmp_path / "vendored_recovery.py"
    os.link(adaptor, other_name)  # written in place, as in the issue

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
