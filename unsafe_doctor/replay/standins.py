"""Stand-ins for the modules the adaptor imports that this machine lacks (mindio_ttp, megatron.training).

Only the modules the *unpatched* adaptor imports get one, so a fix that brings in a module the
adaptor's generation does not have still fails to import, as it would in the job. A stand-in's
names are inert (``StandIn``), except the repair-group getters, which give this replay's group
(its gloo one when asked for gloo, as ``get_repair_group(True)`` is), and ``get_args``, which
answers with the fix guards' switches on.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Protocol


class RepairGroups(Protocol):
    def __call__(self, *, gloo: bool) -> object:
        """The process group of this replay's repair: its gloo one when `gloo`."""


class StandIn:
    """Any name of a stand-in module: called, indexed or read, it gives another; it iterates empty
    and is false, so the adaptor's own optional branches stay off."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> StandIn:
        return StandIn(f"{self._name}()")

    def __getattr__(self, name: str) -> StandIn:
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self._name}.{name}")

    def __getitem__(self, key: object) -> StandIn:
        return StandIn(f"{self._name}[...]")

    def __iter__(self) -> Iterator[object]:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _Arguments(StandIn):
    """``get_args()``'s namespace: the fix guards' switches on, every other argument inert."""

    def __init__(self, switches: Iterable[str]) -> None:
        super().__init__("get_args()")
        for name in switches:
            self.__dict__[name] = True


class StandInModule(types.ModuleType):
    def __init__(self, name: str, getters: frozenset[str], groups: RepairGroups, switches: tuple[str, ...]) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package: its submodules import as stand-ins too
        self._getters, self._groups, self._switches = getters, groups, switches

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._getters:
            return self._getter
        if name == "get_args":
            return lambda: _Arguments(self._switches)
        return StandIn(f"{self.__name__}.{name}")

    def _getter(self, *args: object, **kwargs: object) -> object:
        gloo = any(value is True for value in args) or any(value is True for key, value in kwargs.items() if "gloo" in key)
        return self._groups(gloo=gloo)


def install_standins(
    modules: Iterable[str], getters: Iterable[str], groups: RepairGroups, switches: tuple[str, ...]
) -> list[str]:
    """A stand-in for each module that does not import here (and its missing parents); the names
    stood in, for the report."""
    stood_in = []
    for name in sorted(modules, key=_found):  # what is missing first: a module that imports one is then met
        if name in sys.modules or _imports(name):
            continue
        parts = name.split(".")
        for end in range(1, len(parts) + 1):
            dotted = ".".join(parts[:end])
            if dotted in sys.modules and not isinstance(sys.modules[dotted], StandInModule):
                continue
            if dotted not in sys.modules:
                sys.modules[dotted] = StandInModule(dotted, frozenset(getters), groups, switches)
            if end > 1:
                vars(sys.modules[".".join(parts[: end - 1])]).setdefault(parts[end - 1], sys.modules[dotted])
        stood_in.append(name)
    return sorted(stood_in)


def _found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _imports(name: str) -> bool:
    try:
        importlib.import_module(name)
    except (Exception, SystemExit):  # missing here, or failing at import without its hardware: stand in
        return False
    return True
