"""What `--function` and `--parameter` name: `role=name` items, parsed and checked."""

from __future__ import annotations

import keyword
from collections.abc import Iterable

from unsafe_doctor.adaptor.code import ROLES
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.rules import EVERY_ROLE
from unsafe_doctor.recovery_code.model import Role


def parameter_roles(specs: Iterable[str]) -> dict[str, list[str]]:
    """`role=name` items of `--parameter` (comma-separated or repeated) -> {role: parameter names}; a
    role given twice has alternatives (the send and the receive function's names for it).
    `knowledge.map_parameters` checks the roles and names."""
    mapping: dict[str, list[str]] = {}
    for spec in specs:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            role, equals, name = (part.strip() for part in item.partition("="))
            if not equals or role not in EVERY_ROLE:
                raise UsageError(f"--parameter {item!r}: write role=name, role one of {', '.join(EVERY_ROLE)}")
            mapping.setdefault(role, []).append(name)
    return mapping


def function_overrides(specs: Iterable[str]) -> dict[Role, str]:
    """`role=name` items (comma-separated or repeated) -> {role: function name}."""
    overrides: dict[Role, str] = {}
    for spec in specs:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            role, equals, name = (part.strip() for part in item.partition("="))
            if not equals or role not in ROLES:
                raise UsageError(f"--function {item!r}: write role=name, role one of {', '.join(ROLES)}")
            if not name.isidentifier() or keyword.iskeyword(name):
                raise UsageError(f"--function {item!r}: {name!r} is not a Python function name")
            if overrides.get(role, name) != name:
                raise UsageError(f"--function names two functions for {role}: {overrides[role]} and {name}")
            overrides[role] = name
    return overrides
