"""The bridge from holders to the knowledge: classification (rules, then heuristics) for a holder
found by reading source rather than by a fault in a log (`adaptor.audit_fixes` plans their fixes).

A holder classifies through `classify()` with a subject built for it, at the first of its sites
that a rule names (a rule may name the frame a log shows reading the tensor: the audit takes that
frame as given when the rule names the holder itself), else at its definition. Heuristics run only
for uncovered holders that no rule knows; a cache is scenario 1 by its nature. The generic fixes
behind heuristic verdicts handle a tensor, dict or list: singletons, caches and buffers get no
generic fix."""

from __future__ import annotations

from dataclasses import replace
from itertools import chain
from pathlib import Path

from unsafe_doctor.knowledge.classify import Classification, Classified, classify, classify_as
from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.matching import frame_named, rule_matches
from unsafe_doctor.knowledge.render.template import FixPlan, NoFix
from unsafe_doctor.knowledge.rules import Rule
from unsafe_doctor.knowledge.subject import Evidence, Subject
from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.recovery_code.model import Coverage, Holder, Site


def classification(holder: Holder, coverage: Coverage, context: RunContext) -> tuple[Subject, Classification | None]:
    """Rules first, at the first site a rule names; heuristics only for an uncovered holder."""
    subject = _subject(holder)
    frame = _named_frame(holder, list(context.knowledge.rules))
    if frame is None and coverage.status != "uncovered":
        return subject, None
    if frame is None and holder.kind == "lru-cache":
        return subject, _cache_classification(holder, context)
    if frame is not None and frame != subject.frame:
        subject = replace(subject, frame=frame)
    return subject, _generic_fix_checked(classify(subject, context), holder)


def _generic_fix_checked(verdict: Classification, holder: Holder) -> Classification:
    """The generic fixes handle a tensor, dict, list or lru cache: a singleton, registry or buffer that
    no rule knows gets no fix."""
    if not isinstance(verdict, Classified) or verdict.rule is not None or not isinstance(verdict.fix, FixPlan):
        return verdict
    if holder.kind not in ("singleton", "registry", "buffer"):
        return verdict
    note = (
        f"no fix written: the generic fixes handle a tensor, dict, list or lru cache, not a {holder.kind}; "
        "reset it by hand or add a rule (--rules)"
    )
    return replace(verdict, fix=NoFix(note), notes=(*verdict.notes, note))


def _named_frame(holder: Holder, specific: list[Rule]) -> Frame | None:
    """The first of the holder's sites (or of the frames rules name for it) that a specific rule
    matches; each site's file resolved once, and only up to the first match."""
    resolved: dict[str, str] = {}
    sites = (_frame(site, resolved) for site in (holder.definition, *holder.writers, *holder.readers))
    definition = Path(_resolved(holder.definition.file, resolved))
    name = holder.name
    named = (frame_named(rule, name, definition) for rule in specific)
    return next(
        (
            candidate
            for candidate in chain(sites, (frame for frame in named if frame is not None))
            if any(rule_matches(rule, name, candidate.file, function=candidate.function) for rule in specific)
        ),
        None,
    )


def _subject(holder: Holder, *, cached: bool = False) -> Subject:
    """The holder read at its definition."""
    frame = _frame(holder.definition)
    return Subject.of_global(holder.name, frame.file, frame.line, function=frame.function, code=frame.source, cached=cached)


def _cache_classification(holder: Holder, context: RunContext) -> Classified:
    """A cache holds values computed from its arguments and computes them again when missing: scenario
    1 by its nature, fixed by emptying it. (The source heuristics would read every file naming the
    function, and names such as `forward` are everywhere.)"""
    reason = (
        f"{holder.name.qualname} is a cache: what it returns is computed from its arguments and computed again once "
        "emptied, so it carries nothing into the next step; empty it with cache_clear() in the rollback"
    )
    evidence = (Evidence(holder.definition.file, holder.definition.line, f"decorated with a cache: `{holder.definition.code}`"),)
    return replace(classify_as(_subject(holder, cached=True), 1, context, evidence), confidence="medium", reason=reason)


def _frame(site: Site, resolved: dict[str, str] | None = None) -> Frame:
    """The site as a frame, its file resolved (`resolved`: the files resolved so far)."""
    function = site.function.rpartition(".")[2] if site.function else "<module>"
    return Frame(_resolved(site.file, resolved if resolved is not None else {}), site.line, function, site.code or None)


def _resolved(file: str, resolved: dict[str, str]) -> str:
    if file not in resolved:
        resolved[file] = str(Path(file).resolve())
    return resolved[file]
