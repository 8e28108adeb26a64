import functools

import torch


@functools.lru_cache(maxsize=16)
def causal_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    """True above the diagonal: positions a token may not attend to."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(diagonal=1)
