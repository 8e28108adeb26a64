"""The fixes of the rules added for globals the coverage of every release found
(tests/knowledge/test_coverage.py), run under the emulated unsafe-data check: the step that failed fails again
without the fix and passes with it. Megatron's run on megatron-core 0.19.2's real code, unpacked as
tests/knowledge/test_rules_releases.py unpacks it (where it cannot be had, the tests skip); MindSpeed's, which
cannot be installed here, on few-line stand-ins of our own at its real import paths.

qb_beta (scenario 2, a replica's copy), the global aux-loss counts (their step all-reduces over a
process group this test has not), the activation offload manager (it offloads only tensors on a
"cuda" device, and this machine has none) and the distillation logits saver (built from Megatron's parsed
arguments and parallel state) are held by their traceback cases in tests/knowledge/test_rules_shipped.py only.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from test_rules_releases import rendered_fix, step, unpacked
from test_rules_shipped import CASES, HOT_EXPERTS_MODULE, HOT_EXPERTS_STANDIN, UNSAFE_DATA, diagnose, emulated_npu, run_fix

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


@pytest.mark.parametrize(
    ("case", "setup", "retry"),
    [
        ("0.19 router qb_beta_accum", QB_ROUTER, "layer.quantile_balancing(torch.randn(6, 4))"),
        ("0.19 TileLang DSA scratch", DSA_SCRATCH, "target_chunk()"),
        (
            "0.19 Megatron-FSDP global memory buffer",
            FSDP_BUFFER,
            'get_global_memory_buffer().get_tensor([8], torch.float32, "fsdp_params_0")',
        ),
        ("0.19 MoE paged stash", PAGED_STASH, "paged_stash_reset()"),
        ("0.19 YaRN cos/sin cache", YARN, "cos, sin = rotary.get_cached_cos_sin(4)\n(cos + sin).sum()"),
        ("0.19 DSA indexer loss tracker", DSA_TRACKER, "DSAIndexerLossLoggingHelper.save_loss_to_tracker(aux_loss(), 1, 2)"),
    ],
    ids=lambda value: value if isinstance(value, str) and "\n" not in value else None,
)
def test_fix_lets_the_step_past_the_unsafe_memory_in_0_19(case, setup, retry):
    root = unpacked("0.19.2")
    fix = rendered_fix(case)
    assert step(root, setup, retry, None) == "unsafe"
    assert step(root, setup, retry, fix) == "passed"


# --- MindSpeed, on stand-ins at the real import paths ---------------------------------------------

# The queue both WeightGradStore classes keep: backward puts entries (dualpipev flushes each chunk's
# list to weight_grad_queue), pop() multiplies them into main_grad at the end of the step.
WEIGHT_GRAD_STORE = """
    import queue


    class WeightGradStore:
        cache = []
        weight_grad_queue = queue.Queue()
        store_grad_cache = None

        @classmethod
        def put(cls, total_input, grad_output, weight):
            cls.cache.append((total_input, grad_output, weight))

        @classmethod
        def flush_chunk_grad(cls):
            cls.weight_grad_queue.put(cls.cache)
            cls.cache = []

        @classmethod
        def overlap_matmul(cls, grad_store_cache):
            total_input, grad_output, weight = grad_store_cache
            weight.main_grad.add_(grad_output.t().matmul(total_input))

        @classmethod
        def pop(cls):
            while cls.cache:
                cls.store_grad_cache = cls.cache.pop(0)
                cls.overlap_matmul(cls.store_grad_cache)
            cls.store_grad_cache = None

        @classmethod
        def pop_single(cls):
            if not cls.weight_grad_queue.empty():
                cls.cache = cls.weight_grad_queue.get()
                cls.pop()
    """


def fails_without_and_passes_with_the_fix(case_name, tmp_path, module, setup, retry):
    """The next step meets the state the interrupted one left: unsafe without the rule's fix, past it with."""
    case = CASES[case_name]
    _, result = diagnose(case.log(tmp_path), case.versions, (tmp_path,) if case.standin else ())
    for fixed in (False, True):
        importlib.reload(module)  # the class and module state of a new process
        with emulated_npu() as mark:
            setup(module, mark)
            if fixed:
                run_fix(case.rule, result.fix)
                retry(module)
            else:
                with pytest.raises(RuntimeError, match=UNSAFE_DATA):
                    retry(module)


def weight_with_main_grad():
    import torch

    weight = torch.nn.Parameter(torch.zeros(2, 3))
    weight.main_grad = torch.zeros(2, 3)
    return weight


@pytest.mark.parametrize(
    ("case_name", "module_name", "flush", "drain"),
    [
        ("nanopipe WeightGradStore", "mindspeed.core.weight_grad_store", False, "pop"),
        (
            "fb-overlap WeightGradStore",
            "mindspeed.core.transformer.moe.moe_feature.fb_overlap.modules.weight_grad_store",
            True,
            "pop_single",
        ),  # dualpipev: the interrupted step's chunk waits in weight_grad_queue
        (
            "fb-overlap WeightGradStore, core_r0.8.0",
            "mindspeed.core.pipeline_parallel.fb_overlap.modules.weight_grad_store",
            False,
            "pop",
        ),
    ],
    ids=["nanopipe", "fb-overlap dualpipev", "fb-overlap core_r0.8.0"],
)
def test_weight_grad_store_fix_lets_the_next_step_drain_only_its_own_entries(
    case_name, module_name, flush, drain, *, tmp_path, standin
):
    import torch

    def left_by_the_fault(module, mark):
        """The interrupted step queued an entry whose output gradient the fault left unsafe."""
        stale = torch.ones(4, 2)
        module.WeightGradStore.put(torch.ones(4, 3), stale, weight_with_main_grad())
        if flush:
            module.WeightGradStore.flush_chunk_grad()
        mark(stale)

    def next_step(module):
        module.WeightGradStore.put(torch.ones(4, 3), torch.ones(4, 2), weight_with_main_grad())
        if flush:
            module.WeightGradStore.flush_chunk_grad()
        getattr(module.WeightGradStore, drain)()

    module = standin(module_name, WEIGHT_GRAD_STORE)
    fails_without_and_passes_with_the_fix(case_name, tmp_path, module, left_by_the_fault, next_step)


def test_balanced_moe_fix_gives_the_hot_expert_weights_fresh_memory(tmp_path, standin):
    import torch

    def setup(module, mark):
        module.init_global_shared_params_for_hot_experts((4, 4), torch.device("cpu"))
        mark(module.get_shared_params_for_hot_experts().shared_weight1)  # the broadcast writes it, unsafe still

    module = standin(HOT_EXPERTS_MODULE.removesuffix(".py").replace("/", "."), HOT_EXPERTS_STANDIN.read_text())
    fails_without_and_passes_with_the_fix(
        "balanced MoE hot-expert weights", tmp_path, module, setup, lambda module: module.hot_experts_matmul(torch.ones(3, 4))
    )


def rule_fix(case: str):
    return diagnose(CASES[case].log(None), CASES[case].versions)[1].fix


# 26.1.0's mindspeed/te/pytorch/fp8/reuse.py, in brief: the pool keyed by the weight's storage, the BF16
# storage freed after quantization and given back by the wrapper around the optimizer step.
FP8_REUSE = """
    _WEIGHT_REUSE_POOL = {}
    _RELEASED_BF16_WEIGHT_POOL = {}


    def reuse_or_quantize(weight, quantizer):
        released = _RELEASED_BF16_WEIGHT_POOL.get(id(weight))
        key = released[2] if released else weight.untyped_storage().data_ptr()
        if key not in _WEIGHT_REUSE_POOL:
            _WEIGHT_REUSE_POOL[key] = quantizer(weight)
            _RELEASED_BF16_WEIGHT_POOL[id(weight)] = (weight, weight.untyped_storage().size(), key)
            weight.untyped_storage().resize_(0)
        return _WEIGHT_REUSE_POOL[key]


    def optimizer_step_reuse_cleanup_wrapper(step):
        def wrapper():
            _WEIGHT_REUSE_POOL.clear()
            for weight, size, _ in _RELEASED_BF16_WEIGHT_POOL.values():
                weight.untyped_storage().resize_(size)
            _RELEASED_BF16_WEIGHT_POOL.clear()
            return step()
        return wrapper
    """


def test_fp8_reuse_fix_gives_the_weights_back_and_quantizes_them_again(standin):
    """The retried step reuses the interrupted step's quantized weight (unsafe) and the rollback would
    write the weights from the main parameters into freed storage; after the fix the rollback's write
    lands in the weight and the retried step quantizes it again."""
    fix = rule_fix("MindSpeed FP8 weight reuse")

    def interrupted_step(mark):
        reuse = standin("mindspeed.te.pytorch.fp8.reuse", FP8_REUSE)
        weight, main_param = torch.ones(4, 4), torch.full((4, 4), 3.0)
        mark(reuse.reuse_or_quantize(weight, lambda w: w * 2))  # the fault hit the pooled quantized weight
        return weight, main_param, lambda: torch.ones(2, 4) @ reuse.reuse_or_quantize(weight, lambda w: w * 2).t()

    with emulated_npu() as mark:
        weight, _, retried_forward = interrupted_step(mark)
        assert weight.untyped_storage().size() == 0  # what the rollback's copy of the main parameters would write into
        with pytest.raises(RuntimeError, match=UNSAFE_DATA):
            retried_forward()
    del sys.modules["mindspeed.te.pytorch.fp8.reuse"]
    with emulated_npu() as mark:
        weight, main_param, retried_forward = interrupted_step(mark)
        run_fix("mindspeed.fp8-weight-reuse-pool", fix)
        weight.data.copy_(main_param)  # the rollback: gather_model_params_from_optimizer
        assert torch.equal(retried_forward(), torch.full((2, 4), 24.0))


# 26.1.0's ScaleData and DelayedScalingRecipe, in brief: the recipe keeps a ScaleData and appends itself
# to the class-level list; the scale comes from the amax history, rolled once it is full.
SCALE_DATA = """
    import torch


    class ScaleData:
        def __init__(self, history_len):
            self.scale_shape, self.device, self.amax_history_len = [1], "cpu", history_len
            self.scale = torch.ones(self.scale_shape, device=self.device)
            self.amax_history = torch.zeros([history_len] + self.scale_shape, device=self.device)
            self.amax = torch.zeros(self.scale_shape, device=self.device)
            self.amax_history_current_len, self.current_interval = 0, 1

        def delayed_recipe_update_amax(self, tensor):
            if self.amax_history_current_len == self.amax_history_len:
                self.amax_history = self.amax_history.roll(-1, 0)
                self.amax_history_current_len -= 1
            self.amax_history[self.amax_history_current_len] = tensor.abs().amax()
            self.amax_history_current_len += 1
            self.amax = self.amax_history.amax(0)
            self.scale = self.amax / 448
            return self.scale
    """
DELAYED_RECIPE = """
    from mindspeed.te.pytorch.fp8.scale_data import ScaleData


    class DelayedScalingRecipe:
        ALL_SCALING = []

        def __init__(self):
            self.scale = ScaleData(2)
            DelayedScalingRecipe.ALL_SCALING.append(self)

        def quantization(self, tensor):
            return tensor / self.scale.delayed_recipe_update_amax(tensor)
    """


def test_delayed_scaling_fix_starts_the_amax_history_again(standin):
    """The next quantization rolls the full amax history the fault left unsafe; after the fix it
    starts the history from its own amax, as a run's first step does."""
    fix = rule_fix("MindSpeed FP8 delayed scaling")

    def interrupted_step(mark):
        standin("mindspeed.te.pytorch.fp8.scale_data", SCALE_DATA)
        recipe = standin("mindspeed.te.pytorch.fp8.recipes.delayed_scaling_recipe", DELAYED_RECIPE).DelayedScalingRecipe()
        for iteration in range(3):
            recipe.quantization(torch.full((4,), float(iteration + 1)))
        mark(recipe.scale.amax_history)
        mark(recipe.scale.scale)
        return recipe

    with emulated_npu() as mark:
        recipe = interrupted_step(mark)
        with pytest.raises(RuntimeError, match=UNSAFE_DATA):
            recipe.quantization(torch.full((4,), 448.0))
    for name in ("mindspeed.te.pytorch.fp8.recipes.delayed_scaling_recipe", "mindspeed.te.pytorch.fp8.scale_data"):
        del sys.modules[name]
    with emulated_npu() as mark:
        recipe = interrupted_step(mark)
        run_fix("mindspeed.fp8-delayed-scaling", fix)
        recipe.quantization(torch.full((4,), 448.0))
        assert recipe.scale.amax_history_current_len == 1


# 26.1.0's swap_layer_input_manager.py, in brief (no streams: each copy completes where it starts): an
# entry is pushed before its host copy starts; a layer's backward hook pops its own entry once brought
# back and brings back the previous layer's oldest entry that sits on the host.
SWAP_LAYER_INPUT_MANAGER = """
    import torch


    class SwapTensors:
        def __init__(self, tensors):
            self.tensors = tensors
            self.tensor_cpus = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in tensors]
            self.storage_sizes = [t.untyped_storage().size() for t in tensors]
            self.stat = "device"

        def swap_to_host(self):
            if self.stat == "device":
                for tensor, host in zip(self.tensors, self.tensor_cpus):
                    host.copy_(tensor)
                    tensor.untyped_storage().resize_(0)
                self.stat = "host"

        def swap_to_device(self):
            if self.stat == "host":
                for tensor, host, size in zip(self.tensors, self.tensor_cpus, self.storage_sizes):
                    tensor.untyped_storage().resize_(size)
                    tensor.copy_(host)
                self.stat = "h2d"


    class SwapLayerInputManager:
        manager_map = {}

        def __init__(self, module_tag="default"):
            self.module_tag, self.batch_stack = module_tag, []
            SwapLayerInputManager.manager_map.setdefault(module_tag, []).append(self)
            self.layer_idx = SwapLayerInputManager.manager_map[module_tag].index(self)

        @property
        def num_layers(self):
            return len(SwapLayerInputManager.manager_map[self.module_tag])

        def swap_out_tensors(self, tensors):
            if self.layer_idx + 1 < self.num_layers:
                self.batch_stack.append(SwapTensors(tensors))
                self.batch_stack[-1].swap_to_host()

        def backward_hook(self, _):
            if self.layer_idx + 1 < self.num_layers and self.batch_stack[0].stat == "h2d":
                self.batch_stack.pop(0)
            if self.layer_idx > 0:
                prev_manager = SwapLayerInputManager.manager_map[self.module_tag][self.layer_idx - 1]
                if prev_manager.batch_stack:
                    prev_manager.batch_stack[0].swap_to_device()
    """
SWAP_LAYER_INPUT_MODULE = "mindspeed.core.memory.swap_layer_input.swap_layer_input_manager"


def test_swap_layer_input_fix_lets_the_retried_backward_bring_back_its_own_input(standin):
    """The interrupted step pushed an entry whose host copy read the unsafe layer input (the case's
    log), and the entry heads the first layer's stack: the retried backward brings it back in place
    of the retried step's own input, which stays released for the recompute to read; after the fix
    the retried step's input comes back whole."""
    fix = rule_fix("MindSpeed swap-layer-input stacks")

    def retried_step(mark):
        module = standin(SWAP_LAYER_INPUT_MODULE, SWAP_LAYER_INPUT_MANAGER)
        first, last = module.SwapLayerInputManager(), module.SwapLayerInputManager()
        layer_input = torch.ones(2, 4)
        mark(layer_input)
        with pytest.raises(RuntimeError, match=UNSAFE_DATA):
            first.swap_out_tensors([layer_input])  # the interrupted step's recomputed forward
        return lambda: retried_layer_input(first, last)

    def retried_layer_input(first, last):
        layer_input = torch.full((2, 4), 5.0)
        first.swap_out_tensors([layer_input])  # forward
        last.backward_hook(None)  # backward: the last layer brings the first one's input back
        first.backward_hook(None)
        return layer_input

    with emulated_npu() as mark:
        retry = retried_step(mark)
        assert retry().untyped_storage().size() == 0  # the recompute would read a released input
    del sys.modules[SWAP_LAYER_INPUT_MODULE]
    with emulated_npu() as mark:
        retry = retried_step(mark)
        run_fix("mindspeed.swap-layer-input-stacks", fix)
        layer_input = retry()
        released = layer_input.untyped_storage().size() == 0  # not in an assert: pytest's report would print it
        assert not released
        assert torch.equal(layer_input, torch.full((2, 4), 5.0))
