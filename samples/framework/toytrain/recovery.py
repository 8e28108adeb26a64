"""toytrain's recovery adaptor for MindIO TFT: the stop, clean, repair and rollback callbacks.

MindIO calls them with ``train_args``, the positional arguments of the decorated
``toytrain.train.train``: ``(model, optimizer, data_iterator, config)``. Like most framework
adaptors, they restore the parameters and the optimizer state and nothing else; the tensors in
``toytrain.state`` are left as the fault left them.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MODEL_INDEX, OPTIM_INDEX, DATA_INDEX, CONFIG_INDEX = 0, 1, 2, 3
RT_SEND = 0  # mindio_ttp RepairType: this rank sends to the faulty ranks
UCE_HIGH_LEVEL = 3  # check_uce_in_memory: persistent memory was hit


def stop_callback(train_args, ctx):
    import torch_npu
    torch_npu.npu.stop_device(torch_npu.npu.current_device())


def clean_callback(is_uce_error: bool, train_args, ctx) -> int:
    import torch_npu
    from torch_npu.npu._recovery import update_npu_tensor_to_safe
    device = torch_npu.npu.current_device()
    if is_uce_error:
        result = torch_npu.npu.check_uce_in_memory(device)
        logger.info(f"rank {dist.get_rank()} check uce memory result: {result}")
        if result == UCE_HIGH_LEVEL:
            for tensor in replicated_tensors(train_args):
                update_npu_tensor_to_safe(tensor)
    torch_npu.npu.restart_device(device)
    return 0


def repair_callback(step: int, need_rebuild: bool, error_ranks: list, repair_info: dict, train_args, ctx):
    src_ranks, dest_ranks = repair_info["src"], repair_info["dst"]
    optim_idxs, rank_list = repair_info["type"], repair_info["rank_list"]
    logger.info(f"[repair] rank {dist.get_rank()}, repair type:{repair_info['repair_type']}, src ranks:{src_ranks}, "
                f"dst ranks:{dest_ranks}, rank list:{rank_list}, optim idxs:{optim_idxs}, step:{step}")
    if repair_info["repair_type"] == RT_SEND:
        send_rank_repair(src_ranks, dest_ranks, optim_idxs, rank_list, train_args)
    else:
        recv_rank_repair(src_ranks, dest_ranks, optim_idxs, rank_list, train_args)


def send_rank_repair(src_ranks: list, dest_ranks: list, optim_idxs: list, rank_list: list, train_args):
    repair_group = dist.new_group(rank_list, use_local_synchronization=True)
    for dest_rank in dest_ranks:
        for tensor in replicated_tensors(train_args):
            dist.send(tensor, dst=dest_rank, group=repair_group)


def recv_rank_repair(src_ranks: list, dest_ranks: list, optim_idxs: list, rank_list: list, train_args):
    repair_group = dist.new_group(rank_list, use_local_synchronization=True)
    for src_rank in src_ranks:
        for tensor in replicated_tensors(train_args):
            received = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            dist.recv(received, src=src_rank, group=repair_group)
            tensor.copy_(received)


def rollback_callback(step: int, train_args, ctx):
    train_args[CONFIG_INDEX].iteration = step
    train_args[DATA_INDEX].rebuild(step)
    feature_rollback()
    logger.info(f"[rollback] rank {dist.get_rank()} rolled back to step {step}")


def feature_rollback():
    """Re-initialise framework state that does not depend on past steps (none registered yet)."""


def replicated_tensors(train_args) -> list[torch.Tensor]:
    """Parameters and optimizer state, in the same order on every rank."""
    model, optimizer = train_args[MODEL_INDEX], train_args[OPTIM_INDEX]
    tensors = []
    for param in model.parameters():
        tensors.append(param.data)
        param_state = optimizer.state[param]
        tensors.extend(param_state[key] for key in sorted(param_state) if key != "step")
    return tensors
