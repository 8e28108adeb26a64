"""The bridge from holders to the diagnosis stages: classification (rules, then heuristics) and the
fixes, for a holder found by reading source rather than by a fault in a log.

A holder classifies through `classify()` with a finding built for it, at the first of its sites
that a rule names (a rule may name the frame a log shows reading the tensor: the audit takes that
frame as given when the rule names the holder itself), else at its definition. Heuristics run only
for uncovered holders that no rule knows; a cache is scenario 1 by its nature. The generic fixes
behind heuristic verdicts handle a tensor, dict or list: singletons, caches and buffers get no
generic fix."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from unsafe_doctor.audit.model import Audit, Coverage, Holder, Site
from unsafe_doctor.classify import GENERIC_RULE_IDS, Classification, classify, classify_as
from unsafe_doctor.diagnosis import DiagnosedFinding
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge import KnowledgeBase, Rule, rule_matches
from unsafe_doctor.locate import Finding, TensorRef
from unsafe_doctor.source.files import import_root
from unsafe_doctor.tracebacks import Frame, Traceback
from unsafe_doctor.versions import Environment

if TYPE_CHECKING:
    from unsafe_doctor.fix import Plan


def classification(
    holder: Holder, coverage: Coverage, knowledge: KnowledgeBase, environment: Environment
) -> tuple[Finding, Classification | None]:
    """Rules first, at the first site a rule names; heuristics only for an uncovered holder."""
    finding = _finding(holder)
    frame = _named_frame(holder, [rule for rule in knowledge.rules if rule.id not in GENERIC_RULE_IDS])
    if frame is None and coverage.status != "uncovered":
        return finding, None
    if frame is None and holder.kind == "lru-cache":
        return finding, _cache_classification(holder, finding, knowledge, environment)
    if frame is not None and frame != finding.culprit:
        finding = replace(finding, culprit=frame)
    verdict = classify(finding, knowledge, environment)
    if verdict.rule is None and verdict.fix is not None and holder.kind in ("singleton", "buffer"):
        note = (
            f"no fix written: the generic fixes handle a tensor, dict, list or lru cache, not a {holder.kind}; "
            "reset it by hand or add a rule (--rules)"
        )
        verdict = replace(verdict, fix=None, notes=(*verdict.notes, note))
    return finding, verdict


def _named_frame(holder: Holder, specific: list[Rule]) -> Frame | None:
    """The first of the holder's sites (or of the frames rules name for it) that a specific rule matches."""
    candidates = [_frame(site) for site in (holder.definition, *holder.writers, *holder.readers)]
    candidates += [frame for frame in (_rule_frame(rule, holder) for rule in specific) if frame is not None]
    return next(
        (
            candidate
            for candidate in candidates
            if any(
                rule_matches(rule, holder.variable, holder.module, holder.owner, candidate.file, candidate.function)
                for rule in specific
            )
        ),
        None,
    )


def _finding(holder: Holder) -> Finding:
    """The holder as a finding located at its definition, for classify() and the fixer."""
    expression = f"{holder.owner}.{holder.variable}" if holder.owner else holder.variable
    frame = _frame(holder.definition)
    traceback = Traceback(
        rank=None, source="audit", offset=0, frames=(frame,), exception_type="", message="", error_code=None,
        npu_rank=None, device=None, truncated=False, caused_by=None, chain_kind=None,
    )
    path = str(Path(holder.definition.file).resolve())
    return Finding(
        ranks=(), traceback=traceback, unsafe=traceback, culprit=frame,
        tensor=TensorRef(expression, holder.variable, holder.module, holder.owner), source_file=path, notes=(),
    )


def _cache_classification(holder: Holder, finding: Finding, knowledge: KnowledgeBase, environment: Environment) -> Classification:
    """A cache holds values computed from its arguments and computes them again when missing: scenario
    1 by its nature, fixed by emptying it. (The source heuristics would read every file naming the
    function, and names such as `forward` are everywhere.)"""
    cached = f"{holder.owner}.{holder.variable}" if holder.owner else holder.variable
    reason = (
        f"{cached} is a cache: what it returns is computed from its arguments and computed again once "
        "emptied, so it carries nothing into the next step; empty it with cache_clear() in the rollback"
    )
    evidence = (f"{holder.definition.file}:{holder.definition.line}: decorated with a cache: `{holder.definition.code}`",)
    tensor = finding.tensor
    cache = finding if tensor is None else replace(finding, tensor=replace(tensor, cached=True))
    return replace(classify_as(cache, 1, knowledge, environment, evidence), confidence="medium", reason=reason)


def _rule_frame(rule: Rule, holder: Holder) -> Frame | None:
    """The frame a rule names, for a holder whose name, owner and module the rule names exactly.

    Some rules recognise a tensor by the frame a log shows reading it (`attention_mask_func` reads
    the cached causal mask): the audit knows the holder itself, so the frame is taken as given,
    placed under the holder's import root."""
    match = next(
        (
            block
            for block in rule.matches
            if block.variable == holder.variable
            and (block.file is not None or block.function is not None)
            and rule_matches(
                replace(rule, match=replace(block, file=None, function=None), also_match=()),
                holder.variable, holder.module, holder.owner, None, None,
            )
        ),
        None,
    )
    if match is None:
        return None
    definition = Path(holder.definition.file).resolve()
    file = str(definition)
    if match.file is not None:
        tail = match.file.removeprefix("*/")
        root = import_root(definition, holder.module)
        if _is_glob(tail) or root is None:
            return None
        file = str(root / tail)
    function = match.function if match.function and not _is_glob(match.function) else "<module>"
    return Frame(file, None, function, None)


def _is_glob(pattern: str) -> bool:
    return any(char in pattern for char in "*?[")


def _frame(site: Site) -> Frame:
    function = site.function.rpartition(".")[2] if site.function else "<module>"
    return Frame(str(Path(site.file).resolve()), site.line, function, site.code or None)


# --- fixes -------------------------------------------------------------------------------------------------


def _diagnosed(result: Audit) -> dict[str, DiagnosedFinding]:
    """The fixable holders, by name, as the fixer takes findings."""
    return {
        item.holder.name: DiagnosedFinding(item.finding, "none", item.classification)
        for item in result.fixable
        if item.classification is not None
    }


def plan_fixes(result: Audit, knowledge: KnowledgeBase) -> Plan:
    """One plan (one diff) with the fix of every uncovered holder that has one; refused without an
    adaptor to write into."""
    from unsafe_doctor.fix import plan_fix  # libcst loads only when a fix is planned

    if result.environment.adaptor is None:
        raise UsageError("--fix needs the recovery adaptor: none was found under the paths; give --adaptor FILE")
    return plan_fix(list(_diagnosed(result).values()), result.environment, knowledge)


def plan_fixes_per_holder(result: Audit, knowledge: KnowledgeBase) -> dict[str, Plan]:
    """Each fixable holder's own plan (SARIF attaches a fix to each result)."""
    from unsafe_doctor.fix import plan_fix

    if result.environment.adaptor is None:
        return {}
    return {name: plan_fix([diagnosed], result.environment, knowledge) for name, diagnosed in _diagnosed(result).items()}
