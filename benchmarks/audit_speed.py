"""How fast `unsafe-doctor audit` reads a whole framework tree: the installed megatron-core by default.

    python benchmarks/audit_speed.py                       # site-packages/megatron/core
    python benchmarks/audit_speed.py --path ~/Megatron-LM --adaptor my_adaptor.py

Times the whole command (start-up, parsing every file, coverage of the adaptor, classification,
JSON output), best of --repeat runs, and prints seconds, files and files per second with what the
audit found. Target: under 10 s for megatron-core on 2 cores. The audit runs on one core; the
machine's core count and load are printed because other work on it slows the run down.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEGACY_ADAPTOR = ROOT / "samples" / "adaptors" / "legacy" / "mindio_ttp" / "adaptor" / "modellink_adaptor.py"
TARGET_SECONDS = 10.0


def installed_megatron_core() -> Path:
    """The installed megatron/core folder, found without importing it (it imports torch)."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("megatron-core is not installed: pip install megatron-core, or give --path")
    return Path(next(iter(spec.submodule_search_locations)))


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, help="tree to audit (default: the installed megatron/core)")
    parser.add_argument("--adaptor", type=Path, default=LEGACY_ADAPTOR, help="adaptor file (default: the FAQ's legacy sample)")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the best counts")
    args = parser.parse_args()
    path = args.path or installed_megatron_core()
    doctor = shutil.which("unsafe-doctor") or str(Path(sys.executable).with_name("unsafe-doctor"))
    command = [doctor, "audit", str(path), "--adaptor", str(args.adaptor), "--format", "json"]
    runs = [timed(command) for _ in range(args.repeat)]
    seconds, result = min(runs, key=lambda run: run[0])
    if result.returncode not in (0, 1):
        sys.exit(f"audit failed (exit {result.returncode}): {result.stderr.strip()}")
    audit = json.loads(result.stdout)
    files = audit["files"]
    kinds = Counter(holder["kind"] for holder in audit["holders"])
    summary = audit["summary"]
    print(f"tree: {path}")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    print(f"{'seconds (best of ' + str(args.repeat) + ')':<24}{seconds:>8.2f}")
    print(f"{'files':<24}{files:>8}")
    print(f"{'files/s':<24}{files / seconds:>8.0f}")
    print(f"globals: {summary['holders']} ({', '.join(f'{count} {kind}' for kind, count in sorted(kinds.items()))}); "
          f"{summary['uncovered']} uncovered, {summary['unsafe']} unsafe, {summary['covered']} covered, "
          f"{summary['fixable']} with a fix; {len(audit['stale_resets'])} stale reset(s)")
    print(f"target: under {TARGET_SECONDS:.0f} s")
    print("result: " + ("within target" if seconds < TARGET_SECONDS else "MISSED the target"))


if __name__ == "__main__":
    main()
