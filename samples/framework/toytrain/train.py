"""toytrain's training loop: data-parallel training of a small classifier.

Every step touches both globals of ``toytrain.state``: it clips the gradients against
``_EMA_GRAD_NORM`` and updates it, and it adds the loss to ``LOSS_LOG``, which ``log`` reads
and zeroes.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from toytrain import state

CLIP_FACTOR = 2.0
EMA_DECAY = 0.9


@dataclass
class TrainConfig:
    iteration: int  # steps completed
    train_iters: int
    micro_batch_size: int = 4


class DataIterator:
    """This rank's share of every global batch of a fixed dataset; can restart at any step."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor, config: TrainConfig) -> None:
        self.features, self.labels, self.config = features, labels, config
        self.rebuild(config.iteration)

    def rebuild(self, iteration: int) -> None:
        global_batch = self.config.micro_batch_size * dist.get_world_size()
        self.position = iteration * global_batch + dist.get_rank() * self.config.micro_batch_size

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(self.position, self.position + self.config.micro_batch_size) % len(self.labels)
        self.position += self.config.micro_batch_size * dist.get_world_size()
        return self.features[rows], self.labels[rows]


def build_model(in_features: int = 8, classes: int = 4) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(in_features, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))


def allreduce_gradients(model: torch.nn.Module) -> None:
    world_size = dist.get_world_size()
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad.div_(world_size)


def clip_gradients(model: torch.nn.Module) -> torch.Tensor:
    """Clip to a multiple of the running gradient norm, then update the running norm."""
    grads = [param.grad for param in model.parameters()]
    grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    max_norm = CLIP_FACTOR * state._EMA_GRAD_NORM
    scale = torch.clamp(max_norm / (grad_norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(scale)
    state._EMA_GRAD_NORM.mul_(EMA_DECAY).add_(grad_norm, alpha=1 - EMA_DECAY)
    return grad_norm


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
    inputs, labels = batch
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs), labels)
    loss.backward()
    allreduce_gradients(model)
    grad_norm = clip_gradients(model)
    optimizer.step()
    state.record_loss("loss", loss)
    return grad_norm


def log(iteration: int, grad_norm: torch.Tensor) -> None:
    loss = state.LOSS_LOG["loss"].item()
    if dist.get_rank() == 0:
        print(f"[{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] toytrain step {iteration:6d} | loss {loss:.4f} | "
              f"grad norm {grad_norm.item():.4f} | ema grad norm {state._EMA_GRAD_NORM.item():.4f}", flush=True)
    state.reset_loss_log()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data_iterator: DataIterator,
          config: TrainConfig) -> int:
    """Train from ``config.iteration`` up to ``config.train_iters``; return the last step."""
    while config.iteration < config.train_iters:
        grad_norm = train_step(model, optimizer, next(data_iterator))
        config.iteration += 1
        log(config.iteration, grad_norm)
    return config.iteration
