"""The fixes of the megatron rules added for globals the coverage of every release found
(tests/test_coverage.py), run on megatron-core 0.19.2's real code under the emulated unsafe-data
check: the step that failed fails again without the fix and passes with it. The release is unpacked
as tests/test_rules_releases.py unpacks it; where it cannot be had, the tests skip.

qb_beta (scenario 2, a replica's copy), the global aux-loss counts (their step all-reduces over a
process group this test has not) and the activation offload manager (it offloads only tensors on a
"cuda" device, and this machine has none) are held by their traceback cases in
tests/test_rules_shipped.py only.
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


# the streaming sparse-KL target of a 4-token chunk (2 heads, top-2), its accumulator left in the cache
DSA_SCRATCH = """
from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
query, key = torch.randn(2, 4, 8), torch.randn(4, 8)
topk, valid = torch.tensor([[0, 1], [1, 2], [2, 3], [0, 3]]), torch.ones(4, 2, dtype=torch.bool)
def target_chunk():
    return tilelang_dsa._compute_topk_target_chunk_sum(
        query_h=query, key_shared=key, key_per_head=None, s0=0, s1=4, idx_seq=topk, valid_seq=valid,
        softmax_scale=0.5, head_chunk_size=2, topk_chunk_size=2, sk=4, hn=8)
target_chunk()
for scratch in tilelang_dsa._DSA_SCRATCH_CACHE.values():
    mark(scratch)
"""
# a parameter bucket of the FSDP double buffer, sliced from the buffer as FixedPoolAllocator.allocate slices it
FSDP_BUFFER = """
from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import get_global_memory_buffer
get_global_memory_buffer().get_tensor([8], torch.float32, "fsdp_params_0")
for buffer in get_global_memory_buffer().buffer.values():
    mark(buffer)
"""
# buffers allocated as the capture step's end allocates them (the token maxima a capture records, set here)
PAGED_STASH = """
torch.cuda.Stream = lambda *args, **kwargs: None  # no CUDA stream here; the manager only keeps it
from megatron.core.transformer.moe.paged_stash import PagedStashManager, paged_stash_reset
manager = PagedStashManager.get_instance()
manager.device, manager.vp_size, manager.status = torch.device("cpu"), 1, "capture"
manager.max_tokens_across_vp_stages = {(torch.bfloat16, 16): 256}
paged_stash_reset()
for buffers in manager.stash_buffers.values():
    for buffer in buffers.values():
        for value in vars(buffer).values():
            if isinstance(value, torch.Tensor):
                mark(value)
mark(manager.overflow)
mark(manager.host_spill)
"""


@pytest.mark.parametrize(("case", "setup", "retry"), [
    ("0.19 router qb_beta_accum", QB_ROUTER, "layer.quantile_balancing(torch.randn(6, 4))"),
    ("0.19 TileLang DSA scratch", DSA_SCRATCH, "target_chunk()"),
    ("0.19 Megatron-FSDP global memory buffer", FSDP_BUFFER,
     'get_global_memory_buffer().get_tensor([8], torch.float32, "fsdp_params_0")'),
    ("0.19 MoE paged stash", PAGED_STASH, "paged_stash_reset()"),
    ("0.19 YaRN cos/sin cache", YARN, "cos, sin = rotary.get_cached_cos_sin(4)\n(cos + sin).sum()"),
    ("0.19 DSA indexer loss tracker", DSA_TRACKER, "DSAIndexerLossLoggingHelper.save_loss_to_tracker(aux_loss(), 1, 2)"),
], ids=lambda value: value if isinstance(value, str) and "\n" not in value else None)
def test_fix_lets_the_step_past_the_unsafe_memory_in_0_19(case, setup, retry):
    root = unpacked("0.19.2")
    fix = rendered_fix(case)
    assert step(root, setup, retry, None) == "unsafe"
    assert step(root, setup, retry, fix) == "passed"
