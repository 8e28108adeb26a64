"""The process group the repair traffic goes over (sample, legacy shape)."""

import torch

_REPAIR_GROUP = None


def build_repair_group(rank_list):
    global _REPAIR_GROUP
    _REPAIR_GROUP = torch.distributed.new_group(sorted(rank_list), use_local_synchronization=True)


def get_repair_group():
    return _REPAIR_GROUP
