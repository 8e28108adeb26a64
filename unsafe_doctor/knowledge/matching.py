"""Which rule fits a global, and which of several wins: the knowledge's match blocks read against a finding.

A block fits when every field it names fits (globs for module, file and function; a regex for the
variable; a loss scaling when the log shows one). Among fitting rules the most specific wins, then
the higher declared priority (`precedence`). `may_tie` says, before any finding, whether two rules
could ever fit one global with the same precedence: the knowledge refuses such pairs, so file order
never decides. It errs towards yes; only fields that surely differ tell two blocks apart.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from pathlib import Path

from unsafe_doctor.knowledge.rules import Rule, RuleMatch
from unsafe_doctor.log.recovery import LossScaling
from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.source.files import import_root


def rule_matches(
    rule: Rule,
    variable: str | None,
    module: str | None,
    owner: str | None,
    file: str | None,
    function: str | None,
    loss_scaling: LossScaling | None = None,
) -> bool:
    """Whether one of the rule's match blocks fits the finding (see `matching_block`)."""
    return matching_block(rule, variable, module, owner, file, function, loss_scaling) is not None


def matching_block(
    rule: Rule,
    variable: str | None,
    module: str | None,
    owner: str | None,
    file: str | None,
    function: str | None,
    loss_scaling: LossScaling | None = None,
) -> RuleMatch | None:
    """The rule's first match block whose every field fits; None when no block does.

    A block that names the culprit frame may supply the variable. A block that names a loss scaling
    fits a run with that loss scaling, or one whose loss scaling is unknown (None).
    """
    return next(
        (block for block in rule.matches if _block_fits(block, variable, module, owner, file, function, loss_scaling)),
        None,
    )


def _block_fits(
    match: RuleMatch,
    variable: str | None,
    module: str | None,
    owner: str | None,
    file: str | None,
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
    if variable is None:
        return frame_named
    return match.names(variable, module, owner)


def frame_named(rule: Rule, variable: str, module: str | None, owner: str | None, definition: Path | None) -> Frame | None:
    """The frame a rule names, for a global whose name, owner and module the rule names exactly.

    Some rules recognise a tensor by the frame a log shows reading it (`attention_mask_func` reads
    the cached causal mask). Who knows the global itself (the audit from its source, the sentinel
    in the process) takes that frame as given: under the import root of the global's `definition`,
    or under `/` when no file is known."""
    match = next(
        (
            block
            for block in rule.matches
            if block.variable == variable
            and (block.file is not None or block.function is not None)
            and block.names(variable, module, owner)
        ),
        None,
    )
    if match is None:
        return None
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


def may_tie(first: Rule, second: Rule) -> bool:
    """Whether one global could match both rules with the same precedence (erring towards yes)."""
    return first.priority == second.priority and any(
        specificity(first, a) == specificity(second, b) and _may_overlap(a, b) for a in first.matches for b in second.matches
    )


def _may_overlap(a: RuleMatch, b: RuleMatch) -> bool:
    """Whether some finding could fit both blocks; only what is sure to differ says no."""
    if a.loss_scaling is not None and b.loss_scaling is not None and a.loss_scaling != b.loss_scaling:
        return False
    if not (_globs_may_meet(a.file, b.file) and _globs_may_meet(a.function, b.function)):
        return False
    frames_only = a.file is not None and a.function is not None and b.file is not None and b.function is not None
    return frames_only or (  # a line naming no variable fits any two frame blocks whose frames meet
        _names_may_meet(a, b)
        and _globs_may_meet(a.module, b.module)
        and (a.owner is None or b.owner is None or a.owner == b.owner)
    )


def _names_may_meet(a: RuleMatch, b: RuleMatch) -> bool:
    if a.variable is not None and b.variable is not None:
        return a.variable == b.variable
    for named, other in ((a, b), (b, a)):
        names = {named.variable} if named.variable is not None else _finite_names(named.variable_regex)
        if names is not None and other.variable_regex is not None:
            return any(re.fullmatch(other.variable_regex, name) for name in names)
    return True


def _finite_names(regex: str | None) -> set[str] | None:
    """The names a regex of literal alternatives (`A|B_(C|D)`) matches; None for any other regex."""
    if regex is None or not re.fullmatch(r"[\w|()]*", regex):
        return None
    names, rest = _alternatives(regex)
    return None if rest else names


def _alternatives(text: str) -> tuple[set[str], str]:
    """The strings of `text` up to its first unopened `)`, and what follows."""
    options: list[set[str]] = []
    current = {""}
    while text and text[0] != ")":
        char, text = text[0], text[1:]
        if char == "|":
            options.append(current)
            current = {""}
        elif char == "(":
            inner, text = _alternatives(text)
            text = text[1:]
            current = {start + end for start in current for end in inner}
        else:
            current = {start + char for start in current}
    return set().union(current, *options), text


def _globs_may_meet(a: str | None, b: str | None) -> bool:
    """Whether one name could fit both globs: two globs must agree in their literal start and end."""
    if a is None or b is None:
        return True
    if not (_is_glob(a) and _is_glob(b)):
        return fnmatchcase(a, b) if _is_glob(b) else fnmatchcase(b, a)
    a_start, a_end = re.split(r"[*?[]", a)[0], re.split(r"[*?\]]", a)[-1]
    b_start, b_end = re.split(r"[*?[]", b)[0], re.split(r"[*?\]]", b)[-1]
    return (a_start.startswith(b_start) or b_start.startswith(a_start)) and (a_end.endswith(b_end) or b_end.endswith(a_end))
