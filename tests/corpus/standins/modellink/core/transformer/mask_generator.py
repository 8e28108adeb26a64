"""Stand-in for the corpus at ModelLink 1.0.RC3's import path (not its code): the cached attention mask."""

import torch

_MASK_CACHE = None


def get_attention_mask(size, device):
    """Built at the first call, on the device, and returned to every later one."""
    global _MASK_CACHE
    if _MASK_CACHE is None:
        _MASK_CACHE = torch.triu(torch.ones((size, size), device=device, dtype=torch.bool), diagonal=1)
    return _MASK_CACHE


def attention_probs(scores):
    mask = get_attention_mask(scores.shape[-1], scores.device)
    return scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
