"""Reading Python source files on disk without importing them: finding a file printed in a log,
module names, parsed sources and their module-level bindings, import resolution.

Several stages read the user's and the frameworks' code; importing it would import torch and run
their module-level code, so files are parsed with `ast` only.

* **Files** are found by path as printed, else by the longest path suffix under a source root (an
  import root, like a PYTHONPATH entry) or a `sys.path` directory.
* **Module names** come from the path after `site-packages/`, the directory the file was found
  under, `__init__.py` files, or a well-known top-level package name in the path. A file found at
  its printed path makes the folder above its top package an import root for resolving its imports.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

Function = ast.FunctionDef | ast.AsyncFunctionDef  # a `def` or `async def` node

# --- which files are internal ----------------------------------------------------------------------

_INTERNAL_PARTS = ("/torch/", "/torch_npu/", "site-packages/torch", "dist-packages/torch")
_STDLIB_DIR = re.compile(r"/lib(?:64)?/python\d+(?:\.\d+)?/(?!(?:site|dist)-packages/)")
_STDLIB_WRAPPERS = frozenset({"functools.py", "contextlib.py", "threading.py", "runpy.py"})


def is_internal_file(path: str) -> bool:
    """True for torch / torch_npu and Python standard-library files: code the user does not change."""
    normal = path.replace("\\", "/")
    return (
        normal.startswith("<")  # <frozen importlib._bootstrap>, <string>
        or any(part in normal for part in _INTERNAL_PARTS)
        or _STDLIB_DIR.search(normal) is not None
        or normal.rsplit("/", 1)[-1] in _STDLIB_WRAPPERS
    )


def is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a log's path may be too long, or hold a NUL byte
        return False


# --- module names ----------------------------------------------------------------------------------

_KNOWN_PACKAGES = frozenset({"megatron", "mindspeed", "mindspeed_llm", "modellink", "mindio_ttp"})


def module_from_path(path: str, source_roots: Sequence[Path] = ()) -> str | None:
    """Dotted module name of a file as printed in a log (see the module docstring for the rules)."""
    return Workspace(source_roots).find(path).module


def import_root(path: Path, module: str) -> Path | None:
    """The folder above the module's top package: its sibling modules are importable from there."""
    depth = len(module.split(".")) - (0 if path.name == "__init__.py" else 1)
    parents = path.resolve().parents
    return parents[depth] if depth < len(parents) else None


def package_of(path: Path, module: str | None) -> str | None:
    """The package the file's relative imports start from (the module itself for an `__init__.py`)."""
    package = module if path.name == "__init__.py" else (module.rpartition(".")[0] if module else None)
    return package or None


def _dotted(parts: Sequence[str]) -> str | None:
    names = list(parts)
    if not names:
        return None
    names[-1] = names[-1].removesuffix(".py")
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names) if names and all(name.isidentifier() for name in names) else None


def _after_site_packages(normal: str) -> str | None:
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in normal:
            return _dotted(normal.rsplit(marker, 1)[1].split("/"))
    return None


def _known_package_suffix(parts: Sequence[str]) -> str | None:
    """`/home/u/ModelLink/megatron/core/x.py` -> `megatron.core.x`, without any local file."""
    for index, part in enumerate(parts):
        if part in _KNOWN_PACKAGES:
            dotted = _dotted(parts[index:])
            if dotted:
                return dotted
    return None


# --- files and parsed sources ----------------------------------------------------------------------


@dataclass(frozen=True)
class FoundFile:
    local: Path | None  # the file read for this path, if any
    module: str | None
    shown: str  # how notes name it: the part of the path that matched, else the path as printed


@dataclass(frozen=True)
class ImportedName:
    target: str  # dotted: 'megatron.core.parallel_state' or 'pkg.state.BUF'


@dataclass
class SourceFile:
    path: Path
    text: str
    tree: ast.Module
    module: str | None
    package: str | None  # for relative imports
    bindings: dict[str, object]  # module-level name -> ClassDef | FunctionDef | Assign-like | ImportedName
    declared_globals: frozenset[str]  # names some function declares `global`
    star_import: bool

    def binding(self, name: str) -> object | None:
        """The module-level binding of `name`, seen through a rename of an import (`mpu = parallel_state`)."""
        binding = self.bindings.get(name)
        if isinstance(binding, ast.Assign) and isinstance(binding.value, ast.Name):
            aliased = self.bindings.get(binding.value.id)
            if isinstance(aliased, ImportedName):
                return aliased
        return binding


class Workspace:
    """File look-ups and parsed sources for one run of a stage, cached; files are read, never imported."""

    def __init__(self, source_roots: Sequence[Path]):
        self.source_roots = tuple(Path(root) for root in source_roots)
        self.env_roots = tuple(Path(entry) for entry in sys.path if entry and Path(entry).is_dir())
        self.found_roots: list[Path] = []  # import roots of files found at their printed path
        self._found: dict[str, FoundFile] = {}
        self._sources: dict[Path, SourceFile | None] = {}
        self._module_paths: dict[str, Path | None] = {}

    def find(self, printed: str) -> FoundFile:
        if printed not in self._found:
            self._found[printed] = self._find(printed)
        return self._found[printed]

    def _find(self, printed: str) -> FoundFile:
        normal = printed.replace("\\", "/")
        site_module = _after_site_packages(normal)
        parts = [part for part in normal.split("/") if part]
        as_printed = Path(printed)
        if is_file(as_printed):
            module = site_module or self._module_of_local(as_printed)
            self._add_import_root(as_printed, module)
            return FoundFile(as_printed, module, printed)
        # Source roots first (the user named them), any suffix; then the environment, two parts at least.
        for roots, shortest in ((self.source_roots, 1), (self.env_roots, 2)):
            for start in range(len(parts) - shortest + 1):
                suffix = parts[start:]
                for root in roots:
                    candidate = root.joinpath(*suffix)
                    if is_file(candidate):
                        return FoundFile(candidate, site_module or _dotted(suffix), "/".join(suffix))
        return FoundFile(None, site_module or _known_package_suffix(parts), printed)

    def _module_of_local(self, path: Path) -> str | None:
        resolved = path.resolve()
        for root in self.source_roots:
            if resolved.is_relative_to(root.resolve()):
                return _dotted(resolved.relative_to(root.resolve()).parts)
        names = [] if path.name == "__init__.py" else [path.stem]
        folder = resolved.parent
        # Namespace packages of the well-known frameworks have no __init__.py (megatron in megatron-core).
        while (folder / "__init__.py").is_file() or folder.name in _KNOWN_PACKAGES:
            names.append(folder.name)
            folder = folder.parent
        return ".".join(reversed(names)) if all(name.isidentifier() for name in names) and names else None

    def _add_import_root(self, path: Path, module: str | None) -> None:
        root = import_root(path, module) if module is not None else None
        if root is not None and root not in (*self.source_roots, *self.env_roots, *self.found_roots):
            self.found_roots.append(root)
            self._module_paths.clear()  # earlier misses may be found under the new root

    def module_path(self, dotted: str) -> Path | None:
        """The file (or namespace folder) of a module, searched on disk under the roots."""
        if dotted not in self._module_paths:
            self._module_paths[dotted] = self._module_path(dotted)
        return self._module_paths[dotted]

    def _module_path(self, dotted: str) -> Path | None:
        parts = dotted.split(".")
        if not all(part.isidentifier() for part in parts):
            return None
        for root in (*self.source_roots, *self.found_roots, *self.env_roots):
            folder = root.joinpath(*parts)
            for candidate in (folder.with_name(parts[-1] + ".py"), folder / "__init__.py"):
                if is_file(candidate):
                    return candidate
            if folder.is_dir():
                return folder
        return None

    def source(self, path: Path, module: str | None) -> SourceFile | None:
        if path not in self._sources:
            self._sources[path] = _read_source(path, module)
        return self._sources[path]

    def module_source(self, dotted: str) -> SourceFile | None:
        path = self.module_path(dotted)
        return self.source(path, dotted) if path is not None and path.is_file() else None

    def local_source(self, path: Path) -> SourceFile | None:
        """A file given on the command line (an adaptor), named as if a log had printed it."""
        resolved = path.resolve()
        return self.source(resolved, self.find(str(resolved)).module)


def _read_source(path: Path, module: str | None) -> SourceFile | None:
    try:
        text = path.read_text(encoding="utf-8-sig", errors="replace")  # -sig: a BOM is not source
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return None
    package = package_of(path, module)
    bindings: dict[str, object] = {}
    star = False

    def collect(statements: Sequence[ast.stmt]) -> None:
        nonlocal star
        for statement in statements:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bindings[statement.name] = statement
            elif isinstance(statement, (ast.Import, ast.ImportFrom)):
                star |= any(alias.name == "*" for alias in statement.names)
                bindings.update(import_bindings(statement, package))
            elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                for name in names_bound(targets):
                    bindings[name] = statement
            else:
                collect(child_statements(statement))

    collect(tree.body)
    declared = frozenset(name for node in _statements(tree.body) if isinstance(node, ast.Global) for name in node.names)
    return SourceFile(path, text, tree, module, package, bindings, declared, star)


# --- statements and bindings -----------------------------------------------------------------------


def import_bindings(statement: ast.Import | ast.ImportFrom, package: str | None) -> dict[str, ImportedName]:
    """The names an import statement binds; relative imports resolve against `package`."""
    if isinstance(statement, ast.Import):
        # `import a.b` binds `a`; `import a.b as c` binds `c` to `a.b`.
        bound = {}
        for alias in statement.names:
            top = alias.name.split(".")[0]
            bound[alias.asname or top] = ImportedName(alias.name if alias.asname else top)
        return bound
    base = statement.module or ""
    if statement.level:
        if not package:
            return {}
        kept = package.split(".")[: len(package.split(".")) - statement.level + 1]
        base = ".".join([*kept, *([statement.module] if statement.module else [])])
    return {
        alias.asname or alias.name: ImportedName(f"{base}.{alias.name}" if base else alias.name)
        for alias in statement.names
        if alias.name != "*"
    }


def names_bound(targets: Sequence[ast.expr]) -> Iterator[str]:
    """The plain names assignment targets bind (`a, (b, *c) = ...`); not attributes or subscripts."""
    for target in targets:
        if isinstance(target, ast.Name):
            yield target.id
        elif isinstance(target, (ast.Tuple, ast.List)):
            yield from names_bound(target.elts)
        elif isinstance(target, ast.Starred):
            yield from names_bound([target.value])


def _statements(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement in a block, nested blocks and function and class bodies included: `global`
    is a statement, so this finds them all without walking every expression."""
    for statement in body:
        yield statement
        yield from _statements(child_statements(statement))


def child_statements(statement: ast.stmt) -> list[ast.stmt]:
    """The statements of a compound statement's blocks, in source order."""
    bodies = [getattr(statement, name, None) or [] for name in ("body", "orelse", "finalbody")]
    bodies += [handler.body for handler in getattr(statement, "handlers", ())]
    bodies += [case.body for case in getattr(statement, "cases", ())]
    return [child for body in bodies for child in body if isinstance(child, ast.stmt)]


def compound_header(statement: ast.stmt) -> list[ast.expr] | None:
    """What a loop, `if`, `while`, `with` or `match` evaluates on its own line, before its blocks;
    None for other statements."""
    if isinstance(statement, (ast.For, ast.AsyncFor)):
        return [statement.iter]
    if isinstance(statement, (ast.If, ast.While)):
        return [statement.test]
    if isinstance(statement, (ast.With, ast.AsyncWith)):
        return [item.context_expr for item in statement.items]
    if isinstance(statement, ast.Match):
        return [statement.subject]
    return None


def walk_scope(function: Function) -> Iterator[ast.AST]:
    """The nodes of a function's own scope (not of nested functions, classes or lambdas)."""
    pending: list[ast.AST] = list(function.body)
    while pending:
        node = pending.pop()
        yield node
        pending.extend(
            child
            for child in ast.iter_child_nodes(node)
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
        )


def parameter_names(function: Function) -> set[str]:
    """Every name the function's parameters bind, `*args` and `**kwargs` included."""
    arguments = function.args
    every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
    return {argument.arg for argument in every if argument is not None}


_LINE_ENDS = re.compile(r"(?<=\r\n)|(?<=\r)(?!\n)|(?<=\n)")


@lru_cache(maxsize=16)
def _lines(text: str) -> list[str]:
    return _LINE_ENDS.split(text)


def source_segment(text: str, node: ast.AST) -> str | None:
    """`ast.get_source_segment` without re-splitting a large file on every call."""
    try:
        first, last = node.lineno - 1, node.end_lineno - 1
        start, end = node.col_offset, node.end_col_offset
    except AttributeError:
        return None
    lines = _lines(text)
    if first < 0 or last is None or end is None or last >= len(lines):
        return None
    if first == last:
        return lines[first].encode()[start:end].decode(errors="replace")
    head = lines[first].encode()[start:].decode(errors="replace")
    tail = lines[last].encode()[:end].decode(errors="replace")
    return head + "".join(lines[first + 1 : last]) + tail
