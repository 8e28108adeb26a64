"""Stand-in for the corpus at MindSpeed-LLM's import path (not its code): per-batch MTP inputs."""

import torch

_MTP_POSITION_ID = None


def update_mtp_position_ids(position_ids):
    """Keep this batch's position ids; unchanged ones keep the tensor the MTP layers already have."""
    global _MTP_POSITION_ID
    if _MTP_POSITION_ID is not None and torch.equal(_MTP_POSITION_ID, position_ids):
        return
    _MTP_POSITION_ID = position_ids


def get_mtp_position_ids():
    return _MTP_POSITION_ID
