"""Where the tensor an expression makes lives, as far as the code says: *device* (`device=` a
device string or index or `torch.cuda.current_device()`, `.cuda()`, `.npu()`, `.to("npu")`, an op
on such a tensor), *cpu* (a factory without `device=`, `device="cpu"`, `.cpu()`), else *unknown*
(`device=loss.device`, `loss.detach()`)."""

from __future__ import annotations

import ast
from collections.abc import Sequence

from unsafe_doctor.recovery_code.flow_scope import TensorPlace
from unsafe_doctor.recovery_code.names import Names
from unsafe_doctor.recovery_code.vocabulary import (
    CONTAINER_ADD,
    DEVICE_WORDS,
    DTYPES,
    FACTORIES,
    LIKE_FACTORIES,
    METADATA_NAME_TOKENS,
    NOT_TENSOR_OPS,
    TENSOR_METHODS,
    TENSOR_NAME_TOKENS,
    TENSOR_SUBMODULES,
)
from unsafe_doctor.source.syntax import callee_name


def combine(places: Sequence[TensorPlace | None]) -> TensorPlace | None:
    """The placement of a value made from several: device wins, then unknown."""
    known = [place for place in places if place is not None]
    if not known:
        return None
    if "device" in known:
        return "device"
    return "unknown" if "unknown" in known else "cpu"


class Places:
    """Placements in one scope, from the placements of its locals learnt so far."""

    def __init__(self, names: Names):
        self.names = names
        self.scope = names.scope

    def of(self, node: ast.AST | None) -> TensorPlace | None:
        """Where the tensor an expression makes lives; None when it is not known to be a tensor."""
        if isinstance(node, ast.Name):
            return self.scope.places.get(node.id) or self._named(node.id)
        if isinstance(node, (ast.Tuple, ast.List)):  # `X.append((tensor, handle))`
            return combine([self.of(element) for element in node.elts])
        if isinstance(node, ast.Subscript):
            return self.of(node.value)
        if isinstance(node, ast.BinOp):
            return combine([self.of(node.left), self.of(node.right)])
        if isinstance(node, ast.IfExp):
            return combine([self.of(node.body), self.of(node.orelse)])
        if not isinstance(node, ast.Call):
            return None
        func = node.func
        name = self.names.dotted(func)
        if name is not None and name.startswith("torch."):
            return self._torch_call(name, node)
        if isinstance(func, ast.Attribute):
            return self._method(func, node)
        return None

    def _named(self, name: str) -> TensorPlace | None:
        """A local or parameter whose placement the scope does not know, but whose name says tensor
        (`position_ids`, `shared_experts_input`): unknown placement, so a global that keeps it at
        run time (`_POSITION_IDS = position_ids` in a setter) is a holder."""
        if name not in self.scope.locals or name in self.scope.devices or self._annotated_not_tensor(name):
            return None
        lowered = name.lower()
        if lowered.endswith(("seq_len", "seq_lens")):  # `actual_seq_len`: a packed batch's cumulative lengths
            return "unknown"
        tokens = set(lowered.split("_"))
        return "unknown" if tokens & TENSOR_NAME_TOKENS and not tokens & METADATA_NAME_TOKENS else None

    def _annotated_not_tensor(self, name: str) -> bool:
        """A parameter annotated with a type that is no tensor (`seq_length: int`)."""
        function = self.scope.function
        arguments = function.args if function is not None else None
        every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs] if arguments else []
        annotation = next((argument.annotation for argument in every if argument.arg == name), None)
        return annotation is not None and "Tensor" not in ast.unparse(annotation)

    def added(self, method: str, node: ast.Call) -> TensorPlace | None:
        """The tensor `X.append(t)` and the like put into a container."""
        if method in CONTAINER_ADD and node.args:
            return self.of(node.args[-1])
        return None

    def _method(self, func: ast.Attribute, node: ast.Call) -> TensorPlace | None:
        method = func.attr
        if method in ("cuda", "npu"):
            return "device"
        if method == "cpu":
            return "cpu"
        receiver = self.of(func.value)
        if method == "to":
            return self._moved(node, receiver)
        if method in TENSOR_METHODS:
            return receiver or "unknown"
        return None

    def _torch_call(self, name: str, node: ast.Call) -> TensorPlace | None:
        short = name.rpartition(".")[2]
        keywords = {keyword.arg: keyword.value for keyword in node.keywords if keyword.arg}
        if name.count(".") == 1 and short in FACTORIES:
            return self.device_of(keywords["device"]) if "device" in keywords else "cpu"
        if name.count(".") == 1 and short in LIKE_FACTORIES:
            if "device" in keywords:
                return self.device_of(keywords["device"])
            return (self.of(node.args[0]) or "unknown") if node.args else "unknown"
        if (name.count(".") == 1 and short not in NOT_TENSOR_OPS and short[:1].islower()) or name.startswith(TENSOR_SUBMODULES):
            inputs = [self.of(argument) for argument in [*node.args, *keywords.values()]]
            return combine(inputs) or "unknown"
        return None

    def _moved(self, node: ast.Call, receiver: TensorPlace | None) -> TensorPlace:
        target = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "device"), None)
        if target is None:
            return receiver or "unknown"
        dotted = self.names.dotted(target)
        if dotted is not None and dotted.startswith("torch.") and dotted.rpartition(".")[2] in DTYPES:
            return receiver or "unknown"  # .to(torch.float32)
        return self.device_of(target)

    def device_of(self, node: ast.expr) -> TensorPlace:
        """The placement a `device=` argument or `.to()` target names."""
        value = self.device_value(node)
        return value if value is not None else "unknown"

    def device_value(self, node: ast.expr | None) -> TensorPlace | None:
        """The placement a device expression names; None when the code does not say."""
        if isinstance(node, ast.Constant):
            return _constant_device(node.value)
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            return self.device_value(node.values[0])
        if isinstance(node, ast.Name):
            return self.scope.devices.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr == "device":
            return self.of(node.value)  # `x.device` of a local tensor whose placement is known
        if isinstance(node, ast.Call):
            func = node.func
            if (callee_name(func) or "").startswith("current_device"):  # torch.cuda / torch.npu / get_accelerator()
                return "device"
            if self.names.dotted(func) == "torch.device" and node.args:
                return self.device_value(node.args[0])
        return None


def _constant_device(value: object) -> TensorPlace | None:
    if value is None:
        return "cpu"
    if isinstance(value, int) and not isinstance(value, bool):
        return "device"
    if isinstance(value, str):
        text = value.lower()
        # "meta" tensors have no memory to be unsafe: as good as the CPU here
        return "device" if text.startswith(DEVICE_WORDS) else "cpu" if text.startswith(("cpu", "meta")) else None
    return None
