"""Shadow weights: an exponential moving average of every parameter, updated after each step."""

import torch

SHADOW_PARAMS: dict[str, torch.Tensor] = {}
EMA_DECAY = 0.999


def init_shadow(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        SHADOW_PARAMS[name] = param.detach().clone()


@torch.no_grad()
def update_shadow(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        SHADOW_PARAMS[name].lerp_(param, 1.0 - EMA_DECAY)
