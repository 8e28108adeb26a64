"""How long `unsafe-doctor verify` takes: an 8-rank CPU replay of a scenario-1 and a scenario-2 sample.

    python benchmarks/replay_speed.py            # 8 ranks
    python benchmarks/replay_speed.py --ranks 16

Each sample is fixed in a temporary copy (the real fixer), then verified once: the unpatched (red)
and the patched (green) run, each rank forked on gloo/CPU under the emulated backend. Prints the
wall time of each verify command as a user runs it (start-up, diagnosis, replay) and of each
replay phase (slowest rank). Target: both samples together under 20 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quiet import add_loaded_option, require_quiet

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
TARGET_SECONDS = 20.0


def sample_copies(folder: Path) -> list[tuple[str, str, Path, Path]]:
    """(name, log, adaptor, source root) for each sample, the adaptor copied and fixed."""
    shutil.copytree(SAMPLES / "adaptors" / "in_tree", folder / "in_tree")
    shutil.copytree(SAMPLES / "framework" / "toytrain", folder / "framework" / "toytrain")
    return [
        (
            "scenario 1: Megatron MoE tracker",
            str(SAMPLES / "logs" / "megatron_moe_tracker.log"),
            folder / "in_tree" / "mindspeed_llm" / "core" / "high_availability" / "tft_rollback.py",
            folder / "in_tree",
        ),
        (
            "scenario 2: toytrain _EMA_GRAD_NORM",
            str(SAMPLES / "logs" / "toytrain_ema"),
            folder / "framework" / "toytrain" / "recovery.py",
            folder / "framework",
        ),
    ]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unsafe_doctor", *args], capture_output=True, text=True, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    add_loaded_option(parser)
    options = parser.parse_args()
    require_quiet(loaded_ok=options.loaded)
    total = 0.0
    proven = True
    with tempfile.TemporaryDirectory() as folder:
        for name, log, adaptor, root in sample_copies(Path(folder)):
            common = [log, "--source-root", str(root), "--adaptor", str(adaptor)]
            fixed = cli("fix", *common, "--yes")
            if fixed.returncode != 0:
                print(f"{name}: fix failed: {fixed.stderr.strip()}")
                return 1
            start = time.perf_counter()
            result = cli("verify", *common, "--ranks", str(options.ranks), "--format", "json")
            wall = time.perf_counter() - start
            total += wall
            document = json.loads(result.stdout)
            outcomes = [verdict["outcome"] for verdict in document["verdicts"]]
            proven &= result.returncode == 0
            print(
                f"{name}: {' '.join(outcomes)} · {document['ranks']} ranks · backend {document['backend']} · "
                f"{wall:.2f} s wall (replay {document['seconds']:.2f} s)"
            )
            for phase, seconds in document["phase_seconds"].items():
                print(f"    {phase:<20} {seconds * 1000:8.1f} ms")
    verdict = "within" if total < TARGET_SECONDS else "OVER"
    print(f"both samples, red and green: {total:.2f} s ({verdict} the {TARGET_SECONDS:.0f} s target)")
    return 0 if proven else 1


if __name__ == "__main__":
    sys.exit(main())
