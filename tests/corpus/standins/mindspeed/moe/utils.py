"""Stand-in for the corpus at MindSpeed's import path (not MindSpeed's code): ampipe's cached slice order."""

import torch

ampipe_slices_map = {}


def get_slice_indices_from_order_to_disorder(seq_length, device):
    """The sequence's slice order, built once and kept for every later step."""
    if ampipe_slices_map.get('order_to_disorder') is not None:
        return ampipe_slices_map.get('order_to_disorder')
    output = torch.arange(seq_length, device=device).flip(0)
    ampipe_slices_map['order_to_disorder'] = output
    return output


def reorder(hidden):
    indices = get_slice_indices_from_order_to_disorder(hidden.shape[0], hidden.device)
    return torch.index_select(hidden, 0, indices)
