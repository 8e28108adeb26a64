"""Every block the goldens record, as a maintainer would lint it: ruff finds nothing in it but the
names it reads from the function it is pasted into (F821)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
BEGIN, END = "# unsafe-doctor: begin ", "# unsafe-doctor: end "
# bugbear (B007: an unused loop variable), syntax errors, unused or redefined imports and locals
RULES = "B,E9,F401,F811,F841"
# Not these: B905 asks zip() for `strict=`, which the Python 3.8 of older Ascend jobs lacks; B010 asks
# `module.NAME = None` for `setattr(module, "NAME", None)`, which the fixer would read as the file's own
# `NAME` where the file imports it by name (`from module import NAME`), rebinding a local instead.
IGNORED = "B905,B010"


def blocks(text: str) -> list[str]:
    """The marked blocks of a report, as written (a diff's `+` taken off), dedented."""
    found, current = [], None
    for line in text.splitlines():
        code = line[1:] if line.startswith("+") else line
        stripped = code.strip()
        if stripped.startswith(BEGIN):
            current = [code]
        elif current is not None:
            current.append(code)
            if stripped.startswith(END):
                found.append(textwrap.dedent("\n".join(current)) + "\n")
                current = None
    return found


def recorded_blocks() -> dict[str, str]:
    return {
        f"{path.stem}-{number}": block
        for path in sorted(GOLDEN.glob("*.txt"))
        for number, block in enumerate(blocks(path.read_text()))
    }


def test_the_goldens_record_blocks_to_lint():
    assert len(recorded_blocks()) >= 50


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is in the lint extra: pip install -e '.[lint]'")
def test_ruff_finds_nothing_in_any_recorded_block(tmp_path):
    for name, block in recorded_blocks().items():
        (tmp_path / f"{name.replace('.', '_').replace('-', '_')}.py").write_text(block)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--isolated",
            "--no-cache",
            "--select",
            RULES,
            "--ignore",
            IGNORED,
            "--output-format",
            "concise",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
