"""Every shipped rule classifies a traceback fed through logs -> tracebacks -> locate -> classify.

The tracebacks come from running the real code where it can run here: megatron-core 0.16.1 (a test
dependency) in-process, under the emulated torch_npu unsafe-data check of
tests/fixtures/rules/generate.py; megatron-core 0.7.0 and 0.12.1 ran once in throwaway
environments (the generator's docstring says how) and their logs are committed. MindSpeed and
MindSpeed-LLM cannot be installed here. Where one of their log lines alone shows the frame that
reads the global, the log is written by hand with their real paths and source lines
(`hand-*.log`). Where only their source names the global (a getter returns it into a local), a
few-line stand-in module is written to tmp_path at the real import path and run, so locate reads
it the way it reads a user's MindSpeed tree; the stand-ins are ours, not MindSpeed's code.

Each case checks the rule, scenario, phase and key parts of the rendered fix, and that the fix
compiles inside a function of the adaptor. For megatron-core's scenario-1 rules the fix is also
run on the unsafe memory: the step that failed must fail again without it and pass with it.
"""

from __future__ import annotations

import importlib.util
import re
import string
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import load_module
from packaging.version import Version

from unsafe_doctor.diagnose.locate import Finding, locate
from unsafe_doctor.knowledge.classify import Classification, classify
from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.knowledge.render.template import FixPlan
from unsafe_doctor.knowledge.versions import Environment
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.lines import by_rank, split_lines
from unsafe_doctor.log.tracebacks import parse_tracebacks
from unsafe_doctor.source.workspace import Workspace

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules"
KNOWLEDGE = load_knowledge()
PROFILE = KNOWLEDGE.profile("mindspeed-llm-26")


def _load_fixture(name: str, file: str):
    return load_module(name, FIXTURES / file)


GENERATOR = _load_fixture("rules_fixture_generator", "generate.py")
capture, emulated_npu = GENERATOR.capture, GENERATOR.emulated_npu
release_root = _load_fixture("rules_fixture_release", "release.py").release_root


# --- the pipeline ---------------------------------------------------------------------------------


def environment(versions: dict[str, str]) -> Environment:
    return Environment(
        versions={name: Version(version) for name, version in versions.items()},
        origins={name: "the test" for name in versions},
        source_roots=(),
        profile=PROFILE,
        adaptor=None,
    )


def diagnose(text: str, versions: dict[str, str], source_roots: tuple[Path, ...] = ()) -> tuple[Finding, Classification]:
    lines = split_lines(text, source="train.log", base_offset=0, rank_hint=None)
    tracebacks = [traceback for group in by_rank(lines).values() for traceback in parse_tracebacks(group)]
    workspace = Workspace(source_roots)
    findings = locate(tracebacks, workspace)
    assert len(findings) == 1, findings
    return findings[0], classify(findings[0].subject, RunContext(KNOWLEDGE, workspace, environment(versions)))


def assert_compiles(plan: FixPlan) -> None:
    """Each side of the fix is valid Python at the end of an adaptor function."""
    for body in (plan.code, plan.peer_code):
        if body is not None:
            source = "\n".join(plan.imports) + "\n\ndef adaptor_function(train_args, src_rank, dest_rank):\n"
            compile(source + textwrap.indent(body, "    "), "<fix>", "exec")


def unguarded(rule_id: str, plan: FixPlan) -> tuple[list[str], str]:
    """The fix without its condition guards (they read megatron.training's arguments, absent here)."""
    rule = KNOWLEDGE.rule(rule_id)
    guard_imports = {line for name in rule.conditions for line in KNOWLEDGE.conditions[name].imports}
    code = textwrap.dedent(plan.code.split("\n", 1)[1]) if rule.conditions else plan.code
    return [line for line in plan.imports if line not in guard_imports], code


def run_fix(rule_id: str, plan: FixPlan) -> None:
    imports, code = unguarded(rule_id, plan)
    exec(compile("\n".join(imports) + "\n" + code, f"<fix {rule_id}>", "exec"), {})


# --- megatron-core 0.16.1, run in-process ---------------------------------------------------------

MEGATRON_0_16 = {"megatron-core": "0.16.1"}


class OneRank:
    """The tensor-parallel group of a single rank: attention only asks its size."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def reset_megatron_state() -> None:
    """Megatron's module globals as a new process has them."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER.clear()
    MTPLossLoggingHelper.tracker.clear()
    RotaryEmbedding.forward.cache_clear()
    parallel_state.destroy_global_memory_buffer()


@pytest.fixture(autouse=True)
def fresh_megatron_state():
    """Each test starts and ends with a new process's globals."""
    reset_megatron_state()
    yield
    reset_megatron_state()


def save_aux_loss_twice(mark) -> None:
    from megatron.core.transformer.moe import moe_utils

    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", GENERATOR.aux_loss(), 1, 4)
    mark(moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER["load_balancing_loss"]["values"])
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", GENERATOR.aux_loss(), 1, 4)


def clear_aux_losses(mark) -> None:
    from megatron.core.transformer.moe import moe_utils

    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", GENERATOR.aux_loss(), 1, 4)
    mark(moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER["load_balancing_loss"]["values"])
    moe_utils.clear_aux_losses_tracker()


def save_mtp_loss_twice(mark) -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.save_loss_to_tracker(GENERATOR.aux_loss(), 0, 2)
    mark(MTPLossLoggingHelper.tracker["values"])
    MTPLossLoggingHelper.save_loss_to_tracker(GENERATOR.aux_loss(), 0, 2)


def attention():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    return DotProductAttention(config, 1, AttnMaskType.causal, "self", pg_collection=ProcessGroupCollection(tp=OneRank()))


def attend_with_stale_buffer(mark) -> None:
    """The previous step left its scores in the global buffer; the next attention reuses it."""
    import torch
    from megatron.core import parallel_state

    layer = attention()
    parallel_state.destroy_global_memory_buffer()
    parallel_state._set_global_memory_buffer()
    mark(parallel_state.get_global_memory_buffer().get_tensor((2, 4, 4), torch.float32, "mpu"))
    query = torch.randn(4, 1, 2, 8)
    layer(query, query, query, None)


def rotary():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(kv_channels=8, rotary_percent=1.0, cp_group=OneRank())


def apply_cached_rotary(mark) -> None:
    import torch
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2)
    embedding = rotary()
    mark(embedding(4))  # cached by forward's lru_cache, as in the step before the fault
    apply_rotary_pos_emb(torch.randn(4, 1, 2, 8), embedding(4), config, cp_group=OneRank())


def rotary_of_new_length(mark) -> None:
    embedding = rotary()
    mark(embedding.inv_freq)
    embedding(6)


def router():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_router_load_balancing_type="none",
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        use_cpu_initialization=True,
    )
    groups = ProcessGroupCollection(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    return TopKRouter(config, groups)


def route_with_stale_bias(mark) -> None:
    import torch

    layer = router()
    mark(layer.expert_bias)
    layer.routing(torch.randn(3, 2, 4))


def count_tokens_into_stale_buffer(mark) -> None:
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    layer = router()
    mark(layer.local_tokens_per_expert)
    # MindSpeed turns Megatron's JIT fuser off on the NPU; call the method as written.
    count = getattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable", TopKRouter._apply_expert_bias)
    count(layer, torch.ones(6, 4, dtype=torch.bool))


def mixed_precision_optimizer(grad_scaler=None):
    """Megatron's mixed-precision optimizer state, without the model-parameter bookkeeping."""
    import torch
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, MixedPrecisionOptimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    optimizer = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
    config = OptimizerConfig(bf16=grad_scaler is None, fp16=grad_scaler is not None)
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    MixedPrecisionOptimizer.__init__(optimizer, adam, config, grad_scaler, None)
    optimizer.is_stub_optimizer = True  # no model parameters: only the scalars below take part
    return optimizer


def dynamic_grad_scaler():
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    return DynamicGradScaler(
        initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=10, hysteresis=1
    )


def scale_loss_by_stale_one(mark) -> None:
    import torch

    optimizer = mixed_precision_optimizer()
    mark(optimizer._scale_one)
    optimizer.scale_loss(torch.tensor(2.0))


def reset_stale_found_inf(mark) -> None:
    optimizer = mixed_precision_optimizer(dynamic_grad_scaler())
    mark(optimizer.found_inf)
    optimizer._unscale_main_grads_and_check_for_nan()


def back_off_stale_scale(mark) -> None:
    scaler = dynamic_grad_scaler()
    mark(scaler._scale)
    scaler.update(True)


# --- stand-ins for MindSpeed and MindSpeed-LLM modules that only their source names ---------------

STANDIN_HEADER = '"""Stand-in written by tests/knowledge/test_rules_shipped.py at {path}: not MindSpeed\'s code."""\n'


def run_standin(tmp_path: Path, relative: str, source: str, action: Callable) -> str:
    """Write a stand-in module at its real import path under tmp_path, run `action(module, mark)`."""
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STANDIN_HEADER.format(path=relative) + textwrap.dedent(source))
    module = load_module(f"standin_{path.stem}", path)
    return capture(lambda mark: action(module, mark))


def queued_all2all_output(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        stale = torch.ones(2)
        module.AsyncAll2All_OUTPUT.append(stale)  # queued by the interrupted step
        mark(stale)
        module.combine_grad(torch.ones(2))

    return run_standin(
        tmp_path,
        "mindspeed/core/transformer/moe/moe_feature/fb_overlap/modules/attention.py",
        """
        AsyncAll2All_OUTPUT = []


        def get_async_alltoall_outputs():
            return AsyncAll2All_OUTPUT.pop(0)


        def combine_grad(grad):
            received = get_async_alltoall_outputs()
            return grad + received
        """,
        action,
    )


def saved_gemm_tensors(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        stale = torch.ones(2)
        module.set_gemm_backward_need_tensors(stale)  # the interrupted step's forward
        mark(stale)
        module.expert_backward(torch.ones(2))

    return run_standin(
        tmp_path,
        "mindspeed/core/transformer/moe/moe_utils.py",
        """
        GEMM_BACKWARD_NEED_TENSORS = None


        def set_gemm_backward_need_tensors(tensors):
            global GEMM_BACKWARD_NEED_TENSORS
            GEMM_BACKWARD_NEED_TENSORS = tensors


        def get_gemm_backward_need_tensors():
            global GEMM_BACKWARD_NEED_TENSORS
            result = GEMM_BACKWARD_NEED_TENSORS
            GEMM_BACKWARD_NEED_TENSORS = None
            return result


        def expert_backward(grad):
            saved = get_gemm_backward_need_tensors()
            return grad * saved
        """,
        action,
    )


def cached_attention_mask(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        module.attention(torch.randn(4, 4))
        mark(module.get_attention_mask())
        module.attention(torch.randn(4, 4))

    return run_standin(
        tmp_path,
        "mindspeed/core/transformer/flash_attention/generate_mask/generate_mask.py",
        """
        import torch

        _GLOBAL_ATTN_MASK = None


        def get_attention_mask():
            global _GLOBAL_ATTN_MASK
            if _GLOBAL_ATTN_MASK is None:
                _GLOBAL_ATTN_MASK = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)
            return _GLOBAL_ATTN_MASK


        def attention(scores):
            attention_mask = get_attention_mask()
            return scores.masked_fill(attention_mask, -10000.0)
        """,
        action,
    )


def cached_grid_mask(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        mask = torch.ones(4, 4, dtype=torch.bool)
        module.schedule(mask)
        mark(module.get_grid_mask(mask))
        module.schedule(mask)

    return run_standin(
        tmp_path,
        "mindspeed/core/context_parallel/utils.py",
        """
        CACHED_GRID_MASK = None


        def get_grid_mask(attn_mask):
            global CACHED_GRID_MASK
            if CACHED_GRID_MASK is None:
                CACHED_GRID_MASK = attn_mask.clone()
            return CACHED_GRID_MASK


        def schedule(attn_mask):
            grid_mask = get_grid_mask(attn_mask)
            return grid_mask.sum()
        """,
        action,
    )


def stale_actual_seq_len(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        stale = torch.tensor([2, 2])
        module.set_actual_seq_len(stale)
        mark(stale)
        module.cumulative_lengths()

    return run_standin(
        tmp_path,
        "mindspeed/core/context_parallel/get_batch_utils.py",
        """
        _ACTUAL_SEQ_LEN = None


        def set_actual_seq_len(actual_seq_len):
            global _ACTUAL_SEQ_LEN
            _ACTUAL_SEQ_LEN = actual_seq_len


        def get_actual_seq_len():
            return _ACTUAL_SEQ_LEN


        def cumulative_lengths():
            actual_seq_len = get_actual_seq_len()
            return actual_seq_len.cumsum(0)
        """,
        action,
    )


def stale_mtp_position_ids(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        stale = torch.arange(4)
        module.set_mtp_position_ids(stale)
        mark(stale)
        module.shifted_positions(1)

    return run_standin(
        tmp_path,
        "mindspeed_llm/training/utils.py",
        """
        _MTP_POSITION_ID = None


        def set_mtp_position_ids(position_ids):
            global _MTP_POSITION_ID
            _MTP_POSITION_ID = position_ids


        def get_mtp_position_ids():
            return _MTP_POSITION_ID


        def shifted_positions(shift):
            position_ids = get_mtp_position_ids()
            return position_ids + shift
        """,
        action,
    )


def stale_ampipe_slices(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        stale = module.get_slice_indices_from_order_to_disorder(4, torch.device("cpu"))  # an earlier step built it
        mark(stale)
        module.reorder(torch.ones(4))

    corpus_standin = Path(__file__).parents[1] / "corpus" / "standins" / "mindspeed" / "moe" / "utils.py"  # the corpus run's
    return run_standin(tmp_path, "mindspeed/moe/utils.py", corpus_standin.read_text(), action)


def stale_alibi_bias(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        mark(module.AlibiForFusionAttnSingleton.get_alibi_tensor_for_fusion_attn(4, 2))  # built by an earlier step
        module.attention_scores(torch.ones(1, 2, 4, 4))

    return run_standin(
        tmp_path,
        "mindspeed/model/alibi_mask.py",
        """
        import torch


        class AlibiForFusionAttnSingleton:
            _alibi_tensor_args = None
            _alibi_tensor = None

            @classmethod
            def get_alibi_tensor_for_fusion_attn(cls, max_seq_len, num_attention_heads):
                if cls._alibi_tensor is None or cls._alibi_tensor_args != (max_seq_len, num_attention_heads):
                    cls._alibi_tensor = torch.ones(1, num_attention_heads, max_seq_len, max_seq_len)
                    cls._alibi_tensor_args = (max_seq_len, num_attention_heads)
                return cls._alibi_tensor


        def attention_scores(scores):
            AlibiForFusionAttnSingleton.get_alibi_tensor_for_fusion_attn(scores.shape[-1], scores.shape[1])
            return scores + AlibiForFusionAttnSingleton._alibi_tensor.sum()
        """,
        action,
    )


def stale_teacher_weights(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        teacher = module.get_teacher_manager()
        mark(teacher.teacher_model.weight)
        module.kl_loss(torch.ones(2, 2))

    return run_standin(
        tmp_path,
        "mindspeed/core/distill/qad_adapter.py",
        """
        import torch

        _teacher_manager = None


        class TeacherModelManager:
            def __init__(self):
                self.teacher_model = torch.nn.Linear(2, 2)


        def get_teacher_manager():
            global _teacher_manager
            if _teacher_manager is None:
                _teacher_manager = TeacherModelManager()
            return _teacher_manager


        def kl_loss(tokens):
            teacher_logits = get_teacher_manager().teacher_model(tokens)
            return teacher_logits.sum()
        """,
        action,
    )


def stale_fsdp2_attention_mask(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        mark(module.get_attention_mask_in_transformers())  # built by an earlier step
        module.masked_scores(torch.ones(4, 4))

    return run_standin(
        tmp_path,
        "mindspeed_llm/fsdp2/models/qwen3_next/modeling_qwen3_next.py",
        """
        import torch

        _GLOBAL_ATTN_MASK = None


        def get_attention_mask_in_transformers():
            global _GLOBAL_ATTN_MASK
            if _GLOBAL_ATTN_MASK is not None:
                return _GLOBAL_ATTN_MASK
            _GLOBAL_ATTN_MASK = torch.triu(torch.ones((4, 4), dtype=torch.bool), diagonal=1)
            return _GLOBAL_ATTN_MASK


        def masked_scores(scores):
            attention_mask = get_attention_mask_in_transformers()
            return scores.masked_fill(attention_mask, float("-inf"))
        """,
        action,
    )


HOT_EXPERTS_MODULE = "mindspeed/core/transformer/moe/moe_feature/balanced_moe/modules/moe_layer.py"
HOT_EXPERTS_STANDIN = Path(__file__).parents[1] / "corpus" / "standins" / HOT_EXPERTS_MODULE  # the corpus run's


def stale_hot_expert_weights(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        module.init_global_shared_params_for_hot_experts((4, 4), torch.device("cpu"))
        mark(module.get_shared_params_for_hot_experts().shared_weight1)  # memory the fault left unsafe
        module.hot_experts_matmul(torch.ones(3, 4))

    return run_standin(tmp_path, HOT_EXPERTS_MODULE, HOT_EXPERTS_STANDIN.read_text(), action)


# ModelLink 1.0.RC3.0: get_attention_mask caches the mask in _MASK_CACHE; a function reads it through a
# local (what the log can name), and FlashSelfAttention keeps it as self.attention_mask while it has one
# (model/transformer.py). tests/knowledge/test_rules_found_by_coverage_mindspeed_llm.py runs the fix on it.
MODELLINK_MASK_GENERATOR = """
import torch

_MASK_CACHE = None


def get_attention_mask():
    global _MASK_CACHE
    if _MASK_CACHE is None:
        _MASK_CACHE = torch.triu(torch.ones((4, 4), dtype=torch.bool), diagonal=1)
    return _MASK_CACHE


def masked_scores(scores):
    attention_mask = get_attention_mask()
    return scores.masked_fill(attention_mask, float("-inf"))


class FlashSelfAttention(torch.nn.Module):
    def forward(self, scores):
        if not hasattr(self, "attention_mask"):
            self.attention_mask = get_attention_mask()
        return scores.masked_fill(self.attention_mask, float("-inf"))
"""


def stale_modellink_mask(tmp_path: Path) -> str:
    import torch

    def action(module, mark):
        mark(module.get_attention_mask())  # built by an earlier step
        module.masked_scores(torch.ones(4, 4))

    return run_standin(tmp_path, "modellink/core/transformer/mask_generator.py", MODELLINK_MASK_GENERATOR, action)


# --- the cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    rule: str
    log: Callable[[Path], str]  # tmp_path -> log text
    versions: dict[str, str] = field(default_factory=dict)
    fix: tuple[str, ...] = ()  # fragments of the rendered fix (either side)
    standin: bool = False  # locate reads the stand-in written under tmp_path
    release: str | None = None  # locate reads this unpacked megatron-core release (fixtures/rules/release.py)


def real(action: Callable) -> Callable[[Path], str]:
    return lambda tmp_path: capture(action)


def committed(name: str) -> Callable[[Path], str]:
    return lambda tmp_path: (FIXTURES / name).read_text()


CASES = {
    # megatron-core 0.16.1, real runs
    "moe-utils tracker, save": Case(
        "megatron.moe-layer-wise-tracker-moe-utils",
        real(save_aux_loss_twice),
        MEGATRON_0_16,
        ('getattr(megatron_moe_utils, "_MOE_LAYER_WISE_LOGGING_TRACKER", None)', "torch.zeros(values.shape"),
    ),
    "moe-utils tracker, clear": Case(
        "megatron.moe-layer-wise-tracker-moe-utils",
        real(clear_aux_losses),
        MEGATRON_0_16,
        ("from megatron.core.transformer.moe import moe_utils as megatron_moe_utils",),
    ),
    "mtp tracker": Case(
        "megatron.mtp-loss-tracker",
        real(save_mtp_loss_twice),
        MEGATRON_0_16,
        ("tracker[name] = torch.zeros(values.shape",),
    ),
    "global memory buffer": Case(
        "megatron.global-memory-buffer",
        real(attend_with_stale_buffer),
        MEGATRON_0_16,
        ("parallel_state.destroy_global_memory_buffer()", "parallel_state._set_global_memory_buffer()"),
    ),
    "rotary cache": Case(
        "megatron.rotary-emb-cache",
        real(apply_cached_rotary),
        MEGATRON_0_16,
        ('getattr(RotaryEmbedding, "forward", None)', "cache.cache_clear()"),
    ),
    "rotary inv_freq": Case(
        "megatron.rotary-inv-freq",
        real(rotary_of_new_length),
        MEGATRON_0_16,
        (
            "torch.distributed.recv(recv_tensor, src=src_rank, group=get_repair_group())",
            "global_tensor.data.copy_(recv_tensor)",
            "torch.distributed.send(module.inv_freq, dst=dest_rank, group=get_repair_group())",
        ),
    ),
    "router expert_bias": Case(
        "megatron.router-expert-bias",
        real(route_with_stale_bias),
        MEGATRON_0_16,
        (
            "for chunk in train_args[1]:",
            "torch.distributed.recv(recv_tensor, src=src_rank",
            "global_tensor.data.copy_(recv_tensor)",
            'getattr(module, "expert_bias", None)',
            "torch.distributed.send(module.expert_bias, dst=dest_rank",
        ),
    ),
    "router local_tokens_per_expert": Case(
        "megatron.router-local-tokens-per-expert",
        real(count_tokens_into_stale_buffer),
        MEGATRON_0_16,
        ("gc.get_objects()", "counts.copy_(torch.zeros(counts.shape"),
    ),
    "optimizer _scale_one": Case(
        "megatron.optimizer-scale-one",
        real(scale_loss_by_stale_one),
        MEGATRON_0_16,
        ("optimizer._scale_one = torch.ones(one.shape",),
    ),
    "optimizer found_inf": Case(
        "megatron.optimizer-found-inf",
        real(reset_stale_found_inf),
        MEGATRON_0_16,
        ("optimizer.found_inf = torch.zeros(flag.shape",),
    ),
    "grad scaler": Case(
        "megatron.grad-scaler",
        real(back_off_stale_scale),
        MEGATRON_0_16,
        (
            "train_args[2]",
            '"chained_optimizers"',
            "global_tensor.data.copy_(recv_tensor)",
            "torch.distributed.send(value, dst=dest_rank",
        ),
    ),
    # other megatron-core releases, run by generate.py
    "0.7 aux-loss tracker (the FAQ)": Case(
        "megatron.moe-aux-losses-tracker",
        committed("megatron-core-0.7.0-save-aux-loss.log"),
        {"megatron-core": "0.7.0"},
        (
            'tracker = getattr(parallel_state, "_MOE_AUX_LOSSES_LOGGING_TRACKER", None)',
            "tracker[name] = torch.zeros(values.shape",
        ),
    ),
    "0.7 causal mask": Case(
        "megatron.default-causal-mask-cache",
        committed("megatron-core-0.7.0-causal-mask.log"),
        {"megatron-core": "0.7.0"},
        ('getattr(megatron_transformer_utils, "get_default_causal_mask", None)', "cache.cache_clear()"),
    ),
    "0.12 layer-wise tracker, save": Case(
        "megatron.moe-layer-wise-tracker",
        committed("megatron-core-0.12.1-save-aux-loss.log"),
        {"megatron-core": "0.12.1"},
        ('getattr(parallel_state, "_MOE_LAYER_WISE_LOGGING_TRACKER", None)',),
    ),
    "0.12 layer-wise tracker, clear": Case(
        "megatron.moe-layer-wise-tracker",
        committed("megatron-core-0.12.1-clear-aux-losses.log"),
        {"megatron-core": "0.12.1"},
        ("from megatron.core import parallel_state",),
    ),
    "0.12 causal mask": Case(
        "megatron.default-causal-mask-cache",
        committed("megatron-core-0.12.1-causal-mask.log"),
        {"megatron-core": "0.12.1"},
        ("from megatron.core.transformer import utils as megatron_transformer_utils",),
    ),
    "0.19 moe metrics tracker": Case(
        "megatron.moe-metrics-tracker",
        committed("megatron-core-0.19.2-record-moe-metric.log"),
        {"megatron-core": "0.19.2"},
        ('getattr(moe_logging, "_MOE_METRICS_TRACKER", None)', "entry.values = torch.zeros(values.shape"),
    ),
    # megatron/training, in the wheels from 0.17: read from the index
    "0.18 seqlen stats": Case(
        "megatron.seqlen-stats",
        committed("megatron-core-0.18.2-update-seqlen-stats.log"),
        {"megatron-core": "0.18.2"},
        ('getattr(megatron_training, "_seqlen_stats_in_iteration", None)', "megatron_training._seqlen_stats_active = False"),
    ),
    # the class of `tracker` is read in the release's source
    "0.19 mtp metrics tracker": Case(
        "megatron.mtp-loss-tracker",
        committed("megatron-core-0.19.2-save-mtp-metrics.log"),
        {"megatron-core": "0.19.2"},
        ("for name, values in list(tracker.items())", "tracker[name] = torch.zeros(values.shape"),
        release="0.19.2",
    ),
    # written by hand: Megatron-LM main, MindSpeed, MindSpeed-LLM
    "main moe metrics tracker": Case(
        "megatron.moe-metrics-tracker",
        committed("hand-megatron-lm-main-moe-metrics-tracker.log"),
        {"megatron-core": "0.18.0"},
        ('for entry in getattr(tracker, "metrics", {}).values():',),
    ),
    "AG_SHARED_EXPERTS_INPUTS, moe_utils": Case(
        "mindspeed.ag-shared-experts-inputs",
        committed("hand-mindspeed-ag-shared-experts-inputs.log"),
        fix=('getattr(mindspeed_moe_utils, "AG_SHARED_EXPERTS_INPUTS", None)', "inputs.clear()"),
    ),
    "AG_SHARED_EXPERTS_INPUTS, moe_common": Case(
        "mindspeed.ag-shared-experts-inputs-moe-common",
        committed("hand-mindspeed-ag-shared-experts-inputs-moe-common.log"),
        fix=('getattr(mindspeed_moe_common, "AG_SHARED_EXPERTS_INPUTS", None)', "inputs.clear()"),
    ),
    "kvallgather chunk ids": Case(
        "mindspeed.kvallgather-seq-chunk-ids",
        committed("hand-mindspeed-llm-kvallgather.log"),
        fix=(
            "import mindspeed_llm.core.context_parallel.kvallgather_context_parallel",
            "getattr(mindspeed_llm.core.context_parallel.kvallgather_context_parallel, name, None)",
            "cache.clear()",
        ),
    ),
    "swap prefetch": Case(
        "mindspeed.swap-prefetch",
        committed("hand-mindspeed-swap-prefetch.log"),
        fix=('prefetch = getattr(SwapPrefetch, "swap_prefetch", None)', "prefetch.cur_micro_num, prefetch.remove_num"),
    ),
    "LogArgs": Case(
        "mindspeed-llm.log-args",
        committed("hand-mindspeed-llm-log-args.log"),
        {"mindspeed-llm": "26.0.0"},
        ("recv_log_args(src_rank)", "send_log_args(dest_rank)"),
    ),
    # stand-ins run at MindSpeed's paths: only the source names these globals
    "AsyncAll2All queues": Case(
        "mindspeed.async-all2all-fifo",
        queued_all2all_output,
        fix=("getattr(mindspeed.core.transformer.moe.moe_feature.fb_overlap.modules.attention, name, None)", "queue.clear()"),
        standin=True,
    ),
    "saved MoE overlap tensors": Case(
        "mindspeed.moe-overlap-saved-tensors",
        saved_gemm_tensors,
        fix=("setattr(mindspeed.core.transformer.moe.moe_utils, name, None)",),
        standin=True,
    ),
    "flash-attention mask": Case(
        "mindspeed.global-attn-mask",
        cached_attention_mask,
        fix=('setattr(mindspeed.core.transformer.flash_attention.generate_mask.generate_mask, "_GLOBAL_ATTN_MASK", None)',),
        standin=True,
    ),
    "adaptive CP masks": Case(
        "mindspeed.adaptive-cp-cached-masks",
        cached_grid_mask,
        fix=("clear_global_info()",),
        standin=True,
    ),
    "CP actual sequence lengths": Case(
        "mindspeed.cp-batch-cache",
        stale_actual_seq_len,
        fix=('setattr(mindspeed.core.context_parallel.get_batch_utils, "_ACTUAL_SEQ_LEN", None)',),
        standin=True,
    ),
    # releases after 0.16.1 (hand logs at 0.19.2's real lines) and MindSpeed's newer globals
    "0.19 router global aux-loss counts": Case(
        "megatron.router-global-aux-loss-counts",
        committed("hand-megatron-core-0.19.2-global-aux-loss.log"),
        {"megatron-core": "0.19.2"},
        ("gc.get_objects()", '("global_tokens_per_expert", "ga_steps")', "counts.copy_(torch.zeros("),
    ),
    "0.19 router qb_beta_accum": Case(
        "megatron.router-qb-beta-accum",
        committed("hand-megatron-core-0.19.2-qb-beta-accum.log"),
        {"megatron-core": "0.19.2"},
        ('("qb_beta_accum", "qb_beta_count")', "sums.copy_(torch.zeros("),
    ),
    "0.19 router qb_beta": Case(
        "megatron.router-qb-beta",
        committed("hand-megatron-core-0.19.2-qb-beta.log"),
        {"megatron-core": "0.19.2"},
        (
            'getattr(module, "qb_beta", None)',
            "global_tensor.data.copy_(recv_tensor)",
            "torch.distributed.send(module.qb_beta, dst=dest_rank",
        ),
    ),
    "0.19 DSA indexer loss tracker": Case(
        "megatron.dsa-indexer-loss-tracker",
        committed("hand-megatron-core-0.19.2-dsa-indexer-loss.log"),
        {"megatron-core": "0.19.2"},
        ('getattr(DSAIndexerLossLoggingHelper, "tracker", None)', "tracker[name] = torch.zeros(values.shape"),
    ),
    "0.19 YaRN cos/sin cache": Case(
        "megatron.yarn-rotary-cache",
        committed("hand-megatron-core-0.19.2-yarn-cos-cached.log"),
        {"megatron-core": "0.19.2"},
        ("cache.cache_clear()", "rotary.max_seq_len_cached = -1"),
    ),
    "swap attention prefetch (2.1.0 on)": Case(
        "mindspeed.swap-attention-prefetch",
        committed("hand-mindspeed-swap-attention-prefetch.log"),
        fix=(
            "from mindspeed.core.memory.swap_attention.prefetch import SwapPrefetch",
            "prefetch.cur_micro_num, prefetch.remove_num",
        ),
    ),
    "ampipe slices": Case(
        "mindspeed.ampipe-slices-map",
        stale_ampipe_slices,
        fix=('getattr(mindspeed.moe.utils, "ampipe_slices_map", None)', "slices.clear()"),
        standin=True,
    ),
    "ALiBi bias": Case(
        "mindspeed.alibi-fusion-attn",
        stale_alibi_bias,
        fix=('getattr(mindspeed.model.alibi_mask, "AlibiForFusionAttnSingleton", None)', "singleton._alibi_tensor"),
        standin=True,
    ),
    "QAD teacher": Case(
        "mindspeed.qad-teacher-model",
        stale_teacher_weights,
        fix=("torch.distributed.recv(recv_tensor, src=src_rank", "torch.distributed.send(value, dst=dest_rank"),
        standin=True,
    ),
    "MindSpeed-LLM DSA indexer loss tracker": Case(
        "mindspeed-llm.dsa-indexer-loss-tracker",
        committed("hand-mindspeed-llm-dsa-indexer-loss.log"),
        fix=(
            'getattr(mindspeed_llm.tasks.models.transformer.dsa_indexer, "DSAIndexerLossLoggingHelper", None)',
            "tracker[name] = torch.zeros(values.shape",
        ),
    ),
    "HunYuan rotary buffers": Case(
        "mindspeed-llm.hunyuan-rotary",
        committed("hand-mindspeed-llm-hunyuan-rotary.log"),
        fix=('rotary.register_buffer("inv_freq", inv_freq.bfloat16(), persistent=False)', "rotary._set_cos_sin_cache("),
    ),
    "FSDP2 attention mask": Case(
        "mindspeed-llm.fsdp2-attn-mask",
        stale_fsdp2_attention_mask,
        fix=('setattr(mindspeed_llm.fsdp2.models.qwen3_next.modeling_qwen3_next, "_GLOBAL_ATTN_MASK", None)',),
        standin=True,
    ),
    "MTP position ids": Case(
        "mindspeed-llm.mtp-batch-cache",
        stale_mtp_position_ids,
        fix=('setattr(mindspeed_llm.training.utils, "_MTP_POSITION_ID", None)',),
        standin=True,
    ),
    # MindSpeed-LLM holes the coverage of every release found (hand logs at the releases' real lines)
    "MindSpeed-LLM 2.1.0 MTP loss tracker": Case(
        "mindspeed-llm.mtp-loss-tracker",
        committed("hand-mindspeed-llm-2.1.0-mtp-loss-tracker.log"),
        {"mindspeed-llm": "2.1.0"},
        (
            "from mindspeed_llm.core.transformer.multi_token_prediction import MTPLossLoggingHelper",
            'tracker["values"] = torch.zeros(values.shape',
        ),
    ),
    "FSDP2 GLM-MoE-DSA rotary inv_freq": Case(
        "mindspeed-llm.fsdp2-rotary-inv-freq",
        committed("hand-mindspeed-llm-fsdp2-glm-rotary.log"),
        {"mindspeed-llm": "26.1.0"},
        (
            'getattr(mindspeed_llm.fsdp2.models.glm52.modeling_glm_moe_dsa, "GlmMoeDsaRotaryEmbedding", None)',
            'rotary.rope_init_fn(rotary.config, "cpu")',
        ),
    ),
    "FSDP2 GPT-OSS rotary inv_freq": Case(
        "mindspeed-llm.fsdp2-rotary-inv-freq",
        committed("hand-mindspeed-llm-fsdp2-gpt-oss-rotary.log"),
        fix=('getattr(mindspeed_llm.fsdp2.models.gpt_oss.modeling_gpt_oss, "GptOssRotaryEmbedding", None)',),
    ),
    "ModelLink 1.0.RC3 mask cache": Case(
        "mindspeed-llm.modellink-mask-cache",
        stale_modellink_mask,
        fix=('setattr(modellink.core.transformer.mask_generator, "_MASK_CACHE", None)', "del attention.attention_mask"),
        standin=True,
    ),
    # megatron-core's FSDP buffer, activation offload, paged stash and TileLang DSA scratch
    "0.19 Megatron-FSDP global memory buffer": Case(
        "megatron.fsdp-global-memory-buffer",
        committed("hand-megatron-core-0.19.2-fsdp-global-memory-buffer.log"),
        {"megatron-core": "0.19.2"},
        ("megatron_fsdp_utils._GLOBAL_MEMORY_BUFFER = None",),
    ),
    "0.19 activation offload manager": Case(
        "megatron.activation-offload-manager",
        committed("hand-megatron-core-0.19.2-activation-offload.log"),
        {"megatron-core": "0.19.2"},
        ("PipelineOffloadManager.reset_instance()",),
    ),
    "0.19 MoE paged stash": Case(
        "megatron.moe-paged-stash",
        committed("hand-megatron-core-0.19.2-paged-stash.log"),
        {"megatron-core": "0.19.2"},
        ('getattr(PagedStashManager, "STASH_MGR", None)', "stash_manager.__init__()"),
    ),
    "0.19 TileLang DSA scratch": Case(
        "megatron.dsa-tilelang-scratch",
        committed("hand-megatron-core-0.19.2-dsa-tilelang-scratch.log"),
        {"megatron-core": "0.19.2"},
        ("scratch.clear()", "tilelang_dsa._DSA_SCRATCH_CACHE_TOTAL_BYTES = 0"),
    ),
    "nanopipe WeightGradStore": Case(
        "mindspeed.nanopipe-weight-grad-store",
        committed("hand-mindspeed-nanopipe-weight-grad-store.log"),
        fix=("import mindspeed.core.weight_grad_store", "store.cache, store.grad_store, store.ori_storage"),
    ),
    "fb-overlap WeightGradStore": Case(
        "mindspeed.fb-overlap-weight-grad-store",
        committed("hand-mindspeed-fb-overlap-weight-grad-store.log"),
        fix=(
            "import mindspeed.core.transformer.moe.moe_feature.fb_overlap.modules.weight_grad_store",
            "store.weight_grad_queue.get_nowait()",
        ),
    ),
    "fb-overlap WeightGradStore, core_r0.8.0": Case(
        "mindspeed.fb-overlap-weight-grad-store",
        committed("hand-mindspeed-fb-overlap-weight-grad-store-core-r0.8.log"),
        fix=("import mindspeed.core.pipeline_parallel.fb_overlap.modules.weight_grad_store",),
    ),
    "balanced MoE hot-expert weights": Case(
        "mindspeed.balanced-moe-hot-expert-params",
        stale_hot_expert_weights,
        fix=(
            "getattr(mindspeed.core.transformer.moe.moe_feature.balanced_moe.modules.moe_layer, "
            '"_GLOBAL_SHARED_PARAMS_FOR_HOT_EXPERTS", None)',
            "tensor.data = torch.empty(tensor.shape",
        ),
        standin=True,
    ),
    "MindSpeed FP8 weight reuse": Case(
        "mindspeed.fp8-weight-reuse-pool",
        committed("hand-mindspeed-fp8-weight-reuse.log"),
        fix=(
            "from mindspeed.te.pytorch.fp8 import reuse as fp8_reuse",
            "fp8_reuse.optimizer_step_reuse_cleanup_wrapper(lambda: None)()",
        ),
    ),
    "0.19 distillation logits saver": Case(
        "megatron.logits-saver-accumulated",
        committed("hand-megatron-core-0.19.2-logits-saver.log"),
        {"megatron-core": "0.19.2"},
        ('getattr(logits_saver, "_ACTIVE_LOGITS_SAVER", None)', "saver._accumulated_results.clear()"),
    ),
    "MindSpeed FP8 delayed scaling": Case(
        "mindspeed.fp8-delayed-scaling",
        committed("hand-mindspeed-fp8-delayed-scaling.log"),
        fix=(
            'getattr(DelayedScalingRecipe, "ALL_SCALING", None)',
            "data.amax_history = torch.zeros([data.amax_history_len] + data.scale_shape, device=data.device)",
        ),
    ),
    "MindSpeed swap-layer-input stacks": Case(
        "mindspeed.swap-layer-input-stacks",
        committed("hand-mindspeed-swap-layer-input.log"),
        fix=(
            "from mindspeed.core.memory.swap_layer_input.swap_layer_input_manager import SwapLayerInputManager",
            "manager.batch_stack.clear()",
        ),
    ),
}


def test_every_shipped_rule_has_a_case():
    assert {rule.id for rule in KNOWLEDGE.rules} == {case.rule for case in CASES.values()}


@pytest.mark.parametrize("name", list(CASES))
def test_rule_classifies_its_traceback(name, tmp_path):
    case = CASES[name]
    rule = KNOWLEDGE.rule(case.rule)
    roots: tuple[Path, ...] = (tmp_path,) if case.standin else ()
    if case.release is not None:
        root = release_root(case.release)
        if root is None:
            pytest.skip(f"megatron-core {case.release} cannot be had here")
        roots = (root,)
    finding, result = diagnose(case.log(tmp_path), case.versions, roots)

    assert (result.rule, result.scenario, result.confidence) == (case.rule, rule.scenario, "high")
    assert isinstance(result.fix, FixPlan), result.notes
    assert result.fix.phase == rule.phase
    assert result.fix.function == (PROFILE.rollback if rule.scenario == 1 else PROFILE.recv)
    assert (result.fix.peer_function is not None) == (rule.scenario == 2)
    rendered = "\n".join((*result.fix.imports, result.fix.code, result.fix.peer_code or ""))
    for fragment in case.fix:
        assert fragment in rendered
    for condition in rule.conditions:
        assert result.fix.code.startswith(f"if {KNOWLEDGE.conditions[condition].guard}")
    assert_compiles(result.fix)


def test_faq_case_names_the_stale_tracker_and_its_version():
    """The FAQ's own traceback (megatron-core 0.7) is the aux-loss tracker in parallel_state."""
    finding, result = diagnose((FIXTURES / "megatron-core-0.7.0-save-aux-loss.log").read_text(), {"megatron-core": "0.7.0"})
    assert finding.ranks == (3,)
    assert finding.tensor.name == GlobalName("megatron.core.parallel_state", None, "_MOE_AUX_LOSSES_LOGGING_TRACKER")
    assert result.fix.code.startswith('if getattr(get_args(), "num_experts", None):')


def test_tracker_rule_follows_the_release_the_frames_ran():
    """The same tracker line is the parallel_state global on 0.12 and the moe_utils one on 0.16: the
    index reads each log as the release its frames fit, whatever version is given otherwise."""
    text = (FIXTURES / "megatron-core-0.12.1-save-aux-loss.log").read_text()
    for versions in ({"megatron-core": "0.12.1"}, {"megatron-core": "0.16.1"}, {}):
        finding, verdict = diagnose(text, versions)
        assert finding.tensor is not None and finding.tensor.name.module == "megatron.core.parallel_state"
        assert verdict.rule == "megatron.moe-layer-wise-tracker", versions
    newer = (Path(__file__).parents[2] / "samples" / "logs" / "megatron_moe_tracker.log").read_text()
    finding, verdict = diagnose(newer, {})
    assert finding.tensor is not None and finding.tensor.name.module == "megatron.core.transformer.moe.moe_utils"
    assert verdict.rule == "megatron.moe-layer-wise-tracker-moe-utils"


# --- the fixes themselves, run on unsafe memory ----------------------------------------------------


UNSAFE_DATA = "There is unsafe data in the input tensor"


def repaired(name: str, setup: Callable, retry: Callable, *, then: str | None = None) -> None:
    """Classify the case; on fresh unsafe state the step that failed fails again without the fix,
    and gets past the unsafe memory with it. `then`: the error the repaired step meets further on
    (this machine has no accelerator), None when the step completes."""
    case = CASES[name]
    _, result = diagnose(case.log(None), case.versions)
    with emulated_npu() as mark:
        state = setup(mark)
        with pytest.raises(RuntimeError, match=UNSAFE_DATA):
            retry(state)
    reset_megatron_state()
    with emulated_npu() as mark:
        state = setup(mark)
        run_fix(case.rule, result.fix)
        if then is None:
            retry(state)
        else:
            with pytest.raises(Exception, match=then):
                retry(state)


def test_tracker_fix_lets_the_next_step_log_its_loss():
    from megatron.core.transformer.moe import moe_utils

    def setup(mark):
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", GENERATOR.aux_loss(), 1, 4)
        mark(moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER["load_balancing_loss"]["values"])

    def retry(_):
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", GENERATOR.aux_loss(), 2, 4)
        moe_utils.clear_aux_losses_tracker()

    repaired("moe-utils tracker, save", setup, retry)


def test_mtp_fix_lets_the_next_step_log_its_loss():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    def setup(mark):
        MTPLossLoggingHelper.save_loss_to_tracker(GENERATOR.aux_loss(), 0, 2)
        mark(MTPLossLoggingHelper.tracker["values"])

    repaired("mtp tracker", setup, lambda _: MTPLossLoggingHelper.save_loss_to_tracker(GENERATOR.aux_loss(), 0, 2))


def test_memory_buffer_fix_lets_attention_past_the_buffer():
    import torch
    from megatron.core import parallel_state

    def setup(mark):
        parallel_state.destroy_global_memory_buffer()
        parallel_state._set_global_memory_buffer()
        mark(parallel_state.get_global_memory_buffer().get_tensor((2, 4, 4), torch.float32, "mpu"))
        return attention()

    def retry(layer):
        query = torch.randn(4, 1, 2, 8)
        layer(query, query, query, None)

    repaired("global memory buffer", setup, retry, then="cuda rng state")  # past the buffer: dropout wants CUDA's RNG


def test_rotary_cache_fix_recomputes_the_embedding():
    import torch
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer.transformer_config import TransformerConfig

    def setup(mark):
        embedding = rotary()
        mark(embedding(4))
        return embedding

    def retry(embedding):
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2)
        apply_rotary_pos_emb(torch.randn(4, 1, 2, 8), embedding(4), config, cp_group=OneRank())

    repaired("rotary cache", setup, retry)


def test_local_tokens_fix_lets_routing_count_again():
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    def setup(mark):
        layer = router()
        mark(layer.local_tokens_per_expert)
        return layer

    def retry(layer):
        buffer = layer.local_tokens_per_expert
        count = getattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable", TopKRouter._apply_expert_bias)
        count(layer, torch.ones(6, 4, dtype=torch.bool))
        assert layer.local_tokens_per_expert is buffer  # refreshed in place: still the registered buffer
        assert layer.local_tokens_per_expert.tolist() == [6.0] * 4

    repaired("router local_tokens_per_expert", setup, retry)


def test_scale_one_fix_restores_the_unit_scale():
    import torch

    def setup(mark):
        optimizer = mixed_precision_optimizer()
        mark(optimizer._scale_one)
        return optimizer

    def retry(optimizer):
        assert optimizer.scale_loss(torch.tensor(2.0)).tolist() == [2.0]

    repaired("optimizer _scale_one", setup, retry)


def test_found_inf_fix_lets_the_step_reset_its_overflow_flag():
    def setup(mark):
        optimizer = mixed_precision_optimizer(dynamic_grad_scaler())
        mark(optimizer.found_inf)
        return optimizer

    def retry(optimizer):
        with pytest.raises(AssertionError, match="parallel group is not initialized"):  # past found_inf
            optimizer._unscale_main_grads_and_check_for_nan()
        assert optimizer.found_inf.tolist() == [0.0]

    repaired("optimizer found_inf", setup, retry)


# --- generic templates (used by the source heuristics) ---------------------------------------------


def unknown_global(tmp_path: Path) -> tuple[Finding, object]:
    """A user's trainer keeps per-step statistics in a module dict no rule knows."""
    import torch

    package = tmp_path / "trainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "stats.py").write_text(
        textwrap.dedent("""\
        import torch

        _STEP_STATS = {}


        def record(name, value):
            if name not in _STEP_STATS:
                _STEP_STATS[name] = torch.zeros(2)
            _STEP_STATS[name] += value
        """)
    )
    sys.path.insert(0, str(tmp_path))
    try:
        stats = importlib.import_module("trainer.stats")

        def action(mark):
            stats.record("grad_norm", torch.ones(2))
            mark(stats._STEP_STATS["grad_norm"])
            stats.record("grad_norm", torch.ones(2))

        text = capture(action)
    finally:
        sys.path.remove(str(tmp_path))
    lines = split_lines(text, source="train.log", base_offset=0, rank_hint=None)
    (finding,) = locate(parse_tracebacks(lines), Workspace([tmp_path]))
    return finding, stats


def render(template_id: str, finding: Finding) -> dict[str, str]:
    """The generic templates filled as classify fills them for a heuristic verdict."""
    rule = KNOWLEDGE.template(template_id)
    parent, _, alias = finding.tensor.name.module.rpartition(".")
    slots = {
        "module": finding.tensor.name.module,
        "variable": finding.tensor.name.variable,
        "owner": "",
        "alias": alias,
        "parent": parent,
        "holder": alias,
        "tensor": f"{alias}.{finding.tensor.name.variable}",
        "src": "src_rank",
        "dst": "dest_rank",
        "group": PROFILE.repair_group,
    }
    parts = {"imports": "\n".join(string.Template(line).substitute(slots) for line in rule.fix.imports)}
    for side in ("code", "send", "recv"):
        template = getattr(rule.fix, side)
        if template is not None:
            parts[side] = textwrap.dedent(string.Template(template).substitute(slots))
    return parts


def test_generic_reinitialise_rebuilds_a_dict_of_tensors(tmp_path):
    import torch

    finding, stats = unknown_global(tmp_path)
    assert (finding.tensor.name.variable, finding.tensor.name.module) == ("_STEP_STATS", "trainer.stats")
    fix = render("generic.reinitialise", finding)
    assert fix["imports"].splitlines() == ["import torch", "from trainer import stats"]
    sys.path.insert(0, str(tmp_path))
    try:
        with emulated_npu() as mark:
            mark(stats._STEP_STATS["grad_norm"])
            exec(compile(fix["imports"] + "\n" + fix["code"], "<generic fix>", "exec"), {})
            stats.record("grad_norm", torch.ones(2))  # the step that failed
        assert stats._STEP_STATS["grad_norm"].tolist() == [1.0, 1.0]
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("trainer.stats", "trainer"):
            sys.modules.pop(name, None)


def test_generic_reinitialise_refreshes_a_tensor_in_place():
    import torch

    code = KNOWLEDGE.template("generic.reinitialise").fix.code
    fix = string.Template(code).substitute(holder="holder", variable="value")
    holder = type("Holder", (), {})()
    with emulated_npu() as mark:
        holder.value = torch.ones(3)
        kept = holder.value
        mark(kept)
        exec(textwrap.dedent(fix), {"torch": torch, "holder": holder})
        assert holder.value is kept and (holder.value + 1).tolist() == [1.0, 1.0, 1.0]


def test_generic_replica_copy_renders_matching_send_and_recv(tmp_path):
    finding, _ = unknown_global(tmp_path)
    for name in ("trainer.stats", "trainer"):
        sys.modules.pop(name, None)
    fix = render("generic.replica-copy", finding)
    assert "torch.distributed.recv(recv_tensor, src=src_rank, group=get_repair_group())" in fix["recv"]
    assert "global_tensor.copy_(recv_tensor)" in fix["recv"]
    assert "torch.distributed.send(global_tensor, dst=dest_rank, group=get_repair_group())" in fix["send"]
    for side in ("recv", "send"):
        compile(fix["imports"] + "\ndef f(src_rank, dest_rank):\n" + textwrap.indent(fix[side], "    "), "<fix>", "exec")


# --- what every shipped fix must not do ------------------------------------------------------------

READS_UNSAFE_DATA = re.compile(r"\.(zero_|fill_|item|cpu|clone)\(|_like\(")


@pytest.mark.parametrize("rule", [*KNOWLEDGE.rules, *KNOWLEDGE.templates], ids=lambda rule: rule.id)
def test_fix_never_reads_the_tensor_it_repairs(rule):
    """zero_(), fill_(), .item(), .cpu(), clone() and *_like() all read their input and would raise."""
    for template in (rule.fix.code, rule.fix.send, rule.fix.recv):
        if template is not None:
            assert not READS_UNSAFE_DATA.search(template), template


SENTENCE_END = re.compile(r"[.!?](\s|$)")


@pytest.mark.parametrize("rule", [*KNOWLEDGE.rules, *KNOWLEDGE.templates], ids=lambda rule: rule.id)
def test_reason_is_one_or_two_sentences_with_references(rule):
    assert 1 <= len(SENTENCE_END.findall(rule.reason)) <= 2, rule.reason
    assert rule.references
