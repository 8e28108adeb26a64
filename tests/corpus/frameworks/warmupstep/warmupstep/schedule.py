"""The optimizer step count as a device tensor: the warmup factor needs no host sync per step."""

import torch

_STEP_COUNT = None
WARMUP_STEPS = 2000


def init_step_count(start: int, device: torch.device) -> None:
    global _STEP_COUNT
    _STEP_COUNT = torch.full((), float(start), device=device)


def warmup_factor() -> torch.Tensor:
    return torch.clamp((_STEP_COUNT + 1.0) / WARMUP_STEPS, max=1.0)


def advance() -> None:
    _STEP_COUNT.add_(1.0)
