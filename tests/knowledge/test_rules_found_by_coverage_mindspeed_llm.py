"""The fixes of the MindSpeed-LLM rules added for the holes the coverage of every release found
(tests/knowledge/test_coverage.py), run under the emulated unsafe-data check: the step that failed fails again
without the fix and passes with it.

MindSpeed-LLM cannot be installed here, so each step runs a few-line stand-in written at the real
import path (the fix imports it by that name). A stand-in keeps only what the release's code does
with the global, named in its docstring; the fix is the one diagnose renders for the rule's
traceback case in tests/knowledge/test_rules_shipped.py.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_rules_shipped import CASES, MODELLINK_MASK_GENERATOR, UNSAFE_DATA, diagnose, emulated_npu, unguarded

MTP_HELPER = '''
"""2.1.0's mindspeed_llm/core/transformer/multi_token_prediction.py: save_loss_to_tracker adds into tracker["values"]."""
import torch


class MTPLossLoggingHelper:
    tracker = {}

    @staticmethod
    def save_loss_to_tracker(loss, layer_number, num_layers):
        tracker = MTPLossLoggingHelper.tracker
        if "values" not in tracker:
            tracker["values"] = torch.zeros(num_layers, device=loss.device)
        tracker["values"][layer_number] += loss.detach()
'''
# 26.1.0's FSDP2 rotary embeddings: __init__ builds the buffers with rope_init_fn, forward reads inv_freq[0].item() first
ROTARY = """
import torch


class {name}(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_init_fn = self.compute_default_rope_parameters
        inv_freq, self.attention_scaling = self.rope_init_fn(config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        {original}

    @staticmethod
    def compute_default_rope_parameters(config, device=None):
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
        return 1.0 / (config.rope_theta ** (exponents / config.head_dim)), 1.0

    def forward(self, position_ids):
        if self.inv_freq[0].item() > 2.0:
            raise AssertionError("garbage frequencies")
        return (self.inv_freq[None, :, None] * position_ids[:, None, :]).cos() * self.attention_scaling
"""
GLM_ROTARY = ROTARY.format(
    name="GlmMoeDsaRotaryEmbedding", original='self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)'
)
GPT_OSS_ROTARY = ROTARY.format(name="GptOssRotaryEmbedding", original="self.original_inv_freq = self.inv_freq")


def rendered_fix(case: str, tmp_path: Path) -> str:
    """The fix diagnose renders for the rule's traceback case, without its guards, imports first."""
    traceback_root = tmp_path / "traceback"
    roots = (traceback_root,) if CASES[case].standin else ()
    _, result = diagnose(CASES[case].log(traceback_root), CASES[case].versions, roots)
    imports, code = unguarded(CASES[case].rule, result.fix)
    return "\n".join([*imports, code])


def fails_then_passes(fix: str, setup: Callable, retry: Callable) -> None:
    """On unsafe state the retried step fails; after the fix it passes."""
    with emulated_npu() as mark:
        state = setup(mark)
        with pytest.raises(RuntimeError, match=UNSAFE_DATA):
            retry(state)
    with emulated_npu() as mark:
        state = setup(mark)
        exec(compile(fix, "<fix>", "exec"), {})
        retry(state)


def test_mtp_loss_tracker_fix_lets_2_1_0_log_the_next_loss(standin, tmp_path):
    module = standin("mindspeed_llm.core.transformer.multi_token_prediction", MTP_HELPER)
    helper = module.MTPLossLoggingHelper

    def setup(mark):
        helper.tracker.clear()
        helper.save_loss_to_tracker(torch.tensor(0.25), 0, 2)
        mark(helper.tracker["values"])

    def retry(_):
        helper.save_loss_to_tracker(torch.tensor(0.25), 0, 2)
        assert helper.tracker["values"].tolist() == [0.25, 0.0]

    fails_then_passes(rendered_fix("MindSpeed-LLM 2.1.0 MTP loss tracker", tmp_path), setup, retry)


@pytest.mark.parametrize(
    ("case", "module", "source", "name"),
    [
        (
            "FSDP2 GLM-MoE-DSA rotary inv_freq",
            "mindspeed_llm.fsdp2.models.glm52.modeling_glm_moe_dsa",
            GLM_ROTARY,
            "GlmMoeDsaRotaryEmbedding",
        ),
        (
            "FSDP2 GPT-OSS rotary inv_freq",
            "mindspeed_llm.fsdp2.models.gpt_oss.modeling_gpt_oss",
            GPT_OSS_ROTARY,
            "GptOssRotaryEmbedding",
        ),
    ],
    ids=["glm", "gpt-oss"],
)
def test_fsdp2_rotary_fix_computes_the_same_frequencies_again(standin, tmp_path, case, module, *, source, name):
    rotary_class = getattr(standin(module, source), name)
    config = types.SimpleNamespace(head_dim=8, rope_theta=10000.0)
    expected = rotary_class(config).inv_freq.clone()
    positions = torch.arange(4.0)[None]

    def setup(mark):
        rotary = rotary_class(config)
        mark(rotary.inv_freq)
        mark(rotary.original_inv_freq)
        return rotary

    def retry(rotary):
        rotary(positions)
        assert torch.equal(rotary.inv_freq, expected) and torch.equal(rotary.original_inv_freq, expected)

    fails_then_passes(rendered_fix(case, tmp_path), setup, retry)


def test_modellink_mask_fix_drops_the_cache_and_the_layers_copy(standin, tmp_path):
    module = standin("modellink.core.transformer.mask_generator", MODELLINK_MASK_GENERATOR)
    scores = torch.ones(4, 4)

    def setup(mark):
        module._MASK_CACHE = None
        attention = module.FlashSelfAttention()
        attention(scores)  # the step before the fault built the mask and kept it
        mark(module._MASK_CACHE)
        return attention

    def retry(attention):
        assert torch.isinf(attention(scores)).sum().item() == 6

    fails_then_passes(rendered_fix("ModelLink 1.0.RC3 mask cache", tmp_path), setup, retry)
