"""A tiny MoE language model around megatron-core's real ``TopKRouter``.

The router is megatron-core 0.16.1's own class, so its z-loss goes through the real
``apply_z_loss -> save_to_aux_losses_tracker`` path into ``_MOE_LAYER_WISE_LOGGING_TRACKER``.
Everything else (embedding, dense experts, head) is a few lines of plain torch.
"""

import torch
import torch.nn.functional as F

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

# Two shims for running megatron-core's router on CPU:
# - the router moves its weight to torch.cuda.current_device(); here "the device" is the CPU,
#   the way torch_npu's transfer_to_npu points torch.cuda at the NPU;
# - megatron-core 0.16.1 reads te_general_gemm even when Transformer Engine is not installed.
torch.cuda.current_device = lambda: "cpu"
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None

VOCAB_SIZE = 64
HIDDEN_SIZE = 16
NUM_LAYERS = 2
NUM_EXPERTS = 4


def transformer_config() -> TransformerConfig:
    return TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=HIDDEN_SIZE, num_attention_heads=2,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=2, moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_z_loss_coeff=1e-3, use_cpu_initialization=True,
    )


class MoELayer(torch.nn.Module):
    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__()
        self.router = TopKRouter(config, ProcessGroupCollection.use_mpu_process_groups())
        self.router.set_layer_number(layer_number)
        self.experts = torch.nn.ModuleList(
            torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE) for _ in range(NUM_EXPERTS))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        probs, _ = self.router(hidden)
        tokens = hidden.reshape(-1, HIDDEN_SIZE)
        output = sum(probs[:, e:e + 1] * expert(tokens) for e, expert in enumerate(self.experts))
        return hidden + output.reshape(hidden.shape)


class TinyMoEModel(torch.nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB_SIZE, HIDDEN_SIZE)
        self.layers = torch.nn.ModuleList(MoELayer(config, i + 1) for i in range(NUM_LAYERS))
        self.output_layer = torch.nn.Linear(HIDDEN_SIZE, VOCAB_SIZE)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens).transpose(0, 1).contiguous()  # [seq, batch, hidden]
        for layer in self.layers:
            hidden = layer(hidden)
        logits = self.output_layer(hidden).transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1))
