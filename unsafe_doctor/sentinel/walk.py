"""What a training step can reach, walked from the process itself, each tensor with a path a person can read.

Two kinds of start: the objects the adaptor passes (models, optimizers, ``train_args``), and the
module globals and class attributes of the packages asked for (``sys.modules``; never the standard
library). From there the walk follows containers (dict, list, tuple, set, deque), the attributes of
objects (singletons), ``nn.Module`` parameters, buffers and submodules, and optimizer state. It does
not follow ``.grad`` (a step starts by resetting gradients), data loaders (host memory), code, or
modules met on the way.

Each tensor is attributed to a ``Holder``: the global, class attribute or object attribute a rule
would name (``megatron.core.parallel_state._GLOBAL_MEMORY_BUFFER``; ``TopKRouter.expert_bias`` for a
model's buffer). The walk is bounded in time, depth, entries per container and objects in all, and
says where it stopped early.
"""

from __future__ import annotations

import functools
import gc
import sys
import time
import types
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from unsafe_doctor.sentinel.reachable import CODE, LEAVES

_LEAVES = (*LEAVES, torch.dtype, torch.device, torch.Size)
# Beyond what the replay's walk passes over: methods, generators, frames, partials, and the modules and
# classes met on the way (a package's own are walked from sys.modules, once each).
_CODE = (
    *CODE, types.MethodType, types.MemberDescriptorType, types.GeneratorType, types.CoroutineType, types.CodeType,
    types.FrameType, functools.partial, types.ModuleType, type,
)
_SEQUENCES = (list, tuple, deque, set, frozenset)
_NOTHING_INSIDE = (*_LEAVES, *_CODE)
_SKIPPED_IN_MODULES = (nn.Module, *_NOTHING_INSIDE)  # a module's submodules are walked by named_modules()
_MAPPINGS = (dict, types.MappingProxyType)
_HOST_DATA = (torch.utils.data.Dataset, torch.utils.data.DataLoader)
_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # torch's own bookkeeping: hooks, flags, the tensor dicts
_PACKAGES_NEVER_WALKED = frozenset({"torch", "torch_npu", "unsafe_doctor", "numpy", "typing_extensions", "_pytest", "pytest"})


@dataclass(frozen=True, slots=True)
class Holder:
    """What a rule names: a module global (``owner`` None), or an attribute of a class or of its instances."""

    module: str | None
    owner: str | None
    variable: str

    @property
    def dotted(self) -> str:
        return ".".join(part for part in (self.module, self.owner, self.variable) if part)


@dataclass(frozen=True, slots=True)
class Found:
    path: str
    holder: Holder
    tensor: torch.Tensor


@dataclass(frozen=True, slots=True)
class Limits:
    seconds: float = 5.0  # the whole walk
    depth: int = 12  # levels below a global or an object attribute
    entries: int = 10_000  # of one container
    objects: int = 1_000_000  # visited in all: bounds the memory of the walk itself


@dataclass
class Walk:
    tensors: list[Found] = field(default_factory=list)
    caches: set[Holder] = field(default_factory=set)  # holders that are lru-cached functions: their results were walked
    aliases: dict[Holder, list[Holder]] = field(default_factory=dict)  # other globals bound to the same object
    objects: int = 0
    stopped_early: str | None = None
    cut: list[str] = field(default_factory=list)  # containers walked only in part


class _Stop(Exception):
    """A budget ran out."""


def walk(roots: Sequence[object], packages: Iterable[str], limits: Limits = Limits()) -> Walk:
    """Every tensor reachable from ``roots`` and from the globals of ``packages``, each once, the first path kept."""
    walker = _Walker(limits)
    try:
        walker.roots(roots)
        walker.packages(frozenset(packages))
    except _Stop as stop:
        walker.result.stopped_early = str(stop)
    if walker.result.cut and walker.result.stopped_early is None:
        more = f" and {len(walker.result.cut) - 1} more" if len(walker.result.cut) > 1 else ""
        walker.result.stopped_early = f"walked the first {limits.entries} entries of {walker.result.cut[0]}{more}"
    return walker.result


def package_modules(packages: frozenset[str]) -> list[tuple[str, types.ModuleType]]:
    """The loaded modules of these top-level packages, deepest first: a package re-exporting a
    submodule's global comes after the submodule, which then names it."""
    wanted = packages - _PACKAGES_NEVER_WALKED - set(sys.stdlib_module_names)
    found = [(name, module) for name, module in list(sys.modules.items())
             if isinstance(module, types.ModuleType) and name.partition(".")[0] in wanted]
    return sorted(found, key=lambda item: (-item[0].count("."), item[0]))


class _Walker:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.deadline = time.perf_counter() + limits.seconds
        self.seen: set[int] = set()
        self.result = Walk()
        self.parameter_names: dict[int, str] = {}
        self.global_holders: dict[int, Holder] = {}

    # --- starts ------------------------------------------------------------------------------

    def roots(self, roots: Sequence[object]) -> None:
        # models first: their parameters' names make optimizer state readable
        names = _root_names(roots)
        ordered = sorted(range(len(roots)), key=lambda index: not issubclass(type(roots[index]), nn.Module))
        for index in ordered:
            self.visit(roots[index], names[index], None, 0)

    def packages(self, packages: frozenset[str]) -> None:
        for name, module in package_modules(packages):
            for variable, value in list(vars(module).items()):
                if variable.startswith("__") and variable.endswith("__"):
                    continue
                holder = Holder(name, None, variable)
                kind = type(value)
                if issubclass(kind, type):
                    if value.__module__ == name:
                        self.class_attributes(value, name)
                elif issubclass(kind, functools._lru_cache_wrapper):
                    if getattr(value, "__module__", None) == name:
                        self.cache(value, holder)
                elif id(value) in self.global_holders:
                    if not issubclass(kind, _LEAVES) and not issubclass(kind, _CODE):
                        self.result.aliases.setdefault(self.global_holders[id(value)], []).append(holder)
                else:
                    if not issubclass(kind, _LEAVES) and not issubclass(kind, _CODE):
                        self.global_holders[id(value)] = holder
                    self.visit(value, f"{name}.{variable}", holder, 0)

    def class_attributes(self, cls: type, module: str) -> None:
        for attribute, value in list(vars(cls).items()):
            if attribute.startswith("__") and attribute.endswith("__"):
                continue
            holder = Holder(module, cls.__qualname__, attribute)
            if issubclass(type(value), functools._lru_cache_wrapper):
                self.cache(value, holder)
            else:
                self.visit(value, f"{module}.{cls.__qualname__}.{attribute}", holder, 0)

    def cache(self, function: Any, holder: Holder) -> None:
        """An lru cache's keys and results, which Python does not list: CPython's wrapper hands them
        to the garbage collector (``gc.get_referents``), so they are checked like any other state."""
        self.result.caches.add(holder)
        referents = [item for item in gc.get_referents(function) if not issubclass(type(item), (*_LEAVES, *_CODE))]
        for index, item in enumerate(referents):
            self.visit(item, f"{holder.dotted}(…)[{index}]", holder, 1)

    # --- the walk ----------------------------------------------------------------------------

    def visit(self, obj: Any, path: str, holder: Holder | None, depth: int) -> None:
        """Depth first, each object once; ``holder`` None: not yet inside anything a rule names."""
        pending = [(obj, path, holder, depth)]
        while pending:
            obj, path, holder, depth = pending.pop()
            kind = type(obj)  # not isinstance, which asks objects for __class__ (proxies, deprecations)
            if issubclass(kind, _LEAVES) or issubclass(kind, _CODE) or id(obj) in self.seen:
                continue
            self.count(obj)
            if issubclass(kind, torch.Tensor):
                self.result.tensors.append(Found(path, holder or Holder(None, None, path), obj))
            elif depth >= self.limits.depth or issubclass(kind, _HOST_DATA):
                continue
            elif issubclass(kind, nn.Module):
                pending.extend(reversed(list(self.model(obj, path, holder, depth))))
            elif issubclass(kind, torch.optim.Optimizer):
                pending.extend(reversed(list(self.optimizer(obj, path, holder, depth))))
            elif issubclass(kind, _MAPPINGS):
                pending.extend(reversed(list(self.mapping(obj, path, holder, depth))))
            elif issubclass(kind, _SEQUENCES):
                pending.extend(reversed(list(self.sequence(obj, path, holder, depth))))
            elif not _is_standard_library(kind):
                pending.extend(reversed(list(self.attributes(obj, path, holder, depth))))

    def count(self, obj: object) -> None:
        self.seen.add(id(obj))
        self.result.objects += 1
        if self.result.objects >= self.limits.objects:
            raise _Stop(f"object budget of {self.limits.objects:,} reached")
        if not self.result.objects % 1024 and time.perf_counter() > self.deadline:
            raise _Stop(f"time budget of {self.limits.seconds:g} s spent after {self.result.objects:,} objects")

    def model(self, model: nn.Module, path: str, holder: Holder | None, depth: int) -> Iterator[tuple]:
        """Each submodule's parameters and buffers, held by the submodule's class (a rule's owner)."""
        for name, submodule in model.named_modules(remove_duplicate=True):
            self.seen.add(id(submodule))
            where = f"{path}.{name}" if name else path
            cls = type(submodule)
            tensors = {**submodule._parameters, **submodule._buffers}
            for attribute, tensor in tensors.items():
                if tensor is not None:
                    self.parameter_names.setdefault(id(tensor), f"{where}.{attribute}")
                    yield tensor, f"{where}.{attribute}", holder or Holder(cls.__module__, cls.__qualname__, attribute), depth
            for attribute, value in vars(submodule).items():
                kind = type(value)
                if attribute in _MODULE_INTERNALS or issubclass(kind, _SKIPPED_IN_MODULES) or id(value) in self.seen:
                    continue
                owner = holder
                if holder is None and issubclass(kind, (torch.Tensor, *_MAPPINGS, *_SEQUENCES)):
                    owner = Holder(cls.__module__, cls.__qualname__, attribute)
                # an object (a token dispatcher) holds its state under its own class's names: its own holder
                yield value, f"{where}.{attribute}", owner, depth + 1

    def optimizer(self, optimizer: torch.optim.Optimizer, path: str, holder: Holder | None, depth: int) -> Iterator[tuple]:
        cls = type(optimizer)
        owner = holder or Holder(cls.__module__, cls.__qualname__, "state")
        for index, (parameter, state) in enumerate(self.bounded(optimizer.state.items(), len(optimizer.state), f"{path}.state")):
            name = self.parameter_names.get(id(parameter), f"parameter {index}")
            self.seen.add(id(state))
            for key, value in state.items() if issubclass(type(state), dict) else ():
                yield value, f"{path}.state[{name}][{key!r}]", owner, depth + 2
        for attribute, value in vars(optimizer).items():
            if attribute not in ("state", "param_groups"):
                yield value, f"{path}.{attribute}", holder or Holder(cls.__module__, cls.__qualname__, attribute), depth + 1

    def mapping(self, mapping: Any, path: str, holder: Holder | None, depth: int) -> Iterator[tuple]:
        for key, value in self.bounded(mapping.items(), len(mapping), path):
            yield value, f"{path}[{_key_text(key)}]", holder, depth + 1
            if not issubclass(type(key), _LEAVES):
                yield key, f"{path}.keys()[{_key_text(key)}]", holder, depth + 1

    def sequence(self, sequence: Any, path: str, holder: Holder | None, depth: int) -> Iterator[tuple]:
        ordered = issubclass(type(sequence), (list, tuple, deque))
        for index, value in enumerate(self.bounded(sequence, len(sequence), path)):
            yield value, f"{path}[{index}]" if ordered else f"{path}{{{index}}}", holder, depth + 1

    def attributes(self, obj: Any, path: str, holder: Holder | None, depth: int) -> Iterator[tuple]:
        """An object's own attributes (a singleton's state); the class is read, never the object's ``__getattr__``."""
        try:
            attributes = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            return
        if not issubclass(type(attributes), dict):
            return
        cls = type(obj)
        for attribute, value in self.bounded(list(attributes.items()), len(attributes), path):
            if not issubclass(type(value), _NOTHING_INSIDE):
                yield value, f"{path}.{attribute}", holder or Holder(cls.__module__, cls.__qualname__, attribute), depth + 1

    def bounded(self, items: Iterable[Any], size: int, path: str) -> Iterator[Any]:
        if size > self.limits.entries:
            self.result.cut.append(f"{path} ({size:,} entries)")
        for index, item in enumerate(items):
            if index >= self.limits.entries:
                return
            yield item


def _root_names(roots: Sequence[object]) -> list[str]:
    """``model``, ``optimizer``, ``train_args``; numbered (``model#1``) only where a kind comes twice."""
    kinds = [_root_kind(root) for root in roots]
    return [kind if kinds.count(kind) == 1 else f"{kind}#{index}" for index, kind in enumerate(kinds)]


def _root_kind(root: object) -> str:
    kind = type(root)
    return "model" if issubclass(kind, nn.Module) else "optimizer" if issubclass(kind, torch.optim.Optimizer) else "train_args"


def _key_text(key: object, limit: int = 80) -> str:
    """A dict key as a person reads it, without ever printing a tensor (that reads its data)."""
    text = _plain(key)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plain(key: object) -> str:
    kind = type(key)
    if issubclass(kind, tuple) and kind is tuple:
        items = [_plain(item) for item in key]  # type: ignore[attr-defined]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    return repr(key) if issubclass(kind, _LEAVES) else f"<{kind.__name__}>"


def _is_standard_library(kind: type) -> bool:
    """Loggers, locks, threads, files: nothing of the framework's state lives in them."""
    module = getattr(kind, "__module__", None) or ""
    return module == "builtins" or module.partition(".")[0] in sys.stdlib_module_names
