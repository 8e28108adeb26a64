"""The README's first command on a machine without torch or megatron-core: `pip install .` in a new
virtual environment, then the bundled Megatron samples. The shipped index alone must name each
tensor, its scenario and its rule (the test extra's megatron-core must not be what makes it work).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # CI runs it: python -m pytest -m slow

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples" / "logs"


@pytest.fixture(scope="session")  # once per xdist worker; "module" rebuilds it each time other files' tests come between
def bare(tmp_path_factory) -> Path:
    """A new venv with `pip install .` and nothing else; its bin folder."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr
    return venv / "bin"


def test_the_bare_install_has_neither_torch_nor_megatron(bare):
    probe = "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('megatron'))"
    result = subprocess.run([str(bare / "python"), "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["None", "None"]


@pytest.mark.parametrize(
    ("log", "variable", "rule"),
    [
        ("megatron_moe_tracker.log", "_MOE_LAYER_WISE_LOGGING_TRACKER", "megatron.moe-layer-wise-tracker-moe-utils"),
        ("faq_modellink.log", "_MOE_AUX_LOSSES_LOGGING_TRACKER", "megatron.moe-aux-losses-tracker"),
    ],
)
def test_the_bundled_megatron_samples_are_classified_by_a_bare_install(bare, tmp_path, log, variable, rule):
    command = [str(bare / "unsafe-doctor"), "diagnose", str(SAMPLES / log)]
    report = subprocess.run([*command, "--format", "json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert report.returncode == 1, report.stderr  # 1: findings
    [finding] = json.loads(report.stdout)["findings"]
    assert (finding["tensor"]["variable"], finding["scenario"], finding["rule"]) == (variable, 1, rule)
    assert (finding["source_from"], finding["source_confidence"]) == ("index", "high")
    text = subprocess.run([*command], capture_output=True, text=True, timeout=120, cwd=tmp_path, env={"COLUMNS": "200"})
    shown = " ".join(text.stdout.split())
    assert f"Tensor {variable}" in shown and f"Scenario 1 — re-initialise it in the rollback phase (rule {rule})" in shown
