"""Finding and reading source files: a path printed in a log -> the local file and its module; a
dotted module -> its file; each file read and parsed once, with its module-level bindings.

* **Files** are found, first found wins: by path as printed; by the longest path suffix under a
  source root (an import root, like a PYTHONPATH entry); in the framework index, as the release the
  log's frames fingerprint (`fingerprint`, then `unsafe_doctor.source.fingerprint`); under a
  `sys.path` directory (a local installation: `locate` uses its file only where its lines agree
  with the log's). Modules named by imports are looked for in the same order.
* **Module names** come from the path after `site-packages/`, the directory the file was found
  under, `__init__.py` files, or a framework package name in the path. A file found at its printed
  path makes the folder above its top package an import root for resolving its imports.
* `sys.path` is read once per workspace, when a file is first looked for there.
* **Log only** (`--log-only`): no file a log names is opened and `sys.path` is never searched, so
  the diagnosis rests on the printed lines alone; files given on the command line (an adaptor) are
  still read.
* **Parts**: `FileFinder` finds files and modules; `SourceCache` reads and parses each file once;
  a `Workspace` is a finder with its source cache, and keeps what the stages above derive from the
  files once per run in typed caches (a module-level `Slot` names each kind, `Workspace.cache`
  gives its `Cache`).
"""

from __future__ import annotations

import ast
import os
import re
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar, cast

from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.source.files import (
    FRAMEWORK_PACKAGES,
    after_site_packages,
    dotted,
    framework_suffix,
    import_root,
    is_dir,
    is_file,
    package_of,
    python_files,
    read_source,
)
from unsafe_doctor.source.fingerprint import ReleaseMatch, agreeing_releases, fingerprint
from unsafe_doctor.source.index import FrameworkIndex, IndexedFramework
from unsafe_doctor.source.looked_at import note_size, note_tree
from unsafe_doctor.source.syntax import (
    Function,
    ImportedName,
    child_statements,
    import_bindings,
    names_bound,
    word_lines,
)

K = TypeVar("K")
V = TypeVar("V")

RECENT_SOURCES = 64  # parsed files kept for reuse beyond those something else keeps: every tree of a large job is too much

# What a module-level name is bound to: a class, a function, an assignment, or an import.
Assignment = ast.Assign | ast.AnnAssign | ast.AugAssign
Binding = ast.ClassDef | Function | Assignment | ImportedName


class Origin(str, Enum):
    """Where the source read for a printed path came from; `log` findings are guesses from the printed line,
    `sentinel` ones were named by the training process (no traceback, no source needed)."""

    JOB = "job"  # the path as printed, or under a --source-root: the job's own files
    INDEX = "index"  # the shipped index, as the release the log's frames fingerprint
    INSTALLED = "installed"  # under a `sys.path` directory: a local installation, maybe another release
    LOG = "log"  # nothing read: the log's text alone
    SENTINEL = "sentinel"  # nothing read: the training process named the global itself (the sentinel's lines)

    @property
    def confidence(self) -> str:
        """How far a tensor named from this source can be trusted: a log-only one is a guess."""
        return {"job": "high", "index": "high", "installed": "medium", "sentinel": "high"}.get(self.value, "guess")


@dataclass(frozen=True)
class FoundFile:
    local: Path | None  # the file read for this path, if any
    module: str | None
    shown: str  # how notes name it: the part of the path that matched, else the path as printed
    origin: Origin = Origin.LOG


@dataclass(frozen=True)
class SourceFile:
    path: Path
    text: str
    tree: ast.Module
    module: str | None
    package: str | None  # for relative imports
    bindings: dict[str, Binding]  # module-level names, also those bound under `if` / `try`
    imports: dict[str, ImportedName]  # module-level names bound by an import (a later assignment aside)
    declared_globals: frozenset[str]  # names some function declares `global`
    star_import: bool
    # what a stage computes from this tree's nodes and keeps in nodes: let go with the tree (`Workspace.cache`
    # keeps what holds no node)
    of_nodes: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    def binding(self, name: str) -> Binding | None:
        """The module-level binding of `name`, seen through a rename of an import (`mpu = parallel_state`)."""
        binding = self.bindings.get(name)
        if isinstance(binding, ast.Assign) and isinstance(binding.value, ast.Name):
            aliased = self.bindings.get(binding.value.id)
            if isinstance(aliased, ImportedName):
                return aliased
        return binding

    @cached_property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    @cached_property
    def bound_imports(self) -> dict[str, ImportedName]:
        """The module-level names `binding` sees bound to an import (also through a rename)."""
        return {name: binding for name in self.bindings if isinstance(binding := self.binding(name), ImportedName)}


class TopStatement(NamedTuple):
    """A module-level statement of a file, without its nodes."""

    first: int  # its first line, its decorators' included
    last: int
    definition: bool  # a function or a class
    text: str  # its lines


@dataclass(frozen=True)
class _Outline:
    """What is kept of a parsed file without its tree, to parse only some of its statements later."""

    statements: tuple[tuple[int, int, bool], ...]  # (first line, last line, definition) of each module-level statement
    members: dict[int, tuple[tuple[int, int, bool], ...]]  # the same of a module-level class's body, by its first line
    imports: dict[str, ImportedName]
    package: str | None


@dataclass(frozen=True)
class Parsed:
    """What a workspace keeps of the files it parsed, without their trees: what another process's
    workspace takes (`Workspace.adopt`) to know those files as if it had parsed them."""

    parsed_as: dict[Path, str | None]
    bound_imports: dict[Path, dict[str, ImportedName]]
    outlines: dict[Path, _Outline]
    unparsable: frozenset[Path]


def module_from_path(path: str, source_roots: Sequence[Path] = ()) -> str | None:
    """Dotted module name of one file as printed in a log; a stage naming many uses one `Workspace`."""
    return Workspace(source_roots).find(path).module


class FileFinder:
    """Finding files, each looked for once (the module docstring's **Files** and **Module names**): a
    path printed in a log or a dotted module -> the local file, its module and where it came from.
    The files of a release the log's frames fingerprint are that release's skeletons in the index
    (`skeletons`, under paths that name the release)."""

    def __init__(
        self,
        source_roots: Sequence[Path],
        *,
        log_only: bool = False,
        index: FrameworkIndex | None = None,
        studied: Sequence[Path] | None = None,
    ):
        """`studied`: the folders whose every file the heuristics may read, the source roots unless
        given: an audit names its paths, and their import roots above them are not the user's to read."""
        if log_only and source_roots:
            raise ValueError("a log-only workspace reads no source roots")
        self.source_roots = tuple(Path(root) for root in source_roots)
        self.studied = self.source_roots if studied is None else tuple(studied)
        self.log_only = log_only  # never open a file a log names, never search sys.path
        self.index = index if index is not None else FrameworkIndex()  # shipped data, read in log-only mode too
        self.releases: dict[str, ReleaseMatch] = {}  # framework -> the releases the log's frames fit (`fingerprint`)
        self.fingerprinted = False  # once per workspace: its files are found as that release's
        # modules read from a framework no frame fingerprinted -> the release that stood in (`_module_unmatched`)
        self.assumed_releases: dict[str, str] = {}
        self.skeletons: dict[Path, str] = {}  # the index's files, under the paths `_indexed` makes
        self.found_roots: list[Path] = []  # import roots of files found at their printed path
        self._found: dict[str, FoundFile] = {}
        self._module_paths: dict[str, Path | None] = {}
        self._listings: dict[Path, tuple[Path, ...]] = {}

    @cached_property
    def env_roots(self) -> tuple[Path, ...]:
        """The `sys.path` directories, read once; none when log only."""
        if self.log_only:
            return ()
        return tuple(Path(entry) for entry in sys.path if entry and is_dir(Path(entry)))

    # the framework index

    def fingerprint(self, frames: Sequence[Frame]) -> dict[str, ReleaseMatch]:
        """Match the log's frames against the index, once and before any file is looked for
        (`locate` does, first); the matched releases then stand in for the frameworks' files
        (`find`, `module_path`)."""
        if self.fingerprinted:
            return self.releases
        if self._found or self._module_paths:
            raise RuntimeError("fingerprint the log before looking for files")
        self.releases = fingerprint(frames, self.index)
        self.fingerprinted = True
        return self.releases

    def importers_by_name(self, module: str, name: str) -> list[str]:
        """Where the fingerprinted release imports `name` from `module` by name at module level
        (`from m import name`): those modules keep the old object when `module.name` is rebound (an
        import inside a function reads it again at each call). Empty when the module's framework was
        not fingerprinted (its other modules are not known here)."""
        located = self.index.framework_of(module.replace(".", "/") + ".py")
        match = self.releases.get(located[0].name) if located else None
        if match is None:
            return []
        last = module.rpartition(".")[2]
        pattern = re.compile(rf"^from (?:{re.escape(module)}|\.+{re.escape(last)}) import .*\b{re.escape(name)}\b", re.MULTILINE)
        found = []
        for path in sorted(match.framework.paths):
            version = match.version_of(path)
            for hit in pattern.finditer(version.skeleton if version else ""):
                found.append(f"{path}:{version.skeleton.count(chr(10), 0, hit.start()) + 1}" if version else path)
        return found

    def _indexed(self, path: str, match: ReleaseMatch) -> Path | None:
        """The skeleton of `path` in the matched release, under a path naming the release."""
        version = match.version_of(path)
        if version is None:
            return None
        release = match.framework.releases[match.chosen].name
        shown = Path(f"<{match.framework.name} {release}>", *path.split("/"))
        self.skeletons[shown] = version.skeleton
        return shown

    def _find_indexed(self, normal: str, site_module: str | None) -> FoundFile | None:
        located = self.index.framework_of(normal) if self.releases else None
        if located is None or located[0].name not in self.releases:
            return None
        framework, path = located
        shown = self._indexed(path, self.releases[framework.name])
        if shown is None:
            return None
        return FoundFile(shown, site_module or dotted(path.split("/")), path, Origin.INDEX)

    def _module_indexed(self, parts: Sequence[str]) -> Path | None:
        for name, match in self.releases.items():
            framework: IndexedFramework = match.framework
            folder = "/".join(parts)
            for candidate in (folder + ".py", folder + "/__init__.py"):
                if candidate in framework.paths:
                    shown = self._indexed(candidate, match)
                    if shown is not None:
                        return shown
            if folder in framework.folders:
                return Path(f"<{name}>", *parts)
        return self._module_unmatched(parts)

    def _module_unmatched(self, parts: Sequence[str]) -> Path | None:
        """A module of an indexed framework no frame of the log fingerprinted (MindSpeed under a
        MindSpeed-LLM frame that imports it): its newest release that has the file."""
        if not self.fingerprinted:
            return None
        folder = "/".join(parts)
        for framework in self.index.frameworks:
            if framework.name in self.releases:
                continue
            for candidate in (folder + ".py", folder + "/__init__.py"):
                if candidate in framework.paths:
                    holding = [at for at in range(len(framework.releases)) if framework.version_in(candidate, at)]
                    if not holding:
                        return None
                    self.assumed_releases[".".join(parts)] = f"{framework.name} {framework.releases[holding[-1]].name}"
                    return self._indexed(candidate, ReleaseMatch(framework, (holding[-1],), 0, 0))
        return None

    # files printed in a log

    def find(self, printed: str) -> FoundFile:
        if printed not in self._found:
            self._found[printed] = self._find(printed)
        return self._found[printed]

    def _find(self, printed: str) -> FoundFile:
        normal = printed.replace("\\", "/")
        site_module = after_site_packages(normal)
        parts = [part for part in normal.split("/") if part]
        as_printed = Path(printed)
        if not self.log_only and is_file(as_printed):
            module = site_module or self._module_of_local(as_printed)
            self._add_import_root(as_printed, module)
            return FoundFile(as_printed, module, printed, Origin.JOB)
        # Source roots first (the user named them), any suffix; then the index; then the environment,
        # two parts at least.
        found = self._under(parts, self.source_roots, 1, Origin.JOB, site_module)
        found = found or self._find_indexed(normal, site_module)
        found = found or self._under(parts, self.env_roots, 2, Origin.INSTALLED, site_module)
        return found or FoundFile(None, site_module or framework_suffix(parts), printed)

    @staticmethod
    def _under(
        parts: Sequence[str], roots: Sequence[Path], shortest: int, origin: Origin, site_module: str | None
    ) -> FoundFile | None:
        for start in range(len(parts) - shortest + 1):
            suffix = parts[start:]
            for root in roots:
                candidate = root.joinpath(*suffix)
                if is_file(candidate):
                    return FoundFile(candidate, site_module or dotted(suffix), "/".join(suffix), origin)
        return None

    def _module_of_local(self, path: Path) -> str | None:
        resolved = path.resolve()
        for root in self.source_roots:
            if resolved.is_relative_to(root.resolve()):
                return dotted(resolved.relative_to(root.resolve()).parts)
        names = [] if path.name == "__init__.py" else [path.stem]
        folder = resolved.parent
        # Namespace packages of the frameworks have no __init__.py (megatron in megatron-core).
        while (folder / "__init__.py").is_file() or folder.name in FRAMEWORK_PACKAGES:
            names.append(folder.name)
            folder = folder.parent
        return ".".join(reversed(names)) if all(name.isidentifier() for name in names) and names else None

    def _add_import_root(self, path: Path, module: str | None) -> None:
        root = import_root(path, module) if module is not None else None
        if root is not None and root not in (*self.source_roots, *self.found_roots, *self.env_roots):
            self.found_roots.append(root)
            note_tree(root)  # names now lead here first
            self._module_paths.clear()  # earlier misses may be found under the new root

    # modules and folders

    def module_path(self, dotted_name: str) -> Path | None:
        """The file (or namespace folder) of a module, searched on disk under the roots."""
        if dotted_name not in self._module_paths:
            self._module_paths[dotted_name] = self._module_path(dotted_name)
        return self._module_paths[dotted_name]

    def _module_path(self, dotted_name: str) -> Path | None:
        parts = dotted_name.split(".")
        if not all(part.isidentifier() for part in parts):
            return None
        return (
            self._module_under(parts, (*self.source_roots, *self.found_roots))
            or self._module_indexed(parts)
            or (self._module_under(parts, self.env_roots))
        )

    @staticmethod
    def _module_under(parts: Sequence[str], roots: Sequence[Path]) -> Path | None:
        # Strings, not `Path`s, until one is found: every name an audit resolves is looked for here.
        for root in roots:
            folder = os.path.join(root, *parts)
            for candidate in (folder + ".py", os.path.join(folder, "__init__.py")):
                if os.path.isfile(candidate):
                    return Path(candidate)
            if os.path.isdir(folder):
                return Path(folder)
        return None

    def python_files(self, folder: Path) -> tuple[Path, ...]:
        """`files.python_files` of a folder, listed once per workspace (the heuristics list a package
        for every global they judge)."""
        if folder not in self._listings:
            self._listings[folder] = tuple(python_files(folder))
        return self._listings[folder]

    def is_indexed(self, path: Path) -> bool:
        """A skeleton from the index: its lines hold bindings only, at the release's line numbers."""
        return path in self.skeletons

    def release_of(self, printed: str) -> str | None:
        """The releases the log's frames fit, for a file of an indexed framework (`ReleaseMatch.describe`)."""
        located = self.index.framework_of(printed)
        match = self.releases.get(located[0].name) if located else None
        return match.describe() if match else None

    def index_agrees(self, frame: Frame) -> bool:
        """The matched release's file holds the frame's printed line at its line number."""
        located = self.index.framework_of(frame.file)
        match = self.releases.get(located[0].name) if located else None
        return located is not None and match is not None and match.chosen in agreeing_releases(match.framework, located[1], frame)


class SourceCache:
    """Files read and parsed, each once: a tree is found again while anything keeps it, the latest
    `RECENT_SOURCES` are kept here, and one let go is parsed again when asked for, as the module
    named at the first read. Of every file parsed its imports and outline are kept without the tree,
    and the files that do not parse are known. `skeletons`: the index's files (`FileFinder`), read
    from there, not from disk."""

    def __init__(self, skeletons: Mapping[Path, str]):
        self._skeletons = skeletons
        self._texts: dict[Path, str | None] = {}
        self._sizes: dict[Path, int | None] = {}
        self._sources: weakref.WeakValueDictionary[Path, SourceFile] = weakref.WeakValueDictionary()
        self._recent: OrderedDict[Path, SourceFile] = OrderedDict()
        self._parsed_as: dict[Path, str | None] = {}
        self._unparsable: set[Path] = set()
        self._bound_imports: dict[Path, dict[str, ImportedName]] = {}  # of every file parsed, kept without its tree
        self._outlines: dict[Path, _Outline] = {}  # of every file parsed

    def text(self, path: Path) -> str | None:
        """The file's text, read once; None when it cannot be read."""
        if path in self._skeletons:
            return self._skeletons[path]
        if path not in self._texts:
            self._texts[path] = read_source(path)
        return self._texts[path]

    def size(self, path: Path) -> int | None:
        """The file's size in bytes, looked up once; None when it cannot be."""
        if path not in self._sizes:
            try:
                self._sizes[path] = path.stat().st_size
            except OSError:
                self._sizes[path] = None
            note_size(path, self._sizes[path])
        return self._sizes[path]

    def source(self, path: Path, module: str | None) -> SourceFile | None:
        """The file parsed, as the module first named for it; None when it cannot be read or parsed.
        Parsed again only once nothing keeps the tree and it is not among the `RECENT_SOURCES` latest."""
        if path in self._unparsable:
            return None
        source = self._sources.get(path)
        if source is None:
            module = self._parsed_as.setdefault(path, module)
            text = self.text(path)
            source = _parse(path, text, module) if text is not None else None
            if source is None:
                self._unparsable.add(path)
                return None
            self._sources[path] = source
            self._bound_imports[path] = source.bound_imports
            spans = tuple(_span_of(statement) for statement in source.tree.body)
            classes = [statement for statement in source.tree.body if isinstance(statement, ast.ClassDef)]
            members = {_lines_of(node)[0]: inner for node in classes if (inner := _members(node))}
            self._outlines[path] = _Outline(spans, members, source.imports, source.package)
        self._recent[path] = source
        self._recent.move_to_end(path)
        if len(self._recent) > RECENT_SOURCES:
            self._recent.popitem(last=False)
        return source

    def why_not_parsed(self, path: Path) -> str | None:
        """Why a file that reads gave no `source`, as a note's phrase ("is nested too deeply to
        parse"); None when it parses, or cannot be read (`files.why_not_read` says why)."""
        text = self.text(path)
        if text is None:
            return None
        try:
            ast.parse(text)
        except (RecursionError, MemoryError):
            return "is nested too deeply or too complex to parse (generated code?)"
        except (SyntaxError, ValueError):
            return "is not valid Python: not parsed"
        return None

    def parsed(self) -> Parsed:
        return Parsed(dict(self._parsed_as), dict(self._bound_imports), dict(self._outlines), frozenset(self._unparsable))

    def adopt(self, parsed: Parsed) -> None:
        """Files another process parsed (a copy of this one, `audit.halves`), kept as if parsed here;
        what this one parsed itself stays as it is."""
        self._parsed_as = parsed.parsed_as | self._parsed_as
        self._bound_imports = parsed.bound_imports | self._bound_imports
        self._outlines = parsed.outlines | self._outlines
        self._unparsable |= parsed.unparsable

    def selected(self, path: Path, module: str | None, keep: Callable[[TopStatement], bool]) -> SourceFile | None:
        """The file parsed with only the module-level statements `keep` chooses, and of a chosen
        class only the body statements it chooses (a `pass` where it chooses none), the others left
        as blank lines so that every line keeps its number: less to parse where a study needs few of
        a file's statements again. Its bindings are not listed (its imports are). The whole file
        when it is parsed still, was never parsed (then kept as `source` keeps it), or when its
        chosen statements share a line with others."""
        outline = self._outlines.get(path)
        whole = self._sources.get(path)
        text = self.text(path) or ""
        if whole is not None or outline is None or path in self._unparsable or "\r" in text:  # lines as `split` counts them
            return whole if whole is not None else self.source(path, module)
        lines = text.split("\n")
        kept = [""] * len(lines)
        chosen: list[tuple[int, int]] = []
        bodies: list[list[tuple[int, int]] | None] = []  # a chosen class's body as thinned, None where it is whole
        for first, last, definition in outline.statements:
            if keep(TopStatement(first, last, definition, "\n".join(lines[first - 1 : last]))):
                chosen.append((first, last))
                kept[first - 1 : last] = lines[first - 1 : last]
                body = _thinned(outline.members.get(first, ()), lines, kept, keep)
                if body is not None:
                    chosen[-1] = (first, body[-1][1])  # the class ends where its last statement left in does
                bodies.append(body)
        try:
            tree = ast.parse("\n".join(kept))
        except _UNPARSABLE:
            tree = None
        if (
            tree is None
            or [_lines_of(statement) for statement in tree.body] != chosen
            or any(
                body is not None and [_lines_of(inner) for inner in getattr(statement, "body", ())] != body
                for statement, body in zip(tree.body, bodies, strict=True)
            )
        ):
            return self.source(path, module)  # statements sharing a line: parsed whole
        return SourceFile(path, text, tree, self._parsed_as.get(path), outline.package, {}, outline.imports, frozenset(), False)

    def bound_imports(self, path: Path, module: str | None) -> dict[str, ImportedName] | None:
        """The module-level names of a file that `SourceFile.binding` sees bound to an import; the
        file is parsed only if it was not before. None when it does not parse."""
        if path not in self._bound_imports and self.source(path, module) is None:
            return None
        return self._bound_imports[path]


class Workspace(FileFinder):
    """File look-ups and parsed sources for one run of a stage, cached; files are read, never
    imported. It finds files as a `FileFinder` and reads them through its `SourceCache`; what the
    stages above derive from them is kept in its caches (`cache`)."""

    def __init__(
        self,
        source_roots: Sequence[Path],
        *,
        log_only: bool = False,
        index: FrameworkIndex | None = None,
        studied: Sequence[Path] | None = None,
    ):
        super().__init__(source_roots, log_only=log_only, index=index, studied=studied)
        self.sources = SourceCache(self.skeletons)
        self._caches: dict[Slot[Any, Any], Cache[Any, Any]] = {}

    def __reduce__(self) -> tuple[Callable[..., Workspace], tuple[object, ...]]:
        """Pickled as a fresh workspace over the same roots that reads the frameworks as this one
        does: what it read and parsed may have changed since (an audit's cache keeps its result)."""
        fresh = partial(_fresh_workspace, log_only=self.log_only, releases=self.releases, fingerprinted=self.fingerprinted)
        return fresh, (self.source_roots, self.studied)

    def over(self, source_roots: Sequence[Path]) -> Workspace:
        """A workspace over other roots (an adaptor's tree) that reads the frameworks as this one
        does: the same index and fingerprinted releases, the same log-only switch."""
        other = Workspace(() if self.log_only else source_roots, log_only=self.log_only, index=self.index)
        other.releases, other.fingerprinted = self.releases, self.fingerprinted
        return other

    # reading (`SourceCache`)

    def text(self, path: Path) -> str | None:
        """The file's text, read once; None when it cannot be read."""
        return self.sources.text(path)

    def source(self, path: Path, module: str | None) -> SourceFile | None:
        """The file parsed, as the module first named for it; None when it cannot be read or parsed."""
        return self.sources.source(path, module)

    def selected(self, path: Path, module: str | None, keep: Callable[[TopStatement], bool]) -> SourceFile | None:
        """The file parsed with only the statements `keep` chooses (`SourceCache.selected`)."""
        return self.sources.selected(path, module, keep)

    # modules read

    def module_source(self, dotted_name: str) -> SourceFile | None:
        path = self.module_path(dotted_name)
        if path is None or not (path in self.skeletons or path.is_file()):
            return None
        return self.source(path, dotted_name)

    def module_source_at(self, dotted_name: str, framework: str, release: str) -> SourceFile | None:
        """A framework module as the shipped index holds it in one release (`0.12.1`): what the job
        ran when this machine has another release installed. None when the index does not hold it."""
        indexed = next((each for each in self.index.frameworks if each.name == framework), None)
        at = next((at for at, each in enumerate(indexed.releases) if each.name == release), None) if indexed else None
        if indexed is None or at is None:
            return None
        folder = "/".join(dotted_name.split("."))
        for candidate in (folder + ".py", folder + "/__init__.py"):
            if candidate in indexed.paths:
                shown = self._indexed(candidate, ReleaseMatch(indexed, (at,), 0, 0))
                return self.source(shown, dotted_name) if shown is not None else None
        return None

    def imported_name(self, dotted_name: str, name: str) -> ImportedName | None:
        """What a module binds `name` to when an import binds it (`SourceFile.binding`); the module
        is parsed only if it was not before: following re-exports reads many modules' imports."""
        path = self.module_path(dotted_name)
        if path is None or not (path in self.skeletons or path.is_file()):
            return None
        imports = self.sources.bound_imports(path, dotted_name)
        return imports.get(name) if imports is not None else None

    def local_source(self, path: Path) -> SourceFile | None:
        """A file given on the command line (an adaptor), named as if a log had printed it; read even
        when log only (it is the user's own file, named to be read)."""
        resolved = path.resolve()
        module = self._module_of_local(resolved) if self.log_only else self.find(str(resolved)).module
        return self.source(resolved, module)

    # what the stages above derive from the files

    def cache(self, slot: Slot[K, V]) -> Cache[K, V]:
        """This workspace's cache of the values `slot` stands for: what a stage above derives from
        the files once per workspace (the heuristics judge every holder of an audit over the same
        files)."""
        if slot not in self._caches:
            self._caches[slot] = Cache()
        return cast(Cache[K, V], self._caches[slot])  # each slot's cache holds what the slot says

    def derive(
        self, path: Path, compute: Callable[[SourceFile], V], keep: Callable[[TopStatement], bool] | None = None
    ) -> V | None:
        """`compute` of a file parsed; None when it does not parse. `keep`: the module-level
        statements it needs, where it needs few (`selected`). A value a cache keeps must hold no
        node: the file's tree is let go (what holds nodes lives with the tree, in `SourceFile.of_nodes`)."""
        module = self.find(str(path)).module
        source = self.source(path, module) if keep is None else self.selected(path, module, keep)
        return compute(source) if source is not None else None


class Slot(Generic[K, V]):
    """A kind of value a stage above derives once per workspace (`Workspace.cache`), declared once
    at module level: `CLASSES: Slot[Path, frozenset[str] | None] = Slot("classes a file defines")`."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


class Cache(Generic[K, V]):
    """Values computed once per key."""

    def __init__(self) -> None:
        self._values: dict[K, V] = {}

    def get(self, key: K, compute: Callable[[], V]) -> V:
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]


def _fresh_workspace(
    source_roots: tuple[Path, ...],
    studied: tuple[Path, ...],
    *,
    log_only: bool,
    releases: dict[str, ReleaseMatch],
    fingerprinted: bool,
) -> Workspace:
    workspace = Workspace(source_roots, log_only=log_only, studied=studied)
    workspace.releases, workspace.fingerprinted = releases, fingerprinted
    return workspace


# What `ast.parse` raises for a file it cannot parse: MemoryError is its stack overflowing (3.13:
# "too complex to parse"), RecursionError nesting past its limit.
_UNPARSABLE = (SyntaxError, ValueError, RecursionError, MemoryError)


def _parse(path: Path, text: str, module: str | None) -> SourceFile | None:
    try:
        tree = ast.parse(text)
    except _UNPARSABLE:
        return None
    package = package_of(path, module)
    bindings: dict[str, Binding] = {}
    imports: dict[str, ImportedName] = {}
    star = _collect(tree.body, package, bindings, imports)
    declared: frozenset[str] = frozenset()
    if "global" in text:  # no `global` statement without the word: most files are not walked for one
        declared = frozenset(_declared_global(tree.body, word_lines(text, "global")))
    return SourceFile(path, text, tree, module, package, bindings, imports, declared, star)


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _span_of(statement: ast.stmt) -> tuple[int, int, bool]:
    return (*_lines_of(statement), isinstance(statement, _DEFINITIONS))


def _members(node: ast.ClassDef) -> tuple[tuple[int, int, bool], ...]:
    """The spans of a class's body statements, none where one shares a line with the class's header
    or another: those cannot be left out by lines."""
    spans = tuple(_span_of(statement) for statement in node.body)
    apart = all(earlier[1] < later[0] for earlier, later in zip(spans, spans[1:], strict=False))
    return spans if spans and apart and spans[0][0] > node.lineno else ()


def _thinned(
    members: tuple[tuple[int, int, bool], ...], lines: list[str], kept: list[str], keep: Callable[[TopStatement], bool]
) -> list[tuple[int, int]] | None:
    """Leave out (in `kept`) the body statements of a class that `keep` does not choose, with a
    `pass` where it chooses none; the spans the class's body has then, None where nothing is left out."""
    chosen = [
        (first, last)
        for first, last, definition in members
        if keep(TopStatement(first, last, definition, "\n".join(lines[first - 1 : last])))
    ]
    if len(chosen) == len(members):
        return None
    for first, last, _ in members:
        kept[first - 1 : last] = [""] * (last - first + 1)
    for first, last in chosen:
        kept[first - 1 : last] = lines[first - 1 : last]
    if not chosen:
        first = members[0][0]
        line = lines[first - 1]
        kept[first - 1] = line[: len(line) - len(line.lstrip())] + "pass"
        chosen = [(first, first)]
    return chosen


def _lines_of(statement: ast.stmt) -> tuple[int, int]:
    """A statement's first line (its decorators' included) and last line."""
    decorators = getattr(statement, "decorator_list", None)
    first = decorators[0].lineno if decorators else statement.lineno
    return first, statement.end_lineno or statement.lineno


def _declared_global(statements: Sequence[ast.stmt], lines: list[int]) -> Iterator[str]:
    """The names `global` statements declare, entering only the statements that span a line
    spelling the word (`lines`)."""
    for statement in statements:
        last = statement.end_lineno or statement.lineno
        if not any(statement.lineno <= line <= last for line in lines):
            continue
        if isinstance(statement, ast.Global):
            yield from statement.names
        else:
            yield from _declared_global(child_statements(statement), lines)


def _collect(
    statements: Sequence[ast.stmt], package: str | None, bindings: dict[str, Binding], imports: dict[str, ImportedName]
) -> bool:
    """The module-level bindings of the statements, also under `if` / `try`, into `bindings` and
    `imports`; whether one is a star import. (A function, not a closure: a recursive closure is a
    reference cycle, which would keep every tree until the collector runs.)"""
    star = False
    for statement in statements:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bindings[statement.name] = statement
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            star |= any(alias.name == "*" for alias in statement.names)
            imported = import_bindings(statement, package)
            bindings.update(imported)
            imports.update(imported)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for name in names_bound(targets):
                bindings[name] = statement
        else:
            star |= _collect(child_statements(statement), package, bindings, imports)
    return star
