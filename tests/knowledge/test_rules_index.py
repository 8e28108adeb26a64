"""Every shipped rule held to every release of the shipped index that it claims, offline.

The index (`knowledge_base/index/*.zip`) holds a skeleton of every file of every pinned release;
the project's one resolver (`source/resolve.py`) reads a skeleton as it reads a file. So, for each
rule and each release of its framework that its `versions` range admits (a rule with no range:
every release), the release's own modules are read:

- **its global**: each match block that names a global (a module and a variable, or an owner class
  and its attribute) is bound in that release: a module-level binding that the resolver resolves to
  the variable, or the owner class's attribute (class level, a method of that name, or `self.X`
  set in a method; a buffer, which the skeletons keep only from a `register_buffer` call written
  over several lines, as the audit of the release's whole code found it: index/globals.json). A
  glob module is any of the release's modules it selects; a `variable_regex` any name it matches
  (the names are alternatives: a release need not hold them all). A block
  naming the culprit frame's file names where the global is read: its owner is looked for in that
  file's module (defined or imported there), unless another block names the same global by module.
- **its fix**: the framework names the rendered fix imports (`from megatron.core.x import Y`,
  `import $module`) and reads through them (`module.Y`, `getattr(module, "Y", ...)`, a getter it
  calls) exist in that release.

A release whose name carries no version (`core_r0.17.0@…`, `master@…`: a branch, pinned by commit)
is claimed by every range, as diagnose applies a rule whenever the job's version is not known
(`classify._fits_version`): what a log fingerprinted to a branch gets, the branch must hold. A rule
that knows its global only by the frame reading it (every block names a file) claims only the
releases holding that file: no other release can print such a frame. A claimed release that lacks
the global where no range could leave it out is listed in `NOT_BOUND` with why, and held to
lacking it. Tests are parametrized per rule and release, so a failure names both.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from unsafe_doctor.knowledge.classify import classify_with_rule
from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.knowledge.render.template import FixPlan
from unsafe_doctor.knowledge.rules import Rule, RuleMatch, variable_pattern
from unsafe_doctor.knowledge.subject import Subject
from unsafe_doctor.knowledge.versions import Environment
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.source.fingerprint import ReleaseMatch, release_version
from unsafe_doctor.source.index import FrameworkIndex, IndexedFramework
from unsafe_doctor.source.resolve import Scope, Tier, resolve
from unsafe_doctor.source.syntax import Function, import_bindings, walk_scope
from unsafe_doctor.source.workspace import SourceFile, Workspace

KNOWLEDGE = load_knowledge()
INDEX = FrameworkIndex()
FRAMEWORKS = {framework.name: framework for framework in INDEX.frameworks}
PACKAGES = {"megatron": "megatron-core", "mindspeed": "mindspeed", "mindspeed_llm": "mindspeed-llm", "modellink": "mindspeed-llm"}


def framework_of(rule: Rule, block: RuleMatch) -> str | None:
    """The indexed framework whose releases hold the block's global."""
    where = block.module or (block.file or "").removeprefix("*/").replace("/", ".")
    top = where.split(".")[0]
    return PACKAGES.get(top) or (rule.framework if rule.framework in FRAMEWORKS else None)


def rule_framework(rule: Rule) -> str | None:
    """The framework a rule's fix reads: its range's, else its first block's that names one."""
    if rule.framework in FRAMEWORKS:
        return rule.framework
    return next((name for block in rule.matches if (name := framework_of(rule, block)) is not None), None)


def claimed(rule: Rule, framework: IndexedFramework) -> list[int]:
    """The releases of `framework` the rule claims: those its range admits (all when its range is
    of another framework or absent; a release named without a version by any range); of a rule
    that knows its global only by the frame reading it, those that hold that frame's file."""
    admitted = [
        at
        for at, release in enumerate(framework.releases)
        if rule.versions is None
        or rule.framework != framework.name
        or (version := release_version(release.name)) is None
        or rule.versions.contains(version, prereleases=True)
    ]
    if any(block.file is None for block in rule.matches):
        return admitted
    files = [path for path in framework.paths if any(fnmatchcase("/" + path, block.file or "") for block in rule.matches)]
    return [at for at in admitted if any(framework.version_in(path, at) for path in files)]


def global_blocks(rule: Rule) -> list[RuleMatch]:
    """The rule's blocks that name a global. A block naming the culprit frame names where the
    global is read: it is held only where no other block names the same global by its module."""
    by_module = {(block.variable, block.owner) for block in rule.matches if block.module}
    return [
        block
        for block in rule.matches
        if (block.variable or block.variable_regex)
        and (block.module or block.owner)
        and not (block.module is None and (block.variable, block.owner) in by_module)
    ]


# Releases a rule claims that lack its global, each with why no range of the rule can leave it out.
# The test holds each entry: once the release binds the global, the entry must go.
_BEFORE = (
    "before the feature: diagnose reads MindSpeed 1.0.RC2 and 1.0.RC3 as version 1.0, as it reads 1.0.0, "
    "which has it, so no range tells them apart"
)
_OLD_1_1 = (
    "MindSpeed 1.1.0 (July 2024) predates 1.0.RC2 though its number sorts after 1.0.0: leaving it out "
    "(!=1.1.*) would still leave 1.0.RC2 and 1.0.RC3 in"
)
_SAME_NUMBER_0_6 = (
    "MindSpeed's core_r0.6.0 line never had ampipe (no mindspeed/moe/utils.py slice map); its release "
    "numbers are the core_r0.7.0 line's (1.0.RC3, 1.0.0), which has it, so no range tells them apart"
)
_FP8_REUSE = (
    "FP8 weight reuse (mindspeed/te/pytorch/fp8/reuse.py) came with 26.0.0 and is on the 26.x line only (26.1.0, "
    "master), not on the core_r0.16.0-core_r0.18.0 branches: MindSpeed's versions are the megatron-core "
    "releases they pair with (0.12.1 from 2.1.0 to master), so no range leaves the releases before it out"
)
_FP8_DELAYED = (
    "MindSpeed's own FP8 modules (mindspeed/te/pytorch/fp8) came with 26.0.0 and core_r0.16.0; the core_r0.17.0 "
    "and core_r0.18.0 branches dropped them for Megatron's: versions are the paired megatron-core releases "
    "and branches name none, so no range leaves these out"
)
_QAD = (
    "quantization-aware distillation is only on master (after 26.1.0): a MindSpeed install reads as the version its "
    "setup.py declares, the megatron-core release it pairs with (0.12.1 on master as on 26.1.0 and 2.1.0-26.0.0, "
    "0.16.0 on core_r0.16.0), so no range leaves the releases before it out"
)
NOT_BOUND = {
    ("mindspeed.moe-overlap-saved-tensors", "1.1.0"): _OLD_1_1,
    ("mindspeed.moe-overlap-saved-tensors", "1.0.RC2"): _BEFORE,
    ("mindspeed.moe-overlap-saved-tensors", "1.0.RC3_core_r0.7.0"): _BEFORE,
    ("mindspeed.adaptive-cp-cached-masks", "1.1.0"): _OLD_1_1,
    ("mindspeed.adaptive-cp-cached-masks", "1.0.RC2"): _BEFORE,
    ("mindspeed.adaptive-cp-cached-masks", "1.0.RC3_core_r0.6.0"): _BEFORE,
    ("mindspeed.adaptive-cp-cached-masks", "1.0.RC3_core_r0.7.0"): _BEFORE,
    ("mindspeed.adaptive-cp-cached-masks", "core_r0.18.0@4213c913"): (
        "the branch retired adaptive CP (validate_args refuses adaptive_cp_algo), so no run of it has the caches; "
        "a branch names no version a range could leave out"
    ),
    ("mindspeed.cp-batch-cache", "1.1.0"): _OLD_1_1,
    ("mindspeed.cp-batch-cache", "1.0.RC2"): _BEFORE,
    ("mindspeed.alibi-fusion-attn", "1.1.0"): _OLD_1_1,
    ("mindspeed.alibi-fusion-attn", "1.0.RC2"): _BEFORE,
    ("mindspeed.ampipe-slices-map", "1.1.0"): _OLD_1_1,
    ("mindspeed.ampipe-slices-map", "1.0.RC2"): _BEFORE,
    ("mindspeed.ampipe-slices-map", "1.0.RC3_core_r0.6.0"): _SAME_NUMBER_0_6,
    ("mindspeed.ampipe-slices-map", "1.0.0_core_r0.6.0"): _SAME_NUMBER_0_6,
    **dict.fromkeys(
        [("mindspeed.ampipe-slices-map", "core_r0.17.0@1f5feb86"), ("mindspeed.ampipe-slices-map", "core_r0.18.0@4213c913")],
        (
            "the branch dropped mindspeed/moe and ampipe's slice map with it (its --ampipe-degree argument and a dangling "
            "import in core/tensor_parallel/layers.py remain); a branch names no version a range could leave out"
        ),
    ),
    **{
        ("mindspeed.qad-teacher-model", release): _QAD
        for release in (
            "1.1.0",
            "1.0.RC2",
            "1.0.RC3_core_r0.7.0",
            "1.0.RC3_core_r0.6.0",
            "1.0.0_core_r0.6.0",
            "1.0.0_core_r0.7.0",
            "2.0.0_core_r0.8.0",
            "2.1.0_core_r0.8.0",
            "2.1.0_core_r0.12.1",
            "2.2.0_core_r0.12.1",
            "2.3.0_core_r0.12.1",
            "26.0.0_core_r0.12.1",
            "core_r0.16.0@e4772499",
            "core_r0.17.0@1f5feb86",
            "core_r0.18.0@4213c913",
            "26.1.0_core_r0.12.1@57a33053",
        )
    },
    **{
        ("mindspeed.fp8-weight-reuse-pool", release): _FP8_REUSE
        for release in (
            "1.1.0",
            "1.0.RC2",
            "1.0.RC3_core_r0.7.0",
            "1.0.RC3_core_r0.6.0",
            "1.0.0_core_r0.6.0",
            "1.0.0_core_r0.7.0",
            "2.0.0_core_r0.8.0",
            "2.1.0_core_r0.8.0",
            "2.1.0_core_r0.12.1",
            "2.2.0_core_r0.12.1",
            "2.3.0_core_r0.12.1",
            "core_r0.16.0@e4772499",
            "core_r0.17.0@1f5feb86",
            "core_r0.18.0@4213c913",
        )
    },
    **{
        ("mindspeed.fp8-delayed-scaling", release): _FP8_DELAYED
        for release in (
            "1.1.0",
            "1.0.RC2",
            "1.0.RC3_core_r0.7.0",
            "1.0.RC3_core_r0.6.0",
            "1.0.0_core_r0.6.0",
            "1.0.0_core_r0.7.0",
            "2.0.0_core_r0.8.0",
            "2.1.0_core_r0.8.0",
            "2.1.0_core_r0.12.1",
            "2.2.0_core_r0.12.1",
            "2.3.0_core_r0.12.1",
            "core_r0.17.0@1f5feb86",
            "core_r0.18.0@4213c913",
        )
    },
    ("mindspeed-llm.dsa-indexer-loss-tracker", "26.0.0"): (
        "the rule's two copies of the tracker came one release apart (the tasks' DSAIndexerLossLoggingHelper with "
        "26.0.0, FSDP2's IndexerLossLoggingHelper with 26.1.0): 26.0.0 holds the first, and a range is the rule's, "
        "not a block's"
    ),
    ("mindspeed-llm.fsdp2-rotary-inv-freq", "26.0.0"): (
        "the FSDP2 models came one release apart (GPT-OSS with 26.0.0, GLM-MoE-DSA with 26.1.0): 26.0.0 holds "
        "GPT-OSS's inv_freq, and a range is the rule's, not a block's"
    ),
    **{
        ("megatron.yarn-rotary-cache", release): (
            "YaRN's forward lru cache came with 0.10, its cos_cached and sin_cached buffers with 0.13: these releases "
            "hold the first block's global, and a range is the rule's, not a block's (one rule, so one fix block "
            "resets both)"
        )
        for release in ("0.10.0", "0.11.0", "0.12.0", "0.12.1", "0.12.2", "0.12.3")
    },
    **{
        ("mindspeed-llm.modellink-mask-cache", release): (
            "only ModelLink 1.0.RC3.0 has mask_generator's _MASK_CACHE, but diagnose reads 1.0.RC1.0, 1.0.RC2.0 and "
            "1.0.RC3.0 as version 1.0, which 1.0.0 equals, so no range tells them apart; a branch names no version"
        )
        for release in ("1.0.RC1.0", "1.0.RC2.0", "1.0.0", "master@c77308a1")
    },
}


def by_release(cases: list) -> list:
    """A release's cases side by side: xdist hands each worker a run of cases, and each release a
    worker reads is parsed there (seconds), so a run that spans fewer releases parses fewer."""
    return sorted(cases, key=lambda case: case.values[1:])


CASES = by_release(
    [
        pytest.param(rule, name, at, id=f"{rule.id}@{framework.releases[at].name}")
        for rule in KNOWLEDGE.rules
        for name in dict.fromkeys(framework_of(rule, block) for block in global_blocks(rule))
        if name is not None
        for framework in [FRAMEWORKS[name]]
        for at in claimed(rule, framework)
    ]
)


# --- a release's modules, read through the resolver ------------------------------------------------


class KeepingWorkspace(Workspace):
    """A workspace that keeps every file it parsed: the tests read each release's modules for many
    rules, and a workspace alone keeps only its latest few trees (each parsed again after)."""

    def __init__(self) -> None:
        super().__init__((), log_only=True, index=INDEX)
        self.kept: dict[Path, SourceFile] = {}

    def source(self, path: Path, module: str | None) -> SourceFile | None:
        source = super().source(path, module)
        if source is not None:
            self.kept[path] = source
        return source


_WORKSPACES: dict[tuple[str, int], Workspace] = {}


@pytest.fixture(autouse=True, scope="module")
def _release_workspaces() -> Iterator[None]:
    """The kept trees (millions of objects) go with this module's last test: left alive, they make
    every later garbage collection in the worker take seconds."""
    yield
    _WORKSPACES.clear()


def release_workspace(framework: IndexedFramework, at: int) -> Workspace:
    """A log-only workspace that reads `framework` as its release `at` (as if the log's frames had
    fingerprinted it): modules, imports and re-exports all come from that release's skeletons."""
    key = (framework.name, at)
    if key not in _WORKSPACES:
        workspace = KeepingWorkspace()
        workspace.releases = {framework.name: ReleaseMatch(framework, (at,), 1, 1)}
        workspace.fingerprinted = True
        _WORKSPACES[key] = workspace
    return _WORKSPACES[key]


def dotted(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def modules_selected(framework: IndexedFramework, at: int, block: RuleMatch) -> list[str]:
    """The release's modules the block's module (a glob), or else its file's module, names."""
    patterns = [block.module] if block.module else [dotted(block.file or ""), dotted((block.file or "").removeprefix("*/"))]
    return [
        dotted(path)
        for path in sorted(framework.paths)
        if path.endswith(".py")
        and any(fnmatchcase(dotted(path), pattern) for pattern in patterns)
        and framework.version_in(path, at) is not None
    ]


def names_in(source: SourceFile, block: RuleMatch) -> list[str]:
    if block.variable is not None:
        return [block.variable]
    pattern = variable_pattern(block.variable_regex)
    return sorted({word for word in re.findall(r"\w+", source.text) if pattern.fullmatch(word)})


def binds(workspace: Workspace, module: str, block: RuleMatch) -> tuple[str, str, str | None] | None:
    """(module, variable, owner) of the block's global the module binds in the release; None when
    it binds none."""
    source = workspace.module_source(module)
    if source is None:
        return None
    for name in names_in(source, block):
        if block.owner is None:
            found = resolve(ast.Name(name, ast.Load()), Scope.of(source), workspace)
            if found is not None and found.tier is Tier.GLOBAL and found.name.variable == name and found.name.owner is None:
                return found.name.module or module, name, None
            if name in source.declared_globals:  # bound only by a function's `global` (a lazy getter)
                return module, name, None
        classes = [cls for cls, bound in source.bindings.items() if isinstance(bound, ast.ClassDef)]
        owners = [block.owner] if block.owner else classes
        for owner in owners:
            if _class_binds(workspace, source, owner, name):
                return module, name, owner
    return None


def _class_binds(workspace: Workspace, source: SourceFile, owner: str, attribute: str) -> bool:
    """The owner class (defined in the module, or imported into it) has the attribute: bound in its
    body, or set as `self.attribute` in one of its methods, as the resolver names `self.X`."""
    holder = _class_source(workspace, source, owner)
    if holder is None:
        return False
    holder_source, cls = holder
    for statement in cls.body:
        if isinstance(statement, Function) and statement.name == attribute:
            return True
        if attribute in _targets(statement):
            found = resolve(ast.parse(f"{owner}.{attribute}", mode="eval").body, Scope.of(holder_source), workspace)
            return found is not None and found.name.owner == owner and found.name.variable == attribute
        if isinstance(statement, Function):
            for node in walk_scope(statement):
                for target in _assigned(node):
                    if isinstance(target, ast.Attribute) and target.attr == attribute and isinstance(target.value, ast.Name):
                        found = resolve(target, Scope.of(holder_source, statement, cls), workspace)
                        if found is not None and found.name.owner == owner and found.name.variable == attribute:
                            return True
    return False


def _class_source(workspace: Workspace, source: SourceFile, owner: str) -> tuple[SourceFile, ast.ClassDef] | None:
    """The class `owner` names in the module: its own, or the one an import binds there."""
    for _ in range(4):
        binding = source.binding(owner)
        if isinstance(binding, ast.ClassDef):
            return source, binding
        target = getattr(binding, "target", None)
        if target is None:
            return None
        module, _, owner = target.rpartition(".")
        source = workspace.module_source(module)
        if source is None:
            return None
    return None


def _assigned(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        yield from node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        yield node.target


def _targets(statement: ast.stmt) -> set[str]:
    return {target.id for target in _assigned(statement) if isinstance(target, ast.Name)}


# --- each rule's global -------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "name", "at"), CASES)
def test_each_global_a_rule_names_is_bound_in_every_release_it_claims(rule, name, at):
    framework = FRAMEWORKS[name]
    workspace = release_workspace(framework, at)
    missing = [
        f"{block.owner + '.' if block.owner else ''}{block.variable or block.variable_regex} in {block.module or block.file}"
        for block in global_blocks(rule)
        if framework_of(rule, block) == name and bound(workspace, framework, at, block) is None
    ]
    release = framework.releases[at].name
    if (rule.id, release) in NOT_BOUND:
        assert missing, f"{name} {release} now binds the global of {rule.id}: drop its NOT_BOUND entry"
    else:
        assert not missing, f"{name} {release} has no {missing} ({rule.id}, {rule.origin})"


def bound(workspace: Workspace, framework: IndexedFramework, at: int, block: RuleMatch) -> tuple[str, str, str | None] | None:
    """(module, variable, owner) of the block's global in the release; None when no module binds it."""
    for module in modules_selected(framework, at, block):
        found = binds(workspace, module, block)
        if found is not None:
            return found
    return audited_buffer(framework, at, block)


AUDITED = json.loads((Path(__file__).resolve().parents[2] / "knowledge_base" / "index" / "globals.json").read_text())


def audited_buffer(framework: IndexedFramework, at: int, block: RuleMatch) -> tuple[str, str, str | None] | None:
    """(module, variable, owner) of a buffer the block names that the audit of the release's whole code
    found: `self.register_buffer("x", ...)` on one line is no line of the index's skeletons."""
    release = framework.releases[at].name
    for found in AUDITED["globals"]:
        if (
            found["framework"] == framework.name
            and found["kind"] == "buffer"
            and release in found["releases"]
            and block.names(GlobalName(found["module"], found["class"], found["name"]))
            and (block.module is not None or found["module"] in modules_selected(framework, at, block))
        ):
            return found["module"], found["name"], found["class"]
    return None


# --- each rule's fix ------------------------------------------------------------------------------

FIX_CASES = by_release(
    [
        pytest.param(rule, name, at, id=f"{rule.id}@{FRAMEWORKS[name].releases[at].name}")
        for rule in KNOWLEDGE.rules
        if (name := rule_framework(rule)) is not None
        for at in claimed(rule, FRAMEWORKS[name])
        if (rule.id, FRAMEWORKS[name].releases[at].name) not in NOT_BOUND
    ]
)


def rendered(rule: Rule, workspace: Workspace, framework: IndexedFramework, at: int) -> FixPlan:
    """The rule's fix as diagnose renders it for the release's own global (its module fills
    `$module`), without the condition guards and the repair group's import (not the rule's names)."""
    found = next((hit for block in global_blocks(rule) if (hit := bound(workspace, framework, at, block))), None)
    block = rule.match
    module, variable, owner = found or (block.module or "", block.variable or "", block.owner)
    subject = Subject.of_global(GlobalName(module, owner, variable), "/" + module.replace(".", "/") + ".py", None)
    version = release_version(framework.releases[at].name)
    environment = Environment(
        {framework.name: version} if version else {},
        {framework.name: "the index"},
        (),
        KNOWLEDGE.profile("mindspeed-llm-26"),
        None,
    )
    plan = classify_with_rule(rule, subject, RunContext(KNOWLEDGE, workspace, environment)).fix
    assert isinstance(plan, FixPlan), plan
    return plan


def framework_names(plan: FixPlan, rule: Rule, top: str) -> Iterator[str]:
    """Every dotted framework name the fix imports (`from m import C`: `m.C`; `import m`: `m`) or
    reads through what an import binds (`m.C.x`, `getattr(m.C, "x", ...)`, `m.f()`)."""
    guards = {line for name in rule.conditions for line in KNOWLEDGE.conditions[name].imports}
    targets: dict[str, str] = {}
    for line in plan.imports:
        if line in guards:
            continue
        statement = ast.parse(line).body[0]
        assert isinstance(statement, (ast.Import, ast.ImportFrom)), line
        for local, imported in import_bindings(statement, None).items():
            if imported.target.split(".")[0] == top:
                targets[local] = imported.target
                yield imported.target if isinstance(statement, ast.ImportFrom) else line.split()[1]
    for code in (plan.code, plan.peer_code):
        for node in ast.walk(ast.parse(code or "")):
            read = _read(node)
            if read is not None and read.split(".")[0] in targets:
                root, _, rest = read.partition(".")
                yield ".".join(part for part in (targets[root], rest) if part)


def _read(node: ast.AST) -> str | None:
    """The dotted name `a.b.c` reads, or `getattr(a.b, "c", ...)` (hasattr, setattr) names."""
    if isinstance(node, ast.Attribute):
        return _dotted(node)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        holder = _dotted(node.args[0])
        return f"{holder}.{node.args[1].value}" if holder else None
    return None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        holder = _dotted(node.value)
        return f"{holder}.{node.attr}" if holder else None
    return None


def has(workspace: Workspace, dotted_name: str) -> bool:
    """The release has what the dotted name names: its longest prefix that is a module, then a
    member the module binds, then an attribute of that member's class (further parts are the
    object's own: `tracker.items`, not checked)."""
    parts = dotted_name.split(".")
    cut = next((cut for cut in range(len(parts), 0, -1) if workspace.module_path(".".join(parts[:cut])) is not None), 0)
    if cut == 0:
        return False
    rest = parts[cut:]
    if not rest:
        return True
    source = workspace.module_source(".".join(parts[:cut]))
    if source is None or (source.binding(rest[0]) is None and rest[0] not in source.declared_globals):
        return False
    is_class = isinstance(source.binding(rest[0]), ast.ClassDef)
    return len(rest) == 1 or not is_class or _class_binds(workspace, source, rest[0], rest[1])


@pytest.mark.parametrize(("rule", "name", "at"), FIX_CASES)
def test_each_rules_fix_names_only_what_every_release_it_claims_has(rule, name, at):
    framework = FRAMEWORKS[name]
    workspace = release_workspace(framework, at)
    top = {"megatron-core": "megatron", "mindspeed": "mindspeed", "mindspeed-llm": "mindspeed_llm"}[name]
    plan = rendered(rule, workspace, framework, at)
    lacking = sorted({named for named in framework_names(plan, rule, top) if not has(workspace, named)})
    assert not lacking, f"{name} {framework.releases[at].name} has no {lacking}, which the fix of {rule.id} names"
