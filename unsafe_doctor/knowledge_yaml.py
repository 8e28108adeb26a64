"""Reading one knowledge file: YAML that keeps its line numbers, checked against the JSON schema.

Every problem is one line, 'file:line: where: what is wrong'; building rules from the checked data
is `knowledge`'s part.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML has it: 10x faster
CONDITION_FORMS = "a condition gives either a switch (and its default) or a guard (and its imports), not both"

_SCHEMA: dict[str, Any] | None = None


def _schema() -> dict[str, Any]:
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = json.loads((resources.files("unsafe_doctor") / "schemas" / "knowledge.schema.json").read_text())
    return _SCHEMA


def parse(path: Path, problems: list[str]) -> tuple[yaml.Node, Any] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        problems.append(f"{path}: cannot read ({error})")
        return None
    try:
        loader = SAFE_LOADER(text)
        try:
            node = loader.get_single_node()
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


def schema_problems(path: Path, node: yaml.Node, data: Any) -> list[str]:
    import jsonschema  # imported here: loading only the shipped, already-checked files needs none

    validator = jsonschema.Draft202012Validator(_schema())
    return [
        f"{path}:{line_of(node, error.absolute_path)}: "
        f"{'.'.join(str(part) for part in error.absolute_path) or 'top level'}: {_best_message(error)}"
        for error in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
    ]


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
