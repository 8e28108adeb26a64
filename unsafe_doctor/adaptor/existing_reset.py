"""What the adaptor already does to a finding's global, before `fix` writes a block for it.

The adaptor's recovery functions are judged with `audit`'s coverage model
(`recovery_code.coverage.AdaptorCoverage`). A global they already reset gets no second block: the log
proves that reset did not help, so `fix` says where it is and what can make it ineffective (the
`if` it runs under, whether the job ran this file, a re-fill before the next step) and writes
nothing. A block is still written, with a note, when the failure is established: the adaptor's
handling is unsafe, or it rebinds a global that a module of the log's release imported by name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from unsafe_doctor.adaptor.code import adaptor_files, block_spans, read_adaptor_file
from unsafe_doctor.knowledge.classify import Classified
from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.rules import KnowledgeBase
from unsafe_doctor.knowledge.subject import Subject
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.source.syntax import callee_name

if TYPE_CHECKING:  # for types only: `fix` reads the adaptor's coverage only where a finding has a fix to place
    from unsafe_doctor.recovery_code.coverage import AdaptorCoverage
    from unsafe_doctor.recovery_code.model import Coverage


@dataclass(frozen=True)
class AlreadyReset:
    """A finding whose global the adaptor already resets (judged as `audit` judges coverage): a
    second block would fix nothing, since the log shows the first did not help. Nothing is written;
    `doubts` says what can make the existing reset ineffective, for the user to check."""

    finding: int
    variable: str
    coverage: Coverage
    doubts: tuple[str, ...]

    def __str__(self) -> str:
        where = ", ".join(f"{site.file}:{site.line} `{site.code}`" for site in self.coverage.sites)
        return (
            f"finding {self.finding}: {self.variable} is already {self.coverage.why} ({where}); nothing written, "
            f"since the log shows that reset did not help here. Check: {'; '.join(self.doubts)}"
        )


def existing_reset(
    subject: Subject, classification: Classified, key: str, context: RunContext, adaptor_coverage: AdaptorCoverage | None
) -> AlreadyReset | tuple[str, ...]:
    """How the adaptor already handles the finding's global: an AlreadyReset when it resets it and
    nothing establishes why that failed; else notes for the block that will be written (why the
    existing handling is not enough). Our own block for this key is `present`, not a reset of theirs."""
    environment = context.environment
    if environment.adaptor is None or adaptor_coverage is None:
        return ()
    ours = (span for path in adaptor_files(environment) if path.is_file() for span in block_spans(read_adaptor_file(path)))
    if any(span.key == key for span in ours):
        return ()
    for holder in _globals_of(subject, classification, context.knowledge):
        coverage = adaptor_coverage.of(holder)
        if coverage.status == "unsafe":
            where = ", ".join(f"{site.file}:{site.line}" for site in coverage.sites)
            return (
                f"the adaptor's own handling of {holder.variable} is unsafe ({where}): {coverage.why}; "
                "the block rebuilds it safely, and that statement should go",
            )
        if coverage.status != "covered":
            continue
        importers = context.workspace.importers_by_name(holder.module, holder.variable)
        if importers and coverage.how == "reset":
            return (
                f"the adaptor rebinds {holder.variable} ({coverage.sites[0].file}:{coverage.sites[0].line}), but "
                f"{importers[0]} imported it by name and keeps the old object: the block resets it in place",
            )
        return AlreadyReset(0, holder.dotted, coverage, _doubts(coverage, environment.adaptor))
    return ()


def _globals_of(subject: Subject, classification: Classified, knowledge: KnowledgeBase) -> list[GlobalName[str, str]]:
    """The globals a reset of this finding could name: the tensor's own, then those its rule names
    (the memory buffer's read fails in GlobalMemoryBuffer.buffer; the adaptor resets _GLOBAL_MEMORY_BUFFER)."""
    tensor = subject.tensor
    found = []
    if tensor is not None and tensor.name.variable and tensor.name.module:
        found.append(GlobalName(tensor.name.module, tensor.name.owner, tensor.name.variable))
    rule = knowledge.rule(classification.rule) if classification.rule else None
    for block in rule.matches if rule is not None else ():
        if block.variable and block.module and not any(char in block.module for char in "*?["):
            found.append(GlobalName(block.module, block.owner, block.variable))
    return list(dict.fromkeys(found))


def _doubts(coverage: Coverage, adaptor: Path) -> tuple[str, ...]:
    """What can make an existing reset ineffective, as far as the files can tell (none is established)."""
    called = {helper.rpartition(".")[2] for helper in coverage.via}
    at_sites = [guard for site in coverage.sites for guard in _guards(Path(site.file), {site.line}, set())]
    guards = dict.fromkeys([*at_sites, *_guards(adaptor, set(), called)])
    doubts = [f"it runs only when `{guard}` holds (line {line}): was that so in the job?" for line, guard in guards]
    doubts.append(f"did the job run this {adaptor.name}, or another copy of the adaptor?")
    if coverage.how == "reset":
        doubts.append("does anything re-fill it from unsafe memory between the rollback and the next step?")
    return tuple(doubts)


def _guards(path: Path, lines: set[int], calls: set[str]) -> list[tuple[int, str]]:
    """The `if` conditions (line, text) around the given lines of a file, and around its calls of
    `calls` (the helpers a reset goes through), outermost first."""
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return []
    lines = lines | {node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and callee_name(node.func) in calls}
    return [
        (node.lineno, ast.unparse(node.test))
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and any(node.body[0].lineno <= line <= (node.body[-1].end_lineno or 0) for line in lines)
    ]
