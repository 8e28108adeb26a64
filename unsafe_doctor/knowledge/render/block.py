"""A fix's code written into one adaptor function, in that function's own names, between its markers.

The rule's code (`template.render_fix`) names its roles (`train_args`, `src_ranks`), the profile's repair group
(`get_repair_group()`) and what its imports bind (`torch`, `TopKRouter`). Written into a function:

* each role becomes the function's parameter for it (`send_rank_repair_args.src_ranks`);
* the repair group becomes the function's own: a `--parameter group`, a parameter named like one
  (`group`, `repair_group`), a local it binds to
  `get_repair_group()` or `new_group(...)` before the block, else the getter the file imports; the
  profile's import only when the file has none;
* an imported name the file binds at module level is read from there (`torch`, `dist` for
  `torch.distributed`) and not imported again; what the file lacks is imported in the block, which
  makes it local to the function, so a name the function reads otherwise gets another name;
* a name the block assigns that the function still needs (`kept`) gets another name too;
* the lines go between the block's markers, after its comment, at the function's indentation
  (`marked_block`).

The code is edited as text, where `ast` places the names and expressions to replace, so that the
rule's own layout and comments stay as written. Nothing here reads or writes files: `adaptor`
hands in the function it parsed, as a `Place` (what this module reads of it, declared here so that
the knowledge stage names nothing of the adaptor's).
"""

from __future__ import annotations

import ast
import builtins
import io
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.render.template import INDENT
from unsafe_doctor.knowledge.rules import (
    DEST_RANK,
    GROUP_PARAMETERS,
    PARAMETER_ROLES,
    SOURCE_RANK,
    AdaptorProfile,
    role_parameter,
)
from unsafe_doctor.source.imports import through_imports
from unsafe_doctor.source.markers import MARKER_BEGIN, MARKER_END
from unsafe_doctor.source.syntax import import_bindings

GETTER_NAMES = frozenset({"get_repair_group", "new_group"})  # calls whose result a function keeps as its repair group
PAIR_LOOP_NAMES = ("dict", "zip")  # builtins the rank loop reads


class PlaceFunction(Protocol):
    """The adaptor function a block goes into (`adaptor.code.AdaptorFunction`)."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> Path: ...

    @property
    def first_line(self) -> int: ...  # 1-based, the `def` line

    @property
    def parameters(self) -> frozenset[str]: ...

    @property
    def indent(self) -> str: ...  # the body's indentation

    @property
    def unit(self) -> str: ...  # one indentation level of this function


class PlaceModule(Protocol):
    """What the function's file binds at module level (`adaptor.own_names.ModuleNames`)."""

    @property
    def bound(self) -> frozenset[str]: ...

    @property
    def imports(self) -> Mapping[str, str]: ...  # name -> what it imports

    def local_for(self, target: str) -> str | None: ...


class PlaceNames(Protocol):
    """What the function binds (`adaptor.own_names.FunctionNames`)."""

    @property
    def assigned(self) -> frozenset[str]: ...

    @property
    def locals_before(self) -> Mapping[str, ast.expr]: ...

    @property
    def kept(self) -> frozenset[str]: ...


class Place(Protocol):
    """Where a block goes: the function, with what it and its file bind."""

    @property
    def function(self) -> PlaceFunction: ...

    @property
    def module(self) -> PlaceModule: ...

    @property
    def names(self) -> PlaceNames: ...


@dataclass(frozen=True)
class Rendered:
    lines: list[str]  # template indentation (four spaces a level), no markers
    notes: tuple[str, ...]
    group: str | None  # the function's parameter or local the block uses as its repair group


def render(
    code: str,
    imports: tuple[str, ...],
    scenario: int,
    site: Place,
    profile: AdaptorProfile,
    *,
    group: str | None,
    what: str,
    per_pair: bool = True,
) -> Rendered:
    """`what` names the block in refusals (its marker key); `per_pair` False: scenario-2 code that
    takes the rank lists whole (heal's block), not once per (source, destination) pair."""
    notes: list[str] = []
    _parse(code, imports, what)
    needed, from_imported = _needed(imports)
    own_group: str | None = None
    if scenario == 2:
        expression, own_group, note = _group(site, profile, group)
        if expression != profile.repair_group:
            code = _replace_expression(code, profile.repair_group, expression)
            needed = {name: target for name, target in needed.items() if not _is_group_import(name, target, profile)}
        if note:
            notes.append(note)
    code = _roles(code, site.function, profile, what)
    if scenario == 2 and per_pair:
        code = "\n".join(_rank_loop(code.rstrip("\n").split("\n"), site, profile)) + "\n"
    code, needed = _from_file(code, needed, site)
    code, import_lines = _imports(code, needed, from_imported, site)
    code = _own_locals(code, site, set(needed) | _names_outside(site, profile))
    lines = [*import_lines, *code.rstrip("\n").split("\n")]
    return Rendered(lines, tuple(notes), own_group)


def _parse(code: str, imports: Iterable[str], what: str) -> None:
    try:
        ast.parse("\n".join([*imports, code]))
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise UsageError(f"the fix {what} is not valid Python: {str(error).splitlines()[0]}") from None


def _needed(imports: Iterable[str]) -> tuple[dict[str, str], frozenset[str]]:
    """What each template import binds (name -> the dotted name it imports), and the names it binds
    with `from M import NAME`: written back in that form, as `NAME` may be a variable of M, which
    `import M.NAME` cannot import."""
    needed: dict[str, str] = {}
    from_imported: set[str] = set()
    for line in imports:
        statement = ast.parse(line).body[0]
        if not isinstance(statement, (ast.Import, ast.ImportFrom)):
            raise UsageError(f"{line!r} in a fix is not an import")
        if isinstance(statement, ast.Import):  # `import a.b.c` binds `a`, and loads a.b.c: keep the whole name
            needed.update({alias.asname or alias.name.split(".")[0]: alias.name for alias in statement.names})
        else:
            bound = import_bindings(statement, None)
            needed.update({name: imported.target for name, imported in bound.items()})
            from_imported.update(bound)
    return needed, frozenset(from_imported)


def _is_group_import(name: str, target: str, profile: AdaptorProfile) -> bool:
    return any(_needed([line])[0].get(name) == target for line in profile.repair_group_imports)


# --- the repair group ------------------------------------------------------------------------------


def _group(site: Place, profile: AdaptorProfile, given: str | None) -> tuple[str, str | None, str | None]:
    """(the expression the block uses, the function's name for it if any, a note saying where it came from)."""
    function = site.function
    if given is not None:
        if given not in function.parameters:
            where = f"{function.path}:{function.first_line}"
            raise UsageError(f"{where}: {function.name}() has no parameter {given} (--parameter group=...)")
        return given, given, None
    if profile.repair_group in function.parameters:
        return profile.repair_group, profile.repair_group, None
    parameter = next((name for name in GROUP_PARAMETERS if name in function.parameters), None)
    if parameter is not None:
        return parameter, parameter, f"{function.name}() takes its repair group as {parameter}: the block uses it"
    local = _group_local(site)
    if local is not None:
        return local, local, f"{function.name}() keeps its repair group in {local}: the block uses it"
    getter_name = profile.repair_group.split("(")[0]
    wanted = _needed(profile.repair_group_imports)[0].get(getter_name)
    bound = site.module.local_for(wanted) if wanted else None
    if bound is None:  # the same getter imported from another generation's module
        bound = next((name for name, target in site.module.imports.items() if target.endswith("." + getter_name)), None)
    if bound is not None and bound not in site.names.assigned:
        expression = bound + profile.repair_group[len(getter_name) :]
        source = site.module.imports[bound]
        return expression, None, f"the block gets its repair group from {bound}(), which the file imports from {source}"
    imported = "; ".join(profile.repair_group_imports)
    return (
        profile.repair_group,
        None,
        (f"the file imports no repair-group getter: the block imports it ({imported}), as adaptor profile {profile.id} has it"),
    )


def _group_local(site: Place) -> str | None:
    """The last local the function binds, before the block, to `get_repair_group(...)` or `new_group(...)`."""
    found = None
    for name, value in site.names.locals_before.items():
        if isinstance(value, ast.Call):
            callee = value.func
            called = callee.id if isinstance(callee, ast.Name) else callee.attr if isinstance(callee, ast.Attribute) else None
            if called in GETTER_NAMES:
                found = name
    return found


def _replace_expression(code: str, expression: str, replacement: str) -> str:
    """Every occurrence of the expression (the same tree: `get_repair_group()`) replaced."""
    wanted = ast.dump(ast.parse(expression, mode="eval").body)

    def found(node: ast.AST) -> Iterator[ast.expr]:
        if isinstance(node, ast.expr) and ast.dump(node) == wanted:
            yield node
            return
        for child in ast.iter_child_nodes(node):
            yield from found(child)

    return _edited(code, [(_span(node), replacement) for node in found(ast.parse(code))])


# --- roles and ranks -------------------------------------------------------------------------------


def _roles(code: str, function: PlaceFunction, profile: AdaptorProfile, what: str) -> str:
    """Each role the code reads (`train_args`) replaced by the function's parameter for it."""
    read = _names_read(code)
    mapping = {}
    for role in PARAMETER_ROLES:
        if role in read:
            mapping[role] = _parameter(profile, role, function, what)
    return _rename(code, {role: name for role, name in mapping.items() if name != role})


def _parameter(profile: AdaptorProfile, role: str, function: PlaceFunction, what: str) -> str:
    name = role_parameter(profile, role, function.parameters)  # type: ignore[arg-type]
    if name is None or name.split(".")[0] not in function.parameters:
        has = ", ".join(sorted(function.parameters)) or "no parameters"
        raise UsageError(
            f"{function.path}:{function.first_line}: {function.name}() has no parameter for {role}, which {what} needs "
            f"(adaptor profile {profile.id}); it has {has}: name it with --parameter {role}=NAME"
        )
    return name


def _rank_loop(body: list[str], site: Place, profile: AdaptorProfile) -> list[str]:
    """The code inside a loop over the (source, destination) pairs: list-valued rank parameters hold one
    entry per (source, destination, optimizer index), so each pair once, in first-seen order (the
    same on both sides, which receive the same lists); plain rank parameters are the ranks."""
    source = _parameter(profile, "src_ranks", site.function, "a replica copy")
    destination = _parameter(profile, "dest_ranks", site.function, "a replica copy")
    if not profile.ranks_are_lists:
        return _rename("\n".join(body) + "\n", {SOURCE_RANK: source, DEST_RANK: destination}).rstrip("\n").split("\n")
    shadowed = [name for name in PAIR_LOOP_NAMES if name in site.module.bound or name in site.names.assigned]
    if shadowed:
        raise UsageError(
            f"{site.function.path}: the file binds {', '.join(shadowed)}, which the block's rank loop reads "
            "as the builtin: refusing to write it"
        )
    guard, inner = _outer_guard(body)
    read = _names_read("\n".join(inner) + "\n")
    pair = ", ".join(name if name in read else "_" + name for name in (SOURCE_RANK, DEST_RANK))  # one side reads one
    loop = [f"for {pair} in dict.fromkeys(zip({source}, {destination})):  # each pair once, not per optimizer", *_indented(inner)]
    return [guard, *_indented(loop)] if guard is not None else loop


def _outer_guard(body: list[str]) -> tuple[str | None, list[str]]:
    """(`if GUARD:`, what it holds, dedented) when the code is one `if` on one line with no `else`
    that reads no rank (a rule's conditions): checked once, outside the loop over the ranks; else
    (None, the code)."""
    statements = ast.parse("\n".join(body) + "\n").body
    if len(statements) != 1 or not isinstance(statements[0], ast.If) or statements[0].orelse:
        return None, body
    test = statements[0].test
    if test.lineno != 1 or test.end_lineno != 1 or {SOURCE_RANK, DEST_RANK} & _names_read(ast.unparse(test)):
        return None, body
    if not all(line.startswith(INDENT) or not line.strip() for line in body[1:]):
        return None, body
    return body[0], [line[len(INDENT) :] for line in body[1:]]


def _indented(lines: list[str]) -> list[str]:
    return [INDENT + line if line.strip() else "" for line in lines]


# --- names from the file, imports, the block's own locals ------------------------------------------


def _from_file(code: str, needed: dict[str, str], site: Place) -> tuple[str, dict[str, str]]:
    """Every dotted name the code reads through an import, read from the file's module-level name for
    its longest part the file binds (`torch.distributed.send` -> `dist.send`); the imports still read."""
    module, assigned = site.module, site.names.assigned

    def bound(dotted: str) -> str | None:
        name = module.local_for(dotted)
        return name if name is not None and name not in assigned else None

    def read_through_import(node: ast.Name | ast.Attribute) -> str | None:
        dotted = through_imports(node, needed.get)
        return bound(dotted) if dotted is not None else None

    def replaced(node: ast.AST) -> Iterator[tuple[_Span, str]]:
        if isinstance(node, (ast.Name, ast.Attribute)):
            local = read_through_import(node)
            if local is not None:
                yield _span(node), local
                return
        for child in ast.iter_child_nodes(node):
            yield from replaced(child)

    code = _edited(code, list(replaced(ast.parse(code))))
    read = _names_read(code)
    return code, {name: target for name, target in needed.items() if name in read and bound(target) is None}


def _imports(code: str, needed: dict[str, str], from_imported: frozenset[str], site: Place) -> tuple[str, list[str]]:
    """An import line for each name the file does not bind, in the template's form (`from M import
    NAME` or `import M`); one the function reads or keeps otherwise is imported under another name
    (`as torch_`), since an import in a function binds a local."""
    lines, renamed = [], {}
    for name, target in needed.items():
        alias = _free_name(name, site) if name in site.names.assigned or name in site.names.kept else name
        module, _, last = target.rpartition(".")
        if alias != name:
            renamed[name] = alias
        if name in from_imported and module:
            lines.append(f"from {module} import {last}" + (f" as {alias}" if alias != last else ""))
        elif name == target.split(".")[0] and ("." not in target or alias == name):
            lines.append(f"import {target}" + (f" as {alias}" if alias != name else ""))
        else:
            if name == target.split(".")[0]:  # `import a.b as a_` binds a.b: `a.b.x` is read as `a_.x`
                code = _replace_expression(code, target, alias)
            lines.append(f"import {target} as {alias}")
    return _rename(code, renamed), lines


def _own_locals(code: str, site: Place, outside: set[str]) -> str:
    """The names the block assigns, renamed where the function still needs them."""
    nodes = ast.walk(ast.parse(code))
    assigned = {node.id for node in nodes if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)}
    renamed = {name: _free_name(name, site, outside) for name in assigned if name in site.names.kept or name in outside}
    return _rename(code, renamed)


def _names_outside(site: Place, profile: AdaptorProfile) -> set[str]:
    """Names the block reads from the function and its file: the block must not assign them."""
    return set(site.function.parameters) | set(site.module.bound) - set(PARAMETER_ROLES)


def _free_name(name: str, site: Place, also: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    taken = site.names.assigned | site.names.kept | site.module.bound | also | set(dir(builtins))
    candidate = name + "_"
    while candidate in taken:
        candidate += "_"
    return candidate


# --- editing the code where ast places it ----------------------------------------------------------


def _names_read(code: str) -> set[str]:
    return {node.id for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def _rename(code: str, mapping: dict[str, str]) -> str:
    """Names (not attributes, not keywords) renamed, a lambda's parameters too; a value may be an
    expression (`args.src_ranks`)."""
    if not mapping:
        return code
    edits: list[tuple[_Span, str]] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name) and node.id in mapping:
            edits.append((_span(node), mapping[node.id]))
        elif isinstance(node, ast.arg) and node.arg in mapping:
            edits.append(
                (_Span(node.lineno, node.col_offset, node.lineno, node.col_offset + len(node.arg.encode())), mapping[node.arg])
            )
    return _edited(code, edits)


@dataclass(frozen=True)
class _Span:
    """Where a part of a node is: ast's positions (1-based lines, UTF-8 byte columns)."""

    lineno: int
    col_offset: int
    end_lineno: int
    end_col_offset: int


def _span(node: ast.expr | ast.stmt) -> _Span:
    assert node.end_lineno is not None and node.end_col_offset is not None, "ast.parse places every node it makes"
    return _Span(node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)


def _edited(code: str, edits: list[tuple[_Span, str]]) -> str:
    """The code with each node's text replaced; the nodes do not overlap."""
    lines = io.StringIO(code, newline="").readlines()  # split where Python counts lines, not at \x0c or U+2028
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(line: int, column: int) -> int:  # ast's byte column -> index into `code`
        return starts[line - 1] + len(lines[line - 1].encode()[:column].decode())

    for span, text in sorted(edits, key=lambda edit: (edit[0].lineno, edit[0].col_offset), reverse=True):
        code = code[: offset(span.lineno, span.col_offset)] + text + code[offset(span.end_lineno, span.end_col_offset) :]
    return code


# --- the block between its markers ------------------------------------------------------------------


def marked_block(key: str, comment: str, body: Sequence[str], function: PlaceFunction) -> list[str]:
    """`body` (template indentation) between the markers of `key`, after a comment, indented for `function`."""
    lines = [MARKER_BEGIN + key, f"# {comment}", *body, MARKER_END + key]
    return [_reindent(line, function) for line in lines]


def _reindent(line: str, function: PlaceFunction) -> str:
    """Template indentation (four spaces a level) -> the function's own (tabs, two spaces, ...)."""
    if not line:
        return ""
    stripped = line.lstrip(" ")
    levels, rest = divmod(len(line) - len(stripped), len(INDENT))
    return function.indent + function.unit * levels + " " * rest + stripped
