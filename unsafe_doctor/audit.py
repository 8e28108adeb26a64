"""The audit: every global of a framework that can hold device tensors across training steps, and
whether the recovery adaptor resets, rebuilds or repairs it; found by reading source, before a
fault finds it.

Sources are parsed with `ast` (never imported). Modules are named from the import root above each
audited folder (the first folder up without an `__init__.py`; Megatron's and MindSpeed's namespace
packages count as packages).

**Holders**, the places a tensor can outlive a step:

* *module-global*: a module-level name, or one a function declares `global`;
* *class-attribute*: a name bound in a class body (reached as `Cls.x`, `cls.x`, `self.x`);
* *singleton*: a module global assigned an instance of a class whose methods keep tensors in `self`;
* *lru-cache*: a function or method decorated with `lru_cache` / `cache` that returns a tensor;
* *buffer*: a `register_buffer` of a module class that a method other than `__init__` updates in
  place (`+=`, an in-place method, `.data = ...`, `[k] = ...`).

A module global or class attribute is a holder when a tensor lands in it: assigned one, or one
stored into it (`X[k] = t`, `X[k]["v"] += t`, `X.append(t)`), wherever that happens: in its module,
through `module.X`, `from module import X`, an accessor (`def get_x(): return X`), or a local alias
(`tracker = get_x()`; `for v in X.values()`). **Placement** of a tensor: *device* when the code says
so (`device=` a device string or index or `torch.cuda.current_device()`, `.cuda()`, `.npu()`,
`.to("npu")`, an op on such a tensor); *cpu* for a factory without `device=`, `device="cpu"`,
`.cpu()`; *unknown* otherwise (`device=loss.device`, `loss.detach()`). Holders whose tensors are
all CPU tensors are left out: torch_npu checks only device memory. A buffer made on the CPU follows
its module to the device: unknown. Writers and readers are every use, as file:line.

**Coverage**: the adaptor profile's rollback, send and receive functions are read, with the helpers
they call (functions of the adaptor or of any module found under the roots or on `sys.path`, up to
`MAX_CALL_DEPTH` calls deep), and every use they make of a holder is judged by DESIGN.md's rules
for code that runs on unsafe memory (rollback and receive run on the faulty rank):

* safe, so the holder is *covered*: rebinding it (`= {}`, `= None`: *reset*; a new object or a
  fresh tensor: *rebuilt*), `.clear()`, `.cache_clear()`, storing fresh values into it, `copy_`
  from a fresh tensor (*repaired* in the receive function, when the send function sends it);
* unsafe: an in-place op other than `copy_` (`zero_()`, `fill_()`, `+=`), `copy_` from itself,
  a torch op or arithmetic on it (`zeros_like(t)`), `recv` straight into it (communication does not
  make memory safe), rebinding a holder another module imported by name (that module keeps the old
  object), a receive without the matching send or the reverse;
* anything else (metadata such as `.shape`, `isinstance`, iteration over a dict) is neither.

Buffers live in objects the adaptor reaches by walking modules, so `<anything>.expert_bias` counts
as the buffer when the function also names its class (`isinstance(m, TopKRouter)`).

**Classification** goes through `classify()` with a finding built for the holder, at the first of its
sites that a rule names (a rule may name the frame a log shows reading the tensor: the audit takes
that frame as given when the rule names the holder itself), else at its definition. Heuristics run
only for uncovered holders that no rule knows; a cache is scenario 1 by its nature. The generic
fixes behind heuristic verdicts handle a tensor, dict or list: singletons, caches and buffers get
no generic fix.
"""

from __future__ import annotations

import ast
import gc
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from unsafe_doctor.classify import Classification, Classified, FixPlan, NoFix, classify, classify_as
from unsafe_doctor.context import RunContext
from unsafe_doctor.diagnosis import DiagnosedFinding
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge import KnowledgeBase, Rule, load_knowledge
from unsafe_doctor.locate import Finding
from unsafe_doctor.matching import rule_matches
from unsafe_doctor.source.files import FRAMEWORK_PACKAGES, ImportRoots, import_root, python_files
from unsafe_doctor.source.syntax import (
    Function,
    ImportedName,
    child_statements,
    decorator_name,
    import_bindings,
    is_cache_decorator,
    is_empty_value,
    names_bound,
    parameter_names,
    scope_statements,
    source_segment,
)
from unsafe_doctor.source.workspace import SourceFile, Workspace
from unsafe_doctor.stale import StaleReset, stale_resets
from unsafe_doctor.subject import Evidence, TensorRef
from unsafe_doctor.tracebacks import Frame, Traceback
from unsafe_doctor.versions import Environment, detect_environment, profile_files

if TYPE_CHECKING:
    from unsafe_doctor.fix import Plan

HolderKind = Literal["module-global", "class-attribute", "singleton", "lru-cache", "buffer"]
Placement = Literal["device", "unknown"]
Status = Literal["covered", "unsafe", "uncovered"]
How = Literal["reset", "rebuilt", "repaired"]
Role = Literal["rollback", "send", "recv"]

MAX_CALL_DEPTH = 4  # helper calls followed from an adaptor function
ACCESSOR_SIZE = 8  # statements at most in a function read as a possible accessor (`return X`)
MAX_CODE = 100  # characters of a statement kept in a site

# --- tensors and their placement -------------------------------------------------------------------

_Place = Literal["device", "cpu", "unknown"]
_FACTORIES = frozenset(
    {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "range", "linspace", "logspace", "rand",
     "randn", "randint", "randperm", "eye", "empty_strided", "scalar_tensor", "tril_indices", "triu_indices",
     "from_numpy"}
)
_LIKE_FACTORIES = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"})
_NOT_TENSOR_OPS = frozenset(
    {"device", "dtype", "no_grad", "enable_grad", "inference_mode", "set_grad_enabled", "is_tensor", "is_grad_enabled",
     "is_floating_point", "is_complex", "numel", "manual_seed", "seed", "initial_seed", "get_default_dtype",
     "set_default_dtype", "finfo", "iinfo", "Size", "compile", "load", "save", "Generator", "typename", "is_storage",
     "get_rng_state", "set_rng_state", "use_deterministic_algorithms", "autocast"}
)
_TENSOR_SUBMODULES = ("torch.nn.functional.", "torch.linalg.", "torch.fft.", "torch.special.")
_TENSOR_METHODS = frozenset(
    {"detach", "clone", "contiguous", "float", "half", "bfloat16", "double", "int", "long", "bool", "view", "view_as",
     "reshape", "flatten", "squeeze", "unsqueeze", "expand", "repeat", "transpose", "permute", "narrow", "masked_fill",
     "type_as", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "triu", "tril", "softmax"}
)
_DTYPES = frozenset(
    {"float", "float16", "float32", "float64", "bfloat16", "half", "double", "int", "int8", "int16", "int32", "int64",
     "long", "uint8", "bool", "complex64", "complex128"}
)
_DEVICE_WORDS = ("cuda", "npu", "xpu", "mps")

# --- what uses do --------------------------------------------------------------------------------

_METADATA = frozenset(
    {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "size", "numel", "dim",
     "element_size", "nelement", "data_ptr", "keys", "is_contiguous", "stride", "storage_offset", "names"}
)
_CONTAINER_ADD = frozenset({"append", "appendleft", "insert", "setdefault", "add", "extend", "put"})
_RESETS = frozenset({"clear", "cache_clear"})
_NOT_DATA_INPLACE = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})
_DATA_METHODS = frozenset(
    {"item", "tolist", "cpu", "numpy", "clone", "sum", "mean", "max", "min", "norm", "float", "half", "bfloat16",
     "double", "to", "cuda", "npu", "add", "sub", "mul", "div", "pow", "abs", "any", "all", "eq", "ne", "backward"}
)
_NOT_DATA_CALLS = frozenset({"isinstance", "len", "type", "id", "hasattr", "getattr", "callable", "list", "dict", "tuple"})
_COMMUNICATION_INTO = ("recv", "irecv", "broadcast", "all_reduce", "reduce", "all_gather_into_tensor", "scatter")
_COMMUNICATION_FROM = ("send", "isend", "broadcast")
_HOW_ORDER = {"reset": 0, "rebuilt": 1, "repaired": 2}
# Statements whose blocks are walked in order after their header (try/except* is Python 3.11+).
_BLOCKS = tuple(getattr(ast, name) for name in ("If", "While", "Try", "TryStar", "Match") if hasattr(ast, name))


# --- results -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Site:
    file: str  # as the user named it: under an audited path, the adaptor's path, else relative or absolute
    line: int
    function: str | None  # 'TopKRouter._apply_expert_bias'; None at module level
    code: str  # the statement's first line, shortened


@dataclass(frozen=True)
class Holder:
    kind: HolderKind
    module: str
    owner: str | None  # the class, for class attributes, buffers and cached methods
    variable: str
    placement: Placement
    definition: Site
    evidence: tuple[Site, ...]  # where tensors land in it
    writers: tuple[Site, ...]
    readers: tuple[Site, ...]
    importers: tuple[Site, ...]  # `from module import variable` at module level in another module

    @property
    def name(self) -> str:
        return ".".join(part for part in (self.module, self.owner, self.variable) if part)


@dataclass(frozen=True)
class Coverage:
    status: Status
    how: How | None
    function: str | None  # the adaptor function that handles (or mishandles) it
    via: tuple[str, ...]  # helpers it calls on the way: ('parallel_state.destroy_global_memory_buffer',)
    sites: tuple[Site, ...]  # the statements that do it
    why: str


@dataclass(frozen=True)
class AuditedHolder:
    holder: Holder
    coverage: Coverage
    classification: Classification | None  # None: covered and no rule names it
    finding: Finding  # the holder as diagnose would have located it: what classify and fix read


@dataclass(frozen=True)
class Audit:
    paths: tuple[Path, ...]
    files: int  # Python files read
    unreadable: tuple[str, ...]  # files that could not be parsed
    holders: tuple[AuditedHolder, ...]  # uncovered first, then unsafe, then covered; by name within
    context: RunContext  # the knowledge, the scan's workspace and the environment the holders were judged with
    stale: tuple[StaleReset, ...]
    notes: tuple[str, ...]

    @property
    def uncovered(self) -> tuple[AuditedHolder, ...]:
        """Holders recovery leaves unsafe: not covered, or covered in a way that fails."""
        return tuple(item for item in self.holders if item.coverage.status != "covered")

    @property
    def fixable(self) -> tuple[AuditedHolder, ...]:
        """The holders nothing covers that have a fix to write (an unsafe reset is the user's to change)."""
        return tuple(
            item
            for item in self.holders
            if item.coverage.status == "uncovered" and isinstance(item.classification, Classified)
            and isinstance(item.classification.fix, FixPlan)
        )


def audit(paths: Sequence[Path], *, adaptor: Path | None = None, rule_paths: Sequence[Path] = ()) -> Audit:
    """Scan the source trees, find the adaptor (given, or under the paths), judge each holder."""
    with warnings.catch_warnings():  # invalid escapes and the like in the framework are not ours to report
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.filterwarnings("ignore", "invalid escape sequence", DeprecationWarning)
        return _audit(paths, adaptor, rule_paths)


def _audit(paths: Sequence[Path], adaptor: Path | None, rule_paths: Sequence[Path]) -> Audit:
    knowledge = load_knowledge(rule_paths)
    given = [Path(path) for path in paths]
    if not given:
        raise UsageError("no path to audit: name one or more source folders or files")
    for path in given:
        if not path.exists():
            raise UsageError(f"{path}: no such file or folder")
    files = _python_files(given)
    import_roots = ImportRoots()
    roots = list(dict.fromkeys([*(import_roots.of(path) for path in files), *(import_roots.of(path) for path in given)]))
    index = _Index(given, roots)
    with _keeping_trees() as scanned:
        unreadable = [index.display(path) for path in files if index.add(path, import_roots.of(path)) is None]
        sink = _ScanSink()
        for info in index.scanned:
            _walk_module(index, info, sink)
        holders = sink.holders(index)
        scanned()
        if adaptor is None:
            adaptor = _adaptor_in_tree(index, knowledge)
        context = RunContext(knowledge, index.workspace, detect_environment(knowledge, index.workspace, adaptor=adaptor))
        environment = context.environment
        notes: list[str] = []
        coverage = _Coverage(index, environment, notes) if environment.adaptor else None
        if coverage is None:
            notes.append("no recovery adaptor found under the paths (give --adaptor FILE): nothing covers any global")
        audited = []
        for holder in holders:
            if coverage is not None:  # the adaptor's own uses are its coverage, not the framework's writes and reads
                holder = replace(
                    holder,
                    writers=tuple(site for site in holder.writers if site.file not in coverage.shown),
                    readers=tuple(site for site in holder.readers if site.file not in coverage.shown),
                )
            verdict = coverage.judge(holder) if coverage else Coverage("uncovered", None, None, (), (), "no adaptor was found")
            finding, classification = _classification(holder, verdict, context)
            audited.append(AuditedHolder(holder, verdict, classification, finding))
    order = {"uncovered": 0, "unsafe": 1, "covered": 2}
    audited.sort(key=lambda item: (order[item.coverage.status], item.holder.name))
    stale = stale_resets(environment.adaptor, environment.profile, environment, index.workspace) if environment.adaptor else []
    return Audit(tuple(given), len(files), tuple(unreadable), tuple(audited), context, tuple(stale), tuple(notes))


@contextmanager
def _keeping_trees() -> Iterator[Callable[[], None]]:
    """Garbage collection while every file's syntax tree is kept: none while they are read (the
    cyclic collector would walk them all again and again, half the time on a Megatron tree, and
    they hold no cycles); once the scan calls the function it is given, the trees are frozen out of
    the collector's sight and it runs again, for the heuristics, which do make cycles."""
    collecting = gc.isenabled()
    frozen = False

    def scanned() -> None:
        nonlocal frozen
        gc.freeze()
        frozen = True
        if collecting:
            gc.enable()

    gc.disable()
    try:
        yield scanned
    finally:
        if frozen:
            gc.unfreeze()
        if collecting:
            gc.enable()


def _diagnosed(item: AuditedHolder) -> DiagnosedFinding:
    """A holder as the fixer takes a finding."""
    return DiagnosedFinding(item.finding, "none", item.classification)


def plan_fixes(result: Audit) -> Plan:
    """One plan (one diff) with the fix of every uncovered holder that has one; refused without an
    adaptor to write into."""
    from unsafe_doctor.fix import plan_fix  # libcst loads only when a fix is planned

    if result.context.environment.adaptor is None:
        raise UsageError("--fix needs the recovery adaptor: none was found under the paths; give --adaptor FILE")
    return plan_fix([_diagnosed(item) for item in result.fixable], result.context)


def plan_fixes_per_holder(result: Audit) -> dict[str, Plan]:
    """Each fixable holder's own plan (SARIF attaches a fix to each result)."""
    from unsafe_doctor.fix import plan_fix

    if result.context.environment.adaptor is None:
        return {}
    return {item.holder.name: plan_fix([_diagnosed(item)], result.context) for item in result.fixable}


# --- files and modules -------------------------------------------------------------------------------


def _python_files(paths: Sequence[Path]) -> list[Path]:
    """`*.py` under the paths (as `python_files` skips), resolved, once each."""
    return list(dict.fromkeys(found.resolve() for path in paths for found in python_files(path)))


def _dotted(relative: Path) -> str | None:
    parts = list(relative.with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) if parts and all(part.isidentifier() for part in parts) else None


@dataclass
class _Class:
    module: str
    name: str
    node: ast.ClassDef
    attributes: dict[str, ast.stmt]  # names bound in the class body
    methods: dict[str, Function]
    cached: set[str]  # lru-cached methods
    buffers: dict[str, ast.Call]  # register_buffer calls by buffer name


@dataclass
class _Module:
    name: str
    path: Path  # resolved
    shown: str  # the path as sites name it
    source: SourceFile
    scanned: bool
    names: set[str]  # module-level names that can hold a value
    classes: dict[str, _Class]
    functions: dict[str, Function]
    cached: set[str]  # lru-cached module functions


def _register_buffer_name(call: ast.Call) -> str | None:
    argument = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "name"), None)
    return argument.value if isinstance(argument, ast.Constant) and isinstance(argument.value, str) else None


def _describe_module(name: str, path: Path, shown: str, source: SourceFile, scanned: bool) -> _Module:
    names = {
        key for key, binding in source.bindings.items() if isinstance(binding, (ast.Assign, ast.AnnAssign, ast.AugAssign))
    } | set(source.declared_globals)
    classes: dict[str, _Class] = {}
    functions: dict[str, Function] = {}
    cached: set[str] = set()
    for key, binding in source.bindings.items():
        if isinstance(binding, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[key] = binding
            if any(is_cache_decorator(decorator) for decorator in binding.decorator_list):
                cached.add(key)
        elif isinstance(binding, ast.ClassDef):
            classes[key] = _describe_class(name, binding, "register_buffer" in source.text)
    return _Module(name, path, shown, source, scanned, names, classes, functions, cached)


def _describe_class(module: str, node: ast.ClassDef, has_buffers: bool) -> _Class:
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
    cached = {name for name, method in methods.items() if any(is_cache_decorator(d) for d in method.decorator_list)}
    buffers: dict[str, ast.Call] = {}
    for method in methods.values() if has_buffers else ():
        for inner in ast.walk(method):
            if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr == "register_buffer":
                buffer = _register_buffer_name(inner)
                if buffer is not None:
                    buffers.setdefault(buffer, inner)
    return _Class(module, node.name, node, attributes, methods, cached, buffers)


class _Index:
    """The audited modules, and any other module a name leads to (read on demand, never imported)."""

    def __init__(self, given: Sequence[Path], roots: Sequence[Path]):
        self.roots = tuple(roots)
        self.workspace = Workspace(roots)
        self.scanned: list[_Module] = []
        self.by_path: dict[Path, _Module] = {}
        self.by_name: dict[str, _Module | None] = {}
        self.buffers: dict[str, list[tuple[str, str]]] = {}  # buffer name -> (module, class) defining it
        self.accessors: dict[int, tuple | None] = {}  # id(function node) -> holder key it returns
        self._given = [(path.resolve(), path) for path in given if path.is_dir()]
        self._given_files = {path.resolve(): path for path in given if path.is_file()}
        self._cwd = Path.cwd().resolve()
        # Top-level packages whose modules are read when a name leads there: the audited ones, the
        # adaptor's, and the frameworks adaptors call into. Libraries (torch) are never read.
        self.tops: set[str] = set(FRAMEWORK_PACKAGES)

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

    def add(self, path: Path, root: Path) -> _Module | None:
        """Read one audited file, whose import root is `root`; None when it cannot be parsed."""
        name = _dotted(path.relative_to(root)) or path.stem
        source = self.workspace.source(path, name)
        if source is None:
            return None
        info = _describe_module(name, path, self.display(path), source, scanned=True)
        self.scanned.append(info)
        self.by_path[path] = info
        self.by_name.setdefault(name, info)
        self.tops.add(name.split(".")[0])
        for owner in info.classes.values():
            for buffer in owner.buffers:
                self.buffers.setdefault(buffer, []).append((name, owner.name))
        return info

    def module(self, dotted: str) -> _Module | None:
        if dotted in self.by_name:
            return self.by_name[dotted]
        info = None
        if dotted.split(".")[0] in self.tops:
            path = self.workspace.module_path(dotted)
            if path is not None and path.is_file():
                resolved = path.resolve()
                info = self.by_path.get(resolved)
                if info is None:
                    source = self.workspace.source(resolved, dotted)
                    info = _describe_module(dotted, resolved, self.display(resolved), source, scanned=False) if source else None
                    if info is not None:
                        self.by_path[resolved] = info
        self.by_name[dotted] = info  # None for a namespace folder, a library or a module not found
        return info

    def is_module(self, dotted: str) -> bool:
        if self.module(dotted) is not None:
            return True
        return dotted.split(".")[0] in self.tops and self.workspace.module_path(dotted) is not None

    def module_of_file(self, path: Path) -> _Module | None:
        """An adaptor file (audited or not)."""
        resolved = path.resolve()
        if resolved in self.by_path:
            return self.by_path[resolved]
        found = self.workspace.local_source(resolved)
        if found is None:
            return None
        name = found.module or resolved.stem
        info = _describe_module(name, resolved, self.display(resolved), found, scanned=False)
        self.by_path[resolved] = info
        self.by_name.setdefault(name, info)
        if found.module:
            self.tops.add(found.module.split(".")[0])
        return info

    # names

    def resolve_dotted(self, dotted: str, hops: int = 0) -> _Ref | None:
        """What a dotted name refers to: a module, class, function or holder."""
        if hops > 6 or not dotted or dotted.split(".")[0] not in self.tops:
            return None  # torch and other libraries are never read
        if self.by_name.get(dotted) is not None:
            return _ModuleRef(dotted)
        head, _, name = dotted.rpartition(".")
        parent = self.resolve_dotted(head, hops + 1) if head else None
        found = self.member(parent, name, hops + 1) if parent is not None else None
        if found is None and self.is_module(dotted):  # a module its package does not import
            return _ModuleRef(dotted)
        return found

    def member(self, base: _Ref, name: str, hops: int = 0) -> _Ref | None:
        if isinstance(base, _ModuleRef):
            return self.module_member(base.name, name, hops)
        if isinstance(base, (_ClassRef, _SelfRef)):
            owner = self.class_(base.module, base.name)
            if owner is None:
                return None
            buffer = isinstance(base, _SelfRef) and name in owner.buffers  # buffers belong to instances
            if buffer or name in owner.attributes or name in owner.cached:
                return _HolderRef((base.module, base.name, name), False)
            if name in owner.methods:
                return _FunctionRef(base.module, base.name, owner.methods[name])
            return None
        if isinstance(base, _HolderRef):
            return None if name in _METADATA else _HolderRef(base.key, True)
        return None

    def module_member(self, module: str, name: str, hops: int = 0) -> _Ref | None:
        info = self.module(module)
        if info is None:
            return _ModuleRef(f"{module}.{name}") if self.is_module(f"{module}.{name}") else None
        return self.member_of(info, name, hops)

    def member_of(self, info: _Module, name: str, hops: int = 0) -> _Ref | None:
        """What a module-level name of a module refers to."""
        module = info.name
        binding = info.source.binding(name)
        if isinstance(binding, ImportedName):
            return self.resolve_dotted(binding.target, hops + 1)
        if isinstance(binding, ast.ClassDef):
            return _ClassRef(module, name)
        if isinstance(binding, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if name in info.cached:
                return _HolderRef((module, None, name), False)
            return _FunctionRef(module, None, binding)
        if name in info.names:
            return _HolderRef((module, None, name), False)
        if info.path.name != "__init__.py":
            return None  # a plain module has no submodules
        submodule = f"{module}.{name}"
        return _ModuleRef(submodule) if self.is_module(submodule) else None

    def class_(self, module: str, name: str) -> _Class | None:
        info = self.module(module)
        return info.classes.get(name) if info else None

    def accessor(self, function: _FunctionRef) -> tuple | None:
        """The holder a module function returns (`def get_x(): return X`), if it does."""
        node = function.node
        if id(node) in self.accessors:
            return self.accessors[id(node)]
        self.accessors[id(node)] = None  # while deciding: a recursive accessor returns nothing
        info = self.module(function.module)
        key = None
        small = function.owner is None and len(node.body) <= ACCESSOR_SIZE
        statements = list(scope_statements(node.body)) if small else []
        if info is not None and small and len(statements) <= ACCESSOR_SIZE:
            scope = _Scope.of_function(info, node, None)
            walker = _Walker(self, scope, _NullSink())
            for inner in statements:
                if isinstance(inner, ast.Return) and inner.value is not None:
                    ref = walker.resolve(inner.value)
                    if isinstance(ref, _HolderRef) and not ref.element:
                        key = ref.key
                        break
        self.accessors[id(node)] = key
        return key


# --- references ------------------------------------------------------------------------------------

Key = tuple  # (module, owner or None, variable)


@dataclass(frozen=True, slots=True)
class _ModuleRef:
    name: str


@dataclass(frozen=True, slots=True)
class _ClassRef:
    module: str
    name: str


@dataclass(frozen=True, slots=True)
class _SelfRef:
    module: str
    name: str  # the class


@dataclass(frozen=True)
class _FunctionRef:
    module: str
    owner: str | None
    node: Function


@dataclass(frozen=True, slots=True)
class _HolderRef:
    key: Key
    element: bool  # an entry, field or value computed from it, not the holder itself


_Ref = _ModuleRef | _ClassRef | _SelfRef | _FunctionRef | _HolderRef


# --- uses -------------------------------------------------------------------------------------------

UseKind = Literal["rebind", "store", "augment", "method", "delete", "read", "import", "argument"]


@dataclass
class _Use:
    key: Key
    kind: UseKind
    element: bool
    module: _Module
    statement: ast.stmt
    line: int
    function: str | None
    place: _Place | None = None  # the tensor it stores, when it stores one
    instance_of: tuple[str, str] | None = None  # rebound to an instance of this class
    method: str | None = None
    callee: str | None = None  # the function it is passed to
    reads_data: bool = False  # the use reads the tensor's data (unsafe on unsafe memory)
    value_reads_holder: bool = False  # the value stored or copied in is computed from the holder's data
    empty: bool = False  # rebound to an empty container or None
    in_init: bool = False
    module_level: bool = False
    via: tuple[str, ...] = ()

    def site(self) -> Site:
        code = (source_segment(self.module.source.text, self.statement) or "").strip().splitlines()
        return Site(self.module.shown, self.line, self.function, _shortened(code[0]) if code else "")


def _shortened(line: str) -> str:
    """A statement's first line on one line, at most MAX_CODE characters."""
    text = " ".join(line.split())
    return text if len(text) <= MAX_CODE else text[: MAX_CODE - 3] + "..."


class _NullSink:
    def use(self, use: _Use) -> None:
        pass

    def class_tensor(self, owner: tuple[str, str], place: _Place | None, use: _Use) -> None:
        pass

    def returned(self, key: Key, place: _Place | None, use: _Use) -> None:
        pass

    def buffer(self, key: Key, place: _Place | None, use: _Use) -> None:
        pass


# --- walking code ----------------------------------------------------------------------------------


@dataclass
class _Scope:
    module: _Module
    function: Function | None  # None: the module body
    owner: str | None  # the class of a method
    qualname: str | None
    self_name: str | None  # a method's first parameter: `self` (instance) or `cls` (classmethod)
    self_is_class: bool
    locals: set[str]
    globals: set[str]
    imports: dict[str, ImportedName]
    nested: dict[str, Function]
    aliases: dict[str, _HolderRef] = field(default_factory=dict)
    places: dict[str, _Place] = field(default_factory=dict)  # local name -> placement of the tensor it holds
    devices: dict[str, _Place] = field(default_factory=dict)  # local name -> placement of the device it names
    derived: set[str] = field(default_factory=set)  # locals computed from a holder's data
    mentions: set[str] | None = None

    @classmethod
    def of_function(cls, module: _Module, node: Function, owner: str | None, qualname: str | None = None) -> _Scope:
        locals_: set[str] = set(parameter_names(node))
        globals_: set[str] = set()
        imports: dict[str, ImportedName] = {}
        nested: dict[str, Function] = {}
        # Statements only: names bound inside expressions (comprehensions, `:=`) become local when
        # the walker meets them. Walking every expression here would double the audit's time.
        for inner in scope_statements(node.body):
            if isinstance(inner, ast.Global):
                globals_.update(inner.names)
            elif isinstance(inner, (ast.Import, ast.ImportFrom)):
                imports.update(import_bindings(inner, module.source.package))
            elif isinstance(inner, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                locals_.update(names_bound(targets))
            elif isinstance(inner, (ast.For, ast.AsyncFor)):
                locals_.update(names_bound([inner.target]))
            elif isinstance(inner, (ast.With, ast.AsyncWith)):
                locals_.update(names_bound([item.optional_vars for item in inner.items if item.optional_vars]))
            elif isinstance(inner, ast.Try):
                locals_.update(handler.name for handler in inner.handlers if handler.name)
            elif isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if isinstance(inner, ast.ClassDef):
                    locals_.add(inner.name)
                else:
                    nested.setdefault(inner.name, inner)  # the walker moves on to later ones of a name
        locals_.update(nested)
        locals_ -= globals_
        self_name, self_is_class = None, False
        if owner is not None:
            decorators = {getattr(d, "id", getattr(d, "attr", None)) for d in node.decorator_list}
            positional = [*node.args.posonlyargs, *node.args.args]
            if positional and "staticmethod" not in decorators:
                self_name, self_is_class = positional[0].arg, "classmethod" in decorators
        return cls(module, node, owner, qualname or node.name, self_name, self_is_class, locals_, globals_, imports, nested)

    @classmethod
    def of_module(cls, module: _Module) -> _Scope:
        return cls(module, None, None, None, None, False, set(), set(), {}, {})

    def mentioned(self) -> set[str]:
        if self.mentions is None:
            nodes = ast.walk(self.function) if self.function is not None else ()
            self.mentions = {
                node.id if isinstance(node, ast.Name) else node.attr
                for node in nodes
                if isinstance(node, (ast.Name, ast.Attribute))
            }
        return self.mentions


def _walk_module(index: _Index, info: _Module, sink) -> None:
    """Every scope of an audited module: its body, class bodies, functions and methods, nested ones."""
    _Walker(index, _Scope.of_module(info), sink).run(info.source.tree.body)
    for node, owner, qualname in _functions_of(info.source.tree.body, None, None):
        scope = _Scope.of_function(info, node, owner, qualname)
        try:
            _Walker(index, scope, sink).run(node.body)
        except RecursionError:  # a generated expression thousands of terms deep
            continue


def _functions_of(body: Sequence[ast.stmt], owner: str | None, prefix: str | None) -> Iterator[tuple[Function, str | None, str]]:
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            qualname = f"{prefix}.{statement.name}" if prefix else statement.name
            yield statement, owner, qualname
            yield from _functions_of(statement.body, None, qualname)  # nested functions: their own scope
        elif isinstance(statement, ast.ClassDef):
            # Methods of module-level classes know their class; deeper classes are walked as plain code.
            inner_owner = statement.name if prefix is None else None
            yield from _functions_of(statement.body, inner_owner, f"{prefix}.{statement.name}" if prefix else statement.name)
        else:
            yield from _functions_of(child_statements(statement), owner, prefix)


class _Walker:
    """One scope's statements, in order: local aliases of holders and placements of local tensors
    are followed; every use of a holder goes to the sink. With `follow`, calls of helper functions
    are walked too (their uses carry the helper in `via`)."""

    def __init__(self, index: _Index, scope: _Scope, sink, follow: bool = False, via: tuple[str, ...] = (), seen: frozenset = frozenset()):
        self.index = index
        self.scope = scope
        self.sink = sink
        self.follow = follow
        self.via = via
        self.seen = seen | ({id(scope.function)} if scope.function is not None else set())
        self.statement: ast.stmt | None = None
        self.in_init = scope.function is not None and scope.function.name == "__init__"

    # --- statements

    def run(self, body: Sequence[ast.stmt]) -> None:
        for statement in body:
            self.visit_statement(statement)

    def visit_statement(self, statement: ast.stmt) -> None:
        self.statement = statement
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in statement.decorator_list:
                self.visit(decorator)
            if self.scope.function is not None:
                self.scope.nested[statement.name] = statement  # calls from here on mean this one
            return  # walked as a scope of its own
        if isinstance(statement, ast.ClassDef):
            if self.scope.function is None:
                self._class_body(statement)
            return
        if isinstance(statement, ast.Assign):
            self.visit(statement.value)
            for target in statement.targets:
                self.store(target, statement.value)
        elif isinstance(statement, ast.AnnAssign):
            if statement.value is not None:
                self.visit(statement.value)
                self.store(statement.target, statement.value)
        elif isinstance(statement, ast.AugAssign):
            self.visit(statement.value)
            self.augment(statement.target, statement.value)
        elif isinstance(statement, ast.Delete):
            for target in statement.targets:
                ref = self.resolve(target)
                if isinstance(ref, _HolderRef):
                    self.emit("delete", ref, statement.lineno)
                self.visit_inside(target)
        elif isinstance(statement, (ast.For, ast.AsyncFor)):
            self.visit(statement.iter)
            self.bind_loop(statement.target, statement.iter)
            self.run(statement.body)
            self.run(statement.orelse)
        elif isinstance(statement, (ast.With, ast.AsyncWith)):
            for item in statement.items:
                self.visit(item.context_expr)
                if item.optional_vars is not None:
                    self.store(item.optional_vars, item.context_expr)
            self.run(statement.body)
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            self.imports(statement)
        elif isinstance(statement, ast.Return):
            if statement.value is not None:
                self.visit(statement.value)
                self.returned(statement.value)
        elif isinstance(statement, _BLOCKS):
            for expression in _headers(statement):
                self.statement = statement
                self.visit(expression)
            for child in child_statements(statement):
                self.visit_statement(child)
        else:
            for child in ast.iter_child_nodes(statement):
                if isinstance(child, ast.expr):
                    self.visit(child)

    def _class_body(self, node: ast.ClassDef) -> None:
        """Class attributes bound in the body: their definitions and the tensors they start with."""
        for decorator in node.decorator_list:
            self.visit(decorator)
        attributes = self.scope.module.classes[node.name].attributes if node.name in self.scope.module.classes else {}
        for statement in node.body:
            self.statement = statement
            if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                self.visit(statement.value)
                for name in names_bound(targets):
                    if attributes.get(name) is not statement:
                        continue
                    ref = _HolderRef((self.scope.module.name, node.name, name), False)
                    self.emit("rebind", ref, statement.lineno, place=self.place(statement.value), value=statement.value)

    def store(self, target: ast.expr, value: ast.expr | None) -> None:
        scope = self.scope
        line = self.statement.lineno
        if isinstance(target, ast.Name):
            name = target.id
            if scope.function is None or name in scope.globals:
                ref = _HolderRef((scope.module.name, None, name), False)
                self.emit("rebind", ref, line, place=self.place(value), value=value)
                return
            scope.aliases.pop(name, None)
            scope.places.pop(name, None)
            scope.devices.pop(name, None)
            scope.derived.discard(name)
            if value is None:
                return
            ref = self.resolve(value)
            if isinstance(ref, _HolderRef):
                scope.aliases[name] = ref
                return
            place = self.place(value)
            if place is not None:
                scope.places[name] = place
            device = self.device_value(value)
            if device is not None:
                scope.devices[name] = device
            if self.follow and self.reads_holder(value):
                scope.derived.add(name)
            return
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.store(element, None)
            return
        if isinstance(target, ast.Starred):
            self.store(target.value, None)
            return
        self.visit_inside(target)
        ref = self.resolve(target)
        if isinstance(ref, _HolderRef) and not ref.element and self._instance_attribute(target):
            ref = None  # `self.x = v` where the class has an `x`: the instance gets its own
        if isinstance(ref, _HolderRef):
            kind = "store" if ref.element else "rebind"
            self.emit(kind, ref, line, place=self.place(value), value=value)
        elif self._self_rooted(target):
            self.sink.class_tensor((scope.module.name, scope.owner), self.place(value), self.make("read", None, line))

    def augment(self, target: ast.expr, value: ast.expr) -> None:
        line = self.statement.lineno
        ref = self.resolve(target)
        if not isinstance(target, ast.Name):
            self.visit_inside(target)
        if isinstance(ref, _HolderRef):
            self.emit("augment", ref, line, place=self.place(value), value=value, reads_data=True)
        elif isinstance(target, ast.Name) and (self.scope.function is None or target.id in self.scope.globals):
            ref = _HolderRef((self.scope.module.name, None, target.id), False)
            self.emit("augment", ref, line, place=self.place(value), value=value, reads_data=True)
        elif self._self_rooted(target):
            self.sink.class_tensor((self.scope.module.name, self.scope.owner), self.place(value), self.make("read", None, line))

    def bind_loop(self, target: ast.expr, iterable: ast.expr) -> None:
        """`for v in X.values()`, `for k, v in X.items()`, `for t in [X]`: the loop variables alias X."""
        found = self.holder_in(iterable)
        for name in names_bound([target]):
            self.scope.aliases.pop(name, None)
            self.scope.places.pop(name, None)
            if found is not None:
                self.scope.aliases[name] = _HolderRef(found.key, True)

    def imports(self, statement: ast.Import | ast.ImportFrom) -> None:
        if not isinstance(statement, ast.ImportFrom):
            return
        for name, binding in import_bindings(statement, self.scope.module.source.package).items():
            ref = self.index.resolve_dotted(binding.target)
            if isinstance(ref, _HolderRef) and not ref.element:
                self.emit("import", ref, statement.lineno, module_level=self.scope.function is None)

    def returned(self, value: ast.expr) -> None:
        """What a cached function returns: a tensor by its construction, or by the function's
        `-> Tensor` annotation (placement unknown)."""
        function = self.scope.function
        if function is None:
            return
        key = (self.scope.module.name, self.scope.owner, function.name)
        cached = self.scope.module.classes[self.scope.owner].cached if self.scope.owner in self.scope.module.classes else set()
        if (self.scope.owner is None and function.name in self.scope.module.cached) or function.name in cached:
            place = self.place(value)
            if place is None and _annotated_tensor(function.returns):
                place = "unknown"
            self.sink.returned(key, place, self.make("read", None, self.statement.lineno))

    # --- expressions

    def visit(self, node: ast.AST | None) -> None:
        """Every use an expression makes of a holder."""
        if node is None:
            return
        if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
            ref = self.resolve(node)
            if isinstance(ref, _HolderRef):
                self.emit("read", ref, self.statement.lineno)
                self.visit_inside(node)
                return
            if isinstance(ref, _FunctionRef) or isinstance(node, ast.Name):
                return
        elif isinstance(node, ast.Call):
            self.call(node)
            return
        elif isinstance(node, ast.BinOp):
            for side in (node.left, node.right):
                ref = self.resolve(side)
                if isinstance(ref, _HolderRef):
                    self.emit("read", ref, self.statement.lineno, reads_data=True)
                    self.visit_inside(side)
                else:
                    self.visit(side)
            return
        elif isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            for generator in node.generators:
                self.scope.locals.update(names_bound([generator.target]))
        elif isinstance(node, ast.NamedExpr):
            self.scope.locals.update(names_bound([node.target]))
        for child in ast.iter_child_nodes(node):
            self.visit(child)

    def visit_inside(self, node: ast.expr) -> None:
        """The subscripts and call arguments inside a reference chain, not the chain itself."""
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            if isinstance(node, ast.Subscript):
                self.visit(node.slice)
                node = node.value
            elif isinstance(node, ast.Call):
                for argument in [*node.args, *(keyword.value for keyword in node.keywords)]:
                    self.visit(argument)
                node = node.func
            else:
                node = node.value

    def call(self, node: ast.Call) -> None:
        func = node.func
        line = self.statement.lineno
        arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
        if isinstance(func, ast.Attribute):
            base = self.resolve(func.value)
            if isinstance(base, _HolderRef):
                copied_from_holder = func.attr == "copy_" and any(self.reads_holder(a) for a in arguments)
                reads = func.attr in _DATA_METHODS or (func.attr.endswith("_") and func.attr not in _NOT_DATA_INPLACE and func.attr != "copy_")
                place = self._added_place(func.attr, node)
                self.emit("method", base, line, method=func.attr, place=place, reads_data=reads, value_reads_holder=copied_from_holder)
                self.visit_inside(func.value)
                for argument in arguments:
                    self.visit(argument)
                return
            if isinstance(base, _SelfRef) and func.attr == "register_buffer":
                self.register_buffer(node)
            elif func.attr in _CONTAINER_ADD and self._self_rooted(func.value) and node.args:
                self.sink.class_tensor((self.scope.module.name, self.scope.owner), self.place(node.args[-1]), self.make("read", None, line))
        callee = self.resolve(func)
        if isinstance(callee, _HolderRef):
            self.emit("read", callee, line)  # calling a cached function reads its cache
        elif isinstance(callee, _FunctionRef):
            key = self.index.accessor(callee)
            if key is not None:
                self.emit("read", _HolderRef(key, False), line)
            elif self.follow:
                self.follow_call(callee)
        else:
            self.visit(func)
        name = self.dotted(func) or (func.attr if isinstance(func, ast.Attribute) else None)
        for argument in arguments:
            ref = self.resolve(argument)
            if isinstance(ref, _HolderRef) and name is not None and name.split(".")[-1] not in _NOT_DATA_CALLS:
                torch_op = name.startswith("torch.") and not name.startswith("torch.distributed.")
                self.emit("argument", ref, line, callee=name, reads_data=torch_op)
                self.visit_inside(argument)
            else:
                self.visit(argument)

    def register_buffer(self, node: ast.Call) -> None:
        name = _register_buffer_name(node)
        value = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "tensor"), None)
        if name is None:
            return
        key = (self.scope.module.name, self.scope.owner, name)
        self.sink.buffer(key, self.place(value) if value is not None else None, self.make("store", key, self.statement.lineno))

    def follow_call(self, callee: _FunctionRef) -> None:
        """Walk a helper the adaptor calls, as part of the calling function."""
        node = callee.node
        if id(node) in self.seen or len(self.via) >= MAX_CALL_DEPTH:
            return
        module = self.index.module(callee.module) if callee.module != self.scope.module.name else self.scope.module
        if module is None:
            return
        nested = callee.module == self.scope.module.name and node.name in self.scope.nested
        qualname = node.name if nested else f"{module.name.rpartition('.')[2]}.{node.name}"
        scope = _Scope.of_function(module, node, callee.owner, node.name)
        via = self.via if nested else (*self.via, qualname)  # a nested helper (a fix block's) is part of its function
        walker = _Walker(self.index, scope, self.sink, follow=True, via=via, seen=self.seen)
        try:
            walker.run(node.body)
        except RecursionError:
            pass

    # --- references

    def resolve(self, node: ast.AST) -> _Ref | None:
        if isinstance(node, ast.Name):
            return self.resolve_name(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            if base is not None:
                return self.index.member(base, node.attr)
            return self.buffer_by_name(node.attr)
        if isinstance(node, ast.Subscript):
            base = self.resolve(node.value)
            return _HolderRef(base.key, True) if isinstance(base, _HolderRef) else None
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _METADATA:
                return None
            base = self.resolve(func)
            if isinstance(base, _FunctionRef):
                key = self.index.accessor(base)
                return _HolderRef(key, False) if key is not None else None
            if isinstance(base, _HolderRef):
                return _HolderRef(base.key, True)
            return None
        return None

    def resolve_name(self, name: str) -> _Ref | None:
        scope = self.scope
        if name in scope.aliases:
            return scope.aliases[name]
        if name in scope.imports:
            return self.index.resolve_dotted(scope.imports[name].target)
        if name in scope.nested:
            return _FunctionRef(scope.module.name, None, scope.nested[name])
        if name == scope.self_name and scope.owner is not None:
            return _ClassRef(scope.module.name, scope.owner) if scope.self_is_class else _SelfRef(scope.module.name, scope.owner)
        if name in scope.locals:
            return None
        return self.index.member_of(scope.module, name)

    def buffer_by_name(self, attribute: str) -> _HolderRef | None:
        """`<anything>.expert_bias` where the function names the buffer's class."""
        owners = self.index.buffers.get(attribute)
        if not owners or self.scope.function is None:
            return None
        named = [owner for owner in owners if owner[1] in self.scope.mentioned()]
        if len(named) != 1:
            return None
        module, owner = named[0]
        return _HolderRef((module, owner, attribute), False)

    def holder_in(self, node: ast.AST) -> _HolderRef | None:
        """The first holder an expression refers to, anywhere in it."""
        for inner in ast.walk(node):
            if isinstance(inner, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)):
                ref = self.resolve(inner)
                if isinstance(ref, _HolderRef):
                    return ref
        return None

    def reads_holder(self, node: ast.AST | None) -> bool:
        """Whether computing the expression reads a holder's data (metadata does not count)."""
        if node is None:
            return False
        if isinstance(node, ast.Name) and node.id in self.scope.derived:
            return True
        if isinstance(node, ast.Attribute) and node.attr in _METADATA:
            return False
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _METADATA:
                return False
            if isinstance(func, ast.Name) and func.id in _NOT_DATA_CALLS:
                return False
        if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)) and isinstance(self.resolve(node), _HolderRef):
            return True
        return any(self.reads_holder(child) for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr))

    def dotted(self, node: ast.expr) -> str | None:
        """`torch.zeros`, `F.relu` -> 'torch.nn.functional.relu': the imported name a chain spells."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        binding = self.scope.imports.get(node.id) or self.scope.module.source.bindings.get(node.id)
        if not isinstance(binding, ImportedName) or (node.id in self.scope.locals and node.id not in self.scope.imports):
            return None
        return ".".join([binding.target, *reversed(parts)])

    def _instance_attribute(self, target: ast.expr) -> bool:
        """`self.x` naming a class attribute (not a buffer)."""
        if not isinstance(target, ast.Attribute):
            return False
        base = self.resolve(target.value)
        if not isinstance(base, _SelfRef):
            return False
        owner = self.index.class_(base.module, base.name)
        return owner is not None and target.attr not in owner.buffers

    def _self_rooted(self, node: ast.expr) -> bool:
        if self.scope.owner is None or self.scope.self_name is None or self.scope.self_is_class:
            return False
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return isinstance(node, ast.Name) and node.id == self.scope.self_name

    # --- placement

    def place(self, node: ast.AST | None) -> _Place | None:
        """Where the tensor an expression makes lives; None when it is not known to be a tensor."""
        if isinstance(node, ast.Name):
            return self.scope.places.get(node.id)
        if isinstance(node, ast.Subscript):
            return self.place(node.value)
        if isinstance(node, ast.BinOp):
            return _combine([self.place(node.left), self.place(node.right)])
        if isinstance(node, ast.IfExp):
            return _combine([self.place(node.body), self.place(node.orelse)])
        if not isinstance(node, ast.Call):
            return None
        func = node.func
        name = self.dotted(func)
        if name is not None and name.startswith("torch."):
            return self._torch_call(name, node)
        if isinstance(func, ast.Attribute):
            method = func.attr
            receiver = self.place(func.value)
            if method in ("cuda", "npu"):
                return "device"
            if method == "cpu":
                return "cpu"
            if method == "to":
                return self._moved(node, receiver)
            if method in _TENSOR_METHODS:
                return receiver or "unknown"
        return None

    def _torch_call(self, name: str, node: ast.Call) -> _Place | None:
        short = name.rpartition(".")[2]
        keywords = {keyword.arg: keyword.value for keyword in node.keywords if keyword.arg}
        if name.count(".") == 1 and short in _FACTORIES:
            return self.device_of(keywords["device"]) if "device" in keywords else "cpu"
        if name.count(".") == 1 and short in _LIKE_FACTORIES:
            if "device" in keywords:
                return self.device_of(keywords["device"])
            return (self.place(node.args[0]) or "unknown") if node.args else "unknown"
        if (name.count(".") == 1 and short not in _NOT_TENSOR_OPS and short[:1].islower()) or name.startswith(_TENSOR_SUBMODULES):
            inputs = [self.place(argument) for argument in [*node.args, *keywords.values()]]
            return _combine(inputs) or "unknown"
        return None

    def _moved(self, node: ast.Call, receiver: _Place | None) -> _Place:
        target = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "device"), None)
        if target is None:
            return receiver or "unknown"
        dotted = self.dotted(target)
        if dotted is not None and dotted.startswith("torch.") and dotted.rpartition(".")[2] in _DTYPES:
            return receiver or "unknown"  # .to(torch.float32)
        return self.device_of(target)

    def device_of(self, node: ast.expr) -> _Place:
        """The placement a `device=` argument or `.to()` target names."""
        value = self.device_value(node)
        return value if value is not None else "unknown"

    def device_value(self, node: ast.expr | None) -> _Place | None:
        if isinstance(node, ast.Constant):
            if node.value is None:
                return "cpu"
            if isinstance(node.value, int) and not isinstance(node.value, bool):
                return "device"
            if isinstance(node.value, str):
                text = node.value.lower()
                # "meta" tensors have no memory to be unsafe: as good as the CPU here
                return "device" if text.startswith(_DEVICE_WORDS) else "cpu" if text.startswith(("cpu", "meta")) else None
            return None
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            return self.device_value(node.values[0])
        if isinstance(node, ast.Name):
            return self.scope.devices.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr == "device":
            return self.place(node.value)  # `x.device` of a local tensor whose placement is known
        if isinstance(node, ast.Call):
            func = node.func
            attribute = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if attribute.startswith("current_device"):  # torch.cuda / torch.npu / get_accelerator()
                return "device"
            if self.dotted(func) == "torch.device" and node.args:
                return self.device_value(node.args[0])
        return None

    def _added_place(self, method: str, node: ast.Call) -> _Place | None:
        if method in _CONTAINER_ADD and node.args:
            return self.place(node.args[-1])
        return None

    # --- emitting

    def make(self, kind: UseKind, key: Key | None, line: int, **details) -> _Use:
        return _Use(
            key=key,
            kind=kind,
            element=details.pop("element", False),
            module=self.scope.module,
            statement=self.statement,
            line=line,
            function=self.scope.qualname,
            in_init=self.in_init,
            via=self.via,
            **details,
        )

    def emit(self, kind: UseKind, ref: _HolderRef, line: int, *, value: ast.expr | None = None, **details) -> None:
        if kind in ("rebind", "store") and value is not None:
            if self.follow:  # judging recovery code: what it stores must not come from unsafe data
                details.setdefault("value_reads_holder", self.reads_holder(value))
            details["empty"] = is_empty_value(value)
            if isinstance(value, ast.Call):
                callee = self.resolve(value.func)
                if isinstance(callee, _ClassRef):
                    details["instance_of"] = (callee.module, callee.name)
        self.sink.use(self.make(kind, ref.key, line, element=ref.element, **details))


def _annotated_tensor(annotation: ast.expr | None) -> bool:
    """`-> Tensor`, `-> torch.Tensor`, `-> "torch.Tensor"`."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.rpartition(".")[2] == "Tensor"
    name = annotation.attr if isinstance(annotation, ast.Attribute) else getattr(annotation, "id", None)
    return name == "Tensor"


def _headers(statement: ast.stmt) -> list[ast.expr]:
    if isinstance(statement, (ast.If, ast.While)):
        return [statement.test]
    if isinstance(statement, ast.Match):
        return [statement.subject]
    return []


def _combine(places: Sequence[_Place | None]) -> _Place | None:
    known = [place for place in places if place is not None]
    if not known:
        return None
    if "device" in known:
        return "device"
    return "unknown" if "unknown" in known else "cpu"




# --- scanning: uses -> holders ---------------------------------------------------------------------


class _ScanSink:
    def __init__(self) -> None:
        self.uses: dict[Key, list[_Use]] = {}
        self.classes: dict[tuple[str, str], list[tuple[_Place, _Use]]] = {}
        self.returns: dict[Key, list[tuple[_Place, _Use]]] = {}
        self.buffers: dict[Key, tuple[_Place | None, _Use]] = {}

    def use(self, use: _Use) -> None:
        self.uses.setdefault(use.key, []).append(use)

    def class_tensor(self, owner: tuple[str, str], place: _Place | None, use: _Use) -> None:
        if place is not None and owner[1] is not None:
            self.classes.setdefault(owner, []).append((place, use))

    def returned(self, key: Key, place: _Place | None, use: _Use) -> None:
        if place is not None:
            self.returns.setdefault(key, []).append((place, use))

    def buffer(self, key: Key, place: _Place | None, use: _Use) -> None:
        self.buffers.setdefault(key, (place, use))

    def holders(self, index: _Index) -> list[Holder]:
        found = []
        scanned = {info.name for info in index.scanned}
        for key in sorted({*self.uses, *self.returns, *self.buffers}, key=lambda k: (k[0], k[1] or "", k[2])):
            module, owner, variable = key
            if module not in scanned:
                continue
            uses = self.uses.get(key, [])
            holder = self._holder(index, key, uses)
            if holder is not None:
                found.append(holder)
        return found

    def _holder(self, index: _Index, key: Key, uses: list[_Use]) -> Holder | None:
        module, owner, variable = key
        info = index.by_name.get(module)
        evidence: list[tuple[_Place, _Use]] = []
        kind: HolderKind
        if key in self.buffers:
            place, registered = self.buffers[key]
            updates = [use for use in uses if not use.in_init and _updates_in_place(use)]
            if not updates:
                return None
            kind = "buffer"
            evidence = [("device" if place == "device" else "unknown", registered)]  # a module moves its buffers
            definition = registered
        elif self._cached(info, owner, variable):
            kind = "lru-cache"
            evidence = self.returns.get(key, [])
            definition = None
        else:
            singleton = False
            for use in uses:
                if use.kind in ("rebind", "store", "augment", "method") and use.place is not None:
                    evidence.append((use.place, use))
                if use.kind == "rebind" and use.instance_of is not None:
                    held = self.classes.get(use.instance_of, [])
                    place = _combine([place for place, _ in held])
                    if place is not None:
                        evidence.append((place, use))
                        evidence.append(next(item for item in held if item[0] == place))  # where the class keeps it
                        singleton = singleton or not use.element
            kind = "singleton" if singleton else "class-attribute" if owner else "module-global"
            definition = None
        placement = _combine([place for place, _ in evidence])
        if placement not in ("device", "unknown"):
            return None
        if definition is None:
            definition = self._definition(index, key, uses, evidence)
        writers = [use for use in uses if _writes(use)]
        readers = [use for use in uses if not _writes(use) and use.kind != "import"]
        importers = [use for use in uses if use.kind == "import" and use.module_level and use.module.name != module]
        shown_evidence = [use for place, use in evidence if place != "cpu"]
        return Holder(
            kind=kind,
            module=module,
            owner=owner,
            variable=variable,
            placement=placement,
            definition=definition.site() if isinstance(definition, _Use) else definition,
            evidence=_sites(shown_evidence),
            writers=_sites(writers),
            readers=_sites(readers),
            importers=_sites(importers),
        )

    @staticmethod
    def _cached(info: _Module | None, owner: str | None, variable: str) -> bool:
        if info is None:
            return False
        if owner is None:
            return variable in info.cached
        return owner in info.classes and variable in info.classes[owner].cached

    @staticmethod
    def _definition(index: _Index, key: Key, uses: list[_Use], evidence: list) -> Site:
        """Where the holder is defined: its module-level or class-body binding, its function, else its
        first write."""
        module, owner, variable = key
        info = index.by_name[module]
        node: ast.AST | None = None
        if owner is None:
            node = info.source.bindings.get(variable)
            if node is None or isinstance(node, ImportedName):
                node = info.functions.get(variable)
        elif owner in info.classes:
            holder_class = info.classes[owner]
            node = holder_class.attributes.get(variable) or holder_class.methods.get(variable)
        if isinstance(node, (ast.stmt, ast.expr)):
            code = (source_segment(info.source.text, node) or "").strip().splitlines()
            return Site(info.shown, node.lineno, owner, _shortened(code[0]) if code else "")
        first = next((use for use in uses if _writes(use)), None) or (evidence[0][1] if evidence else uses[0])
        return first.site()


def _updates_in_place(use: _Use) -> bool:
    if use.kind == "augment":
        return True
    if use.kind == "store":
        return True  # `buf.data = ...`, `buf[k] = ...`
    if use.kind == "method":
        return use.method.endswith("_") and use.method not in _NOT_DATA_INPLACE
    return False


def _writes(use: _Use) -> bool:
    if use.kind in ("rebind", "store", "augment", "delete"):
        return True
    if use.kind == "method":
        return use.method.endswith("_") or use.method in _CONTAINER_ADD or use.method in ("pop", "popleft", "update", "clear", "cache_clear", "remove", "discard")
    if use.kind == "argument":
        return use.callee is not None and use.callee.rpartition(".")[2] in _COMMUNICATION_INTO
    return False


def _sites(uses: Sequence[_Use]) -> tuple[Site, ...]:
    seen: dict[tuple[str, int], Site] = {}
    for use in uses:
        site = use.site()
        seen.setdefault((site.file, site.line), site)
    return tuple(seen.values())


# --- the adaptor --------------------------------------------------------------------------------------


def _adaptor_in_tree(index: _Index, knowledge: KnowledgeBase) -> Path | None:
    """When no profile's file path matches under the roots, an audited module that defines a
    profile's rollback, send and receive functions."""
    for root in index.roots:
        for profile in knowledge.profiles:
            if any(next(root.glob(pattern), None) for pattern in profile.files):
                return None  # versions.py finds it by its path
    for info in index.scanned:
        for profile in knowledge.profiles:
            if all(name in info.functions for name in (profile.rollback, profile.send, profile.recv)):
                return Path(index.display(info.path))
    return None


class _CoverageSink(_NullSink):
    def __init__(self, role: Role, function: str) -> None:
        self.role = role
        self.function = function
        self.uses: dict[Key, list[_Use]] = {}

    def use(self, use: _Use) -> None:
        self.uses.setdefault(use.key, []).append(use)


class _Coverage:
    """The uses the adaptor's rollback, send and receive functions make of each holder."""

    def __init__(self, index: _Index, environment: Environment, notes: list[str]):
        self.index = index
        self.profile = environment.profile
        adaptor = environment.adaptor
        files = profile_files(self.profile, adaptor) or [adaptor.resolve()]
        if adaptor.resolve() not in files:
            files.insert(0, adaptor.resolve())
        self.shown = {index.display(path) for path in files}
        self.sinks: list[_CoverageSink] = []
        for role, name in (("rollback", self.profile.rollback), ("send", self.profile.send), ("recv", self.profile.recv)):
            found = [(info, info.functions[name]) for info in map(index.module_of_file, files) if info and name in info.functions]
            if not found:
                notes.append(f"{name}() ({role}) not found in {', '.join(index.display(f) for f in files)}")
                continue
            info, node = found[0]
            sink = _CoverageSink(role, name)
            scope = _Scope.of_function(info, node, None)
            _Walker(index, scope, sink, follow=True).run(node.body)
            self.sinks.append(sink)

    def judge(self, holder: Holder) -> Coverage:
        key = (holder.module, holder.owner, holder.variable)
        safe: dict[Role, list[tuple[How, _Use]]] = {"rollback": [], "recv": [], "send": []}
        sent: list[_Use] = []
        for sink in self.sinks:
            for use in sink.uses.get(key, []):
                if sink.role == "send":
                    if use.kind == "argument" and (use.callee or "").rpartition(".")[2] in _COMMUNICATION_FROM:
                        sent.append(use)
                    continue
                verdict = _effect(use, holder, sink.role)
                if verdict is None:
                    continue
                how, problem = verdict
                if problem is not None:
                    return Coverage("unsafe", None, sink.function, use.via, (use.site(),), problem)
                safe[sink.role].append((how, use))
        names = {sink.role: sink.function for sink in self.sinks}
        if safe["rollback"]:
            return self._covered(safe["rollback"], names["rollback"])
        if safe["recv"]:
            if sent:
                return self._covered(safe["recv"], names["recv"], sent, names["send"])
            sender = names.get("send", self.profile.send)
            return Coverage(
                "unsafe", None, names["recv"], safe["recv"][0][1].via, (safe["recv"][0][1].site(),),
                f"received in {names['recv']}() but never sent by {sender}(): the receive would wait forever",
            )
        if sent:
            receiver = names.get("recv", self.profile.recv)
            return Coverage(
                "unsafe", None, names["send"], sent[0].via, (sent[0].site(),),
                f"sent by {names['send']}() but never received in {receiver}(): the send has no partner and "
                "the faulty rank keeps its unsafe copy",
            )
        touched = ", ".join(f"{name}()" for name in names.values()) or "the adaptor"
        return Coverage("uncovered", None, None, (), (), f"not reset, rebuilt or repaired by {touched}")

    @staticmethod
    def _covered(effects: list[tuple[How, _Use]], function: str, sent: Sequence[_Use] = (), sender: str = "") -> Coverage:
        how = max((how for how, _ in effects), key=_HOW_ORDER.__getitem__)
        uses = [use for _, use in effects]
        via = tuple(dict.fromkeys(helper for use in uses for helper in use.via))
        through = f" via {' and '.join(f'{name}()' for name in via)}" if via else ""
        why = f"{how} in {function}(){through}"
        if sent:
            why += f", sent by the replica in {sender}()"
        sites = _sites([*uses, *sent])
        return Coverage("covered", how, function, via, sites, why)


def _effect(use: _Use, holder: Holder, role: Role) -> tuple[How | None, str | None] | None:
    """(how it covers, None) for a safe reset or rebuild; (None, why) for an unsafe one; None when the
    use neither covers nor harms (metadata, a dict iterated, an isinstance check)."""
    where = f"{use.function}()" if use.function else "the adaptor"
    fresh: How = "repaired" if role == "recv" else "rebuilt"
    name = holder.variable
    if use.kind == "rebind" and not use.element:
        if use.value_reads_holder:
            return None, f"{where} rebuilds {name} from its own unsafe data"
        if holder.importers:
            first = holder.importers[0]
            return None, (
                f"{where} rebinds {name}, but {first.file}:{first.line} imported it by name: that module keeps the "
                f"old object; empty or refresh it in place instead (.clear(), copy_)"
            )
        return ("reset" if use.empty else fresh), None
    if use.kind in ("rebind", "store"):
        if use.value_reads_holder:
            return None, f"{where} stores a value computed from {name}'s unsafe data"
        return fresh, None
    if use.kind == "augment":
        return None, f"{where} updates {name} in place (`+=` reads the unsafe tensor)"
    if use.kind == "method":
        if use.method in _RESETS:
            return "reset", None
        if use.method == "copy_":
            if use.value_reads_holder:
                return None, f"{where} copies {name} from its own unsafe data"
            return fresh, None
        if use.reads_data:
            return None, f"{where} calls {use.method}() on {name}, which reads the unsafe tensor; rebuild it from its metadata or copy_ fresh values in"
        return None
    if use.kind == "argument":
        tail = (use.callee or "").rpartition(".")[2]
        if tail in _COMMUNICATION_INTO:
            return None, f"{where} receives into {name} with {use.callee}(): communication does not make unsafe memory safe; receive into a fresh tensor and copy_ it in"
        if use.reads_data:
            return None, f"{where} passes {name} to {use.callee}(), which reads the unsafe tensor"
        return None
    if use.kind == "read" and use.reads_data:
        return None, f"{where} computes with {name}, reading the unsafe tensor"
    return None


# --- classification ----------------------------------------------------------------------------------


def _finding(holder: Holder) -> Finding:
    """The holder as a finding located at its definition, for classify() and the fixer."""
    expression = f"{holder.owner}.{holder.variable}" if holder.owner else holder.variable
    frame = _frame(holder.definition)
    traceback = Traceback(
        rank=None, source="audit", offset=0, frames=(frame,), exception_type="", message="", error_code=None,
        npu_rank=None, device=None, truncated=False, caused_by=None, chain_kind=None,
    )
    path = str(Path(holder.definition.file).resolve())
    return Finding(
        ranks=(), traceback=traceback, unsafe=traceback, culprit=frame,
        tensor=TensorRef(expression, holder.variable, holder.module, holder.owner), source_file=path, notes=(),
    )


def _cache_classification(holder: Holder, finding: Finding, context: RunContext) -> Classification:
    """A cache holds values computed from its arguments and computes them again when missing: scenario
    1 by its nature, fixed by emptying it. (The source heuristics would read every file naming the
    function, and names such as `forward` are everywhere.)"""
    cached = f"{holder.owner}.{holder.variable}" if holder.owner else holder.variable
    reason = (
        f"{cached} is a cache: what it returns is computed from its arguments and computed again once "
        "emptied, so it carries nothing into the next step; empty it with cache_clear() in the rollback"
    )
    evidence = (Evidence(holder.definition.file, holder.definition.line, f"decorated with a cache: `{holder.definition.code}`"),)
    cache = replace(finding, tensor=replace(finding.tensor, cached=True))
    return replace(classify_as(cache.subject, 1, context, evidence), confidence="medium", reason=reason)


def _rule_frame(rule: Rule, holder: Holder) -> Frame | None:
    """The frame a rule names, for a holder whose name, owner and module the rule names exactly.

    Some rules recognise a tensor by the frame a log shows reading it (`attention_mask_func` reads
    the cached causal mask): the audit knows the holder itself, so the frame is taken as given,
    placed under the holder's import root."""
    match = next(
        (
            block
            for block in rule.matches
            if block.variable == holder.variable
            and (block.file is not None or block.function is not None)
            and rule_matches(
                replace(rule, match=replace(block, file=None, function=None), also_match=()),
                holder.variable, holder.module, holder.owner, None, None,
            )
        ),
        None,
    )
    if match is None:
        return None
    definition = Path(holder.definition.file).resolve()
    file = str(definition)
    if match.file is not None:
        tail = match.file.removeprefix("*/")
        root = import_root(definition, holder.module)
        if _is_glob(tail) or root is None:
            return None
        file = str(root / tail)
    function = match.function if match.function and not _is_glob(match.function) else "<module>"
    return Frame(file, None, function, None)


def _is_glob(pattern: str) -> bool:
    return any(char in pattern for char in "*?[")


def _frame(site: Site) -> Frame:
    function = site.function.rpartition(".")[2] if site.function else "<module>"
    return Frame(str(Path(site.file).resolve()), site.line, function, site.code or None)


def _classification(
    holder: Holder, coverage: Coverage, context: RunContext
) -> tuple[Finding, Classification | None]:
    """Rules first, at the first site a rule names; heuristics only for an uncovered holder."""
    finding = _finding(holder)
    knowledge = context.knowledge
    candidates = [_frame(site) for site in (holder.definition, *holder.writers, *holder.readers)]
    candidates += [frame for frame in (_rule_frame(rule, holder) for rule in knowledge.rules) if frame is not None]
    frame = next(
        (
            candidate
            for candidate in candidates
            if any(
                rule_matches(rule, holder.variable, holder.module, holder.owner, candidate.file, candidate.function)
                for rule in knowledge.rules
            )
        ),
        None,
    )
    if frame is None and coverage.status != "uncovered":
        return finding, None
    if frame is None and holder.kind == "lru-cache":
        return finding, _cache_classification(holder, finding, context)
    if frame is not None and frame != finding.culprit:
        finding = replace(finding, culprit=frame)
    verdict = classify(finding.subject, context)
    generic = isinstance(verdict, Classified) and verdict.rule is None and isinstance(verdict.fix, FixPlan)
    if generic and holder.kind in ("singleton", "buffer"):
        note = (
            f"no fix written: the generic fixes handle a tensor, dict, list or lru cache, not a {holder.kind}; "
            "reset it by hand or add a rule (--rules)"
        )
        verdict = replace(verdict, fix=NoFix(note), notes=(*verdict.notes, note))
    return finding, verdict
