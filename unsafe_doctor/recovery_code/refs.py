"""What a name in framework code can refer to, as the audit tells them apart: a module, a class,
an instance of a class seen from its own methods, a function, or a holder (or a part of one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.source.syntax import Function


class ClassKey(NamedTuple):
    module: str
    name: str


@dataclass(frozen=True, slots=True)
class ModuleRef:
    name: str


@dataclass(frozen=True, slots=True)
class ClassRef:
    module: str
    name: str


@dataclass(frozen=True, slots=True)
class SelfRef:
    """`self` inside a method: attributes are looked up on the class, buffers belong to the instance."""

    module: str
    name: str  # the class


@dataclass(frozen=True)
class FunctionRef:
    """A function or method. Its node is found on demand (`node`): a reference kept to a module's
    function does not keep the module's tree, which the audit lets go and reads again; its place
    tells functions apart."""

    module: str
    owner: str | None
    place: tuple[int, int]  # the `def`'s line and column
    statements: int  # in its body, at its top level
    found: Callable[[], Function] = field(compare=False, repr=False)

    @classmethod
    def holding(cls, module: str, owner: str | None, node: Function) -> FunctionRef:
        """A reference that holds its node (a method or nested function: looked up, used, dropped)."""
        return cls(module, owner, (node.lineno, node.col_offset), len(node.body), lambda: node)

    @property
    def node(self) -> Function:
        return self.found()


@dataclass(frozen=True, slots=True)
class HolderRef:
    key: GlobalName[str, str]  # a place a tensor can outlive a step: `module.variable`, or `module.owner.variable` in a class
    element: bool  # an entry, field or value computed from it, not the holder itself


Ref = ModuleRef | ClassRef | SelfRef | FunctionRef | HolderRef
