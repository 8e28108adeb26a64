"""A rule's or template's fix filled for one subject: the code each adaptor function gets, in the
rule's own names (`train_args`, `src_rank`, `get_repair_group()`), with its imports and the guards of
the rule's conditions.

This is the text every command shows (diagnose's text, JSON and SARIF, the sentinel's heal inside
the training process), and whether it can be written at all (`NoFix`: the log does not name what
the template needs) is part of the classification; `block` then writes it into one adaptor
function, in that function's names.
"""

from __future__ import annotations

import ast
import builtins
import re
import string
import textwrap
from dataclasses import dataclass
from typing import Literal

from unsafe_doctor.knowledge.rules import (
    DEST_RANK,
    GROUP_PARAMETERS,
    PARAMETER_ROLES,
    SOURCE_RANK,
    AdaptorProfile,
    KnowledgeBase,
    Rule,
    RuleMatch,
    Template,
    is_safe_dotted,
    template_slots,
)
from unsafe_doctor.knowledge.subject import Subject

INDENT = "    "  # one indentation level of the rule templates, and where a function shows none


@dataclass(frozen=True)
class FixPlan:
    """The fix's code for each adaptor function it goes into, in the rule's names."""

    phase: Literal["rollback", "repair"]
    function: str  # the rollback function (scenario 1) or the receive function on the faulty rank
    code: str
    imports: tuple[str, ...]
    peer_function: str | None  # scenario 2: the send function on the replica rank
    peer_code: str | None
    profile: str  # adaptor profile whose names were used


@dataclass(frozen=True)
class NoFix:
    """The scenario is known but no fix can be written for it."""

    reason: str  # in plain words, as every command shows it


def _slots(rule: Rule | Template, subject: Subject, profile: AdaptorProfile, block: RuleMatch | None) -> dict[str, str]:
    """The slot values this finding can fill, each a plain Python name: a log is untrusted input.

    A slot whose value is unknown or unsafe is left out; a template that needs it is not rendered.
    `block` is the rule's match block that matched: it may name the variable the log does not.
    """
    tensor = subject.tensor
    variable = (block.variable if block else None) or (tensor.name.variable if tensor else None)
    module = tensor.name.module if tensor else None
    owner = tensor.name.owner if tensor else None
    slots: dict[str, str] = {}
    if variable is not None and is_safe_dotted(variable):
        slots["variable"] = variable
    if owner is not None and is_safe_dotted(owner):
        slots["owner"] = owner
    if module is not None and is_safe_dotted(module):
        parent, _, alias = module.rpartition(".")
        if tensor is not None and tensor.runs_as_main:  # the job's entry script: `import name` would load a second copy
            parent, alias = "", "__main__"
        slots.update(module=module, alias=alias, parent=parent)
        if owner is None or "owner" in slots:
            slots["holder"] = ".".join(part for part in (alias, owner) if part)  # what the global is an attribute of
            if "variable" in slots:
                slots["tensor"] = f"{slots['holder']}.{variable}"
    if rule.scenario == 2:
        slots.update(src=SOURCE_RANK, dst=DEST_RANK, group=profile.repair_group)
    return slots


def render_fix(
    rule: Rule | Template,
    subject: Subject,
    knowledge: KnowledgeBase,
    profile: AdaptorProfile,
    block: RuleMatch | None = None,
    *,
    guarded: bool = True,
) -> FixPlan | NoFix:
    """The rule's (or template's) fix filled with what `subject` names, for `profile`'s functions;
    NoFix, saying why, where the log leaves a slot the fix needs unnamed. `block`: the rule's match
    block that matched (the rule's own by default). ``guarded=False`` leaves out the guards of the
    rule's conditions."""
    block = block or (rule.match if isinstance(rule, Rule) else None)
    slots = _slots(rule, subject, profile, block)
    templates = [*rule.fix.imports, *(part for part in (rule.fix.code, rule.fix.send, rule.fix.recv) if part)]
    conditions = [knowledge.conditions[name] for name in (rule.conditions if isinstance(rule, Rule) else ())]
    module_name = slots.get("alias")
    if module_name is not None:
        taken = [
            *templates,
            *profile.repair_group_imports,
            profile.repair_group,
            *(part for condition in conditions for part in (condition.guard, *condition.imports)),
        ]
        slots = _free_alias(slots, taken)
    missing = set().union(*(template_slots(template) for template in templates)) - set(slots)
    if missing:
        return NoFix(_unnamed(missing, slots, subject, block))

    def fill(template: str | None) -> string.Template:  # the schema requires the templates of the rule's scenario
        return string.Template(template or "")

    imports = [_import_line(fill(line).substitute(slots), module_name, slots.get("alias")) for line in rule.fix.imports]
    guards = []
    for name in rule.conditions if isinstance(rule, Rule) and guarded else ():
        condition = knowledge.conditions[name]
        guards.append(condition.guard)
        imports.extend(condition.imports)
    if rule.scenario == 1:
        code = _guarded(fill(rule.fix.code).substitute(slots), guards)
        return FixPlan("rollback", profile.rollback, code, tuple(dict.fromkeys(imports)), None, None, profile.id)
    imports.extend(profile.repair_group_imports)
    recv = _guarded(fill(rule.fix.recv).substitute(slots), guards)
    send = _guarded(fill(rule.fix.send).substitute(slots), guards)
    return FixPlan("repair", profile.recv, recv, tuple(dict.fromkeys(imports)), profile.send, send, profile.id)


def _unnamed(missing: set[str], slots: dict[str, str], subject: Subject, block: RuleMatch | None) -> str:
    """Why no fix can be shown, said once for every command: what the fix must name that the log
    does not (the global's module, or the global itself), and what would name it."""
    names = "the sentinel names it" if subject.frame else "a traceback names it, as the sentinel does"
    then = f"{names} at the next fault: diagnose of that log writes the fix"
    tensor = subject.tensor
    if "alias" not in slots and missing & {"module", "alias", "parent", "holder", "tensor"}:
        if tensor is not None and tensor.name.module is not None:
            known = "the log's name for it is not a plain Python name"
        elif block is not None and block.module is not None:
            known = f"the rule knows it only by the pattern {block.module}"
        else:
            known = "the rule does not name it" if block is not None else "nothing in the log names it"
        return (
            f"no fix can be shown: the fix must import the module that holds the global, and the log does not say "
            f"which module that is ({known}); {then}"
        )
    if "variable" not in slots and missing & {"variable", "tensor"}:
        pattern = block.variable_regex if block is not None else None
        known = f"the rule knows it only by the pattern {pattern}" if pattern else "its name is not a plain Python name"
        return f"no fix can be shown: the fix must name the global, and the log does not say which one it is ({known}); {then}"
    return f"no fix can be shown: the log does not give a plain Python name for {', '.join(sorted(missing))}"


# names a fix's code reads besides the template's own: the roles, the rank loop's, a hook's group
_ROLE_NAMES = frozenset({*PARAMETER_ROLES, SOURCE_RANK, DEST_RANK, *GROUP_PARAMETERS})


def _free_alias(slots: dict[str, str], templates: list[str]) -> dict[str, str]:
    """The name the global's module is bound to in the block: its own (`state`), or, where that name
    is one the block needs otherwise (a builtin, `torch`, a local of the template, a role), the
    parent's and its own (`team_torch`), so that no binding of the block shadows another."""
    alias = slots["alias"]
    taken = set(dir(builtins)) | _ROLE_NAMES
    for template in templates:
        taken |= set(re.findall(r"(?<![$\w])[A-Za-z_]\w*", re.sub(r"#.*", "", template)))
    if alias not in taken or alias == "__main__":
        return slots
    free = f"{slots['parent'].rpartition('.')[2]}_{alias}" if slots["parent"] else f"{alias}_module"
    while free in taken:
        free += "_"
    holder = ".".join(part for part in (free, slots.get("owner")) if part)
    updated = {**slots, "alias": free, "holder": holder}
    if "tensor" in slots:
        updated["tensor"] = f"{holder}.{slots['variable']}"
    return updated


def _import_line(line: str, module_name: str | None, alias: str | None) -> str:
    """`from $parent import $alias` for a top-level module renders as `import alias`; a module bound
    under another name than its own (`_free_alias`) is imported `as` that name."""
    if module_name and alias and alias != module_name:
        line = re.sub(rf"\bimport {re.escape(alias)}$", f"import {module_name} as {alias}", line)
    return "import " + line.removeprefix("from  import ") if line.startswith("from  import ") else line


def _guarded(code: str, guards: list[str]) -> str:
    code = textwrap.dedent(code).strip("\n") + "\n"
    if not guards:
        return code
    joined = guards[0] if len(guards) == 1 else " and ".join(_and_operand(guard) for guard in guards)
    return f"if {joined}:\n" + textwrap.indent(code, INDENT)


def _and_operand(guard: str) -> str:
    """The guard as one operand of `and`: an `or` (an any-of condition's) or a conditional expression
    binds looser, so it is put in parentheses."""
    node = ast.parse(guard, mode="eval").body
    loose = isinstance(node, ast.IfExp) or (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or))
    return f"({guard})" if loose else guard
