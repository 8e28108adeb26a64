"""Logs shared by several test files, produced here by running real code under the emulated check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORK = ROOT / "samples" / "framework"


def load_rules_generator():
    """tests/fixtures/rules/generate.py: captures a real traceback and writes it as a rank's log."""
    spec = importlib.util.spec_from_file_location("rules_generator", ROOT / "tests" / "fixtures" / "rules" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record_into_stale_loss_log(mark) -> None:
    """toytrain adds the next step's loss into a LOSS_LOG entry the fault left unsafe."""
    import torch

    sys.path.insert(0, str(FRAMEWORK))
    try:
        from toytrain import state

        state.init_state("cpu")
        state.record_loss("loss", torch.ones(()))
        mark(state.LOSS_LOG["loss"])
        state.record_loss("loss", torch.ones(()))
    finally:
        sys.path.remove(str(FRAMEWORK))
        for name in [name for name in sys.modules if name == "toytrain" or name.startswith("toytrain.")]:
            del sys.modules[name]  # a test that imports toytrain gets its own copy


@pytest.fixture(scope="session")
def toytrain_loss_log(tmp_path_factory) -> Path:
    """rank 3's traceback: toytrain.state.record_loss reads LOSS_LOG["loss"] (scenario 1)."""
    generator = load_rules_generator()
    path = tmp_path_factory.mktemp("logs") / "toytrain_loss_log.log"
    path.write_text(generator.as_log(generator.capture(_record_into_stale_loss_log), rank_prefix=True))
    return path
