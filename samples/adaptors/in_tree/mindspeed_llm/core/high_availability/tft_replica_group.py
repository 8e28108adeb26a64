"""The process groups the repair traffic goes over (sample, in-tree shape)."""

import torch

_REPAIR_GROUP = None
_REPAIR_GROUP_GLOO = None


def build_repair_group(rank_list):
    global _REPAIR_GROUP, _REPAIR_GROUP_GLOO
    _REPAIR_GROUP = torch.distributed.new_group(rank_list, use_local_synchronization=True)
    _REPAIR_GROUP_GLOO = torch.distributed.new_group(rank_list, use_local_synchronization=True, backend="gloo")


def get_repair_group(use_gloo=False):
    return _REPAIR_GROUP_GLOO if use_gloo else _REPAIR_GROUP
