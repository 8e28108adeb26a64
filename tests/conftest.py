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


def _route_with_stale_bias(mark) -> None:
    """megatron-core 0.16.1's TopKRouter routes with an expert_bias the fault left unsafe."""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
        moe_router_load_balancing_type="none", moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, use_cpu_initialization=True,
    )
    router = TopKRouter(config, ProcessGroupCollection(tp=None, cp=None, tp_cp=None, tp_dp_cp=None))
    mark(router.expert_bias)
    router.routing(torch.randn(3, 2, 4))


@pytest.fixture(scope="session")
def router_expert_bias_log(tmp_path_factory) -> Path:
    """rank 3's traceback: megatron-core's TopKRouter.routing reads expert_bias (scenario 2)."""
    generator = load_rules_generator()
    path = tmp_path_factory.mktemp("logs") / "router_expert_bias.log"
    path.write_text(generator.as_log(generator.capture(_route_with_stale_bias), rank_prefix=True))
    return path
