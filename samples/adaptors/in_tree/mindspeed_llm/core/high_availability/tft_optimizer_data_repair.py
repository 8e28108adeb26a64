"""Sample repair callbacks in the in-tree shape of MindSpeed-LLM 26.x.

The rank parameters are parallel lists with one entry per (source, destination, optimizer index);
a pair repeats once per optimizer (dense and expert). Written for unsafe-doctor's samples and tests.
"""

from .tft_replica_group import build_repair_group, get_repair_group

RT_SEND = 0
OPTIMIZER = 2  # train_args: (forward_step_func, model, optimizer, ...)


def repair_callback(step, need_rebuild, error_ranks, repair_info, train_args, ctx):
    lists = (repair_info["src"], repair_info["dst"], repair_info["type"], repair_info["rank_list"])
    if repair_info["repair_type"] == RT_SEND:
        send_rank_repair(*lists, train_args)
    else:
        recv_rank_repair(*lists, train_args)


def send_rank_repair(src_ranks: list, dest_ranks: list, optim_idxs: list, rank_list: list, train_args):
    build_repair_group(rank_list)
    group = get_repair_group()
    for dest_rank, optim_idx in zip(dest_ranks, optim_idxs):
        train_args[OPTIMIZER].send_optim_param_state(dest_rank, group, optim_idx)


def recv_rank_repair(src_ranks: list, dest_ranks: list, optim_idxs: list, rank_list: list, train_args):
    build_repair_group(rank_list)
    group = get_repair_group()
    for src_rank, optim_idx in zip(src_ranks, optim_idxs):
        train_args[OPTIMIZER].recv_and_load_optim_param_state(src_rank, group, optim_idx)
