"""The fixes of the rules added for globals the coverage of every release found
(tests/test_coverage.py), run under the emulated unsafe-data check: the step that failed fails again
without the fix and passes with it. Megatron's run on megatron-core 0.19.2's real code, unpacked as
tests/test_rules_releases.py unpacks it (where it cannot be had, the tests skip); MindSpeed's, which
cannot be installed here, on few-line stand-ins of our own at its real import paths.

qb_beta (scenario 2, a replica's copy), the global aux-loss counts (their step all-reduces over a
process group this test has not) and the distillation logits saver (built from Megatron's parsed
arguments and parallel state) are held by their traceback cases in tests/test_rules_shipped.py only.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch
from test_rules_releases import rendered_fix, step, unpacked
from test_rules_shipped import CASES, UNSAFE_DATA, diagnose, emulated_npu, run_fix

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




@pytest.fixture
def mindspeed_standin(tmp_path, monkeypatch):
    """Writes a stand-in module at MindSpeed's path for it and imports it by MindSpeed's name, as the
    rendered fixes import it."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def imported(module: str, source: str):
        path = tmp_path / (module.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('"""Stand-in written by tests/test_rules_found_by_coverage.py: not MindSpeed\'s code."""\n'
                        + textwrap.dedent(source))
        importlib.invalidate_caches()
        return importlib.import_module(module)

    yield imported
    for name in [name for name in sys.modules if name == "mindspeed" or name.startswith("mindspeed.")]:
        del sys.modules[name]


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


def test_fp8_reuse_fix_gives_the_weights_back_and_quantizes_them_again(mindspeed_standin):
    """The retried step reuses the interrupted step's quantized weight (unsafe) and the rollback would
    write the weights from the main parameters into freed storage; after the fix the rollback's write
    lands in the weight and the retried step quantizes it again."""
    fix = rule_fix("MindSpeed FP8 weight reuse")

    def interrupted_step(mark):
        reuse = mindspeed_standin("mindspeed.te.pytorch.fp8.reuse", FP8_REUSE)
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


def test_delayed_scaling_fix_starts_the_amax_history_again(mindspeed_standin):
    """The next quantization rolls the full amax history the fault left unsafe; after the fix it
    starts the history from its own amax, as a run's first step does."""
    fix = rule_fix("MindSpeed FP8 delayed scaling")

    def interrupted_step(mark):
        mindspeed_standin("mindspeed.te.pytorch.fp8.scale_data", SCALE_DATA)
        recipe = mindspeed_standin("mindspeed.te.pytorch.fp8.recipes.delayed_scaling_recipe", DELAYED_RECIPE).DelayedScalingRecipe()
        for step in range(3):
            recipe.quantization(torch.full((4,), float(step + 1)))
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
