"""What a training step can reach, walked from the process itself, each tensor with a path a person can read.

Two kinds of start: the objects the adaptor passes (models, optimizers, ``train_args``), and the
module globals and class attributes of the packages asked for (``sys.modules``; never the standard
library). From there the walk follows containers (dict, list, tuple, set, deque, mapping proxies of a
dict) and the attributes of their subclasses, the attributes of objects (``__dict__`` and
``__slots__``: singletons, slotted dataclasses, ``argparse`` and ``types`` namespaces), functions'
closure cells, defaults and attributes, bound methods' ``__self__``, ``functools.partial``'s function,
arguments and keywords, ``nn.Module`` parameters, buffers and submodules, and optimizer state. It does
not follow ``.grad`` or other attributes of a tensor (a step starts by resetting gradients), data
loaders (host memory), code, frames and generators (a step does not resume them), properties (code
that would run), weak references, the internals of functions of torch and the standard library, or
modules and classes met on the way (a package's own are walked from ``sys.modules``, once each).

It runs no code of the objects it walks: containers are read through the base type's own methods
(``dict.items(obj)``, ``list.__iter__(obj)``), attributes through the descriptors of ``object`` and
``type``, so an override that raises, blocks or lies never runs. What it still cannot read (a mapping
proxy over a mapping that is not a dict, a slot hidden behind a descriptor, an object whose reading
fails) is counted and named, and the walk goes on.

Each tensor is attributed to a ``HolderName`` (a ``GlobalName``): the global, class attribute or object
attribute a rule would name (``megatron.core.parallel_state._GLOBAL_MEMORY_BUFFER``; ``TopKRouter.expert_bias`` for a
model's buffer). The walk is bounded in time, depth, entries per container and objects in all, and
says where it stopped early.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import sys
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.sentinel.reachable import LEAVES

# What a tensor is attributed to, as a rule names a global; no module for a model's buffer.
HolderName = GlobalName[str | None, str]

_LEAVES = (*LEAVES, torch.dtype, torch.device, torch.Size, weakref.ProxyType, weakref.CallableProxyType)
# Hold nothing a step reads through them: code and the descriptors that would run it, frames and
# generators, and the modules and classes met on the way (a package's own are walked from sys.modules).
_PASSED_OVER = (
    types.CodeType,
    property,
    types.MemberDescriptorType,
    types.GetSetDescriptorType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
    types.FrameType,
    types.GeneratorType,
    types.CoroutineType,
    types.AsyncGeneratorType,
    types.ModuleType,
    type,
)
_NOTHING_INSIDE = (*_LEAVES, *_PASSED_OVER)
_SKIPPED_IN_MODULES = (nn.Module, *_NOTHING_INSIDE)  # a module's submodules are walked with it
_HOST_DATA = (torch.utils.data.Dataset, torch.utils.data.DataLoader)
_CALLABLES = (types.FunctionType, types.MethodType, types.BuiltinMethodType, functools.partial, staticmethod, classmethod)
# what a module's class names as its own attribute; an object it holds names its state by its own class
_HELD_BY_THE_MODULE = (torch.Tensor, dict, types.MappingProxyType, list, tuple, deque, set, frozenset)
_NAMESPACES = (types.SimpleNamespace, argparse.Namespace)  # standard library, yet a framework's state (Megatron's args)
_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # torch's own bookkeeping: hooks, flags, the tensor dicts
_PACKAGES_NEVER_WALKED = frozenset({"torch", "torch_npu", "unsafe_doctor", "numpy", "typing_extensions", "_pytest", "pytest"})
_PLAIN_KEYS = (int, bool, float, complex, type(None), torch.dtype, torch.device)  # exactly these: repr runs no user code
FIRST_NAMED = 5  # places kept by name in a tally; the count goes on

# The base types' own readers: an object or class that overrides them runs none of its code.
_TYPE_DICT = type.__dict__["__dict__"]
_TYPE_MRO = type.__dict__["__mro__"]
_TYPE_NAME = type.__dict__["__name__"]
_TYPE_QUALNAME = type.__dict__["__qualname__"]
_TYPE_MODULE = type.__dict__["__module__"]
_MODULE_DICT = vars(types.ModuleType)["__dict__"]
_PARTIAL_FUNC, _PARTIAL_ARGS, _PARTIAL_KEYWORDS = (vars(functools.partial)[name] for name in ("func", "args", "keywords"))
_WRAPPED_FUNCTION = {staticmethod: vars(staticmethod)["__func__"], classmethod: vars(classmethod)["__func__"]}
# Sequences with their own iterator and length, read as the base type reads itself; ordered ones index by position.
_SEQUENCES: tuple[tuple[type, Callable[[Any], Iterator[Any]], Callable[[Any], int], bool], ...] = (
    (list, list.__iter__, list.__len__, True),
    (tuple, tuple.__iter__, tuple.__len__, True),
    (deque, deque.__iter__, deque.__len__, True),
    (set, set.__iter__, set.__len__, False),
    (frozenset, frozenset.__iter__, frozenset.__len__, False),
)


@dataclass(frozen=True, slots=True)
class Found:
    path: str
    holder: HolderName
    tensor: torch.Tensor
    # the class attribute that holds the tensor itself, where an outer one is its holder (an fp16
    # optimizer's `grad_scaler._scale`: held by the optimizer's `grad_scaler`, named `DynamicGradScaler._scale`)
    named: HolderName | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    seconds: float = 5.0  # the whole walk
    depth: int = 12  # levels below a global or an object attribute
    entries: int = 10_000  # of one container
    objects: int = 1_000_000  # visited in all: bounds the memory of the walk itself


@dataclass
class Tally:
    """Places of one kind the walk met: how many, and the first few by path."""

    count: int = 0
    first: list[str] = field(default_factory=list)

    def add(self, place: str) -> None:
        self.count += 1
        if len(self.first) < FIRST_NAMED:
            self.first.append(place)


@dataclass
class Walk:
    tensors: list[Found] = field(default_factory=list)
    caches: set[HolderName] = field(default_factory=set)  # holders that are lru-cached functions: their results were walked
    aliases: dict[HolderName, list[HolderName]] = field(default_factory=dict)  # other globals bound to the same object
    objects: int = 0
    stopped_early: str | None = None  # a budget ran out, a container was walked in part, or the depth limit cut
    cut: Tally = field(default_factory=Tally)  # containers walked in part: "path (N entries)"
    too_deep: Tally = field(default_factory=Tally)  # objects at the depth limit holding more, not opened
    not_walked: Tally = field(default_factory=Tally)  # objects it could not read: "path (why)"


class _Stop(Exception):
    """A budget ran out."""


def walk(roots: Sequence[object], packages: Iterable[str], limits: Limits = Limits()) -> Walk:
    """Every tensor reachable from ``roots`` and from the globals of ``packages``, each once, the first path kept."""
    walker = _ObjectGraph(limits)
    budget = None
    try:
        walker.roots(roots)
        walker.packages(frozenset(packages))
    except _Stop as stop:
        budget = str(stop)
    result = walker.result
    reasons = [budget, _cut_text(result.cut, limits), _too_deep_text(result.too_deep, limits)]
    result.stopped_early = "; ".join(reason for reason in reasons if reason) or None
    return result


def _cut_text(cut: Tally, limits: Limits) -> str | None:
    if not cut.count:
        return None
    more = f" and {cut.count - 1:,} more" if cut.count > 1 else ""
    return f"walked the first {limits.entries} entries of {cut.first[0]}{more}"


def _too_deep_text(too_deep: Tally, limits: Limits) -> str | None:
    if not too_deep.count:
        return None
    objects = f"{too_deep.count:,} object{'s' if too_deep.count > 1 else ''}"
    return f"depth limit of {limits.depth} levels: {objects} not opened, the first {too_deep.first[0]}"


def package_modules(packages: frozenset[str]) -> list[tuple[str, types.ModuleType]]:
    """The loaded modules of these top-level packages, deepest first: a package re-exporting a
    submodule's global comes after the submodule, which then names it."""
    wanted = packages - _PACKAGES_NEVER_WALKED - set(sys.stdlib_module_names)
    found = [
        (name, module)
        for name, module in list(dict.items(sys.modules))
        if type(name) is str and issubclass(type(module), types.ModuleType) and name.partition(".")[0] in wanted
    ]
    return sorted(found, key=lambda item: (-item[0].count("."), item[0]))


class _ObjectGraph:
    """The live objects a step can reach, each visited once: a walk of the process's objects, not of source."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.deadline = time.perf_counter() + limits.seconds
        self.seen: set[int] = set()
        self.result = Walk()
        self.parameter_names: dict[int, str] = {}
        self.global_holders: dict[int, HolderName] = {}
        self.named: dict[int, HolderName] = {}  # id of a tensor an object's attribute holds -> that attribute

    # --- starts ------------------------------------------------------------------------------

    def roots(self, roots: Sequence[object]) -> None:
        # models first: their parameters' names make optimizer state readable
        names = _root_names(roots)
        ordered = sorted(range(len(roots)), key=lambda index: not issubclass(type(roots[index]), nn.Module))
        for index in ordered:
            self.visit(roots[index], names[index], None, 0)

    def packages(self, packages: frozenset[str]) -> None:
        for name, module in package_modules(packages):
            namespace = _MODULE_DICT.__get__(module)
            if not issubclass(type(namespace), dict):
                continue
            for key, value in list(dict.items(namespace)):
                variable = _attribute_text(key)
                if variable.startswith("__") and variable.endswith("__"):
                    continue
                holder = GlobalName(name, None, variable)
                kind = type(value)
                if issubclass(kind, type):
                    if _class_module(value) == name:
                        self.guarded(f"{name}.{variable}", functools.partial(self.class_attributes, value, name))
                elif issubclass(kind, functools._lru_cache_wrapper):
                    if _same_text(_own(value).get("__module__"), name):
                        self.guarded(f"{name}.{variable}", functools.partial(self.cache, value, holder))
                elif id(value) in self.global_holders:
                    if not issubclass(kind, _NOTHING_INSIDE):
                        self.result.aliases.setdefault(self.global_holders[id(value)], []).append(holder)
                else:
                    if not issubclass(kind, _NOTHING_INSIDE):
                        self.global_holders[id(value)] = holder
                    self.visit(value, f"{name}.{variable}", holder, 0)

    def class_attributes(self, cls: type, module: str) -> None:
        owner = _TYPE_QUALNAME.__get__(cls)
        for key, value in list(_TYPE_DICT.__get__(cls).items()):
            attribute = _attribute_text(key)
            if attribute.startswith("__") and attribute.endswith("__"):
                continue
            holder = GlobalName(module, owner, attribute)
            if issubclass(type(value), functools._lru_cache_wrapper):
                self.cache(value, holder)
            else:
                self.visit(value, f"{module}.{owner}.{attribute}", holder, 0)

    def cache(self, function: Any, holder: HolderName) -> None:
        """An lru cache's keys and results, which Python does not list: CPython's wrapper hands them
        to the garbage collector (``gc.get_referents``), so they are checked like any other state."""
        self.result.caches.add(holder)
        referents = [item for item in gc.get_referents(function) if not issubclass(type(item), _NOTHING_INSIDE)]
        for index, item in enumerate(referents):
            self.visit(item, f"{holder.dotted}(…)[{index}]", holder, 1)

    def guarded(self, path: str, start: Callable[[], None]) -> None:
        """A start that reads a class or a cache: one that cannot be read is named, and the walk goes on."""
        try:
            start()
        except _Stop:
            raise
        except Exception as error:  # noqa: BLE001 - anything a hostile class raises: counted, never raised into the job
            self.result.not_walked.add(f"{path} ({_type_name(type(error))})")

    # --- the walk ----------------------------------------------------------------------------

    def visit(self, obj: Any, path: str, holder: HolderName | None, depth: int) -> None:
        """Depth first, each object once; ``holder`` None: not yet inside anything a rule names."""
        pending = [(obj, path, holder, depth)]
        while pending:
            obj, path, holder, depth = pending.pop()
            kind = type(obj)  # not isinstance, which asks objects for __class__ (proxies, deprecations)
            if issubclass(kind, _NOTHING_INSIDE) or id(obj) in self.seen:
                continue
            self.count(obj)
            if issubclass(kind, torch.Tensor):
                self.result.tensors.append(Found(path, holder or GlobalName(None, None, path), obj, self.named.get(id(obj))))
                continue
            if issubclass(kind, _HOST_DATA):
                continue
            inside = (
                child
                for child in self.children(obj, kind, path, holder, depth)
                if not issubclass(type(child[0]), _NOTHING_INSIDE)
            )
            try:
                if depth >= self.limits.depth:
                    if next(inside, None) is not None:
                        self.result.too_deep.add(path)
                    continue
                found = list(inside)
            except _Stop:
                raise
            except Exception as error:  # noqa: BLE001 - whatever reading it raised: counted, never raised into the job
                self.result.not_walked.add(f"{path} ({_type_name(type(error))})")
                continue
            pending.extend(reversed(found))

    def count(self, obj: object) -> None:
        self.seen.add(id(obj))
        self.result.objects += 1
        if self.result.objects >= self.limits.objects:
            raise _Stop(f"object budget of {self.limits.objects:,} reached")
        if not self.result.objects % 1024 and time.perf_counter() > self.deadline:
            raise _Stop(f"time budget of {self.limits.seconds:g} s spent after {self.result.objects:,} objects")

    def children(self, obj: Any, kind: type, path: str, holder: HolderName | None, depth: int) -> Iterator[tuple]:
        """What ``obj`` holds, as (object, path, holder, depth); lazily, so that the depth limit can peek."""
        if issubclass(kind, nn.Module):
            yield from self.model(obj, path, holder, depth)
            return
        if issubclass(kind, torch.optim.Optimizer):
            yield from self.optimizer(obj, path, holder, depth)
            return
        if issubclass(kind, dict):
            yield from self.mapping(obj, path, holder, depth)
        elif issubclass(kind, types.MappingProxyType):
            yield from self.proxy(obj, path, holder, depth)
        elif issubclass(kind, _CALLABLES):
            yield from self.callable(obj, kind, path, holder, depth)
        else:
            for base, iterate, size, ordered in _SEQUENCES:
                if issubclass(kind, base):
                    yield from self.sequence(iterate(obj), size(obj), ordered=ordered, path=path, holder=holder, depth=depth)
                    break
        if issubclass(kind, _NAMESPACES) or not _is_standard_library(kind):
            yield from self.attributes(obj, kind, path, holder, depth)

    def callable(self, obj: Any, kind: type, path: str, holder: HolderName | None, depth: int) -> Iterator[tuple]:
        """What a call reads besides its arguments: closure and defaults, a method's object, a partial's arguments."""
        if issubclass(kind, types.FunctionType):
            yield from self.function(obj, path, holder, depth)
        elif issubclass(kind, (types.MethodType, types.BuiltinMethodType)):
            yield obj.__self__, f"{path}.__self__", holder, depth + 1  # both types are final: no override runs
            if issubclass(kind, types.MethodType):
                yield obj.__func__, f"{path}.__func__", holder, depth + 1
        elif issubclass(kind, functools.partial):
            yield from self.partial(obj, path, holder, depth)
        else:
            reader = _WRAPPED_FUNCTION[staticmethod if issubclass(kind, staticmethod) else classmethod]
            yield reader.__get__(obj), f"{path}.__func__", holder, depth + 1

    def model(self, model: nn.Module, path: str, holder: HolderName | None, depth: int) -> Iterator[tuple]:
        """Each submodule's parameters and buffers, held by the submodule's class (a rule's owner)."""
        for name, submodule in _submodules(model):
            self.seen.add(id(submodule))
            where = f"{path}.{name}" if name else path
            cls = type(submodule)
            module, owner = _class_module(cls), _TYPE_QUALNAME.__get__(cls)
            state = _own(submodule)
            for table in ("_parameters", "_buffers"):
                for key, tensor in _dict_items(state.get(table)):
                    if tensor is not None:
                        attribute = _attribute_text(key)
                        self.parameter_names.setdefault(id(tensor), f"{where}.{attribute}")
                        yield tensor, f"{where}.{attribute}", holder or GlobalName(module, owner, attribute), depth
            for key, value in list(dict.items(state)):
                attribute = _attribute_text(key)
                kind = type(value)
                if attribute in _MODULE_INTERNALS or issubclass(kind, _SKIPPED_IN_MODULES) or id(value) in self.seen:
                    continue
                held = holder
                if holder is None and issubclass(kind, _HELD_BY_THE_MODULE):
                    held = GlobalName(module, owner, attribute)
                # an object (a token dispatcher) holds its state under its own class's names: its own holder
                yield value, f"{where}.{attribute}", held, depth + 1

    def optimizer(self, optimizer: torch.optim.Optimizer, path: str, holder: HolderName | None, depth: int) -> Iterator[tuple]:
        cls = type(optimizer)
        module, owner = _class_module(cls), _TYPE_QUALNAME.__get__(cls)
        attributes = _own(optimizer)
        state: Any = attributes.get("state")
        held = holder or GlobalName(module, owner, "state")
        if issubclass(type(state), dict):
            entries = self.bounded(dict.items(state), dict.__len__(state), f"{path}.state")
            for index, (parameter, per_parameter) in enumerate(entries):
                name = self.parameter_names.get(id(parameter), f"parameter {index}")
                self.seen.add(id(per_parameter))
                for key, value in _dict_items(per_parameter):
                    yield value, f"{path}.state[{name}][{_key_text(key)}]", held, depth + 2
        for key, value in list(dict.items(attributes)):
            attribute = _attribute_text(key)
            if attribute not in ("state", "param_groups"):
                yield value, f"{path}.{attribute}", holder or GlobalName(module, owner, attribute), depth + 1

    def mapping(self, mapping: dict, path: str, holder: HolderName | None, depth: int) -> Iterator[tuple]:
        for key, value in self.bounded(dict.items(mapping), dict.__len__(mapping), path):
            if _holds(value):
                yield value, f"{path}[{_key_text(key)}]", holder, depth + 1
            if _holds(key):
                yield key, f"{path}.keys()[{_key_text(key)}]", holder, depth + 1

    def proxy(self, proxy: types.MappingProxyType, path: str, holder: HolderName | None, depth: int) -> Iterator[tuple]:
        """A read-only view: of a dict, walked as that dict; of another mapping, reading it would run its code."""
        [mapping] = gc.get_referents(proxy)
        if issubclass(type(mapping), dict):
            yield from self.mapping(mapping, path, holder, depth)
        else:
            self.result.not_walked.add(f"{path} (a mapping proxy over a {_type_name(type(mapping))})")

    def sequence(
        self, items: Iterator[Any], size: int, *, ordered: bool, path: str, holder: HolderName | None, depth: int
    ) -> Iterator[tuple]:
        for index, value in enumerate(self.bounded(items, size, path)):
            if _holds(value):
                yield value, f"{path}[{index}]" if ordered else f"{path}{{{index}}}", holder, depth + 1

    def function(self, function: types.FunctionType, path: str, holder: HolderName | None, depth: int) -> Iterator[tuple]:
        """What a call reads besides its arguments: closure cells, defaults, and the function's own attributes.
        Functions of torch and the standard library are their internals, not a framework's state."""
        if _is_internal(function.__globals__.get("__name__")):  # where it was written: wraps() copies __module__
            return
        code = function.__code__
        for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=False):
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet bound
                continue
            yield value, f"{path}.<closure>.{name}", holder, depth + 1
        defaults = list(tuple.__iter__(function.__defaults__ or ()))
        positional = code.co_varnames[: code.co_argcount]
        for index, value in enumerate(defaults):
            position = len(positional) - len(defaults) + index
            name = positional[position] if position >= 0 else str(index)
            yield value, f"{path}.<default>.{name}", holder, depth + 1
        for key, value in _dict_items(function.__kwdefaults__):
            yield value, f"{path}.<default>.{_attribute_text(key)}", holder, depth + 1
        for key, value in _dict_items(function.__dict__):
            yield value, f"{path}.{_attribute_text(key)}", holder, depth + 1

    def partial(self, partial: functools.partial, path: str, holder: HolderName | None, depth: int) -> Iterator[tuple]:
        yield _PARTIAL_FUNC.__get__(partial), f"{path}.func", holder, depth + 1
        arguments = _PARTIAL_ARGS.__get__(partial)
        yield from self.sequence(
            tuple.__iter__(arguments), tuple.__len__(arguments), ordered=True, path=f"{path}.args", holder=holder, depth=depth
        )
        for key, value in _dict_items(_PARTIAL_KEYWORDS.__get__(partial)):
            yield value, f"{path}.keywords[{_key_text(key)}]", holder, depth + 1

    def attributes(self, obj: Any, kind: type, path: str, holder: HolderName | None, depth: int) -> Iterator[tuple]:
        """An object's own attributes (a singleton's state): its ``__dict__`` and its slots, read through
        ``type``'s and ``object``'s descriptors, never the object's ``__getattr__`` or a property."""
        module, owner = _class_module(kind), _TYPE_QUALNAME.__get__(kind)
        reader = _dict_reader(kind)
        instance: Any = None
        if reader is not None and not _reads_the_dict(reader):  # the class put its own __dict__ over the real one
            self.result.not_walked.add(f"{path} (its __dict__ is a {_type_name(type(reader))})")
        elif reader is not None:
            instance = reader.__get__(obj, kind)
        if issubclass(type(instance), dict):
            for key, value in self.bounded(dict.items(instance), dict.__len__(instance), path):
                if not _holds(value):
                    continue
                attribute = _attribute_text(key)
                if holder is not None and issubclass(type(value), torch.Tensor):
                    self.named.setdefault(id(value), GlobalName(module, owner, attribute))
                yield value, f"{path}.{attribute}", holder or GlobalName(module, owner, attribute), depth + 1
        for cls in _TYPE_MRO.__get__(kind):
            declared = _TYPE_DICT.__get__(cls)
            for name in _slot_names(declared.get("__slots__")):
                stored = _mangled(name, _TYPE_NAME.__get__(cls))
                reader = declared.get(stored)
                if type(reader) is not types.MemberDescriptorType:  # replaced or deleted since the class was made
                    hidden = f"behind a {_type_name(type(reader))}" if reader is not None else "with no reader left"
                    self.result.not_walked.add(f"{path}.{name} (a slot {hidden})")
                    continue
                try:
                    value = reader.__get__(obj, kind)
                except AttributeError:  # never set
                    continue
                yield value, f"{path}.{name}", holder or GlobalName(module, owner, name), depth + 1

    def bounded(self, items: Iterable[Any], size: int, path: str) -> Iterator[Any]:
        for index, item in enumerate(items):
            if index >= self.limits.entries:
                self.result.cut.add(f"{path} ({size:,} entries)")
                return
            yield item


def _holds(value: object) -> bool:
    """Whether a value can hold a tensor: filtered before its path is written, which costs more than the test."""
    return not issubclass(type(value), _NOTHING_INSIDE)


def _submodules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``named_modules()`` as torch orders it, read from each module's ``_modules`` without calling its methods."""
    memo: set[int] = set()
    pending: list[tuple[str, nn.Module]] = [("", model)]
    while pending:
        prefix, module = pending.pop()
        if id(module) in memo:
            continue
        memo.add(id(module))
        yield prefix, module
        children = [
            (f"{prefix}.{_attribute_text(key)}" if prefix else _attribute_text(key), child)
            for key, child in _dict_items(_own(module).get("_modules"))
            if issubclass(type(child), nn.Module)
        ]
        pending.extend(reversed(children))


def _dict_reader(kind: type) -> Any:
    """What ``obj.__dict__`` finds on the class: the descriptor ``type`` made, a class's own override, or None."""
    for cls in _TYPE_MRO.__get__(kind):
        reader = _TYPE_DICT.__get__(cls).get("__dict__")
        if reader is not None:
            return reader
    return None


def _reads_the_dict(reader: object) -> bool:
    """Whether it is the descriptor ``type`` made for instances' ``__dict__``, which runs no code of the class."""
    return type(reader) is types.GetSetDescriptorType or type(reader) is types.MemberDescriptorType


def _own(obj: object) -> dict:
    """An object's ``__dict__`` read by the descriptor ``type`` made, or an empty one (none, or a class's own)."""
    kind = type(obj)
    reader = _dict_reader(kind)
    value: Any = reader.__get__(obj, kind) if _reads_the_dict(reader) else None
    return value if issubclass(type(value), dict) else {}


def _dict_items(value: object) -> list[tuple[Any, Any]]:
    """A dict's items by ``dict`` itself (an override of ``items`` never runs); nothing for anything else."""
    return list(dict.items(value)) if issubclass(type(value), dict) else []  # type: ignore[arg-type]


def _slot_names(slots: object) -> list[str]:
    """The names a class's ``__slots__`` declares, when it is what Python accepts at class creation: a name or names."""
    if type(slots) is str:
        return [slots]
    if type(slots) is tuple or type(slots) is list:
        names: list[object] = list(slots)
        return [name for name in names if type(name) is str and name not in ("__dict__", "__weakref__")]
    if type(slots) is dict:
        return [name for name in dict.keys(slots) if type(name) is str and name not in ("__dict__", "__weakref__")]
    return []


def _mangled(name: str, cls: str) -> str:
    """``__x`` in ``__slots__`` of class ``C`` is stored as ``_C__x``."""
    if name.startswith("__") and not name.endswith("__"):
        return f"_{cls.lstrip('_')}{name}"
    return name


def _same_text(value: object, text: str) -> bool:
    """``value == text`` where ``value`` may be anything: only a string is compared (an ``__eq__`` never runs)."""
    return type(value) is str and value == text


def _class_module(cls: type) -> str:
    """A class's ``__module__`` as ``type`` reads it; "" when it is not a string."""
    try:
        module = _TYPE_MODULE.__get__(cls)
    except AttributeError:  # a class whose namespace lost its __module__
        return ""
    return module if type(module) is str else ""


def _type_name(kind: type) -> str:
    return _TYPE_NAME.__get__(kind)


def _is_standard_library(kind: type) -> bool:
    """Loggers, locks, threads, files: nothing of the framework's state lives in them."""
    module = _class_module(kind)
    return module == "builtins" or module.partition(".")[0] in sys.stdlib_module_names


def _is_internal(module: object) -> bool:
    """A function of torch (or of a package never walked) or of the standard library."""
    if type(module) is not str:
        return False
    top = module.partition(".")[0]
    return top in _PACKAGES_NEVER_WALKED or top in sys.stdlib_module_names or top == "builtins"


def _root_names(roots: Sequence[object]) -> list[str]:
    """``model``, ``optimizer``, ``train_args``; numbered (``model#1``) only where a kind comes twice."""
    kinds = [_root_kind(root) for root in roots]
    return [kind if kinds.count(kind) == 1 else f"{kind}#{index}" for index, kind in enumerate(kinds)]


def _root_kind(root: object) -> str:
    kind = type(root)
    return "model" if issubclass(kind, nn.Module) else "optimizer" if issubclass(kind, torch.optim.Optimizer) else "train_args"


def _attribute_text(name: object) -> str:
    """An attribute's or global's name for a path: a string as it is (a ``str`` subclass's own methods never run)."""
    if type(name) is str:
        return name
    return str.__str__(name) if issubclass(type(name), str) else _key_text(name)


def _key_text(key: object, limit: int = 80) -> str:
    """A dict key as a person reads it, running none of its code, and never printing a tensor (that reads its data)."""
    text = _plain(key, limit, 0)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plain(key: object, limit: int, nesting: int) -> str:
    kind = type(key)
    if kind is tuple:
        if nesting >= 3:
            return "(…)"
        entries: list[object] = list(itertools.islice(tuple.__iter__(key), 9))  # type: ignore[arg-type]
        items = [_plain(item, limit, nesting + 1) for item in entries[:8]]
        more = ", …" if len(entries) > 8 else ""
        return "(" + ", ".join(items) + ("," if len(items) == 1 and not more else "") + more + ")"
    if kind is int and key.bit_length() > 64:  # type: ignore[attr-defined]
        return f"<int of {key.bit_length():,} bits>"  # type: ignore[attr-defined]
    if kind is str or kind is bytes:
        return repr(key[: limit + 1])  # type: ignore[index]
    if any(kind is plain for plain in _PLAIN_KEYS):
        return repr(key)
    return f"<{_type_name(kind)}>"
