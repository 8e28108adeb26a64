"""Settings from a project's pyproject.toml `[tool.unsafe-doctor]` table, so a team writes its source
roots, adaptor and rules once instead of on every command line (and a CI step or pre-commit hook
runs a bare `unsafe-doctor audit`).

They reach the commands as click's `default_map`: click then ranks the command line first, an
`UNSAFE_DOCTOR_*` variable second, these settings third, the built-in default last.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unsafe_doctor.errors import UsageError

TABLE = "unsafe-doctor"


@dataclass(frozen=True)
class Settings:
    """The table's values, paths made absolute against the folder holding pyproject.toml."""

    file: Path
    source_roots: tuple[Path, ...] = ()
    adaptor: Path | None = None
    rules: tuple[Path, ...] = ()
    functions: tuple[str, ...] = ()  # ROLE=NAME, as --function takes them
    parameters: tuple[str, ...] = ()  # ROLE=NAME, as --parameter takes them


def find(start: Path) -> Settings | None:
    """The settings of the nearest pyproject.toml, from `start` up, that has a [tool.unsafe-doctor]
    table (one without it is passed over, as ruff does); None when there is none."""
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if os.path.isfile(candidate):  # False, not PermissionError, under a folder this user cannot enter
            table = _table(candidate)
            if table is not None:
                return _settings(candidate, table)
    return None


def _table(file: Path) -> dict[str, Any] | None:
    if sys.version_info >= (3, 11):  # loaded only where a pyproject.toml is found
        import tomllib
    else:
        import tomli as tomllib
    try:
        text = file.read_text(encoding="utf-8")
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError:  # a ValueError too: told below, not read again
            raise
        except ValueError:  # a number past int's digit limit
            document = _without_digit_limit(tomllib.loads, text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise UsageError(f"{file}: {error}") from None
    except RecursionError:
        raise UsageError(f"{file}: values nested too deep to read") from None
    tools = document.get("tool")
    table = tools.get(TABLE) if isinstance(tools, dict) else None  # `tool = "x"` holds no tool's table
    if table is not None and not isinstance(table, dict):
        raise UsageError(f"{file}: [tool.{TABLE}] must be a table")
    return table


def _without_digit_limit(loads: Callable[[str], dict[str, Any]], text: str) -> dict[str, Any]:
    """The document read without `int`'s 4,300-digit limit: tomllib reads every table, and another
    tool's huge number must not break every command run in the folder (the file is the project's
    own, and no key of ours takes a number)."""
    default = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return loads(text)
    finally:
        sys.set_int_max_str_digits(default)


def _settings(file: Path, table: dict[str, Any]) -> Settings:
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        import difflib  # only for a table with a mistake in it

        close = difflib.get_close_matches(unknown[0], _KEYS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"{file}: [tool.{TABLE}] has no key {unknown[0]!r} ({hint}keys: {', '.join(sorted(_KEYS))})")
    base = file.parent

    def paths(key: str) -> tuple[Path, ...]:
        return tuple(base / item for item in _strings(file, key, table.get(key, [])))

    adaptor = table.get("adaptor")
    if adaptor is not None and not isinstance(adaptor, str):
        raise UsageError(f"{file}: [tool.{TABLE}] adaptor must be a path (a string)")
    if adaptor is not None:
        _path_text(file, "adaptor", adaptor)
    return Settings(
        file=file,
        source_roots=paths("source-roots"),
        adaptor=base / adaptor if adaptor else None,
        rules=paths("rules"),
        functions=_roles(file, "functions", table.get("functions", {})),
        parameters=_roles(file, "parameters", table.get("parameters", {})),
    )


_KEYS = {"source-roots", "adaptor", "rules", "functions", "parameters"}


def _strings(file: Path, key: str, value: object) -> list[str]:
    if isinstance(value, str):
        return [_path_text(file, key, value)]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [_path_text(file, key, item) for item in value]
    raise UsageError(f"{file}: [tool.{TABLE}] {key} must be a string or a list of strings")


def _path_text(file: Path, key: str, value: str) -> str:
    """A value that names a file or a function: no NUL byte, which no file name or name can hold."""
    if "\0" in value:
        raise UsageError(f"{file}: [tool.{TABLE}] {key} holds a NUL byte (\\0)")
    return value


def _roles(file: Path, key: str, value: object) -> tuple[str, ...]:
    """`{rollback = "my_rollback", src_ranks = ["src", "peers"]}` -> ROLE=NAME items."""
    if not isinstance(value, dict):
        raise UsageError(f"{file}: [tool.{TABLE}] {key} must be a table of ROLE = NAME")
    return tuple(f"{role}={name}" for role, names in value.items() for name in _strings(file, f"{key}.{role}", names))


def default_map(settings: Settings) -> dict[str, Any]:
    """The settings as click's default_map: command name -> parameter name -> value. audit scans
    the source roots when given no paths; its adaptor is a string (`auto` or a file)."""
    located: dict[str, Any] = {}
    if settings.source_roots:
        located["source_root"] = list(settings.source_roots)
    if settings.adaptor is not None:
        located["adaptor"] = settings.adaptor
    if settings.rules:
        located["rules"] = list(settings.rules)
    adapting = dict(located)
    if settings.functions:
        adapting["function"] = list(settings.functions)
    if settings.parameters:
        adapting["parameter"] = list(settings.parameters)
    audit: dict[str, Any] = {}
    if settings.source_roots:
        audit["paths"] = list(settings.source_roots)
    if settings.adaptor is not None:
        audit["adaptor"] = str(settings.adaptor)
    if settings.rules:
        audit["rules"] = list(settings.rules)
    listing = {"rules": list(settings.rules)} if settings.rules else {}
    return {
        "diagnose": located,
        "fix": adapting,
        "verify": adapting,
        "audit": audit,
        "rules": {"list": listing, "show": dict(listing)},
        "sentinel": {"install": dict(adapting)},
    }
