"""What a fault can reach from a global: every tensor behind it, found without running its code.

The harness checks these tensors after a recovery and probes touch them; torch-only, no backend.
"""

from __future__ import annotations

import weakref
from collections import deque
from types import MappingProxyType, ModuleType
from typing import Any

import torch

LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview, weakref.ref)  # hold no tensor
CODE = (  # functions and descriptors: a tensor they close over is not state a step reads through them
    type(len),  # builtin functions and methods
    type(lambda: None),
    type(object().__str__),  # method-wrapper
    type(str.join),  # method descriptor
    type(int.__add__),  # wrapper descriptor
    type(vars(ModuleType)["__dict__"]),  # getset descriptor
    property,
    classmethod,
    staticmethod,
)


def reachable_tensors(*roots: object) -> list[torch.Tensor]:
    """Every tensor reachable from ``roots``, each once, in the order found.

    Follows containers (dict, list, tuple, set, deque, mapping proxies), attributes in ``__dict__``
    and ``__slots__`` (so ``nn.Module`` parameters, buffers and submodules, and optimizer
    ``state`` and ``param_groups``), class attributes, and each leaf tensor's ``.grad``. A module
    passed as a root is walked through its globals. A module met on the way is not, or one global
    would pull in the whole program. Properties are not evaluated.
    """
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    root_ids = {id(root) for root in roots}
    pending: list[Any] = list(reversed(roots))  # Any: each object's kind is checked below, by type()
    while pending:
        obj = pending.pop()
        kind = type(obj)  # not isinstance, which asks objects for __class__ (proxies, deprecations)
        if id(obj) in seen or issubclass(kind, LEAVES) or issubclass(kind, CODE):
            continue
        seen.add(id(obj))
        if issubclass(kind, torch.Tensor):
            found[id(obj)] = obj
            if obj.is_leaf and obj.grad is not None:
                pending.append(obj.grad)
        if issubclass(kind, ModuleType):
            if id(obj) in root_ids:
                pending.extend(reversed(list(vars(obj).values())))
            continue
        if issubclass(kind, (dict, MappingProxyType)):
            pending.extend(reversed([*obj.keys(), *obj.values()]))
        elif issubclass(kind, (list, tuple, set, frozenset, deque)):
            pending.extend(reversed(list(obj)))
        attributes = getattr(obj, "__dict__", None)
        if isinstance(attributes, (dict, MappingProxyType)):  # an object's own __dict__: isinstance is safe
            pending.extend(reversed(list(attributes.values())))
        pending.extend(reversed(_slot_values(obj)))
    return list(found.values())


def _slot_values(obj: object) -> list[object]:
    if issubclass(type(obj), type):
        return []
    values = []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                values.append(getattr(obj, name))
    return values
