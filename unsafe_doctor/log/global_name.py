"""The name of a global, as every stage writes it: `module.owner.variable`.

It lives in `log`, the lowest stage that names globals: the sentinel's log lines (`sentinel_lines`)
carry one, and every stage above (the knowledge's tensors, the audit's holders, the sentinel's walk,
the replay's targets) holds the same class, so a global is joined to its dotted name in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

# What is known of a name is in its type, `GlobalName[Module, Variable]`: a holder the audit finds in
# source, or a global the replay proves, has both (`GlobalName[str, str]`); one the sentinel walks to
# may have no module (a model's buffer: `GlobalName[str | None, str]`); one a log line or a rule's
# pattern gives may lack either (`GlobalName[str | None, str | None]`).
Module = TypeVar("Module", bound="str | None", covariant=True)
Variable = TypeVar("Variable", bound="str | None", covariant=True)


@dataclass(frozen=True, slots=True)
class GlobalName(Generic[Module, Variable]):
    module: Module  # 'megatron.core.parallel_state'
    owner: str | None  # the class, for a class attribute, an instance attribute or a cached method
    variable: Variable  # '_GLOBAL_MEMORY_BUFFER'

    @property
    def dotted(self) -> str:
        """module.owner.variable, of the parts known: how fixes, verdicts and reports name the global."""
        parts: tuple[str | None, ...] = (self.module, self.owner, self.variable)
        return ".".join(part for part in parts if part)

    @property
    def qualname(self) -> str:
        """owner.variable, of the parts known: the name inside its module."""
        parts: tuple[str | None, ...] = (self.owner, self.variable)
        return ".".join(part for part in parts if part)
