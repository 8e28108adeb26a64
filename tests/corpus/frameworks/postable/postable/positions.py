import math

import torch

POSITION_TABLE = None


def build_position_table(max_length: int, dim: int, device: torch.device) -> None:
    global POSITION_TABLE
    position = torch.arange(max_length, device=device).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, dim, 2, device=device) * (-math.log(10000.0) / dim))
    table = torch.zeros(max_length, dim, device=device)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    POSITION_TABLE = table


def add_positions(hidden: torch.Tensor) -> torch.Tensor:
    return hidden + POSITION_TABLE[: hidden.shape[1]]
