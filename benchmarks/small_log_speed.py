"""How long a small log takes on a bare install, against the interpreter's own start, and what the
framework index adds to it.

    python benchmarks/small_log_speed.py [--repeat 9]

Makes a new virtual environment with `pip install .` only (no torch, no megatron-core: a login
node), then times whole processes in rounds: each round runs every command below once, in turn,
beside its baseline, so that a busy moment slows them alike; each figure is the median of the
rounds (--repeat, at least 5), each ratio the median of the rounds' own ratios:
  python -c pass                                     the interpreter's own start, the baseline
  unsafe-doctor -V, --help, diagnose --help          start-up alone (-V loads no library)
  unsafe-doctor diagnose LOG, and --format json      the whole command
Targets (issue 39): a small log, either form, at most 12x python -c pass; --help at most 0.08 s.
Then, inside that Python, diagnose() of the same log with the shipped index and with an empty one,
best of 15 (target: the index adds at most 50 ms). Logs: the two bundled Megatron samples.
"""

from __future__ import annotations

import argparse
import statistics
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


def wall(command: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, capture_output=True, check=False)
    return time.perf_counter() - started


Timed = dict[str, tuple[float, float]]  # per command: median seconds, median ratio to the baseline


def paired(commands: dict[str, list[str]], baseline: list[str], rounds: int, cwd: Path) -> tuple[float, Timed]:
    """The baseline's median seconds; per command, its median seconds and the median of its ratio to
    the baseline run just before it, each round running every command once."""
    floors: list[float] = []
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    ratios: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            floor, took = wall(baseline, cwd), wall(command, cwd)
            floors.append(floor)
            seconds[name].append(took)
            ratios[name].append(took / floor)
    medians = {name: (statistics.median(seconds[name]), statistics.median(ratios[name])) for name in commands}
    return statistics.median(floors), medians


def index_cost(python: str, log: Path) -> tuple[float, float]:
    """diagnose() of `log` in one process, best of REPEAT: with the shipped index, and with an empty one."""
    timed = subprocess.run([python, "-c", IN_PROCESS, str(log), str(REPEAT)], capture_output=True, text=True, check=True)
    with_index, without = map(float, timed.stdout.split())
    return with_index, without


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9, help="rounds, at least 5; the median counts")
    add_loaded_option(parser)
    options = parser.parse_args()
    require_quiet(loaded_ok=options.loaded)
    rounds = max(options.repeat, 5)
    with tempfile.TemporaryDirectory() as scratch:
        venv = Path(scratch) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(ROOT)], check=True)
        python, tool = str(venv / "bin" / "python"), str(venv / "bin" / "unsafe-doctor")
        starts = {f"unsafe-doctor {' '.join(words)}": [tool, *words] for words in (["-V"], ["--help"], ["diagnose", "--help"])}
        logs = {
            f"diagnose {form} {log.name}": [tool, "diagnose", *extra, str(log)]
            for log in LOGS
            for form, extra in (("", []), ("--format json", ["--format", "json"]))
        }
        floor, timed = paired({**starts, **logs}, [python, "-c", "pass"], rounds, Path(scratch))
        print(f"bare install, medians of {rounds} rounds, each command paired with python -c pass ({floor * 1000:.0f} ms)")
        for name, (seconds, ratio) in timed.items():
            print(f"{' '.join(name.split()):<48} {seconds * 1000:6.0f} ms  {ratio:5.1f} x python -c pass")
        print(f"{'log':<26} {'diagnose()':>11} {'no index':>9} {'index adds':>11}")
        costs = []
        for log in LOGS:
            with_index, without = index_cost(python, log)
            costs.append(with_index - without)
            print(f"{log.name:<26} {with_index * 1000:8.1f} ms {without * 1000:6.1f} ms {costs[-1] * 1000:8.1f} ms")
    worst_ratio, help_seconds = max(timed[name][1] for name in logs), timed["unsafe-doctor --help"][0]
    print(
        f"\nworst small log {worst_ratio:.1f} x python -c pass (target <= 12); --help {help_seconds * 1000:.0f} ms "
        f"(target <= 80 ms); worst index cost {max(costs) * 1000:.1f} ms (target <= 50 ms)"
    )
    return 0 if worst_ratio <= 12 and help_seconds <= 0.08 and max(costs) <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
