"""Gathering what to study about one tensor: the files in scope (the defining module, the culprit's
file, then the module's package and the source roots, at most `MAX_FILES`; which of them spell a
name is looked up in a word index made once per run, not searched per global), the accessors and the
`lru_cache` of the defining module, the events the file studies record, and who calls a function
(up to `MAX_CALLER_DEPTH` calls up) to tell whether a reset runs every iteration."""

from __future__ import annotations

import ast
import re
from functools import lru_cache, partial
from pathlib import Path

from unsafe_doctor.knowledge.heuristics.events import CallSite, Event, EvidenceKind, FileStudy, FunctionStudy
from unsafe_doctor.knowledge.heuristics.vocabulary import runs_per_step
from unsafe_doctor.knowledge.subject import Subject, TensorRef
from unsafe_doctor.source.files import is_file
from unsafe_doctor.source.syntax import (
    callee_name,
    child_nodes,
    child_statements,
    is_cache_decorator,
    returned_values,
    word_starts,
    words,
)
from unsafe_doctor.source.workspace import Slot, SourceFile, TopStatement, Workspace

MAX_FILES = 2000
MAX_FILE_BYTES = 2_000_000
MAX_CALLER_DEPTH = 3


class _Words:
    """Which files spell each word (as `\\b` bounds it), a file added when a scope first lists it,
    once per workspace: a study looks a name up instead of searching every file in scope for it,
    so that judging every global of a large tree stays linear in its files."""

    def __init__(self, workspace: Workspace):
        self.workspace = workspace
        self.ids: dict[Path, int] = {}
        self.postings: dict[str, list[int]] = {}

    def id_of(self, path: Path) -> int:
        found = self.ids.get(path)
        if found is None:
            found = self.ids[path] = len(self.ids)
            for word in words(_readable(self.workspace, path) or ""):
                self.postings.setdefault(word, []).append(found)
        return found


class _Folders:
    """The files of the folders a study reads, in order; made once per workspace for every global
    whose scope they are."""

    def __init__(self, workspace: Workspace, folders: tuple[Path, ...], room: int):
        files: list[Path] = []
        self.truncated = False
        for folder in folders:
            for path in workspace.python_files(folder):
                if len(files) >= room:
                    self.truncated = True
                    break
                files.append(path)
        self.files = tuple(dict.fromkeys(files))
        self.words = workspace.cache(_WORDS).get(None, partial(_Words, workspace))
        self.position = {self.words.id_of(path): at for at, path in enumerate(self.files)}

    def spelling(self, name: str) -> list[int]:
        """The positions in `files` of the files that spell `name` as a word."""
        return [at for at in map(self.position.get, self.words.postings.get(name, ())) if at is not None]


class _InScope:
    """The files a study reads: the defining module and the culprit's file first, then its folders'."""

    def __init__(self, workspace: Workspace, first: tuple[Path, ...], folders: _Folders):
        self.workspace = workspace
        self.first = first
        self.folders = folders
        self.truncated = folders.truncated
        self._first_resolved = {path.resolve() for path in first}  # folder files are listed resolved

    def spelling(self, names: tuple[str, ...]) -> list[Path]:
        """The files that spell any of `names` as a word, in scope order."""
        texts = [(path, _readable(self.workspace, path) or "") for path in self.first]
        found = [path for path, text in texts if any(next(word_starts(text, name), None) is not None for name in names)]
        positions = sorted({at for name in names for at in self.folders.spelling(name)})
        files = self.folders.files
        return found + [files[at] for at in positions if files[at] not in self._first_resolved]


# What a study derives once per workspace, for every global an audit judges over the same files;
# of a file, None where it does not parse.
_WORDS: Slot[None, _Words] = Slot("which files spell each word")
_FOLDERS: Slot[tuple[tuple[Path, ...], int], _Folders] = Slot("the files of the folders in scope, at most so many")
_CLASSES: Slot[Path, frozenset[str] | None] = Slot("the classes a file defines")
_CALL_SITES: Slot[tuple[Path, str], list[CallSite] | None] = Slot("the calls of a function in a file")


def _readable(workspace: Workspace, path: Path) -> str | None:
    """The file's text; None when it is unreadable or too large to study."""
    size = workspace.sources.size(path)
    return workspace.text(path) if size is not None and size <= MAX_FILE_BYTES else None


class TensorStudy:
    """Evidence about one tensor, gathered over the files in scope."""

    def __init__(self, subject: Subject, tensor: TensorRef, workspace: Workspace):
        self.subject = subject
        self.name = tensor.name
        self.variable: str = tensor.name.variable or ""
        self.attribute = tensor.name.owner is not None or tensor.expression.startswith(("self.", "cls."))
        self.roots = workspace.source_roots
        self.workspace = workspace
        self.events: dict[tuple[EvidenceKind, Path, int], Event] = {}
        self.scope: _InScope | None = None
        self.truncated = False
        self.unparsed: list[Path] = []  # files in scope nested too deeply to study
        self.unparsable: tuple[Path, str] | None = None  # the defining module's file, and why it did not parse
        self.referencing: list[Path] = []
        self.defining: SourceFile | None = None
        self.accessors: set[str] = set()
        self.classes_here: frozenset[str] = frozenset()
        self.queue_filled = False  # entries are appended to it somewhere
        self.queue_takes: list[tuple[FunctionStudy, ast.stmt]] = []
        self._shown: dict[Path, str] = {}  # paths as evidence shows them, resolved once

    # files

    def _culprit_path(self) -> Path | None:
        printed = self.subject.source_file or (self.subject.frame.file if self.subject.frame else None)
        return Path(printed) if printed and is_file(Path(printed)) else None

    def _package_dir(self, module: str | None) -> Path | None:
        if not module:
            return None
        found = self.workspace.module_path(module.split(".")[0])
        if found is None:
            return None
        return found.parent if found.name == "__init__.py" else found

    def _scope(self) -> _InScope:
        """Defining module, culprit file, then the module's package and the studied folders, bounded;
        made once per workspace for every global whose scope it is."""
        first = []
        defining = self.workspace.module_path(self.name.module) if self.name.module else None
        for path in (defining, self._culprit_path()):
            if path is not None and path.is_file() and path not in first:
                first.append(path)
        culprit = self._culprit_path()
        culprit_module = self.workspace.find(str(culprit)).module if culprit else None
        folders = [self._package_dir(self.name.module), self._package_dir(culprit_module), *self.workspace.studied]
        resolved = tuple(dict.fromkeys(folder.resolve() for folder in folders if folder is not None))
        room = MAX_FILES - len(first)
        shared = self.workspace.cache(_FOLDERS).get((resolved, room), partial(_Folders, self.workspace, resolved, room))
        return _InScope(self.workspace, tuple(first), shared)

    def parse(self, path: Path) -> SourceFile | None:
        """A file in scope, parsed once by the workspace; None when unreadable, too large or invalid."""
        if _readable(self.workspace, path) is None:
            return None
        return self.workspace.source(path, self.workspace.find(str(path)).module)

    def _studied(self, path: Path, names: tuple[str, ...]) -> SourceFile | None:
        """A file in scope as its study reads it: its module level, and the functions and classes
        that spell a name of the tensor (no other function is studied)."""
        if _readable(self.workspace, path) is None:
            return None
        if self.defining is not None and path == self.defining.path:
            return self.defining
        return self.workspace.selected(path, self.workspace.find(str(path)).module, partial(_spells_any, names))

    def shown(self, path: Path) -> str:
        """A path as evidence shows it: relative to its source root, else as found."""
        if path not in self._shown:
            resolved = path.resolve()
            under = (root for root in (root.resolve() for root in self.roots) if resolved.is_relative_to(root))
            self._shown[path] = next((resolved.relative_to(root).as_posix() for root in under), str(path))
        return self._shown[path]

    # gathering

    def gather(self) -> None:
        self.scope = self._scope()
        self.truncated = self.scope.truncated
        defining = self.workspace.module_path(self.name.module) if self.name.module else None
        self.defining = self.parse(defining) if defining is not None and defining.is_file() else None
        why = self.workspace.sources.why_not_parsed(defining) if defining is not None and self.defining is None else None
        self.unparsable = (defining, why) if defining is not None and why is not None else None
        if self.defining is not None:
            path = self.defining.path
            classes = self.workspace.cache(_CLASSES).get(path, partial(self.workspace.derive, path, _classes_in))
            self.classes_here = classes or frozenset()
            if not self.attribute:
                self.accessors = self._accessors(self.defining)
                self._lru_cache(self.defining)
        names = (self.variable, *sorted(self.accessors))
        for path in self.scope.spelling(names):
            parsed = self._studied(path, names)
            if parsed is not None:
                try:
                    FileStudy(self, parsed).run()
                except RecursionError:  # a statement nested past Python's recursion limit: the file is left out
                    self.events = {key: event for key, event in self.events.items() if key[1] != path}
                    self.unparsed.append(path)
                    continue
                self.referencing.append(path)
        self._queues()

    def _accessors(self, parsed: SourceFile) -> set[str]:
        """Module functions that return the global itself (`get_x()` is then the global)."""
        found = set()
        for statement in parsed.tree.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(isinstance(value, ast.Name) and value.id == self.variable for value in returned_values(statement)):
                    found.add(statement.name)
        return found

    def _lru_cache(self, parsed: SourceFile) -> None:
        for statement in parsed.tree.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == self.variable:
                for decorator in statement.decorator_list:
                    if is_cache_decorator(decorator):
                        code = parsed.lines[decorator.lineno - 1].strip()
                        what = f"{self.variable}() is an lru_cache, rebuilt deterministically: `{code}`"
                        self.add("cache", parsed.path, decorator.lineno, what)

    def add(
        self,
        kind: EvidenceKind,
        path: Path,
        line: int,
        what: str,
        *,
        function: str = "",
        detached: bool = False,
        persistent: bool = False,
        for_logging: bool = False,
    ) -> Event:
        """Record an event; the first of a kind at a line is kept (and returned)."""
        event = Event(
            kind, path, line, what, detached=detached, persistent=persistent, for_logging=for_logging, function=function
        )
        self.events.setdefault((kind, path, line), event)
        return self.events[(kind, path, line)]

    def _queues(self) -> None:
        if self.queue_filled:
            for function, statement in self.queue_takes:
                function.add("queue", statement, "entries appended elsewhere are consumed")
        self.queue_takes.clear()  # its function studies refer back to this study: no cycle is left for the collector

    # who calls a reset

    def _call_sites(self, callee: str) -> list[CallSite]:
        found: list[CallSite] = []
        assert self.scope is not None  # gathered first
        for path in self.scope.spelling((callee,)):
            lines = _calling_lines(_readable(self.workspace, path) or "", callee)
            if lines:  # files that cannot call it are not parsed for it, and of those that can only what spans the lines
                compute = partial(_call_sites_of, path, callee, lines)
                derive = partial(self.workspace.derive, path, compute, partial(_spans_line, lines))
                found.extend(self.workspace.cache(_CALL_SITES).get((path, callee), derive) or ())
        return sorted(found, key=lambda site: (str(site.path), site.line))

    def every_iteration(self, function: str, depth: int = 0) -> list[CallSite] | None:
        """The chain of call sites by which `function` runs every iteration, nearest first."""
        sites = self._call_sites(function)
        for site in sites:
            if runs_per_step(site.caller, in_loop=site.in_loop):
                return [site]
        if depth + 1 < MAX_CALLER_DEPTH:
            for site in sites:
                if site.caller not in ("<module>", function):
                    chain = self.every_iteration(site.caller, depth + 1)
                    if chain:
                        return [site, *chain]
        return None


def _spells_any(names: tuple[str, ...], statement: TopStatement) -> bool:
    return not statement.definition or any(name in statement.text for name in names)


def _spans_line(lines: list[int], statement: TopStatement) -> bool:
    return any(statement.first <= line <= statement.last for line in lines)


def _classes_in(source: SourceFile) -> frozenset[str]:
    """The names of the classes a file defines, nested ones too (a class is a statement: no
    expression is entered)."""
    names: set[str] = set()
    pending: list[ast.stmt] = list(source.tree.body)
    while pending:
        statement = pending.pop()
        if isinstance(statement, ast.ClassDef):
            names.add(statement.name)
        pending.extend(child_statements(statement))
    return frozenset(names)


def _call_sites_of(path: Path, callee: str, lines: list[int], source: SourceFile) -> list[CallSite]:
    """The calls of `callee` in a file, in the order of the source's nodes, with their enclosing
    function and whether they sit in a loop there; made once per file, callee and workspace
    (`_CALL_SITES`). Only the statements around the `lines` where the text can call it are walked."""
    sites: list[CallSite] = []
    pending: list[tuple[ast.AST, str, bool]] = [(source.tree, "<module>", False)]
    while pending:
        node, function, in_loop = pending.pop()
        if isinstance(node, ast.Call) and callee_name(node.func) == callee:
            sites.append(CallSite(callee, function, path, node.lineno, in_loop))
        loop_body = {id(statement) for statement in node.body} if isinstance(node, (ast.For, ast.AsyncFor, ast.While)) else ()
        children: list[tuple[ast.AST, str, bool]] = []
        for child in child_nodes(node):
            if isinstance(child, ast.stmt) and not _spans_any(child, lines):
                continue  # no call of the callee in it
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                children.append((child, child.name, False))
            else:
                children.append((child, function, in_loop or id(child) in loop_body))
        pending.extend(reversed(children))  # depth first, in source order
    return sites


def _calling_lines(text: str, callee: str) -> list[int]:
    """The lines where the text can call `callee`: the name, not the end of a longer one, then up to
    the `(` only what Python lets stand between a callee and its arguments (spaces, line breaks,
    comments, a closing parenthesis)."""
    lines: list[int] = []
    line, counted = 1, 0
    for found in _called(callee).finditer(text):
        start = found.start()
        before = text[start - 1] if start else " "
        if before.isalnum() or before == "_":
            continue
        line += text.count("\n", counted, start)
        counted = start
        lines.append(line)
    return lines


@lru_cache(maxsize=1024)
def _called(callee: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(callee)}(?=(?:\s|\\|\)|#[^\n]*)*\()")  # the name first: searched fast


def _spans_any(statement: ast.stmt, lines: list[int]) -> bool:
    """Whether a statement (its decorators too) spans one of the lines."""
    decorators = getattr(statement, "decorator_list", None)
    first = decorators[0].lineno if decorators else statement.lineno
    last = statement.end_lineno or statement.lineno
    return any(first <= line <= last for line in lines)
