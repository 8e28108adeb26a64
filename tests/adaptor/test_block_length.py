"""A tensor global's block is short, in every generation's adaptor: toytrain's EMA (annotated
`torch.Tensor | None`) gets the tensor template, at most 8 lines of code a side, written into the
samples' adaptors and the real MindSpeed-LLM and taskd ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
EMA_LOG = ROOT / "samples" / "logs" / "toytrain_ema"
SAMPLES = {
    "toytrain": ROOT / "samples" / "framework" / "toytrain" / "recovery.py",
    "legacy": ROOT / "samples" / "adaptors" / "legacy" / "mindio_ttp" / "adaptor" / "modellink_adaptor.py",
    "in-tree": ROOT
    / "samples"
    / "adaptors"
    / "in_tree"
    / "mindspeed_llm"
    / "core"
    / "high_availability"
    / "tft_optimizer_data_repair.py",
}
REAL = {
    "mindspeed-llm-master": Path(
        "mindspeed-llm-master", "mindspeed_llm", "core", "high_availability", "tft_optimizer_data_repair.py"
    ),
    "taskd": Path("mind-cluster-7.2rc1", "taskd", "python", "adaptor", "elastic_training", "repair_callback.py"),
}
MAX_LINES = 8


def block_lengths(adaptor: Path) -> list[int]:
    """The code lines of each block `fix --dry-run` would write (markers and the leading comment aside)."""
    result = run_cli(
        "fix",
        str(EMA_LOG),
        "--source-root",
        str(ROOT / "samples" / "framework"),
        "--adaptor",
        str(adaptor),
        "--dry-run",
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    lengths, current = [], None
    for line in result.stdout.splitlines():
        code = line[1:].strip() if line.startswith("+") else ""
        if code.startswith("# unsafe-doctor: begin"):
            current = 0
        elif code.startswith("# unsafe-doctor: end"):
            lengths.append(current)
            current = None
        elif current is not None and code and not code.startswith("#"):
            current += 1
    return lengths


@pytest.mark.parametrize("name", SAMPLES)
def test_a_sample_adaptors_tensor_blocks_are_short(name):
    lengths = block_lengths(SAMPLES[name])
    assert len(lengths) == 2 and max(lengths) <= MAX_LINES, lengths


@pytest.mark.parametrize("name", REAL)
def test_a_real_adaptors_tensor_blocks_are_short(name, real):
    lengths = block_lengths(real / REAL[name])
    assert len(lengths) == 2 and max(lengths) <= MAX_LINES, lengths
