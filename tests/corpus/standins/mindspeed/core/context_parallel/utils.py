"""Stand-in for the corpus at MindSpeed's import path (not MindSpeed's code): adaptive CP caches."""

CACHED_GRID_MASK = None


def get_grid_mask(attn_mask):
    global CACHED_GRID_MASK
    if CACHED_GRID_MASK is None:
        CACHED_GRID_MASK = attn_mask.clone()
    return CACHED_GRID_MASK


def schedule_weights(attn_mask):
    grid_mask = get_grid_mask(attn_mask)
    return grid_mask / grid_mask.sum(dim=-1, keepdim=True)
