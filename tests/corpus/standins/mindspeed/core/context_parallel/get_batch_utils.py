"""Stand-in for the corpus at MindSpeed's import path (not MindSpeed's code): per-batch lengths."""

import torch

_ACTUAL_SEQ_LEN = None


def update_actual_seq_len(actual_seq_len):
    """Keep the lengths of this batch; unchanged lengths keep the tensor attention already has."""
    global _ACTUAL_SEQ_LEN
    if _ACTUAL_SEQ_LEN is not None and torch.equal(_ACTUAL_SEQ_LEN, actual_seq_len):
        return
    _ACTUAL_SEQ_LEN = actual_seq_len


def get_actual_seq_len():
    return _ACTUAL_SEQ_LEN
