"""The name of a global, as every stage writes it: `module.owner.variable`.

It lives in `log`, the lowest stage that names globals: the sentinel's log lines (`sentinel_lines`)
carry one, and every stage above (the knowledge's tensors, the audit's holders, the sentinel's walk,
the replay's targets) holds the same class, so a global is joined to its dotted name in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

# A name as a log line tells it may lack its variable (a rule's pattern, a local of a module):
# `GlobalName[str | None]`; a holder found in source or in the process always has one: `GlobalName[str]`.
Variable = TypeVar("Variable", bound="str | None", covariant=True)


@dataclass(frozen=True, slots=True)
class GlobalName(Generic[Variable]):
    module: str | None  # 'megatron.core.parallel_state'; None when unknown (a model's buffer, a bare log line)
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
