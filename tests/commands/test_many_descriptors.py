"""audit and verify in a process that inherited more than 1,024 open descriptors (a CI agent that
starts its steps with close_fds=False), so that every pipe they open is numbered past what
`select.select` takes. Each runs the CLI for real, exec'd by a process that opens them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples"
HOLDING = 1100
# Raises the soft limit on open files, opens HOLDING inheritable descriptors, then runs the CLI in its place.
EXEC_HOLDING = f"""
import os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
wanted = {HOLDING} + 200
if hard != resource.RLIM_INFINITY and hard < wanted:
    sys.exit(77)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
for _ in range({HOLDING}):
    os.set_inheritable(os.open(os.devnull, os.O_RDONLY), True)
os.execv(sys.executable, [sys.executable, "-m", "unsafe_doctor", *sys.argv[1:]])
"""


def holding_many(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    result = subprocess.run(
        [sys.executable, "-c", EXEC_HOLDING, *args],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    if result.returncode == 77:
        pytest.skip(f"the hard limit on open files is below {HOLDING + 200}")
    return result


def test_audit_with_many_inherited_descriptors(tmp_path):
    result = holding_many("audit", str(SAMPLES / "framework"))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "2 with a fix" in result.stdout


def test_verify_with_many_inherited_descriptors(tmp_path):
    pytest.importorskip("torch")
    toy = tmp_path / "toy"
    shutil.copytree(SAMPLES / "framework", toy)
    result = holding_many(
        "verify",
        str(SAMPLES / "logs" / "toytrain_ema"),
        "--source-root",
        str(toy),
        "--adaptor",
        str(toy / "toytrain" / "recovery.py"),
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert "The adaptor holds no fix for toytrain.state._EMA_GRAD_NORM" in result.stdout
