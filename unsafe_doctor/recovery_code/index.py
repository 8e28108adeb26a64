"""The modules an audit reads: the audited files, and any other module a name leads to (read on
demand, never imported), with what each defines; and what a dotted name refers to in them.

Modules are named from the import root above each audited folder (the first folder up without an
`__init__.py`; Megatron's and MindSpeed's namespace packages count as packages)."""

from __future__ import annotations

import ast
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.recovery_code.refs import ClassKey, ClassRef, FunctionRef, HolderRef, ModuleRef, Ref, SelfRef
from unsafe_doctor.recovery_code.vocabulary import METADATA
from unsafe_doctor.source.files import FRAMEWORK_PACKAGES, dotted, is_dir, python_files
from unsafe_doctor.source.imports import defined_member, module_named
from unsafe_doctor.source.looked_at import note_link
from unsafe_doctor.source.syntax import (
    Function,
    ImportedName,
    child_statements,
    decorator_name,
    is_cached,
    names_bound,
    returned_values,
    word_lines,
)
from unsafe_doctor.source.workspace import SourceFile, Workspace

ACCESSOR_SIZE = 8  # statements at most in a function read as a possible accessor (`return X`)
RECENT_MODULES = 32  # modules whose trees stay read beyond the one walked: names reach trees only for small functions
MAX_AHEAD = 400  # audited modules read ahead of their scan (a name led there) whose trees wait for it


def audited_files(paths: Sequence[Path]) -> list[Path]:
    """`*.py` under the paths (as `python_files` skips), resolved, once each; a path that a link
    made another file is recorded as such (`looked_at`)."""
    audited: dict[Path, None] = {}
    for path in paths:
        for found in python_files(path):
            resolved = found.resolve()
            if os.path.abspath(found) != str(resolved):
                note_link(os.path.abspath(found), resolved)
            audited[resolved] = None
    return list(audited)


# --- what a module defines ---------------------------------------------------------------------------


@dataclass
class ClassInfo:
    module: str
    name: str
    node: ast.ClassDef
    attributes: dict[str, ast.stmt]  # names bound in the class body
    methods: dict[str, Function]
    cached: set[str]  # lru-cached methods
    buffers: dict[str, ast.Call]  # register_buffer calls by buffer name


class Span(NamedTuple):
    """Where a statement lies in its file, as `source_segment` reads it."""

    lineno: int
    col_offset: int
    end_lineno: int | None
    end_col_offset: int | None

    @classmethod
    def of(cls, node: ast.AST) -> Span:
        return cls(
            getattr(node, "lineno", 0),
            getattr(node, "col_offset", 0),
            getattr(node, "end_lineno", None),
            getattr(node, "end_col_offset", None),
        )


@dataclass(frozen=True)
class ClassOutline:
    """What name resolution asks of a class, kept without its module's tree."""

    attributes: dict[str, Span]  # names bound in the class body, where
    methods: dict[str, tuple[Span, int]]  # where each method is defined, and its statements
    cached: set[str]  # lru-cached methods
    buffers: tuple[str, ...]  # names of the buffers its methods register

    @classmethod
    def of(cls, owner: ClassInfo) -> ClassOutline:
        return cls(
            {name: Span.of(node) for name, node in owner.attributes.items()},
            {name: (Span.of(node), len(node.body)) for name, node in owner.methods.items()},
            owner.cached,
            tuple(owner.buffers),
        )


@dataclass(frozen=True)
class ModuleContents:
    """What a module's syntax tree defines, with the tree: read again after the module lets it go."""

    source: SourceFile
    classes: dict[str, ClassInfo]
    functions: dict[str, Function]


class ModuleInfo:
    """A module the audit read. Its names are kept; its syntax tree (`source`, `classes`,
    `functions`) only while a stage walks the module (`kept`), else it is read again on demand
    through the index's latest few: every tree of a job's code at once is more memory than a machine
    may have."""

    def __init__(
        self,
        name: str,
        path: Path,
        shown: str,
        contents: ModuleContents,
        read_again: Callable[[ModuleInfo], ModuleContents],
    ):
        source = contents.source
        self.name = name
        self.path = path  # resolved
        self.shown = shown  # the path as sites name it
        self.text = source.text
        # module-level names that can hold a value
        self.names: set[str] = {
            key for key, binding in source.bindings.items() if isinstance(binding, (ast.Assign, ast.AnnAssign, ast.AugAssign))
        } | set(source.declared_globals)
        self.cached: set[str] = {key for key, function in contents.functions.items() if is_cached(function)}
        # What name resolution asks of every module, kept without the tree:
        self.outlines = {key: ClassOutline.of(owner) for key, owner in contents.classes.items()}  # by class name
        self.defined = frozenset(key for key in source.bindings if not isinstance(source.binding(key), ImportedName))
        self.imported = frozenset(source.imports)
        self.bound_imports = source.bound_imports  # names bound to an import, also through a rename (`binding`)
        self.function_sizes = {key: len(function.body) for key, function in contents.functions.items()}  # statements
        self.no_accessors = frozenset(  # small functions that return nothing a name leads from: told without the tree
            (function.lineno, function.col_offset)
            for function in contents.functions.values()
            if len(function.body) <= ACCESSOR_SIZE and not _returns_reference(function)
        )
        self.spans = {  # where module-level names are bound, imports aside
            key: Span.of(binding) for key, binding in source.bindings.items() if not isinstance(binding, ImportedName)
        }
        self._kept: ModuleContents | None = None
        self._read_again = read_again

    def __getstate__(self) -> dict[str, object]:
        """Sent to another process without its tree or its index: `Index.adopt` gives it the other's."""
        return {key: value for key, value in self.__dict__.items() if key not in ("_kept", "_read_again")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state, _kept=None)

    @property
    def source(self) -> SourceFile:
        return self._contents().source

    @property
    def classes(self) -> dict[str, ClassInfo]:
        return self._contents().classes

    @property
    def functions(self) -> dict[str, Function]:
        return self._contents().functions

    def _contents(self) -> ModuleContents:
        return self._kept if self._kept is not None else self._read_again(self)

    @property
    def held(self) -> ModuleContents | None:
        """Its tree while a walk of the module keeps it (`kept`)."""
        return self._kept

    @contextmanager
    def kept(self) -> Iterator[None]:
        """The same tree throughout a walk of the module: the walk compares its nodes by identity."""
        self._kept = self._read_again(self)
        try:
            yield
        finally:
            self._kept = None

    def is_cached(self, owner: str | None, variable: str) -> bool:
        """Whether `variable` (of class `owner`) is an lru-cached function or method."""
        if owner is None:
            return variable in self.cached
        return owner in self.outlines and variable in self.outlines[owner].cached


def _returns_reference(function: Function) -> bool:
    """Whether the function returns a name, attribute, item or call: what can lead to a holder."""
    return any(isinstance(value, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)) for value in returned_values(function))


def register_buffer_name(call: ast.Call) -> str | None:
    argument = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "name"), None)
    return argument.value if isinstance(argument, ast.Constant) and isinstance(argument.value, str) else None


def _contents_of(name: str, source: SourceFile) -> ModuleContents:
    classes: dict[str, ClassInfo] = {}
    functions: dict[str, Function] = {}
    buffer_lines = word_lines(source.text, "register_buffer") if "register_buffer" in source.text else []
    for key, binding in source.bindings.items():
        if isinstance(binding, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[key] = binding
        elif isinstance(binding, ast.ClassDef):
            classes[key] = _describe_class(name, binding, buffer_lines)
    return ModuleContents(source, classes, functions)


def _describe_class(module: str, node: ast.ClassDef, buffer_lines: list[int]) -> ClassInfo:
    """`buffer_lines`: where the file spells `register_buffer`; only the methods there are walked for buffers."""
    attributes: dict[str, ast.stmt] = {}
    methods: dict[str, Function] = {}
    # A dataclass's annotated names are fields of each instance, not attributes of the class.
    dataclass = any(decorator_name(decorator) == "dataclass" for decorator in node.decorator_list)
    pending = list(node.body)
    while pending:
        statement = pending.pop(0)
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            methods[statement.name] = statement
        elif isinstance(statement, ast.Assign) or (
            isinstance(statement, ast.AnnAssign) and statement.value is not None and not dataclass
        ):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for target in names_bound(targets):
                attributes.setdefault(target, statement)
        elif not isinstance(statement, ast.ClassDef):
            pending.extend(child_statements(statement))
    cached = {name for name, method in methods.items() if is_cached(method)}
    buffers = _buffers(method for method in methods.values() if _spans_a_line(method, buffer_lines))
    return ClassInfo(module, node.name, node, attributes, methods, cached, buffers)


def _spans_a_line(node: Function, lines: list[int]) -> bool:
    return any(node.lineno <= line <= (node.end_lineno or node.lineno) for line in lines)


def _buffers(methods: Iterable[Function]) -> dict[str, ast.Call]:
    buffers: dict[str, ast.Call] = {}
    for method in methods:
        for inner in ast.walk(method):
            if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr == "register_buffer":
                buffer = register_buffer_name(inner)
                if buffer is not None:
                    buffers.setdefault(buffer, inner)
    return buffers


# --- the index -----------------------------------------------------------------------------------------


class Index:
    """The audited modules, and any other module a name leads to (read on demand, never imported)."""

    def __init__(self, given: Sequence[Path], roots: Sequence[Path], workspace: Workspace | None = None):
        """`workspace`: where modules are read (default: one over `roots`); `fix` passes one that
        reads the frameworks as the log's fingerprinted release."""
        self.roots = tuple(roots)
        folders = [path for path in given if is_dir(path)]
        self.workspace = workspace if workspace is not None else Workspace(roots, studied=folders)
        self.by_path: dict[Path, ModuleInfo] = {}
        self.by_name: dict[str, ModuleInfo | None] = {}
        self.buffers: dict[str, list[ClassKey]] = {}  # buffer name -> the classes defining it
        self._given = [(path.resolve(), path) for path in given if path.is_dir()]
        self._given_files = {path.resolve(): path for path in given if path.is_file()}
        self._cwd = Path.cwd().resolve()
        # Top-level packages whose modules are read when a name leads there: the audited ones, the
        # adaptor's, and the frameworks adaptors call into. Libraries (torch) are never read.
        self.tops: set[str] = set(FRAMEWORK_PACKAGES)
        self._targets: dict[str, Ref | None] = {}  # import target -> what it refers to
        self._recent: OrderedDict[Path, ModuleContents] = OrderedDict()  # the trees read last, by module path
        self._audited: dict[Path, str] = {}  # audited file -> its module's name, in the order the files were given
        self._added: set[Path] = set()  # audited files read for their scan
        # audited modules a name led to before their scan: their trees kept for it, the latest last
        self._ahead: dict[Path, ModuleContents] = {}
        self._first_named: dict[str, Path] = {}  # module name -> the first audited file of that name
        self._claim: Callable[[Path], bool] | None = None  # whether this process scans an audited file (`scanning`)

    # naming

    def display(self, path: Path) -> str:
        """How a file is named in sites: under the path the user gave, else relative to the working
        folder, else absolute."""
        if path in self._given_files:
            return str(self._given_files[path])
        for resolved, given in self._given:
            if path.is_relative_to(resolved):
                return str(given / path.relative_to(resolved))
        return str(path.relative_to(self._cwd)) if path.is_relative_to(self._cwd) else str(path)

    # modules

    def expect(self, path: Path, root: Path) -> None:
        """Know an audited file, whose import root is `root`, before any is scanned: a scan right
        after each file is read must find what reading them all first would have known. That is
        its module's name (a name leading to it reads it as the audited module), its package (read
        when a name leads there) and the buffers it registers (`x.<buffer>` leads to its class)."""
        name = dotted(path.relative_to(root).parts) or path.stem
        self._audited.setdefault(path, name)
        self._first_named.setdefault(name, path)  # of two files named alike, the first
        self._read_package(name)
        text = self.workspace.text(path)
        if text is None or "register_buffer" not in text:
            return
        info = self._described(path, name)
        for owner, outline in info.outlines.items() if info is not None else ():
            for buffer in outline.buffers:
                self.buffers.setdefault(buffer, []).append(ClassKey(name, owner))

    def add(self, path: Path) -> ModuleInfo | None:
        """Read one audited file (expected before) for its scan; None when it cannot be parsed."""
        name = self._audited[path]
        info = self._described(path, name)  # read already where a scan's names led there
        self._added.add(path)
        kept = self._ahead.pop(path, None)
        if info is None:
            return None
        if kept is not None:
            self._remember(path, kept)  # its scan walks the tree read ahead
        self.by_name.setdefault(name, info)
        return info

    @property
    def scanned(self) -> list[ModuleInfo]:
        """The audited modules read for their scan, in the order the files were given."""
        return [self.by_path[path] for path in self._audited if path in self._added and path in self.by_path]

    def scanning(self, claim: Callable[[Path], bool] | None) -> None:
        """Scan here only the audited files `claim` takes (another process scans the others; None:
        all): a tree read before its file's scan is kept for it only once the file is claimed."""
        self._claim = claim
        if claim is not None:  # trees read before the scan (`expect`), kept for the files claimed
            self._ahead = {path: contents for path, contents in self._ahead.items() if claim(path)}

    def adopt(self, added: Sequence[Path], infos: Sequence[ModuleInfo]) -> dict[Path, ModuleInfo]:
        """Audited files another process read for their scan (`added`), with the modules it made of
        them: as if read here. Returns the module of each path, this index's own where it has one."""
        adopted = {}
        for info in infos:
            own = self.by_path.setdefault(info.path, info)
            if own is info:
                info._read_again = self._contents
            self.by_name.setdefault(self._audited[info.path], own)
            adopted[info.path] = own
        self._added.update(added)
        return adopted

    def read_ahead(self) -> Path | None:
        """The latest audited file a name led to before its scan, its tree kept for it: scanned
        next, it is parsed once."""
        return next(reversed(self._ahead), None)

    def _describe(self, name: str, path: Path, source: SourceFile) -> ModuleInfo:
        contents = _contents_of(name, source)
        self._remember(path, contents)
        ahead = path in self._audited and path not in self._added and path not in self._ahead and len(self._ahead) < MAX_AHEAD
        if ahead and (self._claim is None or self._claim(path)):
            self._ahead[path] = contents
        return ModuleInfo(name, path, self.display(path), contents, self._contents)

    def _contents(self, info: ModuleInfo) -> ModuleContents:
        """A module's tree: read ahead of its scan, among the latest `RECENT_MODULES`, or read again
        (as the workspace first named it)."""
        contents = self._ahead.get(info.path) or self._recent.get(info.path)
        if contents is None:
            source = self.workspace.source(info.path, info.name)
            if source is None:
                raise RuntimeError(f"{info.path} could be parsed once, not again")
            contents = _contents_of(info.name, source)
        self._remember(info.path, contents)
        return contents

    def let_go(self) -> None:
        """Let the latest trees go once the scan is done: the coverage reads few modules, the
        heuristics parse their own files."""
        self._recent.clear()

    def _remember(self, path: Path, contents: ModuleContents) -> None:
        self._recent[path] = contents
        self._recent.move_to_end(path)
        if len(self._recent) > RECENT_MODULES:
            self._recent.popitem(last=False)

    def module(self, dotted: str) -> ModuleInfo | None:
        if dotted in self.by_name:
            return self.by_name[dotted]
        info = None
        if dotted in self._first_named:
            info = self._described(self._first_named[dotted], dotted)
        elif self.readable(dotted):
            path = self.workspace.module_path(dotted)
            if path is not None and self.workspace.is_indexed(path):
                info = self._described(path, dotted)  # a release's skeleton, under its index path
            elif path is not None and path.is_file():
                info = self._described(path.resolve(), dotted)
        self.by_name[dotted] = info  # None for a namespace folder, a library or a module not found
        return info

    def _described(self, resolved: Path, dotted: str) -> ModuleInfo | None:
        """A module read on demand (or already read under another name); an audited file as its module."""
        info = self.by_path.get(resolved)
        if info is None:
            name = self._audited.get(resolved, dotted)
            source = self.workspace.source(resolved, name)
            info = self._describe(name, resolved, source) if source else None
            if info is not None:
                self.by_path[resolved] = info
        return info

    def is_module(self, dotted: str) -> bool:
        return self.readable(dotted) and self.workspace.module_path(dotted) is not None

    def module_of_file(self, path: Path) -> ModuleInfo | None:
        """An adaptor file (audited or not)."""
        resolved = path.resolve()
        if resolved in self.by_path:
            return self.by_path[resolved]
        found = self.workspace.local_source(resolved)
        if found is None:
            return None
        name = found.module or resolved.stem
        info = self._describe(name, resolved, found)
        self.by_path[resolved] = info
        self.by_name.setdefault(name, info)
        if found.module:
            self._read_package(found.module)
        return info

    def _read_package(self, module: str) -> None:
        """Read the modules of this module's top-level package when a name leads there."""
        top = module.split(".")[0]
        if top not in self.tops:
            self.tops.add(top)
            self._targets.clear()  # names into it resolved to nothing so far

    def class_(self, key: ClassKey) -> ClassOutline | None:
        info = self.module(key.module)
        return info.outlines.get(key.name) if info else None

    # names

    def readable(self, dotted: str) -> bool:
        """Whether modules of this dotted name's top-level package are read (torch and other
        libraries never are)."""
        return dotted.split(".")[0] in self.tops

    def resolve_dotted(self, dotted: str) -> Ref | None:
        """What an import target refers to: a module, or a class, function or holder of one."""
        if dotted not in self._targets:
            self._targets[dotted] = self._target(dotted) if dotted and self.readable(dotted) else None
        return self._targets[dotted]

    def _target(self, dotted: str) -> Ref | None:
        head, _, name = dotted.rpartition(".")
        info = self.module(head) if head else None
        if info is not None and _defines(info, name):
            return self.member_of(info, name)  # defined where the target says: no import to follow
        member = defined_member(dotted, self.workspace, self.readable)
        if member is None:
            module = module_named(dotted, self.workspace)
            return ModuleRef(module) if module is not None else None
        described = self.module(member.module)
        return self.member_of(described, member.name) if described is not None else None

    def member(self, base: Ref, name: str) -> Ref | None:
        """What `base.name` refers to."""
        if isinstance(base, ModuleRef):
            return self.resolve_dotted(f"{base.name}.{name}")
        if isinstance(base, (ClassRef, SelfRef)):
            return self._class_member(base, name)
        if isinstance(base, HolderRef):
            return None if name in METADATA else HolderRef(base.key, True)
        return None

    def _class_member(self, base: ClassRef | SelfRef, name: str) -> Ref | None:
        info = self.module(base.module)
        owner = info.outlines.get(base.name) if info else None
        if info is None or owner is None:
            return None
        buffer = isinstance(base, SelfRef) and name in owner.buffers  # buffers belong to instances
        if buffer or name in owner.attributes or name in owner.cached:
            return HolderRef(GlobalName(base.module, base.name, name), False)
        if name in owner.methods:
            span, statements = owner.methods[name]
            found = partial(_method_of, info, base.name, name)
            return FunctionRef(base.module, base.name, (span.lineno, span.col_offset), statements, found)
        return None

    def member_of(self, info: ModuleInfo, name: str) -> Ref | None:
        """What a module-level name of a module refers to."""
        module = info.name
        imported = info.bound_imports.get(name)
        if imported is not None:
            return self.resolve_dotted(imported.target)
        if name in info.outlines:
            return ClassRef(module, name)
        if name in info.function_sizes:
            if name in info.cached:
                return HolderRef(GlobalName(module, None, name), False)
            span = info.spans[name]  # its place and size, without reading the tree again
            return FunctionRef(
                module, None, (span.lineno, span.col_offset), info.function_sizes[name], partial(self._function_of, info, name)
            )
        if name in info.names:
            return HolderRef(GlobalName(module, None, name), False)
        if info.path.name != "__init__.py":
            return None  # a plain module has no submodules
        submodule = f"{module}.{name}"
        return ModuleRef(submodule) if self.is_module(submodule) else None

    def _function_of(self, info: ModuleInfo, name: str) -> Function:
        """A module function's node: from its module's tree where that is at hand, else parsed on its
        own (an accessor's few lines, not its module again)."""
        if info.held is not None or info.path in self._ahead or info.path in self._recent:
            return info.functions[name]
        span = info.spans[name]
        source = self.workspace.selected(info.path, info.name, lambda statement: statement.first <= span.lineno <= statement.last)
        pending = list(source.tree.body) if source is not None else []
        while pending:
            statement = pending.pop()
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and Span.of(statement)[:2] == span[:2]:
                return statement
            pending.extend(child_statements(statement))
        return info.functions[name]


def _method_of(info: ModuleInfo, owner: str, name: str) -> Function:
    return info.classes[owner].methods[name]


def _defines(info: ModuleInfo, name: str) -> bool:
    """Whether the module binds `name` itself (not by an import)."""
    return name in info.defined
