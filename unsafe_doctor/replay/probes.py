"""Probes: build a global's tensors the way training does, and touch them the way a step does.

A rule may name a probe that calls the framework's own functions (the real megatron-core tracker
code): ``PROBES`` holds them by the name the knowledge files use. Every other global gets the
generic probe, which imports the global's module from the user's tree, calls the functions of that
module that write the global (with arguments it can make: a device, a small tensor, a name, a
number), and touches every tensor reachable from it. A user who knows better names a function of
theirs with ``--probe MODULE:FUNCTION``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from unsafe_doctor.replay.plan import Target
from unsafe_doctor.sentinel.reachable import reachable_tensors

# Megatron's train() arguments without a model or an optimizer
NO_TRAIN_ARGS: tuple[None, list[object], None, None] = (None, [], None, None)


_ENTRY = "__unsafe_doctor_entry__"  # on the module loaded as __main__: which entry script it is
_BUILT = "__unsafe_doctor_built__"  # set on a module once probes built its globals: the next run reloads it


class ProbeError(Exception):
    """The state of a global cannot be built here: the replay does not model it."""


class Probe:
    """Builds one global's state, runs a step's access to it, and lists its tensors."""

    how: str  # one line for the report: how the state was built

    def build(self) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def train_args(self) -> tuple:
        """What the adaptor's repair functions receive: Megatron's train() arguments
        ``(forward_step_func, model chunks, optimizer, scheduler)``, with no model here."""
        return NO_TRAIN_ARGS


def module_of(target: Target) -> types.ModuleType:
    """The module that holds the target's global in the job: the entry script's is ``__main__``."""
    if target.as_main:
        main = sys.modules["__main__"]
        if getattr(main, _ENTRY, None) == target.name.module:
            return main
        return load_as_main(target.name.module)
    return importlib.import_module(target.name.module)


def load_as_main(name: str) -> types.ModuleType:
    """The entry script run fresh as the job runs it, ``__main__``: loaded under ``__mp_main__`` (as
    multiprocessing does), so that its ``if __name__ == "__main__":`` training stays off, and not
    under its own name, so that ``import <name>`` gives a second copy, as in the job."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ProbeError(f"cannot find the file of {name}, the job's entry script, to run it as __main__")
    entry = importlib.util.spec_from_file_location("__mp_main__", spec.origin)
    if entry is None or entry.loader is None:
        raise ProbeError(f"cannot load {spec.origin} as __main__")
    module = importlib.util.module_from_spec(entry)
    sys.modules["__mp_main__"] = sys.modules["__main__"] = module
    entry.loader.exec_module(module)
    module.__name__ = name  # what reports name its globals by
    setattr(module, _ENTRY, name)
    return module


def _holder(target: Target) -> Any:
    module = module_of(target)
    owner = getattr(module, target.name.owner) if target.name.owner else module
    try:
        return getattr(owner, target.name.variable)
    except AttributeError:
        raise ProbeError(f"{target.name.dotted} does not exist after importing {target.name.module}") from None


def _touch(tensors: list[torch.Tensor]) -> None:
    """Read every tensor with a kernel, as a step's first use would."""
    for tensor in tensors:
        torch.ops.aten.clone.default(tensor)


class GenericProbe(Probe):
    """Any module-level global: the module's own writers build it, a read of each tensor touches it."""

    def __init__(self, target: Target, device: torch.device) -> None:
        self.target, self.device = target, device
        self.cache_arguments: list | None = None  # set when the global is an lru-cached function

    def build(self) -> None:
        module = module_of(self.target)
        holder = _holder(self.target)
        if callable(getattr(holder, "cache_clear", None)):
            self._build_cache(holder)
            return
        called = []
        if self.target.name.owner is None:
            for name in _writers(module, self.target.name.variable):
                function: Any = getattr(module, name, None)
                arguments = _arguments(function, self.device) if callable(function) else None
                if arguments is not None:
                    function(*arguments)
                    called.append(f"{name}({', '.join(_shown(value) for value in arguments)})")
        if not self.tensors():
            raise ProbeError(
                f"no function of {self.target.name.module} creates a tensor in {self.target.name.variable} with arguments the "
                "replay can make; name one that does with --probe MODULE:FUNCTION"
            )
        where = f"{self.target.name.module}." + " then ".join(called) if called else f"importing {self.target.name.module}"
        self.how = f"built by {where}; touched by reading every tensor reachable from {self.target.name.dotted}"

    def _build_cache(self, cached: Callable) -> None:
        """An lru cache: one call fills it; asking again gives the cached tensor (or, once the cache
        was cleared, a fresh one), which is what the next step reads."""
        arguments = _arguments(getattr(cached, "__wrapped__", cached), self.device)
        if arguments is None:
            raise ProbeError(
                f"cannot make the arguments of {self.target.name.dotted}(); "
                "name a function that calls it with --probe MODULE:FUNCTION"
            )
        self.cache_arguments = arguments
        cached(*arguments)
        shown = ", ".join(_shown(value) for value in arguments)
        self.how = f"built by calling the lru-cached {self.target.name.dotted}({shown}); touched by reading what it returns"

    def step(self) -> None:
        _touch(self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        holder = _holder(self.target)
        if self.cache_arguments is not None:
            return reachable_tensors(holder(*self.cache_arguments))
        return reachable_tensors(holder)


def _writers(module: object, variable: str) -> list[str]:
    """Top-level functions of the module's source that assign the global, or store into it."""
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return []
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _writes(node, variable):
            found.append(node.name)
    return found


_FILLERS = {"append", "extend", "insert", "update", "setdefault", "add"}  # calls that put things in; not clear(), zero_()


def _writes(function: ast.FunctionDef | ast.AsyncFunctionDef, variable: str) -> bool:
    """Whether the function creates or fills the global (a reset that empties it does not count)."""
    declared = any(isinstance(node, ast.Global) and variable in node.names for node in ast.walk(function))
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id == variable and isinstance(node.ctx, ast.Store) and declared:
            return True
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and _base_name(node.value) == variable:
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _FILLERS:
            if _base_name(node.func.value) == variable:
                return True
    return False


def _base_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _arguments(function: Callable, device: torch.device) -> list | None:
    """Values for the function's required parameters, by annotation or name; None when one has none."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    values = []
    for parameter in signature.parameters.values():
        if parameter.default is not inspect.Parameter.empty or parameter.kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            continue
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            return None
        value = _value_for(parameter, device)
        if value is None:
            return None
        values.append(value)
    return values


def _value_for(parameter: inspect.Parameter, device: torch.device) -> object:
    annotation = parameter.annotation
    hint = (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))).lower()
    name = parameter.name.lower()
    if "device" in hint or name == "device":
        return device
    if "module" in hint or name == "model":
        return torch.nn.Linear(4, 4, device=device)
    if "tensor" in hint or name in ("tensor", "loss", "value", "values", "grad", "x"):
        return torch.ones((), device=device)
    if hint == "str" or name in ("name", "key", "tag"):
        return "probe"
    if hint == "bool":
        return True
    if hint == "int" or name in ("layer_number", "num_layers", "step", "iteration", "index"):
        return 1
    if hint == "float":
        return 1.0
    return None


def _shown(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, torch.device):
        return "device"
    return repr(value)


class UserProbe(Probe):
    """The user's own function builds (first call) and touches (every later call) the state."""

    def __init__(self, target: Target, spec: str, device: torch.device) -> None:
        self.target, self.device = target, device
        module_name, _, function_name = spec.partition(":")
        try:
            self.function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise ProbeError(f"--probe {spec}: {error}") from None
        self.takes_device = bool(inspect.signature(self.function).parameters)
        self.how = f"built and touched by {spec}()"
        self._train_args: tuple | None = None

    def build(self) -> None:
        self.step()

    def step(self) -> None:
        returned = self.function(self.device) if self.takes_device else self.function()
        if isinstance(returned, tuple):
            self._train_args = returned

    def tensors(self) -> list[torch.Tensor]:
        return reachable_tensors(_holder(self.target))

    def train_args(self) -> tuple:
        """What the probe returned, when it returns a tuple: the arguments of the user's train()."""
        return self._train_args if self._train_args is not None else super().train_args()


class MegatronLossTrackerProbe(Probe):
    """megatron-core's MoE loss tracker, filled and cleared by megatron-core's functions: the
    layer-wise tracker (parallel_state up to 0.12, moe_utils from 0.13) and, before it, the
    aux-losses tracker of 0.6-0.7 (parallel_state), with the same save and clear functions. The
    probe uses the module of the installed release that holds the rule's global, the log's first."""

    LOSS = "load_balancing_loss"
    LAYERS = 2
    HOLDERS = ("megatron.core.transformer.moe.moe_utils", "megatron.core.parallel_state")

    def __init__(self, target: Target, device: torch.device) -> None:
        self.target, self.device = target, device
        self.how = ""

    def build(self) -> None:
        with _megatron_building(f"the MoE loss tracker {self.target.name.variable}"):
            _require_claimed_release(self.target)
            from megatron.core.transformer.moe import moe_utils

            self.holder = self._holder_module()
            self.save, self.clear = moe_utils.save_to_aux_losses_tracker, moe_utils.clear_aux_losses_tracker
            self._tracker().clear()  # a fresh process's tracker
            self._save()
        self.how = (
            f"built by megatron-core {_megatron_release()}'s save_to_aux_losses_tracker() for {self.LAYERS} MoE layers "
            f"into {self.holder.__name__}.{self.target.name.variable}; touched by a step's save_to_aux_losses_tracker() "
            "and clear_aux_losses_tracker()"
        )

    def _holder_module(self) -> Any:
        for name in (self.target.name.module, *self.HOLDERS):
            with contextlib.suppress(ImportError):
                module = importlib.import_module(name)
                if isinstance(getattr(module, self.target.name.variable, None), dict):
                    return module
        raise ProbeError(
            f"megatron-core {_megatron_release()} has no {self.target.name.variable} in "
            f"{' or '.join(dict.fromkeys((self.target.name.module, *self.HOLDERS)))}"
        )

    def _tracker(self) -> dict:
        return getattr(self.holder, self.target.name.variable)

    def _save(self) -> None:
        for layer in range(1, self.LAYERS + 1):
            self.save(self.LOSS, torch.full((), 0.5, device=self.device), layer, self.LAYERS)

    def step(self) -> None:
        self._save()
        self.clear()

    def tensors(self) -> list[torch.Tensor]:
        return reachable_tensors(self._tracker())


class MegatronRouterExpertBiasProbe(Probe):
    """megatron-core's TopKRouter with aux-loss-free balancing: its routing reads expert_bias.

    The router's second argument, its process groups, changed type across releases (none up to 0.12,
    ModelCommProcessGroups in 0.13, ProcessGroupCollection later): it is read from the installed
    constructor's signature and given with every group None (no parallelism). The step routes as
    training does, with gradients on: it reads expert_bias, then adds to local_tokens_per_expert (a
    buffer beside it, with its own rule, which the fix repairs with it where the model is not rebuilt)."""

    def __init__(self, target: Target, device: torch.device) -> None:
        self.target, self.device = target, device
        self.how = ""

    def build(self) -> None:
        with _megatron_building("a TopKRouter with expert bias"):
            _require_claimed_release(self.target)
            from megatron.core.transformer.moe.router import TopKRouter
            from megatron.core.transformer.transformer_config import TransformerConfig

            if "moe_router_enable_expert_bias" not in {field.name for field in dataclasses.fields(TransformerConfig)}:
                raise ProbeError(
                    f"megatron-core {_megatron_release()}'s TransformerConfig has no "
                    "moe_router_enable_expert_bias: its TopKRouter has no expert_bias"
                )
            config = TransformerConfig(
                num_layers=2,
                hidden_size=16,
                num_attention_heads=2,
                num_moe_experts=4,
                moe_router_topk=2,
                moe_router_load_balancing_type="none",
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                use_cpu_initialization=True,
                add_bias_linear=False,
            )
            groups = _no_process_groups(TopKRouter)
            with _cuda_means(self.device):
                self.router = TopKRouter(config, *groups).to(self.device)  # get_model() moves the model as .cuda()
        self.chunk = torch.nn.ModuleList([self.router])
        shown = f"{type(groups[0]).__name__} of no groups" if groups else "no process groups"
        self.how = (
            f"built as megatron-core {_megatron_release()}'s TopKRouter (4 experts, expert bias on, {shown}); "
            "touched by its routing()"
        )

    def step(self) -> None:
        logits = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(1)).to(self.device)
        self.router.routing(logits)

    def tensors(self) -> list[torch.Tensor]:
        return [self.router.expert_bias]

    def train_args(self) -> tuple:
        return (None, [self.chunk], None, None)


def _no_process_groups(router: Any) -> tuple:
    """The router's process-group argument, every group None; () where the constructor takes none."""
    parameters = list(inspect.signature(router).parameters.values())[1:]  # after config
    if not parameters:
        return ()
    hint = typing.get_type_hints(router.__init__).get(parameters[0].name)
    kinds: list[Any] = [kind for kind in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(kind)]
    if not kinds:
        raise ProbeError(f"TopKRouter's {parameters[0].name} is a {hint}, not a dataclass of process groups")
    return (kinds[0](**{field.name: None for field in dataclasses.fields(kinds[0])}),)


def _require_claimed_release(target: Target) -> None:
    """The state and the fix are those of the releases the rule holds for (the log's): another
    release installed here would replay a different layout, so the replay does not model it."""
    installed = _installed_release()
    if target.releases and installed and not SpecifierSet(target.releases).contains(installed, prereleases=True):
        raise ProbeError(
            f"megatron-core {installed} is installed here, but rule {target.rule} holds for megatron-core "
            f"{target.releases}: put one of those releases first on PYTHONPATH "
            "(pip install --no-deps --target DIR megatron-core==VERSION)"
        )


def _installed_release() -> str | None:
    """The megatron-core first on sys.path, as its metadata says (importing it may be what fails)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def _megatron_release() -> str:
    return _installed_release() or "(not installed)"


@contextlib.contextmanager
def _megatron_building(what: str) -> Iterator[None]:
    """Any failure to build megatron-core's state here (a missing module, a constructor that takes
    other arguments) is a ProbeError that names the release: the replay does not model it."""
    try:
        yield
    except ProbeError:
        raise
    except Exception as error:  # whatever the installed release raises
        first_line = next(iter(str(error).strip().splitlines()), "")
        raise ProbeError(
            f"cannot build {what} with megatron-core {_megatron_release()}: {type(error).__name__}: {first_line}"
        ) from None


@contextlib.contextmanager
def _cuda_means(device: torch.device) -> Iterator[None]:
    """megatron-core allocates its buffers on ``torch.cuda.current_device()``; on Ascend, torch_npu's
    ``transfer_to_npu`` makes that the NPU. Without CUDA here, it means the backend's device."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: device  # type: ignore[assignment,return-value]  # as transfer_to_npu does
    try:
        yield
    finally:
        torch.cuda.current_device = saved


# By the name a rule's `probe:` gives; knowledge.PROBE_NAMES lists the same names for validation.
PROBES: dict[str, Callable[[Target, torch.device], Probe]] = {
    "megatron-layer-wise-tracker": MegatronLossTrackerProbe,
    "megatron-aux-losses-tracker": MegatronLossTrackerProbe,
    "megatron-router-expert-bias": MegatronRouterExpertBiasProbe,
}


def refresh(modules: Iterable[str]) -> None:
    """Each module's globals as a fresh process has them, once per run (two globals of one module are
    built in the same module): a module an earlier run built in is reloaded. One that fails to import
    is left to its probe, which says why."""
    for name in dict.fromkeys(modules):
        try:
            module = importlib.import_module(name)
            if getattr(module, _BUILT, False):
                module = importlib.reload(module)
        except Exception:  # noqa: BLE001 (the user's module may fail in any way; make_probe reports it)
            continue
        setattr(module, _BUILT, True)


def make_probe(target: Target, device: torch.device, user_probe: str | None) -> Probe:
    if user_probe:
        return UserProbe(target, user_probe, device)
    if target.probe is not None:
        return PROBES[target.probe](target, device)
    try:
        module_of(target)
    except ProbeError:
        raise
    except Exception as error:  # the user's module may fail in any way on import
        raise ProbeError(f"cannot import {target.name.module}: {type(error).__name__}: {error}") from None
    return GenericProbe(target, device)
