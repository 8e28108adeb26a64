"""The names of torch and of Python containers that tell the audit what code does with a value:
which calls make tensors, which only read metadata, which change data in place or communicate."""

from __future__ import annotations

# --- calls that make tensors, and where ---------------------------------------------------------------

FACTORIES = frozenset(
    {
        "zeros",
        "ones",
        "empty",
        "full",
        "tensor",
        "as_tensor",
        "arange",
        "range",
        "linspace",
        "logspace",
        "rand",
        "randn",
        "randint",
        "randperm",
        "eye",
        "empty_strided",
        "scalar_tensor",
        "tril_indices",
        "triu_indices",
        "from_numpy",
        "frombuffer",
    }
)
LIKE_FACTORIES = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"})
NOT_TENSOR_OPS = frozenset(
    {
        "device",
        "dtype",
        "no_grad",
        "enable_grad",
        "inference_mode",
        "set_grad_enabled",
        "is_tensor",
        "is_grad_enabled",
        "is_floating_point",
        "is_complex",
        "numel",
        "manual_seed",
        "seed",
        "initial_seed",
        "get_default_dtype",
        "set_default_dtype",
        "finfo",
        "iinfo",
        "Size",
        "compile",
        "load",
        "save",
        "Generator",
        "typename",
        "is_storage",
        "get_rng_state",
        "set_rng_state",
        "use_deterministic_algorithms",
        "autocast",
    }
)
TENSOR_SUBMODULES = ("torch.nn.functional.", "torch.linalg.", "torch.fft.", "torch.special.")
TENSOR_METHODS = frozenset(
    {
        "detach",
        "clone",
        "contiguous",
        "float",
        "half",
        "bfloat16",
        "double",
        "int",
        "long",
        "bool",
        "view",
        "view_as",
        "reshape",
        "flatten",
        "squeeze",
        "unsqueeze",
        "expand",
        "repeat",
        "transpose",
        "permute",
        "narrow",
        "masked_fill",
        "type_as",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "new_tensor",
        "triu",
        "tril",
        "softmax",
    }
)
DTYPES = frozenset(
    {
        "float",
        "float16",
        "float32",
        "float64",
        "bfloat16",
        "half",
        "double",
        "int",
        "int8",
        "int16",
        "int32",
        "int64",
        "long",
        "uint8",
        "bool",
        "complex64",
        "complex128",
    }
)
DEVICE_WORDS = ("cuda", "npu", "xpu", "mps")
# Tokens of a name (`shared_experts_input` -> shared, experts, input) that say it holds a tensor,
# when nothing else in the scope says where the value came from (a parameter, a call's result).
TENSOR_NAME_TOKENS = frozenset(
    {
        "tensor",
        "tensors",
        "input",
        "inputs",
        "ids",
        "mask",
        "masks",
        "hidden",
        "logits",
        "scores",
        "grad",
        "grads",
        "loss",
        "losses",
        "weight",
        "weights",
        "freq",
        "freqs",
        "cos",
        "sin",
        "output",
        "outputs",
        "idx",
        "indices",
        "emb",
        "embedding",
        "embeddings",
        "activation",
        "activations",
        "seqlen",
        "seqlens",
    }
)
# ... unless another token says it is a tensor's metadata (`tensor_shape`, `input_size`, `mask_dtype`).
METADATA_NAME_TOKENS = frozenset(
    {
        "shape",
        "shapes",
        "size",
        "sizes",
        "dtype",
        "dtypes",
        "device",
        "numel",
        "ndim",
        "dim",
        "len",
        "count",
        "num",
        "rank",
        "ranks",
        "group",
        "groups",
        "seed",
        "name",
        "names",
    }
)

# --- what uses do ---------------------------------------------------------------------------------------

METADATA = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "is_cuda",
        "requires_grad",
        "layout",
        "size",
        "numel",
        "dim",
        "element_size",
        "nelement",
        "data_ptr",
        "keys",
        "is_contiguous",
        "stride",
        "storage_offset",
        "names",
    }
)
CONTAINER_ADD = frozenset({"append", "appendleft", "insert", "setdefault", "add", "extend", "put"})
CONTAINER_REMOVE = frozenset({"pop", "popleft", "update", "clear", "cache_clear", "remove", "discard"})
RESETS = frozenset({"clear", "cache_clear"})
NOT_DATA_INPLACE = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})
DATA_METHODS = frozenset(
    {
        "item",
        "tolist",
        "cpu",
        "numpy",
        "clone",
        "sum",
        "mean",
        "max",
        "min",
        "norm",
        "float",
        "half",
        "bfloat16",
        "double",
        "to",
        "cuda",
        "npu",
        "add",
        "sub",
        "mul",
        "div",
        "pow",
        "abs",
        "any",
        "all",
        "eq",
        "ne",
        "backward",
    }
)
NOT_DATA_CALLS = frozenset({"isinstance", "len", "type", "id", "hasattr", "getattr", "callable", "list", "dict", "tuple"})
COMMUNICATION_INTO = ("recv", "irecv", "broadcast", "all_reduce", "reduce", "all_gather_into_tensor", "scatter")
COMMUNICATION_FROM = ("send", "isend", "broadcast")


def updates_data_in_place(method: str) -> bool:
    """`zero_()`, `add_()`: a trailing underscore changes the tensor's data (not `requires_grad_()`)."""
    return method.endswith("_") and method not in NOT_DATA_INPLACE
