"""Stand-in for the corpus at MindSpeed's import path (not MindSpeed's code): balanced MoE's shared hot-expert weights."""

import torch


class SharedParamsForHotExperts:
    def __init__(self, weight1_shape, device):
        self.shared_weight1 = torch.nn.Parameter(torch.zeros(weight1_shape, device=device))


_GLOBAL_SHARED_PARAMS_FOR_HOT_EXPERTS = None


def init_global_shared_params_for_hot_experts(weight1_shape, device):
    global _GLOBAL_SHARED_PARAMS_FOR_HOT_EXPERTS
    if _GLOBAL_SHARED_PARAMS_FOR_HOT_EXPERTS is None:
        _GLOBAL_SHARED_PARAMS_FOR_HOT_EXPERTS = SharedParamsForHotExperts(weight1_shape, device)


def get_shared_params_for_hot_experts():
    return _GLOBAL_SHARED_PARAMS_FOR_HOT_EXPERTS


def hot_experts_matmul(tokens):
    """The hot experts' grouped matmul, on weights each step's broadcast writes (a write that leaves them unsafe)."""
    init_global_shared_params_for_hot_experts((tokens.shape[-1], tokens.shape[-1]), tokens.device)
    return tokens.matmul(get_shared_params_for_hot_experts().shared_weight1)
