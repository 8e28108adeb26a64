"""What each corpus run trains: one case per log, each putting one global tensor in every step.

`worker.py` builds a case's model and optimizer and runs its `train_step` every iteration; the
case's code is what touches the global, the way the real framework does in training:

- megatron-core cases run megatron-core's own modules and functions (0.16.1 from the project's
  environment; 0.7.0 and 0.12.1 from the pip targets generate.py puts first on PYTHONPATH);
- stand-in cases run the few-line modules under `standins/`, written at MindSpeed's and
  MindSpeed-LLM's import paths (ours, not their code; see README.md);
- replay cases embed a committed hand-written traceback of tests/fixtures/rules/ (MindSpeed and
  Megatron-LM main cannot be installed here): the faulty rank fails for real on a global of this
  module, and its excepthook prints the fixture's traceback in place of its own;
- framework cases run a user framework under `frameworks/` through its own `train_step`;
- negative cases fail without any unsafe data (an out-of-memory error), or not at all.

A case can say what its adaptor already repairs besides parameters and optimizer state
(`repaired`) and what its rollback already resets (`rollback`): the finding is then the next
global the step reads.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import emulated_mindio as ttp
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_npu_standin

from unsafe_doctor.npu.messages import ERR_MEMORY, UNSAFE_DATA, pta_error

HERE = Path(__file__).resolve().parent
RULE_FIXTURES = HERE.parent / "fixtures" / "rules"
VOCAB_SIZE = 64
HIDDEN_SIZE = 16
NUM_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
_ITERATION = [0]  # the step being run, for fault points planned inside the forward


def _iteration() -> int:
    return _ITERATION[0]


def allreduce_gradients(model: torch.nn.Module) -> None:
    """One flat all-reduce of every gradient, averaged over the data-parallel ranks."""
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


class TinyLM(torch.nn.Module):
    """Embedding, the case's block on Megatron's [seq, batch, hidden] layout, output head."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB_SIZE, HIDDEN_SIZE)
        self.block = block
        self.output_layer = torch.nn.Linear(HIDDEN_SIZE, VOCAB_SIZE)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens).transpose(0, 1).contiguous()
        hidden = self.block(hidden)
        logits = self.output_layer(hidden).transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1))


class Case:
    """A plain step: forward, backward, all-reduce, Adam. Subclasses put their global in it."""

    checkpoint = "gpt_tiny"

    def install_excepthook(self) -> None:
        """Called before init_process_group, whose hook wraps this one with `[rankN]: `."""

    def initialize(self) -> None:
        """After init_process_group: framework state (model parallel groups, buffers)."""

    def block(self) -> torch.nn.Module:
        return torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def build_model(self) -> torch.nn.Module:
        return TinyLM(self.block())

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=1.5e-4)

    def train_step(self, model, optimizer, batch, iteration: int) -> torch.Tensor:
        _ITERATION[0] = iteration
        tokens, labels = batch
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, labels)
        loss.backward()
        allreduce_gradients(model)
        optimizer.step()
        return loss.detach()

    def after_step(self, model: torch.nn.Module, iteration: int) -> None:
        """End of the step, after the optimizer: logging helpers, per-step resets."""

    def repaired(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """Tensors the adaptor already copies from the replica, besides parameters and optimizer state."""
        return []

    def rollback(self, step: int, logged_iteration: int) -> None:
        """What the adaptor's rollback already resets."""

    def arguments(self) -> dict[str, object]:
        """The job's arguments that say which features it runs (the arguments dump shows them): a
        plain fp32 dense model without position embeddings here."""
        return {"position_embedding_type": "none"}

    def loss_scale_value(self) -> float:
        return 1.0


# --- megatron-core ------------------------------------------------------------------------------------


def _no_fuser(function):
    """megatron-core's jit_fuser (torch.compile / TorchScript), off as MindSpeed sets it on the NPU."""
    return function


def python_312_standins() -> None:
    """megatron-core 0.17 and newer declare Python >= 3.12 and run on 3.11 with two stand-ins, ours:
    `typing.override` (3.12's no-op decorator, which megatron/training/models/ imports) and triton
    (release_standins/: the 0.18+ kernels decorate with it at import time). torch settles "no triton"
    first, so that its compiler keeps the path it takes without triton."""
    import typing

    import torch._dynamo.backends.debugging  # noqa: F401
    import torch._inductor.runtime.triton_compat  # noqa: F401

    if not hasattr(typing, "override"):
        typing.override = lambda function: function
    sys.path.append(str(HERE / "release_standins"))


class MegatronCase(Case):
    """Megatron's model-parallel state (TP = PP = 1) and its CPU shims, set up once."""

    checkpoint = "gpt_moe_tiny"

    def initialize(self) -> None:
        if os.environ.get("CORPUS_RELEASE_STANDINS") == "1":
            python_312_standins()
        from megatron.core import jit

        jit.jit_fuser = _no_fuser  # before any module that decorates with it is imported
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.transformer.moe import moe_utils

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        if dist.get_rank() == 0:
            print("> initialized tensor model parallel with size 1", flush=True)
            print("> initialized pipeline model parallel with size 1", flush=True)
        # The CUDA RNG tracker's fork(): MindSpeed points it at the NPU's generator; here there is none.
        tracker = tensor_parallel.random.CudaRNGStatesTracker
        tracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
        if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16.1 reads it without TE
            moe_utils.te_general_gemm = None

    def config(self, **overrides):
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=2,
            hidden_size=HIDDEN_SIZE,
            num_attention_heads=NUM_HEADS,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            use_cpu_initialization=True,
            **overrides,
        )


class MtpLossTracker(MegatronCase):
    """A multi-token-prediction head logs its loss in MTPLossLoggingHelper.tracker every step."""

    def arguments(self):
        return {**super().arguments(), "mtp_num_layers": 1}

    def block(self):
        return MtpBlock()

    def after_step(self, model, iteration):
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        MTPLossLoggingHelper.track_mtp_metrics(loss_scale=1.0, iteration=iteration, writer=None, total_loss_dict={})


class MtpBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)
        self.mtp_head = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        hidden = hidden + torch.tanh(self.mlp(hidden))
        mtp_hidden = self.mtp_head(hidden[:-1])
        mtp_loss = F.mse_loss(mtp_hidden, hidden[1:].detach())
        MTPLossLoggingHelper.save_loss_to_tracker(mtp_loss, 0, 1)
        return hidden + 0.0 * mtp_loss


class GlobalMemoryBuffer(MegatronCase):
    """Megatron's DotProductAttention takes its score buffer from the global memory buffer."""

    def block(self):
        return MegatronSelfAttention(self.config())


class MegatronSelfAttention(torch.nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType

        self.qkv = torch.nn.Linear(HIDDEN_SIZE, 3 * HIDDEN_SIZE)
        self.core_attention = DotProductAttention(
            config, 1, AttnMaskType.causal, "self", pg_collection=ProcessGroupCollection.use_mpu_process_groups()
        )
        self.proj = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        seq, batch, _ = hidden.shape
        query, key, value = self.qkv(hidden).view(seq, batch, NUM_HEADS, 3 * HEAD_DIM).split(HEAD_DIM, dim=-1)
        context = self.core_attention(query.contiguous(), key.contiguous(), value.contiguous(), None)
        return hidden + self.proj(context)


class RotaryCache(MegatronCase):
    """RoPE embeddings come from RotaryEmbedding.forward, an lru_cache on the device."""

    def block(self):
        return RotaryAttention(self.config())

    def arguments(self):
        return {**super().arguments(), "position_embedding_type": "rope"}


class RotaryInvFreq(RotaryCache):
    """The adaptor already empties the rotary cache in rollback: the next step recomputes the
    embedding from inv_freq, which the fault left unsafe."""

    def rollback(self, step, logged_iteration):
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        RotaryEmbedding.forward.cache_clear()


class RotaryAttention(torch.nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        self.config = config
        self.query = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)
        self.rotary_pos_emb = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=1.0)
        self.proj = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        from megatron.core import parallel_state
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        seq, batch, _ = hidden.shape
        query = self.query(hidden).view(seq, batch, NUM_HEADS, HEAD_DIM)
        rotary_pos_emb = self.rotary_pos_emb(seq)
        query = apply_rotary_pos_emb(
            query, rotary_pos_emb, config=self.config, cp_group=parallel_state.get_context_parallel_group()
        )
        return hidden + self.proj(query.reshape(seq, batch, HIDDEN_SIZE))


class RouterExpertBias(MegatronCase):
    """Aux-loss-free load balancing: the routers' expert_bias steers routing and moves every step."""

    def moe_config(self):
        return self.config(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_router_load_balancing_type="none",
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
        )

    def arguments(self):
        return {
            **super().arguments(),
            "num_experts": 4,
            "moe_router_topk": 2,
            "moe_router_load_balancing_type": "none",
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
        }

    def block(self):
        return MoeLayer(self.moe_config())

    def train_step(self, model, optimizer, batch, iteration):
        from megatron.core.distributed.finalize_model_grads import (
            _update_router_expert_bias,
            reset_model_temporary_tensors,
        )

        tokens, labels = batch
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, labels)
        loss.backward()
        allreduce_gradients(model)
        config = model.block.router.config
        _update_router_expert_bias([model], config)  # what finalize_model_grads does after backward
        reset_model_temporary_tensors(config, [model])
        optimizer.step()
        return loss.detach()


class RouterLocalTokens(RouterExpertBias):
    """The adaptor already copies expert_bias from the replica; the token counts were forgotten."""

    def repaired(self, model):
        return [model.block.router.expert_bias]


class RouterExpertBiasAuxCoeff(RouterExpertBias):
    """An aux-loss coefficient is set, but the load-balancing type "none" computes no aux loss, so
    the router records nothing in the MoE tracker: the expert bias is what the step reads."""

    def moe_config(self):
        return self.config(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_router_load_balancing_type="none",
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_aux_loss_coeff=1e-2,
        )

    def arguments(self):
        return {**super().arguments(), "moe_aux_loss_coeff": 1e-2}


class MoeLayer(torch.nn.Module):
    """Megatron's TopKRouter in front of a few dense experts."""

    def __init__(self, config, layer_number: int = 1) -> None:
        super().__init__()
        from megatron.core.transformer.moe.router import TopKRouter

        try:  # megatron-core >= 0.14 takes the process groups
            from megatron.core.process_groups_config import ProcessGroupCollection

            self.router = TopKRouter(config, ProcessGroupCollection.use_mpu_process_groups())
        except ImportError:
            self.router = TopKRouter(config)
        self.router.set_layer_number(layer_number)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE) for _ in range(4))

    def forward(self, hidden):
        probs, routing = self.router(hidden)
        if probs.shape[-1] != len(self.experts):  # megatron-core 0.7: top-k scores and expert indices
            dense = torch.zeros(probs.shape[0], len(self.experts), dtype=probs.dtype, device=probs.device)
            probs = dense.scatter(1, routing, probs)
        tokens = hidden.reshape(-1, HIDDEN_SIZE)
        output = sum(probs[:, e : e + 1] * expert(tokens) for e, expert in enumerate(self.experts))
        return hidden + output.reshape(hidden.shape)


class MegatronOptimizerCase(MegatronCase):
    """Megatron's mixed-precision optimizer scales the loss and checks the gradients every step.

    It is built as a stub (`is_stub_optimizer`: no model-parameter bookkeeping, which needs CUDA
    parameters) around the Adam that trains the model; its loss scale, unit scale and inf flag are
    Megatron's own device tensors.
    """

    fp16 = False

    def arguments(self):
        if self.fp16:
            return {
                **super().arguments(),
                "fp16": True,
                "initial_loss_scale": 2.0**16,
                "min_loss_scale": 1.0,
                "loss_scale_window": 1000,
                "hysteresis": 2,
            }
        return {**super().arguments(), "bf16": True}

    def build_optimizer(self, model):
        from megatron.core.optimizer.grad_scaler import DynamicGradScaler
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, MixedPrecisionOptimizer
        from megatron.core.optimizer.optimizer_config import OptimizerConfig

        adam = torch.optim.Adam(model.parameters(), lr=1.5e-4)
        scaler = None
        if self.fp16:
            scaler = DynamicGradScaler(
                initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000, hysteresis=2
            )
        self.megatron_optimizer = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
        config = OptimizerConfig(bf16=not self.fp16, fp16=self.fp16)
        MixedPrecisionOptimizer.__init__(self.megatron_optimizer, adam, config, scaler, None)
        self.megatron_optimizer.is_stub_optimizer = True
        return adam

    def train_step(self, model, optimizer, batch, iteration):
        tokens, labels = batch
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, labels)
        self.megatron_optimizer.scale_loss(loss).backward()
        allreduce_gradients(model)
        found_inf = self.megatron_optimizer.prepare_grads()
        if not found_inf:
            scale = self.megatron_optimizer.get_loss_scale()
            for param in model.parameters():
                param.grad.div_(scale)
            optimizer.step()
        return loss.detach()

    def loss_scale_value(self) -> float:
        return self.megatron_optimizer.get_loss_scale().item()


class OptimizerScaleOne(MegatronOptimizerCase):
    """bf16: the loss is scaled by the optimizer's unit scale, `_scale_one`."""


class GradScaler(MegatronOptimizerCase):
    """fp16: the loss is scaled by the dynamic grad scaler's `_scale`, which the fault left unsafe."""

    fp16 = True


class OptimizerFoundInf(GradScaler):
    """fp16, and the adaptor already copies the grad scaler from the replica: next comes found_inf."""

    def repaired(self, model):
        scaler = self.megatron_optimizer.grad_scaler
        return [scaler._scale, scaler.min_scale, scaler.growth_factor, scaler.backoff_factor]


class LegacyMoeTracker(MegatronCase):
    """megatron-core 0.7 / 0.12: the router's z-loss is logged in parallel_state's MoE tracker."""

    def initialize(self) -> None:
        super().initialize()
        histc = torch.histc  # megatron-core 0.7 counts expert indices (int64): CUDA and the NPU can, the CPU cannot
        torch.histc = lambda input, *args, **kwargs: histc(input.float(), *args, **kwargs)

    def block(self):
        config = self.config(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_router_load_balancing_type="none",
            moe_z_loss_coeff=1e-3,
            add_bias_linear=False,
        )
        return MoeLayer(config)

    def arguments(self):
        return {
            **super().arguments(),
            "num_experts": 4,
            "moe_router_topk": 2,
            "moe_router_load_balancing_type": "none",
            "moe_z_loss_coeff": 1e-3,
            "add_bias_linear": False,
        }

    def after_step(self, model, iteration):
        from megatron.core.transformer.moe import moe_utils

        moe_utils.clear_aux_losses_tracker()


class LegacyCausalMask(MegatronCase):
    """megatron-core 0.12: the softmax masks scores with the lru-cached default causal mask."""

    def block(self):
        return CausalSoftmaxAttention()


class CausalSoftmaxAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.utils import attention_mask_func

        self.qkv = torch.nn.Linear(HIDDEN_SIZE, 3 * HIDDEN_SIZE)
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            input_in_fp16=False,
            input_in_bf16=False,
            attn_mask_type=AttnMaskType.causal,
            scaled_masked_softmax_fusion=False,
            mask_func=attention_mask_func,
            softmax_in_fp32=True,
            scale=None,
        )
        self.proj = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        seq, batch, _ = hidden.shape
        query, key, value = self.qkv(hidden).view(seq, batch, NUM_HEADS, 3 * HEAD_DIM).split(HEAD_DIM, dim=-1)
        scores = torch.einsum("sbnh,tbnh->bnst", query, key) / HEAD_DIM**0.5
        probs = self.scale_mask_softmax(scores, None)
        context = torch.einsum("bnst,tbnh->sbnh", probs, value)
        return hidden + self.proj(context.reshape(seq, batch, HIDDEN_SIZE))


# --- megatron-core 0.17 to 0.19 (generate.py puts the unpacked release first on PYTHONPATH) ---------------


class MoeMetricsTracker(LegacyMoeTracker):
    """megatron-core 0.18+: the router records its z-loss in moe_logging's MoEMetricsTracker object
    (`_MOE_METRICS_TRACKER`, the tensors in its `_metrics` entries), cleared after each step."""

    def after_step(self, model, iteration):
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().clear()


class MtpMetricsTracker(MtpLossTracker):
    """megatron-core 0.19: the MTP head saves loss, correct and total counts in
    MTPLossLoggingHelper.tracker; track_mtp_metrics adds the cumulative counts (five entries)."""

    def block(self):
        return MtpMetricsBlock()


class MtpMetricsBlock(MtpBlock):
    def forward(self, hidden):
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        hidden = hidden + torch.tanh(self.mlp(hidden))
        mtp_hidden = self.mtp_head(hidden[:-1])
        target = hidden[1:].detach()
        mtp_loss = F.mse_loss(mtp_hidden, target)
        correct = (mtp_hidden.argmax(-1) == target.argmax(-1)).sum().float()
        MTPLossLoggingHelper.save_metrics_to_tracker(mtp_loss, correct, torch.tensor(float(target[..., 0].numel())), 0, 1)
        return hidden + 0.0 * mtp_loss


class SeqlenStats(MegatronCase):
    """megatron-core 0.18+ SFT on packed sequences (--sft): Megatron-LM's forward_step hands each
    micro-batch's real cu_seqlens to training.py's update_seqlen_stats_from_cu_seqlens, which adds the
    lengths into `_seqlen_stats_in_iteration` (kept allocated across iterations); the training log
    consumes and zeroes it after the step."""

    packing = "sft"  # the switch that makes the batches carry cu_seqlens (knowledge_base/conditions.yaml)

    def initialize(self) -> None:
        super().initialize()
        from megatron.training.global_vars import set_args

        set_args(argparse.Namespace(**self.arguments()))  # what pretrain_gpt's get_batch reads

    def arguments(self):
        return {**super().arguments(), self.packing: True}

    def train_step(self, model, optimizer, batch, iteration):
        from megatron.training import get_args, training

        args = get_args()
        # pretrain_gpt.py's get_batch: `has_cu_seqlens = is_sft or args.dataloader_inter_document_masking`
        if getattr(args, "sft", False) or getattr(args, "dataloader_inter_document_masking", False):
            tokens, _ = batch
            training.update_seqlen_stats_from_cu_seqlens(torch.tensor([0, 3, 6, tokens.shape[-1]], dtype=torch.int32))
        return super().train_step(model, optimizer, batch, iteration)

    def after_step(self, model, iteration):
        from megatron.training import training

        training.consume_seqlen_stats_in_iteration()


class SeqlenStatsInterDocument(SeqlenStats):
    """megatron-core 0.19 pretraining with --dataloader-inter-document-masking: GPTDataset packs each
    sample's documents' cu_seqlens, and forward_step adds them up as for SFT."""

    packing = "dataloader_inter_document_masking"


# --- replays of committed hand-written tracebacks ----------------------------------------------------------

_REPLAY_GATE: torch.Tensor | None = None
"""A device tensor every step reads: on the faulty rank the step fails on it after recovery."""


class Replay(Case):
    """The step fails for real on `_REPLAY_GATE`; the excepthook prints the fixture's traceback."""

    def __init__(self, fixture: str) -> None:
        self.fixture = RULE_FIXTURES / fixture

    def initialize(self) -> None:
        global _REPLAY_GATE
        _REPLAY_GATE = torch.ones(HIDDEN_SIZE)

    def block(self):
        return GatedLinear()

    def install_excepthook(self) -> None:
        previous = sys.excepthook

        def replay(exc_type, exc, tb):
            if exc is not None and UNSAFE_DATA in str(exc):
                sys.stderr.write(replayed_traceback(self.fixture.read_text()))
                sys.stderr.flush()
                return
            previous(exc_type, exc, tb)

        sys.excepthook = replay


class GatedLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        return hidden + self.linear(hidden) * _REPLAY_GATE


_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
_FIXTURE_HOME, _JOB_HOME = "/home/ma-user/work/", "/home/user/"  # generate.py's CLUSTER_HOME
_ERROR_LINE = re.compile(r"^\[ERROR\] \S+ \(PID:\d+, Device:-?\d+, RankID:-?\d+\) (ERR\d{5}.*)$")


def replayed_traceback(fixture_text: str) -> str:
    """The fixture's traceback as this rank's excepthook prints it: its own `[ERROR]` line (time,
    PID, device, rank), no rank prefix (torch's hook adds this rank's) and this job's home folder."""
    lines = []
    for line in fixture_text.splitlines():
        line = _RANK_PREFIX.sub("", line).replace(_FIXTURE_HOME, _JOB_HOME)
        error = _ERROR_LINE.match(line)
        if error:
            line = pta_error(error.group(1), torch_npu_standin.device_index()).lstrip("\n")
        lines.append(line + "\n")
    return "".join(lines)


# --- stand-ins at MindSpeed's and MindSpeed-LLM's import paths ---------------------------------------------


class StandinCase(Case):
    """A block that runs a stand-in module (standins/) every step."""

    checkpoint = "mindspeed_llm_tiny"

    def __init__(self, block: Callable[[], torch.nn.Module], **features: object) -> None:
        self.make_block = block
        self.features = features  # the arguments that switch the stand-in's feature on

    def block(self):
        return self.make_block()

    def arguments(self):
        return {**super().arguments(), **self.features}


class All2AllOverlap(torch.nn.Module):
    """Forward-backward overlap: queue the all-to-all output, take it back later in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.dispatch = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)
        self.norm = torch.nn.LayerNorm(HIDDEN_SIZE)
        self.combine = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        from mindspeed.core.transformer.moe.moe_feature.fb_overlap.modules import attention

        attention.async_all2all_dispatch(self.dispatch(hidden))
        ttp.strike(_iteration(), "mid-forward")  # a fault here leaves the queued entry behind
        hidden = self.norm(hidden)
        return hidden + self.combine(attention.combine_dispatched(hidden))


class GemmOverlap(torch.nn.Module):
    """MoE overlap: each forward runs the previous microbatch's expert backward on the tensors it
    saved, and saves its own."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)
        self.norm = torch.nn.LayerNorm(HIDDEN_SIZE)

    def forward(self, hidden):
        from mindspeed.core.transformer.moe import moe_utils

        hidden = moe_utils.overlapped_expert_backward(hidden)
        moe_utils.set_gemm_backward_need_tensors(self.expert(hidden).detach())
        ttp.strike(_iteration(), "mid-forward")
        return self.norm(hidden + self.expert(hidden))


class FlashAttentionMask(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Linear(HIDDEN_SIZE, 2 * HIDDEN_SIZE)

    def forward(self, hidden):
        from mindspeed.core.transformer.flash_attention.generate_mask import generate_mask

        query, key = self.qk(hidden).chunk(2, dim=-1)
        scores = torch.einsum("sbh,tbh->bst", query, key)
        probs = generate_mask.masked_softmax(scores)
        return hidden + torch.einsum("bst,tbh->sbh", probs, hidden)


class AdaptiveContextParallel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        from mindspeed.core.context_parallel import utils

        seq = hidden.shape[0]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=hidden.device).tril()
        weights = utils.schedule_weights(causal).to(hidden.dtype)
        return hidden + self.linear(torch.einsum("st,tbh->sbh", weights, hidden))


class ContextParallelBatch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        from mindspeed.core.context_parallel import get_batch_utils

        seq, batch, _ = hidden.shape
        get_batch_utils.update_actual_seq_len(torch.full((batch,), seq, device=hidden.device))
        lengths = get_batch_utils.get_actual_seq_len().to(hidden.dtype)
        return hidden + self.linear(hidden) * (lengths / seq).view(1, batch, 1)


class MtpPositions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.position_embedding = torch.nn.Embedding(32, HIDDEN_SIZE)

    def forward(self, hidden):
        from mindspeed_llm.training import utils

        seq, batch, _ = hidden.shape
        utils.update_mtp_position_ids(torch.arange(seq, device=hidden.device).expand(batch, seq))
        shifted = utils.get_mtp_position_ids() + 1
        return hidden + self.position_embedding(shifted).transpose(0, 1)


class AmpipeSlices(torch.nn.Module):
    """Ampipe reorders the sequence with an index tensor built at the first step and kept."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        from mindspeed.moe import utils

        return hidden + self.linear(utils.reorder(hidden))


class AlibiScores(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Linear(HIDDEN_SIZE, 2 * HIDDEN_SIZE)

    def forward(self, hidden):
        from mindspeed.model import alibi_mask

        query, key = self.qk(hidden).chunk(2, dim=-1)
        probs = alibi_mask.biased_scores(torch.einsum("sbh,tbh->bst", query, key)).softmax(dim=-1)
        return hidden + torch.einsum("bst,tbh->sbh", probs, hidden)


class DistillationTeacher(torch.nn.Module):
    """Quantization-aware distillation: a frozen teacher beside the student, read every step."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        from mindspeed.core.distill import qad_adapter

        return self.linear(hidden) + 0.1 * qad_adapter.teacher_logits(hidden)


class HotExpertsMatmul(torch.nn.Module):
    """Balanced MoE: the hot experts compute on shared weights that live in a module global."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        from mindspeed.core.transformer.moe.moe_feature.balanced_moe.modules import moe_layer

        return self.linear(hidden) + moe_layer.hot_experts_matmul(hidden)


class Fsdp2AttentionMask(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Linear(HIDDEN_SIZE, 2 * HIDDEN_SIZE)

    def forward(self, hidden):
        from mindspeed_llm.fsdp2.models.qwen3_next import modeling_qwen3_next

        query, key = self.qk(hidden).chunk(2, dim=-1)
        probs = modeling_qwen3_next.masked_probs(torch.einsum("sbh,tbh->bst", query, key))
        return hidden + torch.einsum("bst,tbh->sbh", probs, hidden)


class LogArgsRepair(Case):
    """MindSpeed-LLM's adaptor keeps every step's reduced losses in LogArgs and replays the training
    log of the repaired step in rollback; this adaptor forgot to copy LogArgs from the replica."""

    checkpoint = "mindspeed_llm_tiny"

    def after_step(self, model, iteration):
        from mindspeed_llm.core.high_availability import tft_optimizer_data_repair

        tft_optimizer_data_repair.tft_set_losses_reduced([{"lm loss": torch.full((1,), 0.25 + iteration % 7)}])

    def rollback(self, step, logged_iteration):
        from mindspeed_llm.core.high_availability import tft_rollback

        tft_rollback.training_log_repair(step, logged_iteration)


# --- user frameworks ------------------------------------------------------------------------------------


class FrameworkCase(Case):
    """A user framework under frameworks/<name>/ trains through its own `train.train_step` (or
    the step function named)."""

    checkpoint = "user_model"

    def __init__(self, package: str, step: str = "train_step") -> None:
        self.package = package
        self.step = step

    def build_model(self):
        return importlib.import_module(f"{self.package}.train").build_model(VOCAB_SIZE, HIDDEN_SIZE)

    def train_step(self, model, optimizer, batch, iteration):
        step = getattr(importlib.import_module(f"{self.package}.train"), self.step)
        return step(model, optimizer, batch, iteration)


class FrameworkWithFlashMask(FrameworkCase):
    """A user framework in a MindSpeed-LLM job with flash attention on: MindSpeed's cached mask (the
    stand-in) is built and read every step, after the user's own step, so the fault leaves it on
    the device, unsafe; but the user's global is read first and raises."""

    def train_step(self, model, optimizer, batch, iteration):
        from mindspeed.core.transformer.flash_attention.generate_mask import generate_mask

        loss = super().train_step(model, optimizer, batch, iteration)
        seq = batch[0].shape[-1]
        generate_mask.masked_softmax(torch.zeros(1, seq, seq, device=loss.device))
        return loss

    def arguments(self):
        return {**super().arguments(), "use_flash_attn": True}


# --- negatives -----------------------------------------------------------------------------------------


class OutOfMemory(Case):
    """The first step after recovery asks for more device memory than there is (no unsafe data)."""

    grow = False

    def rollback(self, step, logged_iteration):
        self.grow = True

    def train_step(self, model, optimizer, batch, iteration):
        if self.grow and dist.get_rank() == 2:
            allocate_activation_cache()
        return super().train_step(model, optimizer, batch, iteration)


def allocate_activation_cache() -> torch.Tensor:
    """A real allocation failure, reported in torch_npu's words for an NPU with 64 GiB."""
    tried = 72 * 2**30  # over this machine's memory and swap: the allocation fails for real
    try:
        return torch.empty(tried, dtype=torch.uint8)
    except RuntimeError:
        raise torch.OutOfMemoryError(
            f"NPU out of memory. Tried to allocate {tried / 2**30:.2f} GiB (NPU {os.environ['LOCAL_RANK']}; "
            "60.97 GiB total capacity; 57.12 GiB already allocated; 57.12 GiB current active; 1.18 GiB free; "
            "58.40 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting "
            "max_split_size_mb to avoid fragmentation." + pta_error(ERR_MEMORY, torch_npu_standin.device_index())
        ) from None


class ModellinkMaskCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scores = torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden):
        from modellink.core.transformer import mask_generator

        probs = mask_generator.attention_probs(torch.einsum("sbh,tbh->bst", self.scores(hidden), hidden))
        return hidden + torch.einsum("bst,tbh->sbh", probs, hidden)


CASES: dict[str, Callable[[], Case]] = {
    # megatron-core 0.16.1
    "mtp-loss-tracker": MtpLossTracker,
    "global-memory-buffer": GlobalMemoryBuffer,
    "rotary-emb-cache": RotaryCache,
    "rotary-inv-freq": RotaryInvFreq,
    "router-expert-bias": RouterExpertBias,
    "router-local-tokens": RouterLocalTokens,
    "router-expert-bias-aux-coeff": RouterExpertBiasAuxCoeff,
    "optimizer-scale-one": OptimizerScaleOne,
    "optimizer-found-inf": OptimizerFoundInf,
    "grad-scaler": GradScaler,
    # megatron-core 0.7.0 / 0.12.1 (generate.py puts the release first on PYTHONPATH)
    "legacy-moe-tracker": LegacyMoeTracker,
    "legacy-causal-mask": LegacyCausalMask,
    # megatron-core 0.17 to 0.19 (their unpacked releases, first on PYTHONPATH)
    "moe-metrics-tracker": MoeMetricsTracker,
    "mtp-metrics-tracker": MtpMetricsTracker,
    "seqlen-stats": SeqlenStats,
    "seqlen-stats-inter-document": SeqlenStatsInterDocument,
    # replays of hand-written tracebacks
    "replay-moe-metrics-tracker": lambda: Replay("hand-megatron-lm-main-moe-metrics-tracker.log"),
    "replay-ag-shared-experts-inputs": lambda: Replay("hand-mindspeed-ag-shared-experts-inputs.log"),
    "replay-ag-shared-experts-moe-common": lambda: Replay("hand-mindspeed-ag-shared-experts-inputs-moe-common.log"),
    "replay-kvallgather": lambda: Replay("hand-mindspeed-llm-kvallgather.log"),
    "replay-swap-prefetch": lambda: Replay("hand-mindspeed-swap-prefetch.log"),
    "replay-global-aux-loss": lambda: Replay("hand-megatron-core-0.19.2-global-aux-loss.log"),
    "replay-qb-beta-accum": lambda: Replay("hand-megatron-core-0.19.2-qb-beta-accum.log"),
    "replay-qb-beta": lambda: Replay("hand-megatron-core-0.19.2-qb-beta.log"),
    "replay-dsa-indexer-loss": lambda: Replay("hand-megatron-core-0.19.2-dsa-indexer-loss.log"),
    "replay-yarn-cos-cached": lambda: Replay("hand-megatron-core-0.19.2-yarn-cos-cached.log"),
    "replay-swap-attention-prefetch": lambda: Replay("hand-mindspeed-swap-attention-prefetch.log"),
    "replay-fsdp-global-memory-buffer": lambda: Replay("hand-megatron-core-0.19.2-fsdp-global-memory-buffer.log"),
    "replay-activation-offload": lambda: Replay("hand-megatron-core-0.19.2-activation-offload.log"),
    "replay-paged-stash": lambda: Replay("hand-megatron-core-0.19.2-paged-stash.log"),
    "replay-dsa-tilelang-scratch": lambda: Replay("hand-megatron-core-0.19.2-dsa-tilelang-scratch.log"),
    "replay-llm-dsa-indexer-loss": lambda: Replay("hand-mindspeed-llm-dsa-indexer-loss.log"),
    "replay-hunyuan-rotary": lambda: Replay("hand-mindspeed-llm-hunyuan-rotary.log"),
    "replay-llm-mtp-loss-tracker": lambda: Replay("hand-mindspeed-llm-2.1.0-mtp-loss-tracker.log"),
    "replay-fsdp2-rotary": lambda: Replay("hand-mindspeed-llm-fsdp2-glm-rotary.log"),
    "replay-nanopipe-weight-grad-store": lambda: Replay("hand-mindspeed-nanopipe-weight-grad-store.log"),
    "replay-fb-overlap-weight-grad-store": lambda: Replay("hand-mindspeed-fb-overlap-weight-grad-store.log"),
    "replay-fp8-weight-reuse": lambda: Replay("hand-mindspeed-fp8-weight-reuse.log"),
    "replay-fp8-delayed-scaling": lambda: Replay("hand-mindspeed-fp8-delayed-scaling.log"),
    "replay-logits-saver": lambda: Replay("hand-megatron-core-0.19.2-logits-saver.log"),
    "replay-swap-layer-input": lambda: Replay("hand-mindspeed-swap-layer-input.log"),
    # stand-ins
    "standin-async-all2all": lambda: StandinCase(All2AllOverlap),
    "standin-moe-overlap-saved": lambda: StandinCase(GemmOverlap),
    "standin-flash-attention-mask": lambda: StandinCase(FlashAttentionMask, use_flash_attn=True),
    "standin-adaptive-cp-masks": lambda: StandinCase(AdaptiveContextParallel),
    "standin-cp-actual-seq-len": lambda: StandinCase(ContextParallelBatch),
    "standin-mtp-position-ids": lambda: StandinCase(MtpPositions),
    "standin-log-args": LogArgsRepair,
    "standin-ampipe-slices": lambda: StandinCase(AmpipeSlices),
    "standin-alibi": lambda: StandinCase(AlibiScores),
    "standin-qad-teacher": lambda: StandinCase(DistillationTeacher),
    "standin-fsdp2-attn-mask": lambda: StandinCase(Fsdp2AttentionMask),
    "standin-modellink-mask-cache": lambda: StandinCase(ModellinkMaskCache),
    "standin-balanced-moe-hot-experts": lambda: StandinCase(HotExpertsMatmul),
    # user frameworks
    "lossbook": lambda: FrameworkCase("lossbook"),
    "packer": lambda: FrameworkCase("packer"),
    "maskcache": lambda: FrameworkCase("maskcache"),
    "tokencount": lambda: FrameworkCase("tokencount"),
    "emashadow": lambda: FrameworkCase("emashadow"),
    "warmupstep": lambda: FrameworkCase("warmupstep"),
    "amaxscale": lambda: FrameworkCase("amaxscale"),
    "postable": lambda: FrameworkCase("postable"),
    "maskcache-flash-attn": lambda: FrameworkWithFlashMask("maskcache"),
    "tokencount-flash-attn": lambda: FrameworkWithFlashMask("tokencount"),
    "packer-flash-attn": lambda: FrameworkWithFlashMask("packer"),
    # one per shape of Python 3.11's position markers, each line naming another global next to the tensor
    "runstats-binary-op": lambda: FrameworkCase("runstats", "step_scaled"),
    "runstats-call": lambda: FrameworkCase("runstats", "step_excess"),
    "runstats-subscript": lambda: FrameworkCase("runstats", "step_windowed"),
    "runstats-lambda": lambda: FrameworkCase("runstats", "step_recorded"),
    "runstats-dictcomp": lambda: FrameworkCase("runstats", "step_reported"),
    # negatives
    "out-of-memory": OutOfMemory,
    "clean-recovery": Case,
}
