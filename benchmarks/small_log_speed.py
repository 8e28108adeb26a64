"""How long a small log takes on a bare install, and what the framework index adds to it.

    python benchmarks/small_log_speed.py

Makes a new virtual environment with `pip install .` only (no torch, no megatron-core: a login
node), then, each best of 15 runs:
  python -c pass                                     the interpreter's own start, the floor
  unsafe-doctor -V, --help, diagnose --help          start-up alone (-V loads no library)
  unsafe-doctor diagnose samples/logs/<log>          whole command, wall (target: under 0.15 s; --help under 0.1 s)
and, inside that Python, diagnose() of the same log with the shipped index and with an empty one
(target: the index adds at most 50 ms). Logs: the two bundled Megatron samples.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quiet import add_loaded_option, require_quiet

ROOT = Path(__file__).resolve().parent.parent
LOGS = [ROOT / "samples" / "logs" / name for name in ("megatron_moe_tracker.log", "faq_modellink.log")]
REPEAT = 15

IN_PROCESS = """
import sys, tempfile, time
from pathlib import Path
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.source.index import FrameworkIndex
log, repeat = sys.argv[1], int(sys.argv[2])
empty = Path(tempfile.mkdtemp())
def once(index):
    setup = groundwork()
    if index is not None:
        setup.workspace.index = index
    started = time.perf_counter()
    diagnose([log], setup)
    return time.perf_counter() - started
with_index = min(once(None) for _ in range(repeat))
without = min(once(FrameworkIndex(empty)) for _ in range(repeat))
print(with_index, without)
"""


def best_wall(command: list[str], cwd: Path) -> float:
    times = []
    for _ in range(REPEAT):
        started = time.perf_counter()
        subprocess.run(command, cwd=cwd, capture_output=True, check=False)
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_loaded_option(parser)
    require_quiet(parser.parse_args().loaded)
    with tempfile.TemporaryDirectory() as scratch:
        venv = Path(scratch) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(ROOT)], check=True)
        python, tool = str(venv / "bin" / "python"), str(venv / "bin" / "unsafe-doctor")
        floor = best_wall([python, "-c", "pass"], Path(scratch))
        print(f"bare install, best of {REPEAT}; python -c pass: {floor * 1000:.0f} ms")
        starts = {}
        for words in (["-V"], ["--help"], ["diagnose", "--help"]):
            starts[" ".join(words)] = start = best_wall([tool, *words], Path(scratch))
            print(f"unsafe-doctor {' '.join(words):<16} {start * 1000:6.0f} ms  {start / floor:5.1f} x python -c pass")
        worst_help = max(starts["--help"], starts["diagnose --help"])
        print(f"{'log':<26} {'wall':>8} {'diagnose()':>11} {'no index':>9} {'index adds':>11}")
        worst_wall = worst_cost = 0.0
        for log in LOGS:
            wall = best_wall([tool, "diagnose", str(log)], Path(scratch))
            timed = subprocess.run([python, "-c", IN_PROCESS, str(log), str(REPEAT)], capture_output=True, text=True, check=True)
            with_index, without = map(float, timed.stdout.split())
            cost = with_index - without
            worst_wall, worst_cost = max(worst_wall, wall), max(worst_cost, cost)
            print(f"{log.name:<26} {wall * 1000:6.0f} ms {with_index * 1000:8.1f} ms "
                  f"{without * 1000:6.1f} ms {cost * 1000:8.1f} ms")
    print(f"\nworst wall {worst_wall * 1000:.0f} ms (target < 150 ms); --help {worst_help * 1000:.0f} ms (target < 100 ms); "
          f"worst index cost {worst_cost * 1000:.1f} ms (target <= 50 ms)")
    return 0 if worst_wall < 0.15 and worst_help < 0.1 and worst_cost <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
