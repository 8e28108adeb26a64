"""Sample of a team's own recovery adaptor, with its own function names.

MindIO calls whatever functions the framework registers, so a home-grown adaptor seldom uses
MindSpeed-LLM's names: give them to ``unsafe-doctor fix`` with
``--function rollback=reset_step_state,send=send_to_repaired_rank,recv=receive_from_replica``.
The repair functions take the same list-valued rank parameters as MindSpeed-LLM's and build their
own process group. Written for unsafe-doctor's samples and tests.
"""

import functools
import logging
import time

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def timed(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        started = time.time()
        result = function(*args, **kwargs)
        logger.info("%s took %.3f s", function.__name__, time.time() - started)
        return result

    return wrapper


@timed
def reset_step_state():
    """Nothing of the interrupted step is kept (no per-step state registered yet)."""


@timed
def send_to_repaired_rank(src_ranks, dest_ranks, optim_idxs, rank_list, train_args):
    group = dist.new_group(rank_list, use_local_synchronization=True)
    model = train_args[0]
    for dest_rank in dict.fromkeys(dest_ranks):
        for param in model.parameters():
            dist.send(param.data, dst=dest_rank, group=group)
    return 0


@timed
def receive_from_replica(src_ranks, dest_ranks, optim_idxs, rank_list, train_args):
    group = dist.new_group(rank_list, use_local_synchronization=True)
    if not src_ranks:
        logger.warning("nothing to receive")
        return 1
    model = train_args[0]
    for src_rank in dict.fromkeys(src_ranks):
        for param in model.parameters():
            received = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            dist.recv(received, src=src_rank, group=group)
            param.data.copy_(received)
    return 0
