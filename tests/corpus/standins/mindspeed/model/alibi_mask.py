"""Stand-in for the corpus at MindSpeed's import path (not MindSpeed's code): the cached ALiBi bias."""

import torch


class AlibiForFusionAttnSingleton:
    _alibi_tensor_args = None
    _alibi_tensor = None

    @classmethod
    def get_alibi_tensor_for_fusion_attn(cls, max_seq_len, device):
        """Built at the first call, then kept for every step with the same length."""
        if cls._alibi_tensor is None or cls._alibi_tensor_args != max_seq_len:
            positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
            cls._alibi_tensor = -(positions.view(1, -1) - positions.view(-1, 1)).abs() * 0.5
            cls._alibi_tensor_args = max_seq_len
        return cls._alibi_tensor


def biased_scores(scores):
    AlibiForFusionAttnSingleton.get_alibi_tensor_for_fusion_attn(scores.shape[-1], scores.device)
    return scores + AlibiForFusionAttnSingleton._alibi_tensor.unsqueeze(0)
