"""How fast `unsafe-doctor audit` reads whole framework trees: the installed megatron-core by default.

    python benchmarks/audit_speed.py                       # site-packages/megatron/core
    python benchmarks/audit_speed.py --path ~/Megatron-LM --adaptor my_adaptor.py
    python benchmarks/audit_speed.py --path ~/MindSpeed-LLM/mindspeed_llm --path ~/MindSpeed/mindspeed \
        --path .venv/lib/python3.11/site-packages/megatron/core        # a real job's three trees
    python benchmarks/audit_speed.py --scaling 500,1000,2000          # N files, one global each: linear?
    python benchmarks/audit_speed.py --cache --path ... --path ...    # again from the cache; after one edit

Times the whole command (start-up, parsing every file, coverage of the adaptor, classification,
JSON output), best of --repeat runs, and prints seconds, CPU seconds, files, files per second and
the peak memory (PSS, measured in one more run) with what the audit found. With several trees it
also audits the first one, then the first two, ... once each, and prints how the time and memory
grow with the files. Targets: under 10 s and 250 MB on 2 cores. The audit scans and classifies in
two processes where it may use two cores (the second a forked copy); the memory is their PSS
summed. It refuses to run on a loaded machine (quiet.py: other work slows the run down, and the
CPU seconds say less about that load than the wall time), and the time is also given as a ratio
to a baseline run in the same script: one process parsing every file once with `ast`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from quiet import add_loaded_option, require_quiet

ROOT = Path(__file__).resolve().parent.parent
LEGACY_ADAPTOR = ROOT / "samples" / "adaptors" / "legacy" / "mindio_ttp" / "adaptor" / "modellink_adaptor.py"
TARGET_SECONDS = 10.0
TARGET_MB = 250


def installed_megatron_core() -> Path:
    """The installed megatron/core folder, found without importing it (it imports torch)."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("megatron-core is not installed: pip install megatron-core, or give --path")
    return Path(next(iter(spec.submodule_search_locations)))


def timed(command: list[str]) -> tuple[float, float, float, subprocess.CompletedProcess[str]]:
    """Seconds, CPU seconds (GNU time's: with the audit's forked copy), the peak RSS of the audit's
    main process in MB (GNU time's) and the result."""
    started = time.perf_counter()
    result = subprocess.run(["/usr/bin/time", "-f", "%U %S %M", *command], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    user, system, peak_kb = result.stderr.strip().splitlines()[-1].split()
    return seconds, float(user) + float(system), int(peak_kb) / 1024, result


PARSE_ALL = """
import ast, sys, pathlib
for tree in sys.argv[1:]:
    for path in sorted(pathlib.Path(tree).rglob("*.py")):
        try:
            ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            pass
"""


def parse_all_seconds(paths: list[Path], repeat: int) -> float:
    """The baseline: one process that reads and parses every file of the trees once with `ast`, the
    least an audit that reads source as syntax trees can do; best of `repeat`."""
    runs = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", PARSE_ALL, *map(str, paths)], check=True)
        runs.append(time.perf_counter() - started)
    return min(runs)


def peak_memory_mb(command: list[str]) -> float:
    """The peak of the PSS summed over the audit and its forked copy, sampled every 50 ms, in a run
    of its own (reading a process's PSS takes the kernel a millisecond or two: it would slow a timed
    run). A page the two share (the copy starts with all of its parent's) counts half to each, so
    the sum is the memory they take together, where RSS would count those pages twice."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak_kb = 0
    while process.poll() is None:
        peak_kb = max(peak_kb, _tree_pss_kb(process.pid))
        time.sleep(0.05)
    return peak_kb / 1024


def _tree_pss_kb(pid: int) -> int:
    """The proportional set size of a process and all its descendants, in KB (0 for one gone meanwhile)."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/smaps_rollup").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Pss:")), 0)
        pending.extend(int(child) for child in children)
    return total


GLOBAL_PER_FILE = """import torch

_STATE_{n} = torch.zeros(4, device="npu")


def step_{n}(x):
    _STATE_{n}.add_(x)
    return _STATE_{n} * 2
"""


def scaling(sizes: list[int], doctor: str, repeat: int) -> None:
    """Packages of N files with one device global each: the audit's time should grow as N does
    (judging each global once looked up its name in every file of its package: quadratic)."""
    print(f"scaling: N files, one global each (best of {repeat})")
    print(f"{'files':>6}{'seconds':>9}{'CPU s':>8}{'ms/file':>9}{'x parse-all':>13}{'x previous':>12}")
    previous = None
    with tempfile.TemporaryDirectory() as scratch:
        for size in sizes:
            package = Path(scratch) / f"scaled{size}"
            package.mkdir()
            (package / "__init__.py").write_text("")
            for n in range(size):
                (package / f"m{n}.py").write_text(GLOBAL_PER_FILE.format(n=n))
            runs = [timed([doctor, "audit", str(package), "--format", "json", "--no-cache"]) for _ in range(repeat)]
            seconds, cpu, _, _ = min(runs, key=lambda run: run[0])
            baseline = parse_all_seconds([package], repeat)
            growth = f"{seconds / previous:12.2f}" if previous else f"{'':>12}"
            print(f"{size:>6}{seconds:>9.2f}{cpu:>8.2f}{seconds * 1000 / size:>9.2f}{seconds / baseline:>13.2f}{growth}")
            previous = seconds


def cached(paths: list[Path], adaptor: Path, doctor: str, repeat: int) -> None:
    """The audit run again with its cache: on a copy of the trees (each under its import root's
    layout, so modules keep their names), first with no cache, then again unchanged, then after
    one line is added to one file; medians of `repeat` runs each, as ratios to the first."""
    from unsafe_doctor.source.files import ImportRoots

    with tempfile.TemporaryDirectory() as scratch:
        copies = []
        for number, path in enumerate(paths):
            copy = Path(scratch) / str(number) / path.resolve().relative_to(ImportRoots().of(path))
            shutil.copytree(path, copy, ignore=shutil.ignore_patterns("__pycache__"))
            copies.append(copy)
        cache = Path(scratch) / "cache"
        audit = [doctor, "audit", *map(str, copies), "--adaptor", str(adaptor), "--format", "json"]
        first = [timed([*audit, "--no-cache"]) for _ in range(repeat)]
        timed([*audit, "--cache-dir", str(cache)])  # the entry
        unchanged = [timed([*audit, "--cache-dir", str(cache)]) for _ in range(repeat)]
        files = sorted(copies[0].rglob("*.py")) if copies[0].is_dir() else [copies[0]]
        edited = files[len(files) // 2]
        changed = []
        for number in range(repeat):
            with edited.open("a") as handle:
                handle.write(f"\n# edit {number}\n")
            changed.append(timed([*audit, "--cache-dir", str(cache)]))
        outputs = {run[3].stdout for run in first[:1] + unchanged}
        base = statistics.median(run[0] for run in first)
        print(f"trees: {', '.join(map(str, paths))} (copied); medians of {repeat}")
        print(f"{'first audit, no cache (s)':<34}{base:>8.2f}")
        for name, runs, target in (("again, unchanged", unchanged, 0.10), ("after one file changed", changed, 0.20)):
            seconds = statistics.median(run[0] for run in runs)
            print(f"{name + ' (s)':<34}{seconds:>8.2f}   {seconds / base:6.1%} of the first (target <= {target:.0%})")
        print(f"{'reports the same bytes':<34}{'yes' if len(outputs) == 1 else 'NO':>8}   (first audit and every unchanged run)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, action="append", help="a tree to audit, repeatable (default: megatron/core)")
    parser.add_argument("--adaptor", type=Path, default=LEGACY_ADAPTOR, help="adaptor file (default: the FAQ's legacy sample)")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the best counts")
    parser.add_argument("--scaling", help="instead: packages of these many files, one global each (500,1000,2000)")
    parser.add_argument("--cache", action="store_true", help="instead: the audit again from its cache, on a copy of the trees")
    add_loaded_option(parser)
    args = parser.parse_args()
    require_quiet(loaded_ok=args.loaded)
    doctor = shutil.which("unsafe-doctor") or str(Path(sys.executable).with_name("unsafe-doctor"))
    if args.scaling:
        scaling([int(size) for size in args.scaling.split(",")], doctor, args.repeat)
        return
    paths = args.path or [installed_megatron_core()]
    if args.cache:
        cached(paths, args.adaptor, doctor, args.repeat)
        return

    def command(trees: list[Path]) -> list[str]:
        return [doctor, "audit", *map(str, trees), "--adaptor", str(args.adaptor), "--format", "json", "--no-cache"]

    runs = [timed(command(paths)) for _ in range(args.repeat)]
    seconds, cpu_seconds, main_rss_mb, result = min(runs, key=lambda run: run[0])
    peak_mb = peak_memory_mb(command(paths))
    if result.returncode not in (0, 1):
        sys.exit(f"audit failed (exit {result.returncode}): {result.stderr.strip()}")
    audit = json.loads(result.stdout)
    files = audit["files"]
    kinds = Counter(holder["kind"] for holder in audit["holders"])
    summary = audit["summary"]
    print(f"trees: {', '.join(map(str, paths))}")
    print(f"{'seconds (best of ' + str(args.repeat) + ')':<24}{seconds:>8.2f}")
    print(f"{'seconds (median)':<24}{statistics.median(run[0] for run in runs):>8.2f}")
    baseline = parse_all_seconds(paths, args.repeat)
    print(f"{'parse-all baseline (s)':<24}{baseline:>8.2f}   (ast.parse of every file, one process, best of {args.repeat})")
    print(f"{'x parse-all':<24}{seconds / baseline:>8.2f}")
    print(f"{'CPU seconds':<24}{cpu_seconds:>8.2f}")
    print(f"{'CPU x parse-all':<24}{cpu_seconds / baseline:>8.2f}   (target <= 2.0; the baseline runs in one process)")
    print(f"{'files':<24}{files:>8}")
    print(f"{'files/s':<24}{files / seconds:>8.0f}")
    print(f"{'peak PSS (MB, summed)':<24}{peak_mb:>8.0f}   (the audit and its forked copy)")
    print(f"{'peak RSS (MB, main)':<24}{main_rss_mb:>8.0f}   (the audit's own process, GNU time)")
    print(
        f"globals: {summary['holders']} ({', '.join(f'{count} {kind}' for kind, count in sorted(kinds.items()))}); "
        f"{summary['uncovered']} uncovered, {summary['unsafe']} unsafe, {summary['covered']} covered, "
        f"{summary['fixable']} with a fix; {len(audit['stale_resets'])} stale reset(s); "
        f"{len(audit['conversion_only'])} left out (only a checkpoint converter uses them)"
    )
    if len(paths) > 1:
        print("growth (one run each):")
        for count in range(1, len(paths) + 1):
            part_seconds, part_cpu, _, part = timed(command(paths[:count]))
            part_mb = peak_memory_mb(command(paths[:count]))
            part_files = json.loads(part.stdout)["files"] if part.returncode in (0, 1) else 0
            print(
                f"  {count} tree(s): {part_files:>5} files  {part_seconds:6.2f} s ({part_cpu:6.2f} CPU)  {part_mb:5.0f} MB  "
                f"{part_seconds * 1000 / max(part_files, 1):5.1f} ms/file"
            )
    print(f"targets: under {TARGET_SECONDS:.0f} s and {TARGET_MB} MB")
    within = seconds < TARGET_SECONDS and peak_mb < TARGET_MB
    print("result: " + ("within targets" if within else "MISSED a target"))


if __name__ == "__main__":
    main()
