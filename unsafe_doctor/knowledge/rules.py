"""The knowledge base. Rules, templates, conditions and adaptor profiles are data (YAML),
validated on load.

A rule says, for one global tensor (matched by name, module, owner class or culprit frame, and by
the run's loss scaling where a frame alone is ambiguous; a rule may list several such match
blocks), in which framework versions it holds, which scenario it is, in which recovery phase it is
fixed, the code that fixes it as a template over validated slots, and the replay probe that
builds its state. When several rules match, the most specific wins, then the higher `priority`;
two rules that could match one global with the same specificity and priority are refused, so file
order never decides. A template is the fix for a global no rule knows, chosen by the scenario and
by what the global is (a value, or an lru-cached function). A condition names the framework
argument that switches a feature on (or several, any of which does); its guard is rendered from
it. Adaptor profiles describe each generation of the recovery adaptor: where it lives, its
rollback / send / receive functions and which parameter holds each role (`PARAMETER_ROLES`, the
one list of them).

`loading` builds them from the files (`yaml_file` reads one, lines kept, schema checked); `matching`
fits rules to a global.
"""

from __future__ import annotations

import ast
import functools
import keyword
import math
import operator
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any, Literal, get_args

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from unsafe_doctor.errors import UsageError
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.recovery import LossScaling

Scenario = Literal[1, 2]
FixPhase = Literal["rollback", "repair"]
# What a global is, for choosing a template: a tensor, dict or list (as its assignment shows), a value
# of a kind not shown, or an lru-cached function. Every scenario has a template for the base kinds;
# the others fall back to value's.
GlobalKind = Literal["value", "tensor", "dict", "list", "lru-cache"]
BASE_KINDS: tuple[GlobalKind, ...] = ("value", "lru-cache")
# What MindIO passes the adaptor's repair functions; a profile names the parameter that holds each.
ParameterRole = Literal["src_ranks", "dest_ranks", "optim_idxs", "rank_list", "train_args", "need_rebuild"]
PARAMETER_ROLES: tuple[ParameterRole, ...] = get_args(ParameterRole)
# Roles that map onto the others (profile files and `--parameter`): `peer`, the one rank on the other
# side (the source where a function receives, the destination where it sends; ranks then are no
# lists); `group`, a parameter holding the repair group (instead of the profile's expression).
MAPPING_ROLES = ("peer", "group")
EVERY_ROLE = (*PARAMETER_ROLES, *MAPPING_ROLES)
# parameter names that hold the repair group where a hook takes it (`push_state_to_peer(peer, group)`)
GROUP_PARAMETERS = ("repair_group", "group", "process_group")
# The names a scenario-2 template's $src and $dst render to; the fix binds them from the rank roles.
SOURCE_RANK = "src_rank"
DEST_RANK = "dest_rank"
# Where a training step first reads a global, in the order a step runs: the shortlist of an untraced
# error puts what the step reads first first (the first unsafe read is the one that raises).
ReadStage = Literal["embedding", "attention", "moe", "loss", "backward", "optimizer", "logging"]
READ_STAGES: tuple[ReadStage, ...] = get_args(ReadStage)
# Probes the replay implements (replay/probes.py registers one class per name; a test holds the two equal).
PROBE_NAMES = frozenset({"megatron-layer-wise-tracker", "megatron-aux-losses-tracker", "megatron-router-expert-bias"})


class PatternError(ValueError):
    """A variable_regex that RE2 does not take; the message says why."""


@functools.cache
def variable_pattern(regex: str) -> Any:
    """A rule's `variable_regex`, compiled by RE2: matching takes time linear in the text whatever
    the pattern (a user's `(x+x+)+y` cannot hang an audit), and RE2 refuses what would need
    backtracking (lookaround, backreferences) with a PatternError."""
    import re2  # type: ignore[import-untyped]  # loaded with the first rule that has a regex

    options = re2.Options()
    options.log_errors = False  # RE2 would print its own line on stderr
    try:
        return re2.compile(regex, options)
    except re2.error as error:
        reason = error.args[0].decode(errors="replace") if error.args and isinstance(error.args[0], bytes) else str(error)
        raise PatternError(f"{reason} (RE2 syntax: no lookaround, no backreference)") from None


@dataclass(frozen=True, slots=True)
class RuleMatch:
    variable: str | None = None
    variable_regex: str | None = None
    module: str | None = None  # glob over the dotted module
    owner: str | None = None
    file: str | None = None  # glob over the culprit frame's path
    function: str | None = None  # glob over the culprit frame's function
    loss_scaling: LossScaling | None = None  # holds only for runs with this loss scaling

    def names(self, name: GlobalName[str | None, str | None]) -> bool:
        """Whether the block's variable, module and owner fields fit a global (its frame fields aside);
        a name without its variable fits none."""
        variable, module = name.variable, name.module
        if variable is None or (self.variable is not None and variable != self.variable):
            return False
        if self.variable_regex is not None and not variable_pattern(self.variable_regex).fullmatch(variable):
            return False
        if self.module is not None and (module is None or not fnmatchcase(module, self.module)):
            return False
        return self.owner is None or name.owner == self.owner


@dataclass(frozen=True, slots=True)
class FixTemplate:
    imports: tuple[str, ...] = ()
    code: str | None = None  # scenario 1: the re-initialisation
    send: str | None = None  # scenario 2: replica side
    recv: str | None = None  # scenario 2: faulty side


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    match: RuleMatch  # the first match block: it names the variable of a finding that names none
    framework: str | None  # distribution whose version `versions` constrains, e.g. "megatron-core"
    versions: SpecifierSet | None
    scenario: Scenario
    phase: FixPhase
    conditions: tuple[str, ...]
    fix: FixTemplate
    reason: str
    references: tuple[str, ...]
    origin: str  # "file:line" of the rule
    also_match: tuple[RuleMatch, ...] = ()  # further blocks of a `match:` list; any one block suffices
    probe: str | None = None  # the replay probe that builds this global's state (one of PROBE_NAMES)
    priority: int = 0  # between rules equally specific for one global, the higher wins
    # Conditions that must hold for the global to exist or hold device data, besides `conditions`
    # (which also guard the fix): what an arguments dump is read against.
    exists_when: tuple[str, ...] = ()
    first_read: ReadStage | None = None  # None: the step writes it before reading, or where is not known
    # the device memory the global holds, in bytes: arithmetic over the arguments dump's names
    # (`seq_length * seq_length`); None: not known
    device_bytes: str | None = None
    # rules whose global the same step reads right after this one's (TopKRouter's local_tokens_per_expert
    # after expert_bias): repaired with it wherever the adaptor's generation does not repair them itself
    repair_with: tuple[str, ...] = ()

    @property
    def matches(self) -> tuple[RuleMatch, ...]:
        return (self.match, *self.also_match)


@dataclass(frozen=True)
class StepWritten:
    """Tensors a training step writes before it reads them (a `copy_` into them, or a new binding):
    unsafe after a fault and harmless, so the sentinel names them apart and never stops a recovery for them."""

    id: str
    title: str
    matches: tuple[RuleMatch, ...]
    reason: str
    references: tuple[str, ...]
    origin: str

    def names(self, name: GlobalName[str | None, str | None]) -> bool:
        return any(match.names(name) for match in self.matches)


@dataclass(frozen=True)
class Template:
    """The fix of a global that no rule knows, once heuristics or the user gave its scenario."""

    id: str
    title: str
    scenario: Scenario
    phase: FixPhase
    applies_to: tuple[GlobalKind, ...]
    fix: FixTemplate
    reason: str
    references: tuple[str, ...]
    origin: str


@dataclass(frozen=True)
class AdaptorProfile:
    id: str
    title: str
    framework: str | None
    versions: SpecifierSet | None
    files: tuple[str, ...]  # globs, relative to a source root or site-packages
    rollback: str
    send: str
    recv: str
    # MindIO's rollback callback, which calls `rollback` and then repairs more (the model's parameters
    # from the optimizer, the dataset, the log): its end is the end of the rollback, where the sentinel
    # goes. None: `rollback` is the end.
    rollback_callback: str | None
    # role -> the parameter that holds it, or its alternatives: a role the send and receive functions
    # hold under different names (`send_args.src_ranks`, `recv_args.src_ranks`) lists both, and each
    # function uses the one it has (`role_parameter`)
    parameters: dict[ParameterRole, tuple[str, ...]]
    ranks_are_lists: bool
    repair_group: str  # expression that yields the repair process group
    repair_group_imports: tuple[str, ...]
    origin: str
    resets: tuple[str, ...] = ()  # ids of the rules whose global the shipped rollback and repair already reset or repair
    # a user's profile: texts only its adaptor logs, each a message of it (shipped ones use adaptor_messages.json)
    log_evidence: tuple[str, ...] = ()
    # framework -> the releases this generation runs with (MindSpeed-LLM 26 pairs with megatron core_r0.12.1)
    pairs_with: dict[str, tuple[Version, ...]] = field(default_factory=dict)
    # recovery rebuilds the model (or makes all of it safe); False: only the optimizer's state and the
    # DDP buckets are made safe, and the model's buffers stay unsafe (MindSpeed-LLM 26.x's clean)
    rebuilds_model: bool = True


_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def size_problem(expression: str) -> str | None:
    """Why a rule's `device_bytes` is not arithmetic over names and numbers, or None when it is."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        return f"not an expression: {error.msg}"
    for node in ast.walk(tree.body):
        allowed = isinstance(node, (ast.Name, ast.Load)) or type(node) in _ARITHMETIC
        allowed |= isinstance(node, ast.BinOp) or (isinstance(node, ast.Constant) and type(node.value) in (int, float))
        if not allowed:
            return f"only + - * /, numbers and argument names are allowed, not {type(node).__name__}"
    return None


def device_bytes(expression: str, values: Mapping[str, str]) -> float | None:
    """A rule's `device_bytes` for the values an arguments dump printed; None when a name is missing,
    not a number, or the arithmetic fails (a division by zero)."""

    def value(node: ast.expr) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name):
            return float(values[node.id])  # KeyError, ValueError ("None"): not known
        assert isinstance(node, ast.BinOp)  # size_problem allowed nothing else
        return _ARITHMETIC[type(node.op)](value(node.left), value(node.right))

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (KeyError, ValueError, ZeroDivisionError, OverflowError, SyntaxError):
        return None
    return result if math.isfinite(result) and result >= 0 else None


# How an arguments dump prints a switch that is off: None, False, zero, an empty string or list.
_OFF_VALUES = frozenset({"None", "False", "0", "0.0", "", "[]", "{}"})


def is_on(printed: str) -> bool:
    """Whether a value as an arguments dump prints it is true (not one of the printed off values)."""
    return printed not in _OFF_VALUES


@dataclass(frozen=True)
class Condition:
    guard: str  # Python expression; the fix runs only when it is true
    imports: tuple[str, ...]
    description: str
    # the framework arguments the guard tests (rendered from them), any of which turns the feature on;
    # none for a free guard
    switches: tuple[str, ...] = ()
    values: tuple[str, ...] = ()  # the switch's printed values that turn the feature on (none: any true value)
    above: int | None = None  # the feature is on when the switch's value is greater than this
    common: bool = False  # on in most runs of the stacks: what it alone creates is generic, not the run's own

    def on_in(self, arguments: Mapping[str, str]) -> tuple[str, ...]:
        """The switches an arguments dump shows on; one absent from it reads as off, as the guard reads it."""
        return tuple(
            switch for switch in self.switches if (printed := arguments.get(switch)) is not None and self.holds_for(printed)
        )

    def holds_for(self, printed: str) -> bool:
        """Whether a switch's value, as an arguments dump prints it (`str(value)`), turns the feature on."""
        if self.values:
            return printed in self.values
        if self.above is not None:
            try:
                return float(printed) > self.above
            except ValueError:
                return False
        return is_on(printed)


@dataclass(frozen=True)
class KnowledgeBase:
    rules: tuple[Rule, ...]
    profiles: tuple[AdaptorProfile, ...]
    conditions: dict[str, Condition]
    templates: tuple[Template, ...] = ()
    step_written: tuple[StepWritten, ...] = ()

    def written_by_the_step(self, name: GlobalName[str | None, str]) -> StepWritten | None:
        return next((item for item in self.step_written if item.names(name)), None)

    def rule(self, rule_id: str) -> Rule | None:
        return next((rule for rule in self.rules if rule.id == rule_id), None)

    def template(self, template_id: str) -> Template | None:
        return next((template for template in self.templates if template.id == template_id), None)

    def template_for(self, scenario: Scenario, kind: GlobalKind) -> Template:
        """The template for a global of this kind in this scenario (at most one: checked on load); a
        tensor, dict or list without its own template takes the value template."""
        found = next((t for t in self.templates if t.scenario == scenario and kind in t.applies_to), None)
        return found or next(t for t in self.templates if t.scenario == scenario and "value" in t.applies_to)

    def features(self, rule: Rule) -> tuple[str, ...]:
        """The conditions for the rule's global to exist: its guards and its `exists_when`."""
        return tuple(dict.fromkeys((*rule.conditions, *rule.exists_when)))

    def switches(self, rule: Rule) -> tuple[str, ...]:
        """The framework arguments the rule's conditions test: what must be on for its fix to run."""
        return tuple(switch for name in rule.conditions for switch in self.conditions[name].switches)

    def profile(self, profile_id: str) -> AdaptorProfile | None:
        return next((profile for profile in self.profiles if profile.id == profile_id), None)


def map_parameters(profile: AdaptorProfile, mapping: Mapping[str, Sequence[str]]) -> AdaptorProfile:
    """The profile with some roles held by other parameters (`--parameter`, or a profile file's
    `parameters`), `peer` and `group` included (see MAPPING_ROLES); a role may name alternatives."""
    parameters = dict(profile.parameters)
    lists, group, imports = profile.ranks_are_lists, profile.repair_group, profile.repair_group_imports
    for role, names in mapping.items():
        for name in names:
            if not is_safe_dotted(name):
                raise UsageError(f"parameter role {role}={name}: {name!r} is not a Python name")
        if role == "peer":
            parameters["src_ranks"] = parameters["dest_ranks"] = tuple(names)
            lists = False
        elif role == "group":
            if len(names) != 1:
                raise UsageError(f"parameter role group: one parameter, not {', '.join(names)}")
            group, imports = names[0], ()
        elif role in PARAMETER_ROLES:
            parameters[role] = tuple(names)
        else:
            raise UsageError(f"unknown parameter role {role!r} (roles: {', '.join(EVERY_ROLE)})")
    return replace(profile, parameters=parameters, ranks_are_lists=lists, repair_group=group, repair_group_imports=imports)


def role_parameter(profile: AdaptorProfile, role: ParameterRole, parameters: Iterable[str]) -> str | None:
    """What holds `role` in a function with these parameters: the first of the role's alternatives
    whose root is one of them; None when the profile names none for the role."""
    alternatives = profile.parameters.get(role, ())
    present = set(parameters)
    return next((name for name in alternatives if name.split(".")[0] in present), alternatives[0] if alternatives else None)


def template_slots(template: str) -> set[str]:
    return {named or braced for _, named, braced, _ in string.Template.pattern.findall(template) if named or braced}


def stray_dollar(template: str) -> str | None:
    """The line of a template that holds a `$` starting no slot (`$5`, a lone `$`, an unclosed
    `${name`), which `string.Template` cannot fill; None when every `$` is a slot or `$$`, the escape."""
    for found in string.Template.pattern.finditer(template):
        if found.start("invalid") >= 0:
            start = template.rfind("\n", 0, found.start()) + 1
            end = template.find("\n", found.start())
            return template[start : end if end >= 0 else len(template)].strip()
    return None


def is_safe_dotted(name: str | None) -> bool:
    """A dotted Python name with no keywords and no dunder parts: safe to place in generated code.

    ASCII only: Python reads identifiers after NFKC normalisation, so `_\uff3fbuiltins__` (a
    full-width low line) is `__builtins__` to it and would pass a check made on the raw text; and a
    homoglyph (a Cyrillic `а` in `pаrallel_state`) shows one name while meaning another. Framework
    names are ASCII; a log that offers anything else is refused."""
    if not name or not name.isascii():
        return False
    return all(part.isidentifier() and not keyword.iskeyword(part) and not part.startswith("__") for part in name.split("."))
