"""Which framework versions the user runs, and which adaptor profile their recovery code follows.

Framework symbols move between versions (Megatron's MoE tracker has had three names in three
modules), so rules say which versions they hold for and this module finds the version in the user's
tree: `--source-root` folders, the frames' own paths when they exist here, installed package
metadata. It reads files and metadata only; it never imports the frameworks (they import torch).

Versions, first found wins (the resolution order of `source.workspace`):

* under each source root, then under the import root of each local frame file: Megatron's
  `megatron/core/package_info.py` (MAJOR, MINOR, PATCH, PRE_RELEASE), a `setup.py` whose literal
  name is one of the frameworks (MindSpeed's is; MindSpeed-LLM's says `modellink 0.0.1`, a
  placeholder, so it never counts), `*.dist-info` / `*.egg-info` metadata folders;
* then the release the log's frames fingerprint (`Workspace.fingerprint`), origin "the log's
  frames (megatron-core 0.12.0–0.12.1, from 7 frames)";
* then the metadata installed for this Python ("installed"), unless the frames fingerprint
  releases of that framework which the installed one is not: it did not run the job.

Where neither a file nor the frames tell megatron-core's release, the job's arguments dump does
(`argument_releases`): `Environment.job_releases` takes the releases it fits ahead of the adaptor
generation's `pairs_with` and of the installed release.

A log-only workspace (`--log-only`) has no source roots and no frames read here: no file, no
installed metadata, so no versions; an adaptor given on the command line is still read.

Adaptor profile: the profile whose function and parameter names best fit the adaptor file (given,
or found by the profiles' `files` globs under the source roots, the frames' import roots and
`sys.path`); ties go to the profile whose MindSpeed-LLM versions hold the detected version, then to
`DEFAULT_PROFILE`. With no adaptor file, the generations the log shows (`generations.read_generation`:
whose derived messages the log's lines match most) pick, then the detected MindSpeed-LLM version,
else the default; `Environment.profile_from` says which.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePath
from types import ModuleType
from typing import TYPE_CHECKING, Literal

from packaging.version import InvalidVersion, Version

from unsafe_doctor.errors import AmbiguousAdaptor, UsageError, os_reason
from unsafe_doctor.knowledge.argument_releases import FRAMEWORK as DUMPED_FRAMEWORK
from unsafe_doctor.knowledge.argument_releases import DumpFit, NoDecision, dump_releases
from unsafe_doctor.knowledge.rules import AdaptorProfile, KnowledgeBase, role_parameter
from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.source import looked_at
from unsafe_doctor.source.files import (
    FRAMEWORK_DISTRIBUTIONS,
    import_root,
    is_file,
    is_internal_file,
    python_files,
    read_source,
)
from unsafe_doctor.source.syntax import Function, ImportedName, import_bindings, same_target
from unsafe_doctor.source.workspace import SourceFile, Workspace

if TYPE_CHECKING:
    import importlib.metadata

DEFAULT_PROFILE = "mindspeed-llm-26"  # the current in-tree adaptor, used when nothing says otherwise
# What chose the adaptor profile: the adaptor file's names, the log's lines, the MindSpeed-LLM version, nothing.
ProfileSource = Literal["option", "adaptor", "log", "version", "default"]
# Which of several adaptors found is the one: the person's answer, or the refusal raised again.
AdaptorChooser = Callable[[AmbiguousAdaptor], Path]
ADAPTOR_FRAMEWORK = "mindspeed-llm"  # the distribution whose version the profiles' `versions` constrain


@dataclass(frozen=True)
class Environment:
    versions: dict[str, Version]  # distribution name ("megatron-core") -> version found
    origins: dict[str, str]  # distribution name -> where the version was read (path or "installed")
    source_roots: tuple[Path, ...]
    profile: AdaptorProfile  # the adaptor generation fixes are written for
    adaptor: Path | None  # the adaptor file, when given or found
    profile_from: ProfileSource = "default"
    profile_why: str = ""  # what in the adaptor, the log or the version chose it
    tied: tuple[AdaptorProfile, ...] = ()  # other profiles the adaptor fits exactly as well
    adaptor_why: str = "given"  # how the adaptor was found (given; found under the roots, by what)
    # the generations the job may have run: the one an adaptor file or --profile names, the log's (several
    # when its evidence ties), else every generation the MindSpeed-LLM version found admits, else all
    possible: tuple[AdaptorProfile, ...] = ()
    # the names of the log's arguments dump (None: the log has no dump); see `dump_fit`
    dumped: frozenset[str] | None = None

    @cached_property
    def dump_fit(self) -> DumpFit | NoDecision | None:
        """What the log's arguments dump says of the megatron-core release (None: the log has no dump);
        matched only when a report asks (the frames or a file tell the release in most logs)."""
        return None if self.dumped is None else dump_releases(self.dumped)

    @property
    def generation(self) -> AdaptorProfile | None:
        """The adaptor generation the adaptor file or the log shows; a default profile, or a profile picked
        among the generations the log's lines tie between, is no evidence."""
        return self.profile if self.profile_from == "adaptor" or self.profile_from == "log" and len(self.possible) == 1 else None

    def job_releases(self) -> dict[str, tuple[tuple[Version, ...], str]]:
        """The frameworks' releases the job may have run, with where that comes from: what was found,
        unless it is only this machine's installation and the generations the job may have run (those
        `possible` when the adaptor or the log shows one) run with other releases (their `pairs_with`):
        then those of every such generation. Where no file or frame told megatron-core's release, the
        releases its arguments dump fits come first: those of them the generations run with, else all
        of them. The one decision every report reasons with (the suspects, the stale resets)."""
        shown = self.shown_generations()
        paired: dict[str, tuple[Version, ...]] = {}
        for profile in shown:
            for framework, pairs in profile.pairs_with.items():
                paired[framework] = tuple(sorted({*paired.get(framework, ()), *pairs}))
        told = self.origins.get(DUMPED_FRAMEWORK, "installed") != "installed"  # by a file or the frames: no dump read
        dumped = self.dump_fit.releases if not told and isinstance(self.dump_fit, DumpFit) else ()
        found: dict[str, tuple[tuple[Version, ...], str]] = {}
        for framework in dict.fromkeys([*self.versions, *paired, *([DUMPED_FRAMEWORK] if dumped else [])]):
            version = self.versions.get(framework)
            pairs = paired.get(framework, ())
            narrowed = ""
            if dumped and framework == DUMPED_FRAMEWORK:
                agreed = tuple(release for release in pairs if release in dumped)
                if not agreed:
                    found[framework] = (dumped, _dump_origin(len(dumped)))
                    continue
                narrowed = " and the arguments dump fits" if agreed != pairs else ""
                pairs = agreed
            installed_elsewhere = self.origins.get(framework) == "installed" and pairs and version not in pairs
            if version is not None and not installed_elsewhere:
                found[framework] = ((version,), self.origins[framework])
            elif pairs:
                releases = "the release" if len(pairs) == 1 else "the releases"
                names = [profile.id for profile in shown if framework in profile.pairs_with]
                if self.profile in shown and self.profile.pairs_with.get(framework) == pairs:
                    names = [self.profile.id]  # the generation fixes are written for runs with all of them
                runs = "adaptor runs" if len(names) == 1 else "adaptors run"
                found[framework] = (pairs, f"{releases} the {' or '.join(names)} {runs} with{narrowed}")
        return found

    def dumped_release(self, framework: str) -> DumpFit | None:
        """The arguments dump's fit, when the job's releases of the framework are all the releases it fits."""
        if framework != DUMPED_FRAMEWORK or self.origins.get(framework, "installed") != "installed":
            return None
        fit = self.dump_fit
        if not isinstance(fit, DumpFit):
            return None
        return fit if self.job_releases().get(framework) == (fit.releases, _dump_origin(len(fit.releases))) else None

    def shown_generations(self) -> tuple[AdaptorProfile, ...]:
        """The generations the adaptor file or the log's lines show: the adaptor's, or the one the lines
        decide or every one they tie between; none when nothing shows a generation."""
        if self.profile_from == "adaptor":
            return (self.profile,)
        return self.possible if self.profile_from == "log" else ()


def detect_environment(
    knowledge: KnowledgeBase,
    workspace: Workspace,
    *,
    frames: Sequence[Frame] = (),
    adaptor: Path | None = None,
    logged: Sequence[AdaptorProfile] = (),
    chosen: AdaptorProfile | None = None,
    search_under: Sequence[Path] = (),
    choose_adaptor: AdaptorChooser | None = None,
    dumped: Collection[str] | None = None,
) -> Environment:
    """`workspace`: the command's, over the source roots (`context.Groundwork`); `logged`: the
    generations the log shows (`generations.read_generation`); `chosen`: the profile the user named (--profile);
    `search_under`: where a module defining the recovery functions is looked for (default: the
    source roots; an audit: the folders it audits, not their import roots); `choose_adaptor`: which
    of several adaptors found is the one, or the refusal (None: the refusal); `dumped`: the names of
    the log's arguments dump (`log.arguments.RunArguments`), None when the log has none."""
    roots = workspace.source_roots
    for root in roots:
        if not root.is_dir():
            raise UsageError(f"source root {root} is not a directory")
    if adaptor is not None and not is_file(Path(adaptor)):
        raise UsageError(f"adaptor {adaptor}: {_why_not_a_file(Path(adaptor))}")
    frame_roots = [] if workspace.log_only else _frame_roots(frames, workspace)
    found: dict[str, tuple[Version, str]] = {}
    for root in (*roots, *frame_roots):
        for distribution, value in _versions_under(root).items():
            found.setdefault(distribution, value)
    for distribution, match in workspace.releases.items():
        version = match.version
        if version is not None:
            found.setdefault(distribution, (version, f"the log's frames ({match.describe()})"))
    for distribution in () if workspace.log_only else FRAMEWORK_DISTRIBUTIONS:
        if distribution not in found and distribution not in workspace.releases:
            installed = _installed_version(distribution)
            if installed is not None:
                found[distribution] = (installed, "installed")
    versions = {name: version for name, (version, _) in found.items()}
    origins = {name: origin for name, (_, origin) in found.items()}
    chooser = _ProfileChooser(knowledge, workspace, versions.get(ADAPTOR_FRAMEWORK))
    search_roots = (*roots, *frame_roots, *workspace.env_roots)
    adaptor_file, adaptor_why, choice = _adaptor_and_profile(
        chooser, adaptor, search_roots, search_under or roots, logged, choose_adaptor=choose_adaptor
    )
    if chosen is not None:
        choice = _Choice(chosen, "option", "named with --profile")
    return Environment(
        versions,
        origins,
        roots,
        choice.profile,
        adaptor_file,
        choice.source,
        choice.why,
        choice.tied,
        adaptor_why,
        chooser.possible(choice, logged),
        None if dumped is None else frozenset(dumped),
    )


def _dump_origin(releases: int) -> str:
    return f"the release{'s' if releases > 1 else ''} the arguments dump fits"


@dataclass(frozen=True)
class _Choice:
    profile: AdaptorProfile
    source: ProfileSource
    why: str
    tied: tuple[AdaptorProfile, ...] = ()


def _adaptor_and_profile(
    chooser: _ProfileChooser,
    adaptor: Path | None,
    roots: Sequence[Path],
    own_roots: Sequence[Path],
    logged: Sequence[AdaptorProfile],
    *,
    choose_adaptor: AdaptorChooser | None,
) -> tuple[Path | None, str, _Choice]:
    """The adaptor given, else the one found under the roots (of several, the one `choose_adaptor`
    names: given, as if by --adaptor), how, and its profile; with none, the generation the log
    shows, the version's, or the default."""
    found = None
    if adaptor is None:
        try:
            found = chooser.search(roots, own_roots)
        except AmbiguousAdaptor as ambiguous:
            if choose_adaptor is None:
                raise
            adaptor = choose_adaptor(ambiguous)
    if adaptor is not None:
        return Path(adaptor), "given", chooser.best_for(Path(adaptor))
    if found is not None:
        return found[0], f"found under the source roots {found[1]}", chooser.best_for(found[0])
    profile, source = chooser.fallback(logged)
    why = {
        "log": "the log's lines show this generation",
        "version": "the MindSpeed-LLM version found",
        "default": "nothing else told: the current in-tree adaptor",
    }[source]
    return None, "none under the source roots" if own_roots else "no source root to look under", _Choice(profile, source, why)


# --- versions ------------------------------------------------------------------------------------


def _why_not_a_file(path: Path) -> str:
    try:
        path.stat()
    except (OSError, ValueError) as error:  # too long a name, a NUL byte, no such file
        return os_reason(error)
    return "not a file"


def _frame_roots(frames: Sequence[Frame], workspace: Workspace) -> list[Path]:
    """Import roots (the folder above the top package) of the frame files that exist here."""
    roots: list[Path] = []
    for printed in dict.fromkeys(frame.file for frame in frames):
        path = Path(printed)
        if is_internal_file(printed) or not is_file(path):
            continue
        module = workspace.find(printed).module
        if module is None:
            continue
        root = import_root(path, module)
        if root is not None and root not in roots:
            roots.append(root)
    return roots


def _versions_under(root: Path) -> dict[str, tuple[Version, str]]:
    """Framework versions recorded under one import root: version files first, then metadata."""
    found: dict[str, tuple[Version, str]] = {}
    package_info = root / "megatron" / "core" / "package_info.py"
    megatron = _megatron_version(package_info)
    if megatron is not None:
        found["megatron-core"] = (megatron, str(package_info))
    setup = root / "setup.py"
    declared = _setup_version(setup)
    if declared is not None and (root / FRAMEWORK_DISTRIBUTIONS[declared[0]]).is_dir():
        found.setdefault(declared[0], (declared[1], str(setup)))
    stems = tuple(name.replace("-", "_") for name in FRAMEWORK_DISTRIBUTIONS)
    for folder in sorted([*root.glob("*.dist-info"), *root.glob("*.egg-info")]):
        if not folder.name.lower().replace("-", "_").startswith(stems):
            continue  # site-packages holds hundreds of these
        metadata = _metadata().PathDistribution(folder).metadata
        _note_metadata(folder)
        name = _canonical(_first_value(metadata, "Name"))
        version = _version(_first_value(metadata, "Version"))
        if name in FRAMEWORK_DISTRIBUTIONS and version is not None:
            found.setdefault(name, (version, str(folder)))
    return found


def _metadata() -> ModuleType:
    """importlib.metadata, imported when metadata is read: it costs a tenth of a small log's start-up."""
    import importlib.metadata

    return importlib.metadata


def _canonical(name: str) -> str:
    from packaging.utils import canonicalize_name  # packaging.utils imports packaging.tags: start-up time

    return canonicalize_name(name)


def _first_value(metadata: importlib.metadata.PackageMetadata, field: str) -> str:
    """A metadata field's first value, '' when the folder's metadata lacks it."""
    values = metadata.get_all(field)
    return values[0] if values else ""


def _megatron_version(path: Path) -> Version | None:
    constants = _literals(path)
    parts = [constants.get(name) for name in ("MAJOR", "MINOR", "PATCH")]
    if any(part is None for part in parts):
        return None
    return _version(".".join(map(str, parts)) + str(constants.get("PRE_RELEASE") or ""))


def _setup_version(path: Path) -> tuple[str, Version] | None:
    """(distribution, version) from a setup.py's literal `setup(name=..., version=...)`, when the
    distribution is one of the frameworks. Names in the call may refer to module constants."""
    tree = _parse(path)
    if tree is None:
        return None
    constants = _literals(path, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "setup":
            arguments = {keyword.arg: _literal(keyword.value, constants) for keyword in node.keywords}
            name, version = arguments.get("name"), _version(str(arguments.get("version") or ""))
            if isinstance(name, str) and _canonical(name) in FRAMEWORK_DISTRIBUTIONS and version is not None:
                return _canonical(name), version
    return None


def _literals(path: Path, tree: ast.Module | None = None) -> dict[str, object]:
    """Module-level `NAME = <str or int literal>` assignments of a file, without running it."""
    tree = tree or _parse(path)
    constants: dict[str, object] = {}
    for statement in tree.body if tree else ():
        targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
        value = getattr(statement, "value", None)
        if isinstance(statement, (ast.Assign, ast.AnnAssign)) and isinstance(value, ast.Constant):
            constants.update((target.id, value.value) for target in targets if isinstance(target, ast.Name))
    return constants


def _literal(node: ast.expr, constants: dict[str, object]) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _installed_version(distribution: str) -> Version | None:
    try:
        found = _metadata().distribution(distribution)
    except _metadata().PackageNotFoundError:
        return None
    folder = getattr(found, "_path", None)  # a PathDistribution's folder; other finders' are not recorded
    _note_metadata(Path(folder) if isinstance(folder, (str, os.PathLike)) else None)
    return _version(found.version)


def _note_metadata(folder: Path | None) -> None:
    """The files a distribution's metadata is read from, for the audit's cache (`source.looked_at`):
    a `setup.py develop` checkout's `*.egg-info` keeps its name when its version changes."""
    if folder is not None and looked_at.recorded() is not None:
        for name in ("METADATA", "PKG-INFO"):
            path = folder / name
            looked_at.note_read(path, looked_at.regular_bytes(path), whole=True)


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def _parse(path: Path) -> ast.Module | None:
    try:
        text = read_source(path)
        return ast.parse(text) if text is not None else None
    except (SyntaxError, ValueError, RecursionError):
        return None


# --- adaptor profile -------------------------------------------------------------------------------

# Score weights: a function name says more than one parameter; the location, a little more.
_NAME_WEIGHT = 3  # a rollback / send / recv function of the profile's name
_PATH_WEIGHT = 2  # the file sits where the profile's `files` say
_IMPORT_WEIGHT = 10  # the file imports the repair-group getter from the profile's module: its generation, whatever the names


class _ProfileChooser:
    """Scores profiles against adaptor files; parsed files are cached for one detection."""

    def __init__(self, knowledge: KnowledgeBase, workspace: Workspace, version: Version | None):
        if not knowledge.profiles:
            raise UsageError("the knowledge base has no adaptor profiles")
        self.profiles = knowledge.profiles
        self.source_roots = workspace.source_roots
        self.version = version
        self._workspace = workspace

    def search(self, roots: Sequence[Path], own_roots: Sequence[Path]) -> tuple[Path, str] | None:
        """The adaptor file under the roots, and how it was found: by a profile's file names, else,
        in the user's own roots only (`own_roots`), as the module that defines a profile's rollback,
        send and receive functions. Two files that each hold a rollback function (a team's adaptor
        and a vendored copy) are not chosen between: AmbiguousAdaptor."""
        how = "by its generation's file name"
        candidates = list(self._candidates(roots))
        if not candidates:
            how = "as the module that defines the rollback and repair functions"
            candidates = list(self._defining(own_roots))
        best: tuple[tuple, Path] | None = None
        holders: list[Path] = []
        for path in candidates:
            choice = self.best_for(path)
            functions = self._functions(path)
            profile = choice.profile
            own = (profile.rollback in functions, sum(name in functions for name in (profile.send, profile.recv)))
            if own[0]:
                holders.append(path)
            key = (self._key(profile, path, self.profiles.index(profile)), own)
            if best is None or key > best[0]:
                best = (key, path)
        if len(holders) > 1:
            raise AmbiguousAdaptor(tuple(holders))
        return (best[1], how) if best is not None else None

    def _defining(self, roots: Sequence[Path]) -> Iterator[Path]:
        """Python files under the roots that define some profile's rollback, send and receive
        functions (a `def` of each name is looked for in the text before the file is parsed)."""
        wanted = [(profile.rollback, profile.send, profile.recv) for profile in self.profiles]
        seen: set[Path] = set()
        for root in roots:
            for path in python_files(root):
                if path.resolve() in seen:
                    continue
                seen.add(path.resolve())
                text = read_source(path)
                if text is not None and any(all(f"def {name}(" in text for name in names) for names in wanted):
                    functions = self._functions(path)
                    if any(all(name in functions for name in names) for names in wanted):
                        yield path  # as the root was given: relative, or absolute

    def best_for(self, adaptor: Path) -> _Choice:
        """The profile the adaptor fits best; profiles that fit it exactly as well are `tied`: the
        default profile is no reason to pick one of them."""
        if self._source(adaptor) is None:
            raise UsageError(f"adaptor {adaptor} cannot be read or is not valid Python")
        scored = [(self._key(profile, adaptor, index), profile) for index, profile in enumerate(self.profiles)]
        key, profile = max(scored, key=lambda item: item[0])
        tied = tuple(other for other_key, other in scored if other is not profile and other_key[:2] == key[:2])
        getter = self._getter_import(profile, adaptor)
        why = f"the adaptor imports {getter}" if getter else "its function and parameter names fit best"
        return _Choice(profile, "adaptor", why, tied)

    def _key(self, profile: AdaptorProfile, adaptor: Path, index: int) -> tuple:
        return (self._fit(profile, adaptor), self._fits_version(profile), profile.id == DEFAULT_PROFILE, -index)

    def _getter_import(self, profile: AdaptorProfile, adaptor: Path) -> str | None:
        """`get_repair_group from mindio_ttp.adaptor.tft_replica_group` when the adaptor's files import
        the profile's repair-group getter from the profile's module."""
        imports = self._imports(profile, adaptor)
        for statement in profile.repair_group_imports:
            parsed = ast.parse(statement).body[0]
            if isinstance(parsed, (ast.Import, ast.ImportFrom)):
                for name, binding in import_bindings(parsed, None).items():
                    if name in imports and same_target(imports[name], binding.target):
                        return f"{name} from {binding.target.rpartition('.')[0]}"
        return None

    def _imports(self, profile: AdaptorProfile, adaptor: Path) -> dict[str, str]:
        imports: dict[str, str] = {}
        for path in profile_files(profile, adaptor) or [adaptor]:
            source = self._source(path)
            if source is not None:
                imports.update(
                    (name, binding.target) for name, binding in source.bindings.items() if isinstance(binding, ImportedName)
                )
        return imports

    def _fit(self, profile: AdaptorProfile, adaptor: Path) -> int:
        """How well the profile's names fit the adaptor, read together with the profile's other files
        beside it: per rollback / send / recv function found, per expected parameter present (minus
        those absent and those the profile does not know), for sitting where `files` says, and most
        for importing the repair-group getter from the profile's module."""
        files = profile_files(profile, adaptor)
        functions: dict[str, Function] = {}
        for path in files or [adaptor]:
            functions.update(self._functions(path))
        score = _PATH_WEIGHT if files else 0
        score += _NAME_WEIGHT * sum(name in functions for name in (profile.rollback, profile.send, profile.recv))
        known = {held.split(".")[0] for names in profile.parameters.values() for held in names}
        for name, receives in ((profile.send, False), (profile.recv, True)):
            if name in functions:
                present = _parameters(functions[name])
                expected = {
                    held.split(".")[0]
                    for role in profile.parameters
                    if receives or role != "need_rebuild"
                    if (held := role_parameter(profile, role, present)) is not None
                }
                score += len(expected & present) - len(expected - present) - len(present - known)
        if self._getter_import(profile, adaptor):
            score += _IMPORT_WEIGHT
        return score

    def _candidates(self, roots: Sequence[Path]) -> Iterator[Path]:
        seen: set[Path] = set()
        for root in roots:
            for profile in self.profiles:
                for pattern in profile.files:
                    for path in sorted(root.glob(pattern)):
                        if path.resolve() not in seen and is_file(path) and self._source(path) is not None:
                            seen.add(path.resolve())
                            yield path

    def fallback(self, logged: Sequence[AdaptorProfile]) -> tuple[AdaptorProfile, ProfileSource]:
        """With no adaptor file: among the generations the log shows, else among all, the one the
        MindSpeed-LLM version fits, then the default."""
        pool = list(logged) or list(self.profiles)
        fitting = [profile for profile in pool if self._fits_version(profile)]
        candidates = fitting or pool
        profile = next((profile for profile in candidates if profile.id == DEFAULT_PROFILE), candidates[0])
        return profile, "log" if logged else "version" if fitting else "default"

    def possible(self, choice: _Choice, logged: Sequence[AdaptorProfile]) -> tuple[AdaptorProfile, ...]:
        """`Environment.possible` for the profile chosen."""
        if choice.source in ("option", "adaptor"):
            return (choice.profile,)
        if logged:
            return tuple(logged)
        return tuple(profile for profile in self.profiles if self._fits_version(profile)) or tuple(self.profiles)

    def _fits_version(self, profile: AdaptorProfile) -> bool:
        return (
            self.version is not None
            and profile.versions is not None
            and profile.versions.contains(self.version, prereleases=True)
        )

    def _source(self, path: Path) -> SourceFile | None:
        return self._workspace.local_source(path)

    def _functions(self, path: Path) -> dict[str, Function]:
        source = self._source(path)
        return {name: binding for name, binding in (source.bindings.items() if source else ()) if isinstance(binding, Function)}


def profile_files(profile: AdaptorProfile, adaptor: Path) -> list[Path]:
    """The profile's files beside the adaptor, when the adaptor is one of them (MindSpeed-LLM 2.3
    and later split rollback and repair over two files); empty when it is not."""
    for pattern in profile.files:
        if PurePath(adaptor.resolve()).match(pattern):
            root = adaptor.resolve().parents[len(PurePath(pattern).parts) - 1]
            return [path for glob in profile.files for path in sorted(root.glob(glob)) if is_file(path)]
    return []


def _parameters(function: Function) -> set[str]:
    arguments = function.args
    return {argument.arg for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)}
