"""Sample recovery adaptor in the legacy shape: one file inside the mindio_ttp wheel.

Up to MindSpeed-LLM 2.2 (ModelLink before it), MindIO TTP shipped its adaptor for Megatron-based
frameworks as ``mindio_ttp/adaptor/modellink_adaptor.py``, with the rollback and both repair
functions in this one file. Written for unsafe-doctor's samples and tests in that shape: the
function names and parameters are the adaptor's, the bodies are a minimal stand-in.
"""

import torch
from megatron.core import mpu
from megatron.training import get_args

from mindio_ttp.adaptor.tft_replica_group import build_repair_group, get_repair_group

OPTIMIZER = 2  # train_args: (forward_step_func, model, optimizer, ...)


def feature_rollback():
    """Forget per-step state so the replayed step starts clean."""
    args = get_args()
    if getattr(args, "num_experts", None):
        # The MoE loss log under its megatron-core <= 0.7 name only.
        mpu._MOE_AUX_LOSSES_LOGGING_TRACKER = {}


def send_rank_repair(src_ranks, dest_ranks, optim_idxs, step, rank_list, train_args):
    build_repair_group(rank_list)
    for dest_rank, optim_idx in zip(dest_ranks, optim_idxs):
        train_args[OPTIMIZER].send_optim_param_state(dest_rank, get_repair_group(), optim_idx)


def recv_rank_repair(src_ranks, dest_ranks, optim_idxs, step, need_rebuild, rank_list, train_args):
    build_repair_group(rank_list)
    for src_rank, optim_idx in zip(src_ranks, optim_idxs):
        train_args[OPTIMIZER].recv_and_load_optim_param_state(src_rank, get_repair_group(), step, optim_idx)
