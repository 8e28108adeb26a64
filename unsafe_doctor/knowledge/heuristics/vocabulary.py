"""The words the heuristics read code by: which names speak of training, logging, set-up or a step,
which methods reset, accumulate or decay a tensor, and the small tests built on them.

A name is read by its tokens (`train_step` -> {train, step}), so `training_log` and `trainStep`
match the same sets."""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence

from unsafe_doctor.source.syntax import callee_name, flatten, is_empty_value

# --- names of functions and values -----------------------------------------------------------------

TRAIN_TOKENS = frozenset(
    {
        "loss",
        "losses",
        "grad",
        "grads",
        "gradient",
        "gradients",
        "param",
        "params",
        "parameter",
        "parameters",
        "lr",
        "scale",
        "scaled",
        "scaler",
    }
)
STEP_TOKENS = frozenset(
    {"train", "training", "step", "iteration", "forward", "backward", "log", "logging", "metrics", "track", "finalize", "fit"}
)
HELPER_TOKENS = frozenset({"reset", "clear", "zero", "destroy", "init", "initialize", "get", "set"})
INIT_TOKENS = frozenset({"init", "initialize", "initialise", "setup", "build", "create"})
TRAIN_LOOP_TOKENS = frozenset({"train", "training", "fit", "run", "main", "loop", "pretrain"})
REPORT_TOKENS = frozenset({"log", "logging", "logs", "metric", "metrics", "track", "report", "summary", "tensorboard"})
SHAPE_TOKENS = frozenset({"shape", "size", "dtype", "device", "len", "numel", "seq", "seqlen"})
HANDLE_TOKENS = frozenset({"group", "pg", "stream", "communicator", "comm"})  # keyword arguments that carry no data

# --- calls -----------------------------------------------------------------------------------------

LOG_CALLS = frozenset(
    {
        "print",
        "print_rank_0",
        "print_rank_last",
        "log_single_rank",
        "add_scalar",
        "add_scalars",
        "add_histogram",
        "log",
        "info",
        "debug",
        "warning",
    }
)
LOG_RECEIVERS = frozenset({"logger", "logging", "wandb", "writer", "wandb_writer", "tb_writer"})
TRAIN_CALLS = frozenset({"backward", "step", "zero_grad"})
NO_GRAD = frozenset({"no_grad", "inference_mode"})

# --- methods on the tensor -------------------------------------------------------------------------

RESET_METHODS = frozenset({"zero_", "clear", "cache_clear"})
ACCUMULATE_METHODS = frozenset({"add_", "sub_", "index_add_", "scatter_add_"})
DECAY_METHODS = frozenset({"mul_", "div_", "lerp_", "addcmul_", "addcdiv_", "pow_", "sqrt_", "clamp_", "exp_"})
QUEUE_ADD = frozenset({"append", "appendleft", "extend", "insert"})
QUEUE_TAKE = frozenset({"pop", "popleft"})
COPY_CALLS = frozenset(
    {
        "clone",
        "detach",
        "to",
        "float",
        "half",
        "bfloat16",
        "double",
        "cpu",
        "cuda",
        "npu",
        "contiguous",
        "stack",
        "cat",
        "view",
        "reshape",
        "flatten",
        "deepcopy",
        "copy",
        "item",
        "tolist",
        "list",
        "dict",
        "tuple",
    }
)
FRESH_CALLS = frozenset(
    {"zeros", "empty", "zeros_like", "empty_like", "dict", "list", "set", "deque", "OrderedDict", "defaultdict"}
)  # called with any arguments: `torch.zeros(n)`, `defaultdict(float)`
METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"})
METADATA_METHODS = frozenset({"size", "numel", "dim", "element_size", "keys", "nelement", "data_ptr"})
ELEMENT_METHODS = frozenset({"items", "values", "get", "setdefault"})


# --- tests on names and nodes ----------------------------------------------------------------------


def tokens(name: str) -> set[str]:
    """`train_step` -> {train, step}; `forwardBackward` -> {forward, backward}."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return {token.lower() for token in spaced.split("_") if token}


def target_name(node: ast.expr) -> str | None:
    """The identifier an assignment target is about: `loss`, `self.loss`, `group["lr"]` -> lr."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value
        return target_name(node.value)
    return None


def dotless(node: ast.expr) -> str:
    """`(x.shape, x.dtype)` -> `(x_shape, x_dtype)`: its words, for token matching."""
    return ast.unparse(node).replace(".", "_")


def is_logging_call(call: ast.Call) -> bool:
    """`print(...)`, `writer.add_scalar(...)`, `logger.info(...)`, `wandb.log(...)`."""
    chain = flatten(call.func.value) if isinstance(call.func, ast.Attribute) else None
    receiver = chain[0] if chain else None  # the name the receiver starts at: `wandb` in `wandb.run.log`
    return callee_name(call.func) in LOG_CALLS or (isinstance(receiver, ast.Name) and receiver.id in LOG_RECEIVERS)


def is_fresh(value: ast.expr) -> bool:
    """A value a reset rebinds to: None, an empty literal, a new zeroed tensor or empty container."""
    return is_empty_value(value) or (isinstance(value, ast.Call) and callee_name(value.func) in FRESH_CALLS)


def is_reporting(name: str, calls: Sequence[ast.Call] = ()) -> bool:
    """A logging function: named so, or its calls log and drive no training (no backward, step)."""
    if tokens(name) & REPORT_TOKENS:
        return True
    logs = any(is_logging_call(call) for call in calls)
    return logs and not any(callee_name(call.func) in TRAIN_CALLS for call in calls)


def runs_per_step(function: str, *, in_loop: bool) -> bool:
    """Runs every iteration: named like a training or logging step (a helper named for what it resets,
    `reset_loss_log`, is not), or sits in a loop of a train-like function or of the module."""
    words = tokens(function)
    if words & STEP_TOKENS and not words & HELPER_TOKENS:
        return True
    return in_loop and (function == "<module>" or bool(words & TRAIN_LOOP_TOKENS))
