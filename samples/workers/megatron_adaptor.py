"""MindIO recovery callbacks for the Megatron sample, shaped like MindSpeed-LLM's.

Function names, call order and log messages follow ``mindspeed_llm/core/high_availability``
(``tft_stop_clean.py``, ``tft_optimizer_data_repair.py``, ``tft_rollback.py``), trimmed to what
this tiny model needs. Like MindSpeed-LLM up to master, ``feature_rollback`` resets the MoE
tracker under its megatron-core <= 0.7 name, ``parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER``,
which megatron-core 0.16.1 no longer reads: the real tracker,
``moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER``, keeps its unsafe tensor.
"""

from __future__ import annotations

import time
from logging import getLogger

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

import megatron_training

ttp_logger = getLogger(__name__)

MODEL_INDEX, OPTIM_INDEX, SCHEDULER_INDEX, TRAIN_DATA_INDEX = 1, 2, 3, 4
RT_SEND = 0
UCE_HIGH_LEVEL = 3


class LogArgs:
    losses_reduced_ = None
    grad_norm_ = None
    num_zeros_in_grad_ = None


def set_log_args(grad_norm, num_zeros_in_grad) -> None:
    LogArgs.grad_norm_ = grad_norm
    LogArgs.num_zeros_in_grad_ = num_zeros_in_grad


def tft_set_losses_reduced(losses) -> None:
    LogArgs.losses_reduced_ = losses


# --- stop / clean ------------------------------------------------------------------------------

def stop_callback(train_args, ctx):
    import torch_npu
    torch_npu.npu.stop_device(torch_npu.npu.current_device())


def clean_callback(is_uce_error: bool, train_args, ctx):
    import torch_npu
    from torch_npu.npu._recovery import update_npu_tensor_to_safe
    device = torch_npu.npu.current_device()
    rank = dist.get_rank()
    start_time = time.time()
    if is_uce_error:
        check_memory_result = torch_npu.npu.check_uce_in_memory(device)
        ttp_logger.info(f"rank {rank} check uce memory result: {check_memory_result}")
        if check_memory_result == UCE_HIGH_LEVEL:
            train_args[OPTIM_INDEX].update_npu_tensor_to_safe()
            for model in train_args[MODEL_INDEX]:
                for param in model.parameters():
                    update_npu_tensor_to_safe(param.data)
    torch_npu.npu.restart_device(device)
    ttp_logger.info(f"[clean] rank:{rank}, type:retry, cost:{time.time() - start_time:.3f}s, ret:0")
    return 0


# --- repair ------------------------------------------------------------------------------------

def repair_callback(step: int, need_rebuild: bool, error_ranks: list, repair_info: dict, train_args, ctx):
    t1 = time.time()
    rank = dist.get_rank()
    optim_idxs = repair_info.get("type", 0)
    repair_type = repair_info.get("repair_type", None)
    src_ranks = repair_info.get("src", None)
    dest_ranks = repair_info.get("dst", None)
    rank_list = repair_info.get("rank_list", None)
    ttp_logger.info("[repair] rank %s, repair type:%s, src ranks:%s, dst ranks:%s, "
                    "rank list:%s, optim idxs:%s, step:%s",
                    rank, repair_type, src_ranks, dest_ranks, rank_list, optim_idxs, step)
    if repair_type == RT_SEND:
        send_rank_repair(src_ranks, dest_ranks, optim_idxs, rank_list, train_args)
    else:
        recv_rank_repair(src_ranks, dest_ranks, optim_idxs, rank_list, train_args)
    ttp_logger.info(f"[repair] rank {rank} repair total time consumed:{time.time() - t1:.3f}s")


def send_rank_repair(src_ranks: list, dest_ranks: list, optim_idxs: list, rank_list: list, train_args):
    t1 = time.time()
    args = megatron_training.get_args()
    for dest_rank in dest_ranks:
        dist.send(torch.tensor([args.iteration, args.consumed_train_samples,
                                train_args[SCHEDULER_INDEX].num_steps]), dst=dest_rank)
        for tensor in train_args[OPTIM_INDEX].state_tensors():
            dist.send(tensor, dst=dest_rank)
        dist.send(torch.tensor([LogArgs.grad_norm_]), dst=dest_rank)
        dist.send(LogArgs.losses_reduced_[0]["lm loss"], dst=dest_rank)
    ttp_logger.info(f"[repair] rank {dist.get_rank()} send total time consumed:{time.time() - t1:.3f}s")


def recv_rank_repair(src_ranks: list, dest_ranks: list, optim_idxs: list, rank_list: list, train_args):
    args = megatron_training.get_args()
    for src_rank in src_ranks:
        counters = torch.zeros(3, dtype=torch.long)
        dist.recv(counters, src=src_rank)
        args.iteration, args.consumed_train_samples, train_args[SCHEDULER_INDEX].num_steps = counters.tolist()
        for tensor in train_args[OPTIM_INDEX].state_tensors():
            received = torch.empty(tensor.shape, dtype=tensor.dtype)
            dist.recv(received, src=src_rank)
            tensor.copy_(received)
        grad_norm = torch.zeros(1)
        dist.recv(grad_norm, src=src_rank)
        LogArgs.grad_norm_ = grad_norm.item()
        lm_loss = torch.zeros(())
        dist.recv(lm_loss, src=src_rank)
        LogArgs.losses_reduced_ = [{"lm loss": lm_loss}]
    ttp_logger.info(f"rank:{dist.get_rank()} successfully load checkpoint to memory")


# --- rollback ----------------------------------------------------------------------------------

def rollback_callback(step: int, train_args, ctx):
    t1 = time.time()
    args = megatron_training.get_args()
    rank = dist.get_rank()
    args.consumed_train_samples = step * args.global_batch_size
    feature_rollback()
    ttp_logger.info(f"rank:{rank} successfully gather and rollback at iteration {step}")
    train_args[TRAIN_DATA_INDEX].rebuild(args.consumed_train_samples)
    dist.barrier()
    training_log_repair(step, train_args)
    args.iteration = step
    ttp_logger.info(f"[rollback] rank {rank} rollback total time consumed:{time.time() - t1:.3f}s")


def feature_rollback():
    args = megatron_training.get_args()
    # fix megatron global buffer unsafe data
    if hasattr(mpu, "destroy_global_memory_buffer") and hasattr(mpu, "_set_global_memory_buffer"):
        mpu.destroy_global_memory_buffer()
        mpu._set_global_memory_buffer()
    if args.num_experts:
        mpu._MOE_AUX_LOSSES_LOGGING_TRACKER = {}


def training_log_repair(iteration: int, train_args):
    """Replay the training log of the step that finished before the fault but was not logged."""
    args = megatron_training.get_args()
    losses_reduced = LogArgs.losses_reduced_
    if iteration == args.iteration or losses_reduced is None:
        ttp_logger.info(f"rank:{args.rank} Skip the train log repair. repair_step:{iteration} "
                        f"args.iteration:{args.iteration}.")
        return
    loss_scale = train_args[OPTIM_INDEX].get_loss_scale().item()
    learning_rate = train_args[OPTIM_INDEX].param_groups[0]["lr"]
    ttp_logger.info(f"rank:{args.rank} repair training log at iteration: {iteration}")
    megatron_training.training_log(losses_reduced[0], {}, learning_rate, None, iteration,
                                   loss_scale, False, 0, LogArgs.grad_norm_, None, LogArgs.num_zeros_in_grad_)
