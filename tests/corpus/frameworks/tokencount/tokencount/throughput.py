"""Non-padding tokens of the current step, counted on the device and reported once per step."""

import time

import torch
import torch.distributed as dist

_STEP_TOKENS = None
_STEP_STARTED = [time.time()]


def init_counter(device: torch.device) -> None:
    global _STEP_TOKENS
    _STEP_TOKENS = torch.zeros((), dtype=torch.int64, device=device)


@torch.no_grad()
def count_tokens(tokens: torch.Tensor, pad_token: int) -> None:
    _STEP_TOKENS.add_((tokens != pad_token).sum())


def log_throughput(iteration: int) -> None:
    elapsed, _STEP_STARTED[0] = time.time() - _STEP_STARTED[0], time.time()
    if dist.get_rank() == 0:
        print(f"tokencount step {iteration:6d} | {_STEP_TOKENS.item() / elapsed:10.1f} tokens/s on rank 0", flush=True)
    _STEP_TOKENS.zero_()
