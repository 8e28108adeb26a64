"""One device buffer reused by every step for packing; reallocated when a batch needs more."""

import torch

_PACK_BUFFER = None


def get_pack_buffer(numel: int, device: torch.device) -> torch.Tensor:
    global _PACK_BUFFER
    if _PACK_BUFFER is None or _PACK_BUFFER.numel() < numel:
        _PACK_BUFFER = torch.empty(numel, device=device)
    return _PACK_BUFFER
