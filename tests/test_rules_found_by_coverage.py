"""The fixes of the megatron rules added for globals the coverage of every release found
(tests/test_coverage.py), run on megatron-core 0.19.2's real code under the emulated unsafe-data
check: the step that failed fails again without the fix and passes with it. The release is unpacked
as tests/test_rules_releases.py unpacks it; where it cannot be had, the tests skip.

qb_beta (scenario 2, a replica's copy) and the global aux-loss counts (their step all-reduces over a
process group this test has not) are held by their traceback cases in tests/test_rules_shipped.py only.
"""

from __future__ import annotations

import pytest
from test_rules_releases import rendered_fix, step, unpacked

QB_ROUTER = """
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                           moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0,
                           use_cpu_initialization=True)
layer = TopKRouter(config, ProcessGroupCollection(tp=None, cp=None, tp_cp=None, tp_dp_cp=None))
layer.quantile_balancing(torch.randn(6, 4))
mark(layer.qb_beta_accum)
mark(layer.qb_beta_count)
"""
YARN = """
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
rotary = YarnRotaryEmbedding(kv_channels=8, use_cpu_initialization=True, scaling_factor=2.0)
rotary.get_cached_cos_sin(4)
mark(rotary.cos_cached)
mark(rotary.sin_cached)
"""
DSA_TRACKER = """
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper
DSAIndexerLossLoggingHelper.save_loss_to_tracker(aux_loss(), 1, 2)
mark(DSAIndexerLossLoggingHelper.tracker["values"])
"""


@pytest.mark.parametrize(("case", "setup", "retry"), [
    ("0.19 router qb_beta_accum", QB_ROUTER, "layer.quantile_balancing(torch.randn(6, 4))"),
    ("0.19 YaRN cos/sin cache", YARN, "cos, sin = rotary.get_cached_cos_sin(4)\n(cos + sin).sum()"),
    ("0.19 DSA indexer loss tracker", DSA_TRACKER, "DSAIndexerLossLoggingHelper.save_loss_to_tracker(aux_loss(), 1, 2)"),
], ids=lambda value: value if isinstance(value, str) and "\n" not in value else None)
def test_fix_lets_the_step_past_the_unsafe_memory_in_0_19(case, setup, retry):
    root = unpacked("0.19.2")
    fix = rendered_fix(case)
    assert step(root, setup, retry, None) == "unsafe"
    assert step(root, setup, retry, fix) == "passed"
