"""How long the sentinel's walk takes on a real megatron-core GPT/MoE model, and how it grows with the tensors.

    python benchmarks/sentinel_walk.py                 # a 134 M-parameter model, then 2..16 layers, 8..64 experts
    python benchmarks/sentinel_walk.py --profile       # and where the time goes (cProfile)

Builds megatron-core's GPTModel with MoE on CPU (tests/fixtures/sentinel/megatron_gpt_moe.py: local
spec, aux-loss-free balancing, rotary embeddings, gloo world of one) and trains it for a few steps
with Adam, so that the optimizer state, the MoE tracker, the global memory buffer and the routers'
buffers exist. Then, under the emulated backend: every tensor is marked unsafe (the fault), the
parameters and the optimizer state safe again (the adaptor's repair), and
``examine(model, optimizer, packages=["megatron"])`` is timed, best and median of --repeat runs.
Prints the parameters, the tensors checked, the objects visited, the seconds, the unsafe globals
named, and the peak RSS the walk adds; then the same walk on smaller models of 2 to 16 layers and 8
to 64 experts, with the cost per tensor and the line fitted through them (a fixed cost, and a cost
per tensor). Target: under 1 s per rank. Other work on the machine slows the runs: compare bests.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "sentinel"))

import megatron_gpt_moe as gpt  # noqa: E402  (a fixture module, found through the path above)
from quiet import add_loaded_option, require_quiet  # noqa: E402

TARGET_SECONDS = 1.0
LARGE = gpt.Shape(layers=4, hidden=768, experts=8, expert_hidden=1536)  # 134 M parameters
LARGE_STEPS = 2
GROWTH = [
    gpt.Shape(layers=layers, hidden=128, experts=experts, expert_hidden=256, vocabulary=4096)
    for layers, experts in ((2, 8), (4, 8), (8, 8), (16, 8), (16, 32), (16, 64))
]
PACKAGES = ["megatron"]


@dataclass(frozen=True)
class Timing:
    parameters: int
    tensors: int
    objects: int
    best: float
    median: float
    named: tuple[str, ...]
    rss_added_mb: float | None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print where the walk of the large model spends its time")
    add_loaded_option(parser)
    options = parser.parse_args()
    require_quiet(loaded_ok=options.loaded)
    print(f"{LARGE}: training {LARGE_STEPS} steps on CPU...", flush=True)
    large = measure(LARGE, LARGE_STEPS, options.repeat, profile=options.profile)
    print(f"parameters          {large.parameters:,}")
    print(f"tensors checked     {large.tensors:,}")
    print(f"objects visited     {large.objects:,}")
    print(f"walk seconds        best {large.best:.3f}, median {large.median:.3f} ({options.repeat} runs)")
    rss = f"{large.rss_added_mb:.1f} MB" if large.rss_added_mb is not None else "not measurable here"
    print(f"peak RSS added      {rss}")
    print(f"unsafe globals      {len(large.named)}")
    for name in large.named:
        print(f"    {name}")
    print("\ngrowth (hidden 128, vocabulary 4096; 1 step each):")
    print(
        f"{'layers':>6} {'experts':>7} {'parameters':>12} {'tensors':>8} {'objects':>8} {'best s':>8} {'median s':>9} "
        f"{'us/tensor':>10}"
    )
    points = []
    for shape in GROWTH:
        timing = measure(shape, 1, options.repeat, profile=False)
        points.append((timing.tensors, timing.best))
        per_tensor = timing.best / timing.tensors * 1e6
        print(
            f"{shape.layers:>6} {shape.experts:>7} {timing.parameters:>12,} {timing.tensors:>8,} {timing.objects:>8,} "
            f"{timing.best:>8.3f} {timing.median:>9.3f} {per_tensor:>10.1f}"
        )
    fixed, slope = _line(points)
    print(
        f"least squares on the best times: {fixed * 1e3:.0f} ms fixed + {slope * 1e6:.1f} us per tensor "
        f"(1 s at about {(TARGET_SECONDS - fixed) / slope:,.0f} tensors)"
    )
    verdict = "within" if large.best < TARGET_SECONDS else "OVER"
    print(f"\nlarge model: {large.best:.3f} s per rank ({verdict} the {TARGET_SECONDS:g} s target)")
    return 0


def measure(shape: gpt.Shape, steps: int, repeat: int, *, profile: bool) -> Timing:
    """Train, fault, repair the parameters and optimizer state, then time the sentinel's examine."""
    import torch

    from unsafe_doctor.npu.backend import EmulatedBackend
    from unsafe_doctor.sentinel import examine
    from unsafe_doctor.sentinel.walk import walk

    with gpt.megatron_on_cpu():
        trained = gpt.train(shape, steps)
        backend = EmulatedBackend()
        with backend.activate():
            backend.mark_host(*gpt.host_tensors(trained))
            backend.mark_all_unsafe()
            backend.set_check(enabled=True)
            for parameter in trained.model.parameters():  # the repair, as the replica's copy leaves it
                backend.mark_safe(parameter)
                for value in trained.optimizer.state[parameter].values():
                    if isinstance(value, torch.Tensor):
                        backend.mark_safe(value)
            roots = (trained.model, trained.optimizer)
            before = _resident_mb()
            _reset_peak_resident()
            report = examine(*roots, packages=PACKAGES, backend=backend)
            peak = _peak_resident_mb()
            added = peak - before if peak is not None and before is not None else None
            seconds = []
            for _ in range(repeat):
                started = time.perf_counter()
                examine(*roots, packages=PACKAGES, backend=backend)
                seconds.append(time.perf_counter() - started)
            objects = walk(roots, PACKAGES).objects
            if profile:
                _profile(lambda: examine(*roots, packages=PACKAGES, backend=backend))
        named = tuple(
            item.name.dotted
            + (" (lru cache)" if item.cached else "")
            + (f" (written by the step first: {item.written_by_step})" if item.written_by_step else "")
            for item in report.unsafe
        )
        timing = Timing(
            trained.parameters, report.summary.tensors_checked, objects, min(seconds), statistics.median(seconds), named, added
        )
        gpt.forget_rotary_cache()
    del trained, report
    gc.collect()
    return timing


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Intercept and slope of the least-squares line through (tensors, seconds)."""
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    slope = statistics.covariance(xs, ys) / statistics.variance(xs)
    return statistics.fmean(ys) - slope * statistics.fmean(xs), slope


def _profile(run) -> None:
    profiler = cProfile.Profile()
    profiler.runcall(run)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(20)
    print(text.getvalue())


def _status_mb(field: str) -> float | None:
    """A memory figure of this process from /proc (Linux), in MB."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return None


def _resident_mb() -> float | None:
    return _status_mb("VmRSS")


def _peak_resident_mb() -> float | None:
    return _status_mb("VmHWM")


def _reset_peak_resident() -> None:
    """Linux resets the peak RSS (VmHWM) to the current RSS when 5 is written to clear_refs."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
