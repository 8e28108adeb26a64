"""Stand-in for the corpus at MindSpeed's import path (not MindSpeed's code): the cached mask."""

import torch

_GLOBAL_ATTN_MASK = None


def get_attention_mask(seq_length, device):
    global _GLOBAL_ATTN_MASK
    if _GLOBAL_ATTN_MASK is None:
        _GLOBAL_ATTN_MASK = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(diagonal=1)
    return _GLOBAL_ATTN_MASK


def masked_softmax(scores):
    attention_mask = get_attention_mask(scores.shape[-1], scores.device)
    return scores.masked_fill(attention_mask, -10000.0).softmax(dim=-1)
