"""Stand-in for the corpus at MindSpeed-LLM's import path (not its code): the FSDP2 model's cached mask."""

import torch

_GLOBAL_ATTN_MASK = None


def get_attention_mask_in_transformers(size, device):
    """A causal mask built at the first call and handed to every later one."""
    global _GLOBAL_ATTN_MASK
    if _GLOBAL_ATTN_MASK is not None:
        return _GLOBAL_ATTN_MASK
    _GLOBAL_ATTN_MASK = torch.triu(torch.ones((size, size), device=device, dtype=torch.bool), diagonal=1)
    return _GLOBAL_ATTN_MASK


def masked_probs(scores):
    attention_mask = get_attention_mask_in_transformers(scores.shape[-1], scores.device)
    return scores.masked_fill(attention_mask, float("-inf")).softmax(dim=-1)
