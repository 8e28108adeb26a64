"""Delayed scaling: activations are quantised with the largest |x| seen in earlier steps."""

import torch

FP8_MAX = 448.0
_AMAX = None


def init_amax(device: torch.device) -> None:
    global _AMAX
    _AMAX = torch.full((), 1.0, device=device)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """Round x to the fp8 grid of the current scale (straight-through gradient), then widen the
    running maximum for the next steps."""
    global _AMAX
    scale = FP8_MAX / _AMAX
    quantized = torch.clamp(x * scale, -FP8_MAX, FP8_MAX).round() / scale
    _AMAX = torch.maximum(_AMAX, x.detach().abs().max())
    return x + (quantized - x).detach()
