"""The fixes of an audit's uncovered holders, planned into the adaptor: one plan for `audit --fix`,
one per holder for SARIF, which attaches a fix to each result."""

from __future__ import annotations

from dataclasses import dataclass

from unsafe_doctor.adaptor.plan import Plan, plan_fix
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.classify import Classified
from unsafe_doctor.knowledge.subject import Subject
from unsafe_doctor.recovery_code.model import Audit


@dataclass(frozen=True)
class _Fixable:
    """An uncovered holder with the classification whose fix it gets: what the fixer takes."""

    subject: Subject
    classification: Classified

    @property
    def suspect(self) -> None:
        """An audited holder is read from the source, never a suspect chosen from a shortlist."""
        return None


def _fixable(result: Audit) -> dict[str, _Fixable]:
    """The fixable holders, by name."""
    return {
        item.holder.name.dotted: _Fixable(item.subject, item.classification)
        for item in result.fixable
        if isinstance(item.classification, Classified)
    }


def plan_fixes(result: Audit) -> Plan:
    """One plan (one diff) with the fix of every uncovered holder that has one; refused without an
    adaptor to write into."""
    if result.context.environment.adaptor is None:
        raise UsageError("--fix needs the recovery adaptor: none was found under the paths; give --adaptor FILE")
    return plan_fix(list(_fixable(result).values()), result.context)


def plan_fixes_per_holder(result: Audit) -> dict[str, Plan]:
    """Each fixable holder's own plan (SARIF attaches a fix to each result)."""
    if result.context.environment.adaptor is None:
        return {}
    return {name: plan_fix([fixable], result.context) for name, fixable in _fixable(result).items()}
