"""A Python that sees this project and every installed package but megatron-core: a bare install.

The test extra installs megatron-core, which would hide what a user without it gets. This runs a
script in a child Python started isolated (`-I -S`: no user site, no `site` module, no
PYTHONPATH), whose `sys.path` is this checkout plus a copy of site-packages made of links, less
megatron's folders and metadata. Used by tests/diagnose/test_log_only.py, tests/commands/test_corpus.py and
benchmarks/classification_accuracy.py.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_BOOT = """
import runpy, sys
from pathlib import Path
site, shadow, root = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
shadow.mkdir(exist_ok=True)
for entry in site.iterdir():
    if not entry.name.lower().startswith("megatron") and not (shadow / entry.name).exists():
        (shadow / entry.name).symlink_to(entry)
sys.path[:0] = [root, str(shadow)]
sys.argv = sys.argv[4:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_without_megatron(script: Path, *arguments: str, scratch: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run `script` with `arguments` where megatron-core is not importable; `scratch`: a folder for the links."""
    site = sysconfig.get_paths()["purelib"]
    command = [sys.executable, "-I", "-S", "-c", _BOOT, site, str(scratch / "site-packages"), str(ROOT), str(script), *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=scratch)
