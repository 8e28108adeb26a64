"""What the knowledge base says of each unsafe holder, asked inside the training process.

Rules only: the source heuristics read files for seconds, which a recovery cannot spare; a holder
no rule names is logged without a scenario, and ``diagnose`` on the log classifies it from the
source. Heal runs a scenario-1 rule's own fix here, without its conditions' guards (the sentinel
has just found the global, so the feature that creates it is on).
"""

from __future__ import annotations

import functools
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from unsafe_doctor.knowledge.classify import Classified, classify_by_rule
from unsafe_doctor.knowledge.context import Groundwork, RunContext, groundwork
from unsafe_doctor.knowledge.render.template import FixPlan
from unsafe_doctor.knowledge.subject import Subject, TensorRef
from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.sentinel.walk import HolderName


@dataclass(frozen=True)
class SentinelVerdict:
    scenario: Literal[1, 2] | None
    rule: str | None
    fix_function: str | None  # where `fix` writes the rule's code: the rollback or the receive function
    heal: str | None  # scenario 1: the rule's fix with its imports, runnable in this process
    written_by_step: str | None = None  # the knowledge's `step_written` entry: harmless, the step writes it first


NO_RULE = SentinelVerdict(None, None, None, None)


def verdicts(
    holders: Mapping[HolderName, Sequence[HolderName]], caches: Iterable[HolderName], rules: Sequence[Path]
) -> dict[HolderName, SentinelVerdict]:
    """Each holder's verdict, from the first of it and its aliases (the same object under other names)
    the knowledge names: as written by the step before it reads, else by a rule."""
    cached = set(caches)
    context = _groundwork(tuple(rules)).detect([_frame(holder) for holder in holders if holder.module])
    found = {}
    for holder, aliases in holders.items():
        written = next(filter(None, (_written(name, context) for name in (holder, *aliases))), None)
        if written is not None:
            found[holder] = SentinelVerdict(None, None, None, None, written)
            continue
        for name in (holder, *aliases):
            classified = _by_rule(name, cached=name in cached or holder in cached, context=context)
            if classified is not None:
                found[holder] = _verdict(classified)
                break
        else:
            found[holder] = NO_RULE
    return found


@functools.lru_cache(maxsize=4)
def _groundwork(rules: tuple[Path, ...]) -> Groundwork:
    """The knowledge, loaded once per process (a recovery may check more than once)."""
    return groundwork(rules)


def _written(holder: HolderName, context: RunContext) -> str | None:
    entry = context.knowledge.written_by_the_step(holder)
    return entry.id if entry else None


def heal(verdict: SentinelVerdict) -> str | None:
    """Run the rule's fix; None when it ran, else why not (an error the fix raised)."""
    if verdict.heal is None:
        return "no scenario-1 rule fix to run"
    namespace = {"__name__": "unsafe_doctor.sentinel.heal"}
    try:
        exec(compile(verdict.heal, f"<unsafe-doctor heal: {verdict.rule}>", "exec"), namespace)  # noqa: S102 (shipped rule code)
    except Exception as error:  # the rule's code met a state it does not expect: report, never break the recovery
        return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    return None


def _by_rule(holder: HolderName, *, cached: bool, context: RunContext) -> Classified | None:
    if holder.module is None:
        return None
    tensor = TensorRef(holder.qualname, holder, cached)
    frame = _frame(holder)
    return classify_by_rule(Subject(tensor, frame, frame.file), context, guarded=False)


def _frame(holder: HolderName) -> Frame:
    module = sys.modules.get(holder.module or "")
    return Frame(getattr(module, "__file__", None) or "<unknown>", None, "<module>", None)


def _verdict(classified: Classified) -> SentinelVerdict:
    fix = classified.fix
    if not isinstance(fix, FixPlan):
        return SentinelVerdict(classified.scenario, classified.rule, None, None)
    heal_code = None
    if classified.scenario == 1:
        heal_code = "\n".join(fix.imports) + "\n" + textwrap.dedent(fix.code)
    return SentinelVerdict(classified.scenario, classified.rule, fix.function, heal_code)
