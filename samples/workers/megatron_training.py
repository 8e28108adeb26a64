"""A slim stand-in for ``megatron.training`` (not part of the megatron-core wheel).

It keeps Megatron's shapes where the sample logs show them: ``get_args()``, the
``train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
valid_data_iterator, process_non_loss_data_func, config)`` signature whose positional arguments
MindIO hands to the recovery callbacks, ``training_log`` calling megatron-core's real
``track_moe_metrics``, and the iteration line format printed by the last rank.
"""

from __future__ import annotations

import datetime
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import track_moe_metrics

import emulated_mindio as ttp
import megatron_adaptor

_ARGS: SimpleNamespace | None = None
_LAST_LOG_TIME = [time.time()]


def get_args() -> SimpleNamespace:
    return _ARGS


def set_args(args: SimpleNamespace) -> None:
    global _ARGS
    _ARGS = args


def print_rank_0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    if dist.get_rank() == dist.get_world_size() - 1:
        print(message, flush=True)


class Optimizer:
    """Adam plus the two hooks a recovery adaptor calls (as MindSpeed's optimizers have)."""

    def __init__(self, params, lr: float) -> None:
        self.optimizer = torch.optim.Adam(params, lr=lr)
        for group in self.optimizer.param_groups:
            group["is_decoupled_lr"] = False
        self._scale_one = torch.tensor([1.0])

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_tensors(self) -> list[torch.Tensor]:
        """Parameters, then each parameter's optimizer state, in a fixed order on every rank."""
        tensors = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                tensors.append(param.data)
                state = self.optimizer.state[param]
                tensors.extend(state[key] for key in sorted(state) if key != "step")
        return tensors

    def update_npu_tensor_to_safe(self) -> None:
        from torch_npu.npu._recovery import update_npu_tensor_to_safe
        for tensor in self.state_tensors():
            update_npu_tensor_to_safe(tensor)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.optimizer.step()


class OptimizerParamScheduler:
    def __init__(self, optimizer: Optimizer, lr: float, num_steps: int) -> None:
        self.optimizer, self.max_lr, self.num_steps = optimizer, lr, num_steps

    def get_lr(self) -> float:
        return self.max_lr * min(1.0, self.num_steps / 1280)

    def step(self, increment: int) -> None:
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr()


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, iteration):
    args = get_args()
    optimizer.zero_grad()
    loss = forward_step_func(data_iterator, model[0])
    loss.backward()

    ttp.collective_guard()
    world_size = dist.get_world_size()
    grads = [p.grad for p in model[0].parameters() if p.grad is not None]
    for grad in grads:
        dist.all_reduce(grad)
        grad.div_(world_size)
    grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    optimizer.step()
    opt_param_scheduler.step(increment=args.global_batch_size)
    ttp.tft_end_updating_os(iteration)
    megatron_adaptor.set_log_args(grad_norm, None)
    ttp.strike(iteration, "after-optimizer")

    loss_reduced = loss.detach().clone()
    ttp.collective_guard()
    dist.all_reduce(loss_reduced)
    loss_reduced /= world_size
    megatron_adaptor.tft_set_losses_reduced([{"lm loss": loss_reduced}])
    return {"lm loss": loss_reduced}, grad_norm


def training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, iteration,
                 loss_scale, report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad):
    args = get_args()
    track_moe_metrics(loss_scale=1.0, iteration=iteration, total_loss_dict=total_loss_dict,
                      force_initialize=True, track_names=["z_loss"], num_layers=args.num_layers)
    now = time.time()
    elapsed, _LAST_LOG_TIME[0] = now - _LAST_LOG_TIME[0], now
    log_string = f" [{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    log_string += " iteration {:8d}/{:8d} |".format(iteration, args.train_iters)
    log_string += " consumed samples: {:12d} |".format(args.consumed_train_samples)
    log_string += " elapsed time per iteration (ms): {:.1f} |".format(elapsed * 1000.0)
    log_string += " learning rate: {:.6E} |".format(learning_rate)
    log_string += " global batch size: {:5d} |".format(args.global_batch_size)
    for key, value in {**loss_dict, **total_loss_dict}.items():
        log_string += " {}: {:.6E} |".format(key, float(value))
    log_string += " loss scale: {:.1f} |".format(loss_scale)
    if grad_norm is not None:
        log_string += " grad norm: {:.3f} |".format(grad_norm)
    log_string += " number of skipped iterations: {:3d} |".format(skipped_iter)
    log_string += " number of nan iterations: {:3d} |".format(0)
    print_rank_last(log_string)
    return report_memory_flag


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
          valid_data_iterator, process_non_loss_data_func, config):
    args = get_args()
    iteration = args.iteration
    while iteration < args.train_iters and iteration < args.exit_iteration:
        ttp.strike(iteration + 1, "forward")
        loss_dict, grad_norm = train_step(forward_step_func, train_data_iterator, model, optimizer,
                                          opt_param_scheduler, config, iteration + 1)
        iteration += 1
        args.iteration = iteration
        args.consumed_train_samples += args.global_batch_size
        training_log(loss_dict, {}, optimizer.param_groups[0]["lr"], None, iteration,
                     optimizer.get_loss_scale().item(), False, 0, grad_norm, None, None)
    return iteration
