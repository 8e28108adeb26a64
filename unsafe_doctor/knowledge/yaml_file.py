"""Reading one knowledge file: YAML that keeps its line numbers, checked against the JSON schema.

Every problem is one line, 'file:line: where: what is wrong'; building rules from the checked data
is `rules`' part.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from importlib import resources
from itertools import islice
from pathlib import Path
from typing import Any

import yaml


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]  # libyaml when PyYAML has it: 10x faster
    """The safe loader, with an integer longer than `int` converts (4,300 digits) a YAML error at its line."""


def _integer(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    try:
        return yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"an integer of {len(node.value)} characters is out of range", node.start_mark
        ) from None


_Loader.add_constructor("tag:yaml.org,2002:int", _integer)

MAX_FILE_BYTES = 4 << 20  # the shipped knowledge base is under 50 KB in all
MAX_EXPANDED_NODES = 200_000  # YAML nodes once aliases are expanded; the shipped files hold a few thousand
MAX_SCHEMA_PROBLEMS = 50  # schema problems reported per file
MAX_PROBLEM_CHARS = 400  # jsonschema quotes the whole offending value
CONDITION_FORMS = (
    "a condition gives one of a switch, an any_of list of switches (each with its default) or a guard (and its imports)"
)

_SCHEMA: dict[str, Any] | None = None


def _schema() -> dict[str, Any]:
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = json.loads((resources.files("unsafe_doctor.knowledge") / "knowledge.schema.json").read_text())
    return _SCHEMA


def parse(path: Path, problems: list[str], *, bound_aliases: bool = True) -> tuple[yaml.Node, Any] | None:
    text = _read(path, problems)
    if text is None:
        return None
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if bound_aliases and node is not None and (refused := _alias_bomb(node)):
                problems.append(f"{path}:1: {refused}")
                return None
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problems.append(f"{path}{line}: invalid YAML: {getattr(error, 'problem', None) or error}")
        return None
    if node is None:
        problems.append(f"{path}:1: empty knowledge file")
        return None
    return node, data


def _read(path: Path, problems: list[str]) -> str | None:
    """The file's text; a FIFO (opened without waiting for a writer) or a file too large to be rules
    is refused before it is read."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as handle:
            status = os.fstat(handle.fileno())
            if not stat.S_ISREG(status.st_mode):
                problems.append(f"{path}: cannot read (not a regular file)")
                return None
            data = handle.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            problems.append(f"{path}: cannot read (larger than {MAX_FILE_BYTES >> 20} MB: not a knowledge file)")
            return None
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        problems.append(f"{path}: cannot read ({error})")
        return None


def _alias_bomb(root: yaml.Node) -> str | None:
    """Why the document is refused, when its aliases would expand it past MAX_EXPANDED_NODES (a
    few hundred bytes of nested aliases make billions) or make it contain itself; None when fine.
    Counted on the composed nodes, where an alias is still one shared node."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        children = _children(node)
        if finished:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[key] > MAX_EXPANDED_NODES:
                return f"aliases expand this file past {MAX_EXPANDED_NODES:,} YAML nodes: refused before expanding them"
        elif key in open_nodes:
            return "an alias refers to a node that contains it: refused"
        elif key not in sizes:
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children)
    return None


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def schema_problems(path: Path, node: yaml.Node, data: Any) -> list[str]:
    """At most MAX_SCHEMA_PROBLEMS lines, each at most MAX_PROBLEM_CHARS long: a wrong file must not
    print megabytes."""
    import jsonschema  # imported here: loading only the shipped, already-checked files needs none

    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(islice(validator.iter_errors(data), MAX_SCHEMA_PROBLEMS + 1), key=lambda e: list(map(str, e.absolute_path)))
    problems = [
        _shortened(
            f"{path}:{line_of(node, error.absolute_path)}: "
            f"{'.'.join(str(part) for part in error.absolute_path) or 'top level'}: {_best_message(error)}"
        )
        for error in errors[:MAX_SCHEMA_PROBLEMS]
    ]
    if len(errors) > MAX_SCHEMA_PROBLEMS:
        problems.append(f"{path}: more schema problems not shown (fix these first)")
    return problems


def _shortened(problem: str) -> str:
    return problem if len(problem) <= MAX_PROBLEM_CHARS else problem[: MAX_PROBLEM_CHARS - 1] + "…"


def _best_message(error: Any) -> str:
    """jsonschema's message for anyOf/oneOf is the whole instance; the deepest cause says more."""
    if error.context:
        deepest = max(error.context, key=lambda e: len(e.absolute_path))
        return deepest.message
    if error.message.startswith("False schema does not allow"):
        return CONDITION_FORMS  # the schema's only `false` subschemas keep a condition's two forms apart
    return error.message


def line_of(node: yaml.Node, path: Iterable[Any]) -> int:
    """1-based line of the YAML node at a JSON path; the nearest existing parent when it is absent."""
    for part in path:
        if isinstance(node, yaml.MappingNode):
            child = next((value for key, value in node.value if key.value == str(part)), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
        else:
            child = None
        if child is None:
            break
        node = child
    return node.start_mark.line + 1
