"""A fix's code written into one adaptor function, in that function's own names.

The rule's code names its roles (`train_args`, `src_ranks`), the profile's repair group
(`get_repair_group()`) and what its imports bind (`torch`, `TopKRouter`). Written into a function:

* each role becomes the function's parameter for it (`send_rank_repair_args.src_ranks`);
* the repair group becomes the function's own: a `--parameter group`, a parameter named like one
  (`group`, `repair_group`), a local it binds to
  `get_repair_group()` or `new_group(...)` before the block, else the getter the file imports; the
  profile's import only when the file has none;
* an imported name the file binds at module level is read from there (`torch`, `dist` for
  `torch.distributed`) and not imported again; what the file lacks is imported in the block, which
  makes it local to the function, so a name the function reads otherwise gets another name;
* a name the block assigns that the function still needs (`kept`) gets another name too.

Nothing here reads or writes files: `fix` hands in what it parsed.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable
from dataclasses import dataclass

import libcst as cst

from unsafe_doctor.adaptor.code import INDENT, AdaptorFunction, Site
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.rules import (
    DEST_RANK,
    GROUP_PARAMETERS,
    PARAMETER_ROLES,
    SOURCE_RANK,
    AdaptorProfile,
    role_parameter,
)
from unsafe_doctor.source.syntax import import_bindings

GETTER_NAMES = frozenset({"get_repair_group", "new_group"})  # calls whose result a function keeps as its repair group
PAIR_LOOP_NAMES = ("dict", "zip")  # builtins the rank loop reads


@dataclass(frozen=True)
class Rendered:
    lines: list[str]  # template indentation (four spaces a level), no markers
    notes: tuple[str, ...]
    group: str | None  # the function's parameter or local the block uses as its repair group


def render(
    code: str, imports: tuple[str, ...], scenario: int, site: Site, profile: AdaptorProfile, group: str | None, what: str
) -> Rendered:
    """`what` names the block in refusals (its marker key)."""
    notes: list[str] = []
    tree = _parse(code, imports, what)
    needed = _needed(imports)
    own_group: str | None = None
    if scenario == 2:
        expression, own_group, note = _group(site, profile, group)
        if expression != profile.repair_group:
            tree = _replace_expression(tree, profile.repair_group, expression)
            needed = {name: target for name, target in needed.items() if not _is_group_import(name, target, profile)}
        if note:
            notes.append(note)
    tree = _roles(tree, site.function, profile, what)
    body = tree.code.rstrip("\n").split("\n")
    if scenario == 2:
        body = _rank_loop(body, site, profile)
        tree = cst.parse_module("\n".join(body) + "\n")
    tree, needed = _from_file(tree, needed, site)
    tree, import_lines = _imports(tree, needed, site)
    tree = _own_locals(tree, site, set(needed) | _names_outside(site, profile))
    lines = [*import_lines, *tree.code.rstrip("\n").split("\n")]
    return Rendered(lines, tuple(notes), own_group)


def _parse(code: str, imports: Iterable[str], what: str) -> cst.Module:
    try:
        ast.parse("\n".join([*imports, code]))
        return cst.parse_module(code)
    except (SyntaxError, cst.ParserSyntaxError) as error:
        raise UsageError(f"the fix {what} is not valid Python: {str(error).splitlines()[0]}") from None


def _needed(imports: Iterable[str]) -> dict[str, str]:
    """What each template import binds: name -> the dotted name it imports."""
    needed: dict[str, str] = {}
    for line in imports:
        statement = ast.parse(line).body[0]
        if not isinstance(statement, (ast.Import, ast.ImportFrom)):
            raise UsageError(f"{line!r} in a fix is not an import")
        if isinstance(statement, ast.Import):  # `import a.b.c` binds `a`, and loads a.b.c: keep the whole name
            needed.update({alias.asname or alias.name.split(".")[0]: alias.name for alias in statement.names})
        else:
            needed.update({name: imported.target for name, imported in import_bindings(statement, None).items()})
    return needed


def _is_group_import(name: str, target: str, profile: AdaptorProfile) -> bool:
    return any(_needed([line]).get(name) == target for line in profile.repair_group_imports)


# --- the repair group ------------------------------------------------------------------------------


def _group(site: Site, profile: AdaptorProfile, given: str | None) -> tuple[str, str | None, str | None]:
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
    wanted = _needed(profile.repair_group_imports).get(getter_name)
    bound = site.module.local_for(wanted) if wanted else None
    if bound is None:  # the same getter imported from another generation's module
        bound = next((name for name, target in site.module.imports.items() if target.endswith("." + getter_name)), None)
    if bound is not None and bound not in site.names.assigned:
        expression = bound + profile.repair_group[len(getter_name):]
        source = site.module.imports[bound]
        return expression, None, f"the block gets its repair group from {bound}(), which the file imports from {source}"
    imported = "; ".join(profile.repair_group_imports)
    return profile.repair_group, None, (
        f"the file imports no repair-group getter: the block imports it ({imported}), as adaptor profile {profile.id} has it"
    )


def _group_local(site: Site) -> str | None:
    """The last local the function binds, before the block, to `get_repair_group(...)` or `new_group(...)`."""
    found = None
    for name, value in site.names.locals_before.items():
        if isinstance(value, ast.Call):
            callee = value.func
            called = callee.id if isinstance(callee, ast.Name) else callee.attr if isinstance(callee, ast.Attribute) else None
            if called in GETTER_NAMES:
                found = name
    return found


def _replace_expression(tree: cst.Module, expression: str, replacement: str) -> cst.Module:
    wanted = cst.parse_expression(expression)
    new = cst.parse_expression(replacement)

    class Replacer(cst.CSTTransformer):
        def on_leave(self, original_node, updated_node):
            if isinstance(original_node, cst.BaseExpression) and original_node.deep_equals(wanted):
                return new
            return updated_node

    return tree.visit(Replacer())


# --- roles and ranks -------------------------------------------------------------------------------


def _roles(tree: cst.Module, function: AdaptorFunction, profile: AdaptorProfile, what: str) -> cst.Module:
    """Each role the code reads (`train_args`) replaced by the function's parameter for it."""
    read = _names_read(tree)
    mapping = {}
    for role in PARAMETER_ROLES:
        if role in read:
            mapping[role] = _parameter(profile, role, function, what)
    return _rename(tree, {role: name for role, name in mapping.items() if name != role})


def _parameter(profile: AdaptorProfile, role: str, function: AdaptorFunction, what: str) -> str:
    name = role_parameter(profile, role, function.parameters)  # type: ignore[arg-type]
    if name is None or name.split(".")[0] not in function.parameters:
        has = ", ".join(sorted(function.parameters)) or "no parameters"
        raise UsageError(
            f"{function.path}:{function.first_line}: {function.name}() has no parameter for {role}, which {what} needs "
            f"(adaptor profile {profile.id}); it has {has}: name it with --parameter {role}=NAME"
        )
    return name


def _rank_loop(body: list[str], site: Site, profile: AdaptorProfile) -> list[str]:
    """The code inside a loop over the (source, destination) pairs: list-valued rank parameters hold one
    entry per (source, destination, optimizer index), so each pair once, in first-seen order (the
    same on both sides, which receive the same lists); plain rank parameters are the ranks."""
    source = _parameter(profile, "src_ranks", site.function, "a replica copy")
    destination = _parameter(profile, "dest_ranks", site.function, "a replica copy")
    if not profile.ranks_are_lists:
        tree = _rename(cst.parse_module("\n".join(body) + "\n"), {SOURCE_RANK: source, DEST_RANK: destination})
        return tree.code.rstrip("\n").split("\n")
    shadowed = [name for name in PAIR_LOOP_NAMES if name in site.module.bound or name in site.names.assigned]
    if shadowed:
        raise UsageError(f"{site.function.path}: the file binds {', '.join(shadowed)}, which the block's rank loop reads "
                         "as the builtin: refusing to write it")
    loop = f"for {SOURCE_RANK}, {DEST_RANK} in dict.fromkeys(zip({source}, {destination})):  # each pair once, not per optimizer"
    return [loop, *(INDENT + line if line.strip() else "" for line in body)]


# --- names from the file, imports, the block's own locals ------------------------------------------


def _from_file(tree: cst.Module, needed: dict[str, str], site: Site) -> tuple[cst.Module, dict[str, str]]:
    """Every dotted name the code reads through an import, read from the file's module-level name for
    its longest part the file binds (`torch.distributed.send` -> `dist.send`); the imports still read."""
    module, assigned = site.module, site.names.assigned

    def bound(dotted: str) -> str | None:
        name = module.local_for(dotted)
        return name if name is not None and name not in assigned else None

    class FromFile(cst.CSTTransformer):
        def leave_Attribute(self, original_node, updated_node):
            dotted = _dotted(original_node)
            if dotted is not None and dotted.split(".")[0] in needed:
                root, _, rest = dotted.partition(".")
                local = bound(f"{needed[root]}.{rest}")
                if local is not None:
                    return cst.Name(local)
            return updated_node.with_changes(attr=original_node.attr)

        def leave_Name(self, original_node, updated_node):
            target = needed.get(original_node.value)
            local = bound(target) if target is not None else None
            return cst.Name(local) if local is not None else updated_node

        def leave_Arg(self, original_node, updated_node):
            return updated_node.with_changes(keyword=original_node.keyword)

    tree = tree.visit(FromFile())
    read = _names_read(tree)
    return tree, {name: target for name, target in needed.items() if name in read and bound(target) is None}


def _imports(tree: cst.Module, needed: dict[str, str], site: Site) -> tuple[cst.Module, list[str]]:
    """An import line for each name the file does not bind; one the function reads or keeps otherwise is
    imported under another name (`as torch_`), since an import in a function binds a local."""
    lines, renamed = [], {}
    for name, target in needed.items():
        alias = _free_name(name, site) if name in site.names.assigned or name in site.names.kept else name
        module, _, last = target.rpartition(".")
        if alias != name:
            renamed[name] = alias
        if name == target.split(".")[0] and ("." not in target or alias == name):
            lines.append(f"import {target}" + (f" as {alias}" if alias != name else ""))
        elif module and last == name:
            lines.append(f"from {module} import {last}" + (f" as {alias}" if alias != name else ""))
        else:
            lines.append(f"import {target} as {alias}")
    return _rename(tree, renamed), lines


def _own_locals(tree: cst.Module, site: Site, outside: set[str]) -> cst.Module:
    """The names the block assigns, renamed where the function still needs them."""
    nodes = ast.walk(ast.parse(tree.code))
    assigned = {node.id for node in nodes if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)}
    renamed = {name: _free_name(name, site, outside) for name in assigned if name in site.names.kept or name in outside}
    return _rename(tree, renamed)


def _names_outside(site: Site, profile: AdaptorProfile) -> set[str]:
    """Names the block reads from the function and its file: the block must not assign them."""
    return set(site.function.parameters) | set(site.module.bound) - set(PARAMETER_ROLES)


def _free_name(name: str, site: Site, also: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    taken = site.names.assigned | site.names.kept | site.module.bound | also | set(dir(builtins))
    candidate = name + "_"
    while candidate in taken:
        candidate += "_"
    return candidate


# --- libcst helpers --------------------------------------------------------------------------------


def _names_read(tree: cst.Module) -> set[str]:
    return {node.id for node in ast.walk(ast.parse(tree.code)) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def _dotted(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr.value}" if base is not None else None
    return None


def _rename(tree: cst.Module, mapping: dict[str, str]) -> cst.Module:
    """Names (not attributes, not keywords) renamed; a value may be an expression (`args.src_ranks`)."""
    if not mapping:
        return tree

    class Renamer(cst.CSTTransformer):
        def leave_Name(self, original_node, updated_node):
            new = mapping.get(original_node.value)
            return cst.parse_expression(new) if new is not None else updated_node

        def leave_Attribute(self, original_node, updated_node):
            return updated_node.with_changes(attr=original_node.attr)

        def leave_Arg(self, original_node, updated_node):
            return updated_node.with_changes(keyword=original_node.keyword)

    return tree.visit(Renamer())
