"""Module-level tensors that toytrain keeps between training steps.

Both live on the training device and belong neither to the model nor to the optimizer, so a
recovery adaptor that restores only those two leaves them exactly as a hardware fault left them.
"""

from __future__ import annotations

import torch

LOSS_LOG: dict[str, torch.Tensor] = {}
"""Scenario 1: this step's losses, summed for logging and zeroed after every step."""

_EMA_GRAD_NORM: torch.Tensor | None = None
"""Scenario 2: running average of the gradient norm. Every step clips its gradients against it and
then updates it from its previous value, so it carries information from step to step."""


def init_state(device: torch.device | str) -> None:
    global _EMA_GRAD_NORM
    _EMA_GRAD_NORM = torch.ones((), device=device)
    LOSS_LOG.clear()


def record_loss(name: str, loss: torch.Tensor) -> None:
    if name not in LOSS_LOG:
        LOSS_LOG[name] = torch.zeros((), device=loss.device)
    LOSS_LOG[name] += loss.detach()


def reset_loss_log() -> None:
    for value in LOSS_LOG.values():
        value.zero_()
