"""The log shapes that hurt a byte scanner: a marker on every line, lines packed with sentinel tags, a folder of ranks.

    python benchmarks/input_shapes.py
    python benchmarks/input_shapes.py --repeat 3 --only folder

Whole processes, page cache warm, medians of --repeat rounds, each round running the baseline and
unsafe-doctor in turn:
  dense    an unsafe-data message on every line, 100 MB and 200 MB: peak RSS <= 200 MB whatever the size
  packed   a 200 MB log whose every 1,000th line is 100 KB of back-to-back sentinel tags, against the
           same log without them: <= 2x
  folder   64 per-rank logs of 16 MB: against `rg -c -F` over the folder (`grep -r -c -F` when rg is
           not installed), one pass over the page cache on every core, the physical floor: <= 3.0x rg
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quiet import add_loaded_option, require_quiet

PLAIN = (
    "[rank{rank}]: [2026-11-30 03:12:44] iteration {step:8d}/  200000 | consumed samples: {samples:12d} | "
    "elapsed time per iteration (ms): 851.3 | learning rate: 1.500000E-04 | global batch size: 512 | "
    "lm loss: 2.513570E+00 | loss scale: 1.0 | grad norm: 1.103 | number of skipped iterations: 0 |\n"
)
UNSAFE = "[rank3]: RuntimeError: There is unsafe data in the input tensor.\n"
TAG = "[unsafe-doctor sentinel]"


def plain_lines(count: int, rank: int | None = None) -> str:
    return "".join(
        PLAIN.format(rank=rank if rank is not None else step % 64, step=step, samples=step * 512) for step in range(count)
    )


def write_repeated(path: Path, block: str, size: int) -> None:
    data = block.encode()
    with path.open("wb") as out:
        for _ in range(max(1, size // len(data))):
            out.write(data)


def timed(command: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS in KB of the process and the children it waited for)."""
    # Output into a file, not /dev/null: GNU grep stops at its first match when its output is /dev/null.
    sink = tempfile.TemporaryFile()
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=sink, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(process.pid, 0)
    sink.close()
    return time.perf_counter() - started, usage.ru_maxrss


def rounds(repeat: int, commands: list[list[str]]) -> list[tuple[float, int]]:
    """Per command: median seconds and peak RSS over `repeat` rounds, the commands run in turn in each."""
    results: list[list[tuple[float, int]]] = [[] for _ in commands]
    for _ in range(repeat):
        for index, command in enumerate(commands):
            results[index].append(timed(command))
    return [(statistics.median(r[0] for r in runs), max(r[1] for r in runs)) for runs in results]


def dense(doctor: str, workdir: Path, repeat: int) -> bool:
    print("dense: an unsafe-data message on every line")
    peaks = []
    for megabytes in (100, 200):
        log = workdir / f"dense{megabytes}.log"
        write_repeated(log, UNSAFE * 1000, megabytes << 20)
        subprocess.run(["cat", str(log)], stdout=subprocess.DEVNULL, check=True)
        (grep_s, _), (doctor_s, rss) = rounds(
            repeat, [["grep", "-c", "-F", "unsafe data", str(log)], [doctor, "diagnose", str(log)]]
        )
        print(
            f"  {megabytes} MB: grep {grep_s:.3f} s, unsafe-doctor {doctor_s:.2f} s ({doctor_s / grep_s:.1f}x), "
            f"peak RSS {rss / 1024:.0f} MB"
        )
        peaks.append(rss)
        log.unlink()
    ok = max(peaks) <= 200 * 1024
    print(f"  target: peak RSS <= 200 MB whatever the size: {'met' if ok else 'MISSED'}")
    return ok


def packed(doctor: str, workdir: Path, repeat: int) -> bool:
    print("packed: every 1,000th line is 100 KB of sentinel tags")
    size = 200 << 20
    plain_block = plain_lines(1000)
    tags = TAG * (100_000 // len(TAG)) + "\n"
    write_repeated(workdir / "plain.log", plain_block, size)
    write_repeated(workdir / "packed.log", plain_block[: len(plain_block) - len(tags)] + tags, size)
    for name in ("plain.log", "packed.log"):
        subprocess.run(["cat", str(workdir / name)], stdout=subprocess.DEVNULL, check=True)
    (plain_s, _), (packed_s, rss) = rounds(
        repeat, [[doctor, "diagnose", str(workdir / "plain.log")], [doctor, "diagnose", str(workdir / "packed.log")]]
    )
    ratio = packed_s / plain_s
    print(
        f"  plain {plain_s:.2f} s, packed {packed_s:.2f} s: {ratio:.2f}x (peak RSS {rss / 1024:.0f} MB); "
        f"target <= 2x: {'met' if ratio <= 2 else 'MISSED'}"
    )
    for name in ("plain.log", "packed.log"):
        (workdir / name).unlink()
    return ratio <= 2


def folder(doctor: str, workdir: Path, repeat: int) -> bool:
    print("folder: 64 per-rank logs of 16 MB")
    logs = workdir / "ranks"
    logs.mkdir()
    for rank in range(64):
        block = plain_lines(500, rank)
        path = logs / f"rank_{rank}.log"
        write_repeated(path, block, 16 << 20)
        if rank == 3:
            with path.open("a") as out:
                out.write(UNSAFE)
    subprocess.run(["cat", *map(str, sorted(logs.iterdir()))], stdout=subprocess.DEVNULL, check=True)
    rg = shutil.which("rg")
    baseline = (
        [rg, "-c", "-F", "There is unsafe data", str(logs)]
        if rg
        else ["grep", "-r", "-c", "-F", "There is unsafe data", str(logs)]
    )
    (base_s, _), (doctor_s, rss) = rounds(repeat, [baseline, [doctor, "diagnose", str(logs)]])
    ratio = doctor_s / base_s
    name = "rg -c -F" if rg else "grep -r -c -F (rg is not installed)"
    print(
        f"  {name} {base_s:.2f} s, unsafe-doctor {doctor_s:.2f} s: {ratio:.2f}x, peak RSS {rss / 1024:.0f} MB, "
        f"{os.cpu_count()} cores"
    )
    print(f"  target <= 3.0x rg: {'met' if rg and ratio <= 3 else 'MISSED' if rg else 'not measurable here'}")
    shutil.rmtree(logs)
    return ratio <= 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the median counts")
    parser.add_argument("--only", choices=["dense", "packed", "folder"], help="one shape only")
    add_loaded_option(parser)
    args = parser.parse_args()
    require_quiet(loaded_ok=args.loaded)
    doctor = shutil.which("unsafe-doctor") or str(Path(sys.executable).with_name("unsafe-doctor"))
    workdir = Path(tempfile.mkdtemp(prefix="unsafe-doctor-shapes-"))
    try:
        shapes = (("dense", dense), ("packed", packed), ("folder", folder))
        results = [shape(doctor, workdir, args.repeat) for name, shape in shapes if args.only in (None, name)]
        print("result: " + ("within targets" if all(results) else "MISSED a target"))
    finally:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
