"""Loss statistics a trainer keeps on the device between steps.

Each reader's line holds a config value or a display name next to the tensor it reads, so what
raised is told by Python's position markers, not by the line alone.
"""

import torch

WINDOW = 4
_CONFIG = {"floor": 0.0, "growth": 1.001, "decay": 0.5}
_LABELS = {"lm": "lm loss", "z": "z loss"}
_LOSS_SCALE = None  # dynamic loss scale, grown a little every step
_PEAK = None  # the highest loss seen so far
_WINDOW = None  # the last WINDOW losses, a ring buffer
_HISTORY: dict[str, torch.Tensor] = {}  # each loss summed since the last report, cleared there


def init(device: torch.device) -> None:
    global _LOSS_SCALE, _PEAK, _WINDOW
    _LOSS_SCALE = torch.ones((), device=device)
    _PEAK = torch.zeros((), device=device)
    _WINDOW = torch.zeros(WINDOW, device=device)
    for name in _LABELS:
        _HISTORY[name] = torch.zeros((), device=device)


def get_history() -> dict[str, torch.Tensor]:
    return _HISTORY


def scale_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss under the dynamic scale."""
    return _CONFIG["floor"] + loss * _LOSS_SCALE


def grow_scale() -> None:
    """After the step: the scale grows a little."""
    _LOSS_SCALE.mul_(_CONFIG["growth"])


def loss_excess(loss: torch.Tensor) -> torch.Tensor:
    """How far the loss is above the highest one seen, which then moves up."""
    global _PEAK
    excess = _CONFIG["decay"] * torch.maximum(loss, _PEAK).sub(loss)
    _PEAK = torch.maximum(_PEAK, loss)
    return excess


def windowed_loss(loss: torch.Tensor, iteration: int) -> torch.Tensor:
    """The mean of the last losses; this one then takes the oldest one's place."""
    mean = _CONFIG["decay"] * _WINDOW[:WINDOW].mean()
    _WINDOW[iteration % WINDOW] = loss
    return mean


def record(values: dict[str, torch.Tensor]) -> str:
    """Name the loss with the largest sum so far; then add each loss to its sum."""
    largest = max(_LABELS, key=lambda name: _HISTORY[name].sum())
    for name, value in values.items():
        _HISTORY[name].add_(value)
    return largest


def report_and_clear(count: int) -> dict[str, torch.Tensor]:
    """Each loss' mean since the last report, by display name; the sums start again."""
    means = {_LABELS[k]: v / count for k, v in get_history().items()}
    for value in _HISTORY.values():
        value.zero_()
    return means
