"""A subject -> scenario, rule or heuristic evidence, and the fix rendered for the adaptor
(`render.template`).

A matching rule decides (confidence high). The run's loss scaling, when the log shows it, excludes
the rules written for the other one; among several, the framework version detected in the user's
tree filters them, then the most specific wins (then the higher priority: `matching.precedence`).
With no rule, source heuristics decide when they find evidence (medium or low), and the knowledge's
template for that scenario and kind of global renders the fix. Otherwise the finding stays
unclassified and says what to check.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, get_args

from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.matching import matching_block, precedence
from unsafe_doctor.knowledge.render.template import FixPlan, NoFix, render_fix
from unsafe_doctor.knowledge.rules import GlobalKind, KnowledgeBase, Rule, RuleMatch, Scenario, Template
from unsafe_doctor.knowledge.subject import Evidence, Subject
from unsafe_doctor.knowledge.versions import Environment
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.recovery import LossScaling
from unsafe_doctor.source.syntax import callee_name, dotted_name, scope_statements
from unsafe_doctor.source.workspace import Workspace

Confidence = Literal["high", "medium", "low"]
# A log that shows neither a loss scale nor the fp16 argument is read as bf16, the usual precision of
# LLM training; the classification then says which rule an fp16 run would get instead.
ASSUMED_LOSS_SCALING: LossScaling = "none"
LOSS_SCALING_WORDS: dict[LossScaling, str] = {"none": "no grad scaler (bf16)", "grad-scaler": "an fp16 grad scaler"}


@dataclass(frozen=True)
class Classified:
    """A scenario decided by a rule (`rule` set), the source heuristics, or the user (`confidence` None)."""

    scenario: Scenario
    rule: str | None  # None when heuristics or the user decided
    confidence: Confidence | None
    reason: str
    evidence: tuple[Evidence, ...]  # for heuristic verdicts
    fix: FixPlan | NoFix
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Unclassified:
    """Neither a rule nor the heuristics decided: `reason` says what the user should check."""

    reason: str
    evidence: tuple[Evidence, ...]
    notes: tuple[str, ...]
    scenario: ClassVar[None] = None
    rule: ClassVar[None] = None
    confidence: ClassVar[None] = None
    fix: ClassVar[None] = None


Classification = Classified | Unclassified


class ClassifiedSubject(Protocol):
    """A subject with its classification: what the fixer and verify take (a diagnosed finding, an audited holder)."""

    @property
    def subject(self) -> Subject: ...

    @property
    def classification(self) -> Classification: ...

    @property
    def suspect(self) -> int | None:
        """The suspect's number when a person chose it (`--suspect N`): what they know it by."""
        ...


def classify(subject: Subject, context: RunContext, loss_scaling: LossScaling | None = None) -> Classification:
    """`loss_scaling`: what the log shows of the run's loss scaling (`recovery.read_loss_scaling`)."""
    knowledge, environment = context.knowledge, context.environment
    chosen, notes = _choose_rule(subject, knowledge, environment, loss_scaling)
    if chosen is not None:
        return _by_rule(*chosen, subject, context, notes)
    from unsafe_doctor.knowledge.heuristics import judge_by_source  # only when no rule matched: it costs start-up time

    verdict = judge_by_source(subject, context.workspace)
    if verdict.scenario is None:
        return Unclassified(verdict.reason, verdict.evidence, notes)
    template = generic_template(knowledge, verdict.scenario, subject, context.workspace)
    fix = render_fix(template, subject, knowledge, environment.profile)
    return Classified(verdict.scenario, None, verdict.confidence, verdict.reason, verdict.evidence, fix, (*notes, *_why_not(fix)))


def classify_cache(subject: Subject, context: RunContext, loss_scaling: LossScaling | None = None) -> Classified:
    """A global known to be an lru cache (the sentinel found one holding entries): the rule that names
    it, else scenario 1 by its nature, emptied with the knowledge's cache template. The source
    heuristics are not asked: they would read every file naming the function (`forward` is everywhere)."""
    chosen, notes = _choose_rule(subject, context.knowledge, context.environment, loss_scaling)
    if chosen is not None:
        return _by_rule(*chosen, subject, context, notes)
    name = subject.tensor.expression if subject.tensor else "the cache"
    reason = (
        f"{name} is an lru cache: what it returns is computed from its arguments and computed again once "
        "emptied, so it carries nothing into the next step; empty it with cache_clear() in the rollback"
    )
    verdict = classify_as(subject, 1, context, ())
    return Classified(1, None, "medium", reason, (), verdict.fix, (*notes, *verdict.notes))


def classify_by_rule(
    subject: Subject, context: RunContext, loss_scaling: LossScaling | None = None, *, guarded: bool = True
) -> Classified | None:
    """The rules alone, no heuristics: what the sentinel asks inside the training process, where reading
    the source would cost seconds. ``guarded=False`` leaves out the conditions' guards, for code run
    where the global is known to exist (the sentinel found it)."""
    chosen, notes = _choose_rule(subject, context.knowledge, context.environment, loss_scaling)
    return None if chosen is None else _by_rule(*chosen, subject, context, notes, guarded=guarded)


def classify_with_rule(rule: Rule, subject: Subject, context: RunContext) -> Classified:
    """The rule's verdict and fix for a global the rule names, chosen by other evidence than a frame
    (a suspect of an untraced error): no matching, the rule is given."""
    return _by_rule(rule, rule.match, subject, context, ())


def _by_rule(
    rule: Rule, block: RuleMatch, subject: Subject, context: RunContext, notes: tuple[str, ...], *, guarded: bool = True
) -> Classified:
    environment = context.environment
    fix = render_fix(rule, subject, context.knowledge, environment.profile, block, guarded=guarded)
    confidence, doubt = _rule_confidence(rule, subject, environment)
    return Classified(rule.scenario, rule.id, confidence, rule.reason, (), fix, (*notes, *_why_not(fix), *doubt))


def _rule_confidence(rule: Rule, subject: Subject, environment: Environment) -> tuple[Confidence, tuple[str, ...]]:
    """High, unless the rule depends on a version read from this machine's installed framework and
    the log's culprit file is not the installed one (the job ran another release); then a note says so."""
    framework = rule.framework
    frame = subject.frame
    if (
        rule.versions is None
        or framework is None
        or frame is None
        or not subject.source_differs
        or environment.origins.get(framework) != "installed"
        or environment.dumped_release(framework) is not None  # the rule was chosen for the dump's releases
    ):
        return "high", ()
    version = environment.versions[framework]
    note = (
        f"the log's {frame.file.rsplit('/', 1)[-1]} is not the installed {framework} "
        f"{version}'s (line {frame.line} differs), so the job may have run another "
        f"release: the rule is the one for {version}; give --source-root with the job's tree to be sure"
    )
    return "medium", (note,)


def classify_as(subject: Subject, scenario: Scenario, context: RunContext, evidence: tuple[Evidence, ...]) -> Classified:
    """The user's answer for a finding nothing could classify: the generic fix for that scenario."""
    template = generic_template(context.knowledge, scenario, subject, context.workspace)
    fix = render_fix(template, subject, context.knowledge, context.environment.profile)
    return Classified(scenario, None, None, "scenario given by the user", evidence, fix, _why_not(fix))


def generic_template(
    knowledge: KnowledgeBase, scenario: Scenario, subject: Subject, workspace: Workspace | None = None
) -> Template:
    """The template a verdict without a rule gets, by what the global is: an lru cache, or a value,
    which the module-level assignment read through `workspace` may show to be a tensor, dict or list."""
    return knowledge.template_for(scenario, global_kind(subject, workspace))


TENSOR_FACTORIES = frozenset(
    {
        "zeros",
        "ones",
        "empty",
        "full",
        "tensor",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "arange",
        "rand",
        "randn",
        "as_tensor",
    }
)


def global_kind(subject: Subject, workspace: Workspace | None) -> GlobalKind:
    """What a module global is, from its annotation and every value it is given (at module level,
    and in functions that declare it `global`): a tensor, a dict or a list where all of them agree
    (None, a feature off, agrees with any; a value whose kind the source does not tell agrees only
    with an annotation), else a value of a kind the source does not show."""
    tensor = subject.tensor
    if tensor is not None and tensor.cached:
        return "lru-cache"
    if workspace is None or tensor is None or tensor.name.owner or not tensor.name.module or not tensor.name.variable:
        return "value"
    path = workspace.module_path(tensor.name.module)
    source = workspace.source(path, tensor.name.module) if path is not None and path.is_file() else None
    if source is None:
        return "value"
    annotated: list[GlobalKind | None] = []
    given: list[GlobalKind | None] = []
    for statement in _assignments(source.tree, tensor.name.variable):
        if isinstance(statement, ast.AnnAssign):
            annotated.append(_annotated_kind(statement.annotation))
        if statement.value is not None and not _is_none(statement.value):
            given.append(_value_kind(statement.value))
    # a value the source does not tell the kind of leaves it to the annotation, if there is one
    kinds = {kind for kind in (*annotated, *given) if kind is not None}
    if len(kinds) != 1 or (None in given and not any(annotated)):
        return "value"
    return kinds.pop()


def _assignments(tree: ast.Module, variable: str) -> Iterator[ast.Assign | ast.AnnAssign]:
    """The statements that give the module global `variable` a value: at module level, and in the
    functions that declare it `global` (not in a class, whose names are its own)."""
    scopes: list[Sequence[ast.stmt]] = [tree.body]
    scopes += [
        node.body
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and any(isinstance(inner, ast.Global) and variable in inner.names for inner in scope_statements(node.body))
    ]
    for body in scopes:
        for statement in scope_statements(body):
            if isinstance(statement, (ast.Assign, ast.AnnAssign)) and _binds(statement, variable):
                yield statement


def _binds(statement: ast.Assign | ast.AnnAssign, variable: str) -> bool:
    """Whether the statement gives the name itself its value (not through unpacking, which shows no kind)."""
    targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
    return any(isinstance(target, ast.Name) and target.id == variable for target in targets)


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


_TENSOR_TYPES = frozenset({"Tensor", "torch.Tensor"})
_DICT_TYPES = frozenset(
    {"dict", "Dict", "typing.Dict", "OrderedDict", "collections.OrderedDict", "defaultdict", "collections.defaultdict"}
)
_LIST_TYPES = frozenset({"list", "List", "typing.List"})


def _annotated_kind(annotation: ast.expr) -> GlobalKind | None:
    """`torch.Tensor`, `torch.Tensor | None`, `Optional[Tensor]`, `dict[str, torch.Tensor]`, `"List[Tensor]"`;
    None for anything else (it says nothing the templates use)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    parts = [part for part in _union_parts(annotation) if not _is_none(part)]
    if len(parts) != 1:
        return None
    (part,) = parts
    base = part.value if isinstance(part, ast.Subscript) else part
    name = dotted_name(base)
    if name in _TENSOR_TYPES:
        return "tensor"
    if name in _DICT_TYPES:
        return "dict"
    if name in _LIST_TYPES:
        return "list"
    return None


def _union_parts(annotation: ast.expr) -> list[ast.expr]:
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return [*_union_parts(annotation.left), *_union_parts(annotation.right)]
    if isinstance(annotation, ast.Subscript) and dotted_name(annotation.value) in (
        "Optional",
        "typing.Optional",
        "Union",
        "typing.Union",
    ):
        inner = annotation.slice
        return [part for element in (inner.elts if isinstance(inner, ast.Tuple) else [inner]) for part in _union_parts(element)]
    return [annotation]


def _value_kind(value: ast.expr) -> GlobalKind | None:
    """What a value makes the global: a dict or list display or constructor, a torch factory's
    tensor; None for a value the source does not tell."""
    if isinstance(value, (ast.Dict, ast.DictComp)):
        return "dict"
    if isinstance(value, (ast.List, ast.ListComp)):
        return "list"
    if isinstance(value, ast.Call):
        callee = callee_name(value.func)
        if callee in ("dict", "OrderedDict", "defaultdict"):
            return "dict"
        if callee == "list":
            return "list"
        if callee in TENSOR_FACTORIES and isinstance(value.func, ast.Attribute):
            return "tensor"
    return None


def _why_not(fix: FixPlan | NoFix) -> tuple[str, ...]:
    """Why no fix could be written is a note of the classification too."""
    return (fix.reason,) if isinstance(fix, NoFix) else ()


def _choose_rule(
    subject: Subject, knowledge: KnowledgeBase, environment: Environment, loss_scaling: LossScaling | None
) -> tuple[tuple[Rule, RuleMatch] | None, tuple[str, ...]]:
    """The rule for the run's loss scaling (the assumed one when the log does not show it), with notes.

    When another loss scaling would choose another rule, a note says which, and why this one.
    """
    read_as = loss_scaling or ASSUMED_LOSS_SCALING
    chosen, found = _best_rule(subject, knowledge, environment, read_as)
    notes = list(found)
    for other in get_args(LossScaling):
        alternative = None if other == read_as else _best_rule(subject, knowledge, environment, other)[0]
        if alternative is None or (chosen is not None and alternative[0].id == chosen[0].id):
            continue
        rule, block = alternative
        instead = f"rule {rule.id} would apply instead (scenario {rule.scenario}"
        instead += f", tensor {block.variable})" if block.variable else ")"
        if loss_scaling is None:
            notes.append(
                f"the log shows neither a loss scale nor the fp16 argument: read as {LOSS_SCALING_WORDS[read_as]}; "
                f"with {LOSS_SCALING_WORDS[other]} {instead}"
            )
        else:
            notes.append(f"the log shows {LOSS_SCALING_WORDS[read_as]}; with {LOSS_SCALING_WORDS[other]} {instead}")
    return chosen, tuple(notes)


def _best_rule(
    subject: Subject, knowledge: KnowledgeBase, environment: Environment, loss_scaling: LossScaling
) -> tuple[tuple[Rule, RuleMatch] | None, tuple[str, ...]]:
    tensor, frame = subject.tensor, subject.frame
    candidates = []
    for rule in knowledge.rules:
        block = matching_block(
            rule,
            tensor.name if tensor else GlobalName(None, None, None),
            frame.file if frame else None,
            function=frame.function if frame else None,
            loss_scaling=loss_scaling,
        )
        if block is not None:
            candidates.append((rule, block))
    if not candidates:
        return None, ()
    fitting = [(rule, block) for rule, block in candidates if _fits_version(rule, environment)]
    chosen = max(fitting or candidates, key=lambda pair: precedence(*pair))
    rule = chosen[0]
    dumped = environment.dumped_release(rule.framework) if rule.framework else None
    if dumped is not None:
        if not fitting:
            return chosen, (f"the log's symbol belongs to {rule.framework} {rule.versions}, but the job ran {dumped.describe()}",)
        return chosen, (f"rule chosen for {dumped.describe()}",)
    if not fitting and rule.framework is not None:
        return chosen, (
            f"the log's symbol belongs to {rule.framework} {rule.versions}, but {environment.origins[rule.framework]} "
            f"has {rule.framework} {environment.versions[rule.framework]}: the log comes from another version than the one "
            "found here",
        )
    if rule.framework and rule.framework not in environment.versions:
        return chosen, (f"{rule.framework} version unknown here; rule chosen by the symbol in the log",)
    return chosen, ()


def _fits_version(rule: Rule, environment: Environment) -> bool:
    """Whether the rule holds for the job's release: the one found, or one its arguments dump fits when
    no file or frame told it (then the release installed here did not run the job)."""
    if rule.versions is None or rule.framework is None:
        return True
    dumped = environment.dumped_release(rule.framework)
    versions = dumped.releases if dumped is not None else (environment.versions.get(rule.framework),)
    return any(version is None or rule.versions.contains(version, prereleases=True) for version in versions)
