"""Loss meters: each loss term of the steps since the last log line, summed on the device."""

import torch
import torch.distributed as dist

LOSS_METERS: dict[str, torch.Tensor] = {}


def add_loss(name: str, value: torch.Tensor) -> None:
    meter = LOSS_METERS.get(name)
    if meter is None:
        LOSS_METERS[name] = value.detach().clone()
    else:
        meter += value.detach()


def report_and_clear(iteration: int, steps: int) -> None:
    """Print the average of every meter over the last `steps` steps, then start again."""
    averages = " | ".join(f"{name} {meter.item() / steps:.4f}" for name, meter in LOSS_METERS.items())
    if dist.get_rank() == 0:
        print(f"lossbook step {iteration:6d} | {averages}", flush=True)
    LOSS_METERS.clear()
