"""Which rule fits a global, and which of several wins: the knowledge's match blocks read against a finding.

A block fits when every field it names fits (globs for module, file and function; a regex for the
variable; a loss scaling when the log shows one). Among fitting rules the most specific wins, then
the higher declared priority (`precedence`). `ties` says, before any finding, which two rules
could ever fit one global with the same precedence: the knowledge refuses such pairs, so file order
never decides. It errs towards yes; only fields that surely differ tell two blocks apart.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path

from unsafe_doctor.knowledge.rules import Rule, RuleMatch, variable_pattern
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.recovery import LossScaling
from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.source.files import import_root


def rule_matches(
    rule: Rule,
    name: GlobalName[str | None, str | None],
    file: str | None,
    *,
    function: str | None,
    loss_scaling: LossScaling | None = None,
) -> bool:
    """Whether one of the rule's match blocks fits the finding (see `matching_block`)."""
    return matching_block(rule, name, file, function=function, loss_scaling=loss_scaling) is not None


def matching_block(
    rule: Rule,
    name: GlobalName[str | None, str | None],
    file: str | None,
    *,
    function: str | None,
    loss_scaling: LossScaling | None = None,
) -> RuleMatch | None:
    """The rule's first match block whose every field fits; None when no block does.

    A block that names the culprit frame may supply the variable. A block that names a loss scaling
    fits a run with that loss scaling, or one whose loss scaling is unknown (None).
    """
    return next(
        (block for block in rule.matches if _block_fits(block, name, file, function=function, loss_scaling=loss_scaling)),
        None,
    )


def _block_fits(
    match: RuleMatch,
    name: GlobalName[str | None, str | None],
    file: str | None,
    *,
    function: str | None,
    loss_scaling: LossScaling | None,
) -> bool:
    if match.loss_scaling is not None and loss_scaling is not None and match.loss_scaling != loss_scaling:
        return False
    frame_named = match.file is not None and match.function is not None
    frame_ok = (match.file is None or (file is not None and fnmatchcase(file.replace("\\", "/"), match.file))) and (
        match.function is None or (function is not None and fnmatchcase(function, match.function))
    )
    if not frame_ok:
        return False
    if name.variable is None:
        return frame_named
    return match.names(name)


def frame_named(rule: Rule, name: GlobalName[str | None, str | None], definition: Path | None) -> Frame | None:
    """The frame a rule names, for a global whose name, owner and module the rule names exactly.

    Some rules recognise a tensor by the frame a log shows reading it (`attention_mask_func` reads
    the cached causal mask). Who knows the global itself (the audit from its source, the sentinel
    in the process) takes that frame as given: under the import root of the global's `definition`,
    or under `/` when no file is known; None for a name without its variable."""
    variable = name.variable
    if variable is None:
        return None
    match = next(
        (
            block
            for block in rule.matches
            if block.variable == variable and (block.file is not None or block.function is not None) and block.names(name)
        ),
        None,
    )
    if match is None:
        return None
    module = name.module
    root = import_root(definition, module) if definition is not None and module else Path("/")
    file = str(definition) if definition is not None else "/" + (module or variable).replace(".", "/") + ".py"
    if match.file is not None:
        tail = match.file.removeprefix("*/")
        if _is_glob(tail) or root is None:
            return None
        file = str(root / tail)
    function = match.function if match.function and not _is_glob(match.function) else "<module>"
    return Frame(file, None, function, None)


def _is_glob(pattern: str) -> bool:
    return any(char in pattern for char in "*?[")


def specificity(rule: Rule, match: RuleMatch | None = None) -> int:
    """More named fields, more specific: the most specific matching rule wins.

    `match` is the block that matched (the rule's first by default).
    """
    match = match or rule.match
    return sum(
        weight
        for weight, present in (
            (4, match.variable is not None),
            (2, match.variable_regex is not None),
            (3, match.module is not None and not _is_glob(match.module)),
            (2, match.module is not None and _is_glob(match.module)),
            (2, match.owner is not None),
            (1, match.file is not None),
            (1, match.function is not None),
            (1, match.loss_scaling is not None),
        )
        if present
    )


def precedence(rule: Rule, match: RuleMatch) -> tuple[int, int]:
    """What decides between rules that match one global: specificity, then the declared priority."""
    return specificity(rule, match), rule.priority


def ties(rules: Sequence[Rule]) -> list[tuple[Rule, Rule]]:
    """Each pair of rules (later, earlier) that one global could match with the same precedence, in
    the rules' order. Not every pair is compared: only blocks of one priority and specificity can
    tie, and a block naming a variable meets only blocks of that variable or of none, or, when both
    name a file and a function, any such block (a line naming no variable fits both)."""
    groups: dict[tuple[int, int], _TieGroup] = {}
    found: set[tuple[int, int]] = set()
    for index, rule in enumerate(rules):
        for block in rule.matches:
            group = groups.setdefault((rule.priority, specificity(rule, block)), _TieGroup())
            found.update(
                (index, other)
                for other, other_block in group.candidates(block)
                if other != index and _may_overlap(other_block, block)
            )
            group.add(index, block)
    return [(rules[index], rules[other]) for index, other in sorted(found)]


class _TieGroup:
    """The blocks of one priority and specificity seen so far, by the variable they name."""

    def __init__(self) -> None:
        self.by_variable: dict[str | None, list[tuple[int, RuleMatch]]] = {}
        self.framed: list[tuple[int, RuleMatch]] = []

    def candidates(self, block: RuleMatch) -> list[tuple[int, RuleMatch]]:
        if block.variable is None:
            return [entry for entries in self.by_variable.values() for entry in entries]
        return [
            *self.by_variable.get(block.variable, []),
            *self.by_variable.get(None, []),
            *(self.framed if _framed(block) else []),
        ]

    def add(self, index: int, block: RuleMatch) -> None:
        self.by_variable.setdefault(block.variable, []).append((index, block))
        if _framed(block) and block.variable is not None:
            self.framed.append((index, block))


def _framed(block: RuleMatch) -> bool:
    return block.file is not None and block.function is not None


def _may_overlap(a: RuleMatch, b: RuleMatch) -> bool:
    """Whether some finding could fit both blocks; only what is sure to differ says no."""
    if a.loss_scaling is not None and b.loss_scaling is not None and a.loss_scaling != b.loss_scaling:
        return False
    if not (_globs_may_meet(a.file, b.file) and _globs_may_meet(a.function, b.function)):
        return False
    return (_framed(a) and _framed(b)) or (  # a line naming no variable fits any two frame blocks whose frames meet
        _names_may_meet(a, b)
        and _globs_may_meet(a.module, b.module)
        and (a.owner is None or b.owner is None or a.owner == b.owner)
    )


def _names_may_meet(a: RuleMatch, b: RuleMatch) -> bool:
    if a.variable is not None and b.variable is not None:
        return a.variable == b.variable
    for named, other in ((a, b), (b, a)):
        names = {named.variable} if named.variable is not None else finite_names(named.variable_regex)
        if names is not None and other.variable_regex is not None:
            pattern = variable_pattern(other.variable_regex)
            return any(pattern.fullmatch(name) for name in names)
    return True


FINITE_NAMES = 1024  # past this many names, a regex of alternatives is taken as one that may match any


@functools.cache
def finite_names(regex: str | None) -> frozenset[str] | None:
    """The names a regex of literal alternatives (`A|B_(C|D)`) matches; None for any other regex,
    and for one of more than FINITE_NAMES names (`(a|b)` twenty times is a million): read with a
    stack, not by recursion, so that no nesting or size of pattern costs more than its length."""
    if regex is None or not re.fullmatch(r"[\w|()]*", regex):
        return None
    stack: list[tuple[list[set[str]], set[str]]] = [([], {""})]  # per open group: its alternatives, the current one
    for char in regex:
        alternatives, current = stack[-1]
        if char == "|":
            alternatives.append(current)
            if sum(map(len, alternatives)) > FINITE_NAMES:
                return None
            stack[-1] = (alternatives, {""})
        elif char == "(":
            stack.append(([], {""}))
        elif char == ")":
            if len(stack) == 1:
                return None
            stack.pop()
            inner = set().union(current, *alternatives)
            outer_alternatives, outer = stack[-1]
            if len(outer) * len(inner) > FINITE_NAMES:
                return None
            stack[-1] = (outer_alternatives, {start + end for start in outer for end in inner})
        else:
            stack[-1] = (alternatives, {start + char for start in current})
    if len(stack) != 1:
        return None
    alternatives, current = stack[0]
    return frozenset(set().union(current, *alternatives))


def _globs_may_meet(a: str | None, b: str | None) -> bool:
    """Whether one name could fit both globs: two globs must agree in their literal start and end."""
    if a is None or b is None:
        return True
    if not (_is_glob(a) and _is_glob(b)):
        return fnmatchcase(a, b) if _is_glob(b) else fnmatchcase(b, a)
    a_start, a_end = re.split(r"[*?[]", a)[0], re.split(r"[*?\]]", a)[-1]
    b_start, b_end = re.split(r"[*?[]", b)[0], re.split(r"[*?\]]", b)[-1]
    return (a_start.startswith(b_start) or b_start.startswith(a_start)) and (a_end.endswith(b_end) or b_end.endswith(a_end))
