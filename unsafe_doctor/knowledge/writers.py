"""Which run settings make the step write a rule's global: read from the frameworks' code, shipped as data.

A switch that allocates a global does not make the step fill it: Megatron's MoE aux-loss tracker is
written only by the router's load-balancing and z-loss code, so a run with
`--moe-router-load-balancing-type none` and no `--moe-z-loss-coeff` never records into it.
`scripts/derive_writers.py` reads every real release for the functions that store into each rule's
global, walks their callers back to the step (`forward`, `backward`, `step`), and records each call
path as the conjunction of the `if` tests on run settings around it (`self.config.X`, `args.X`, ...:
Megatron names its config fields after its arguments). `knowledge_base/writers.json` holds them,
per rule and release, with where each test and write is. A test the script cannot express is
`unknown`: it never decides.

What a path needs from an arguments dump is three-valued: a switch absent from the dump, or an
unknown test, decides nothing. A rule's global is unwritten when every path of every release the
job may have run is decided false.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from unsafe_doctor.knowledge.rules import is_on

WRITERS_FILE = "writers.json"
FORMAT = 1
Test = Literal["==", "!=", "in", "not in", "is None", "is not None", "true", "false"]
_NEGATED: dict[Test, Test] = {
    "==": "!=",
    "!=": "==",
    "in": "not in",
    "not in": "in",
    "is None": "is not None",
    "is not None": "is None",
    "true": "false",
    "false": "true",
}
Constant = str | int | float | bool | None


@dataclass(frozen=True)
class Leaf:
    """One test of one run setting: `switch` (the argument's name) `test` `value`."""

    switch: str
    test: Test
    value: Constant | tuple[Constant, ...] = None
    at: str = ""  # "path:line" of the test in the release


@dataclass(frozen=True)
class Unknown:
    """A test the derivation cannot express in run settings; it decides nothing."""

    text: str
    at: str = ""


@dataclass(frozen=True)
class AllOf:
    items: tuple[Guard, ...]


@dataclass(frozen=True)
class AnyOf:
    items: tuple[Guard, ...]


Guard = Leaf | Unknown | AllOf | AnyOf


@dataclass(frozen=True)
class WritePath:
    """One way the step reaches a write: all its guards must hold."""

    guards: tuple[Guard, ...]
    via: tuple[str, ...]  # "path:line function", from the write up to the step


@dataclass(frozen=True)
class ReleaseWriters:
    framework: str
    release: str
    paths: tuple[WritePath, ...]


def negated(guard: Guard) -> Guard:
    if isinstance(guard, Leaf):
        return Leaf(guard.switch, _NEGATED[guard.test], guard.value, guard.at)
    if isinstance(guard, AllOf):
        return AnyOf(tuple(map(negated, guard.items)))
    if isinstance(guard, AnyOf):
        return AllOf(tuple(map(negated, guard.items)))
    return guard


def decide(guard: Guard, printed: Mapping[str, str]) -> bool | None:
    """Whether the guard holds for the printed arguments; None when they do not tell."""
    if isinstance(guard, Unknown):
        return None
    if isinstance(guard, (AllOf, AnyOf)):
        found = {decide(item, printed) for item in guard.items}
        settled = isinstance(guard, AnyOf)  # the value that settles it: any true, or (all of) any false
        if settled in found:
            return settled
        return None if None in found else not settled
    value = printed.get(guard.switch)
    if value is None:
        return None
    return _holds(guard, value)


def _holds(leaf: Leaf, printed: str) -> bool:
    test = leaf.test
    if test in ("is None", "is not None"):
        return (printed == "None") == (test == "is None")
    if test in ("true", "false"):
        return is_on(printed) == (test == "true")
    choices = leaf.value if isinstance(leaf.value, tuple) else (leaf.value,)
    equal = any(_printed_as(printed, choice) for choice in choices)
    return equal == (test in ("==", "in"))


def _printed_as(printed: str, value: Constant) -> bool:
    """Whether `str(value)` would print as `printed` (numbers compared as numbers: 0 and 0.0)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(printed) == value
        except ValueError:
            return False
    return printed == str(value)


def deciding(guard: Guard, printed: Mapping[str, str]) -> list[Leaf]:
    """The leaves that make a false guard false (the first of an all, each of an any)."""
    if isinstance(guard, Leaf):
        return [guard] if decide(guard, printed) is False else []
    if isinstance(guard, AllOf):
        return next((deciding(item, printed) for item in guard.items if decide(item, printed) is False), [])
    if isinstance(guard, AnyOf):
        return [leaf for item in guard.items for leaf in deciding(item, printed)]
    return []


# --- the shipped data -------------------------------------------------------------------------------


def guard_from_json(data: dict[str, Any]) -> Guard:
    if "all" in data:
        return AllOf(tuple(map(guard_from_json, data["all"])))
    if "any" in data:
        return AnyOf(tuple(map(guard_from_json, data["any"])))
    if "unknown" in data:
        return Unknown(data["unknown"], data.get("at", ""))
    value = data.get("value")
    return Leaf(data["switch"], data["test"], tuple(value) if isinstance(value, list) else value, data.get("at", ""))


def guard_to_json(guard: Guard) -> dict[str, Any]:
    if isinstance(guard, AllOf):
        return {"all": [guard_to_json(item) for item in guard.items]}
    if isinstance(guard, AnyOf):
        return {"any": [guard_to_json(item) for item in guard.items]}
    if isinstance(guard, Unknown):
        return {"unknown": guard.text, "at": guard.at}
    found: dict[str, Any] = {"switch": guard.switch, "test": guard.test}
    if guard.test not in ("is None", "is not None", "true", "false"):
        found["value"] = list(guard.value) if isinstance(guard.value, tuple) else guard.value
    return {**found, "at": guard.at}


@dataclass(frozen=True)
class Writers:
    """The derived writers of the rules' globals: rule id -> the releases read, each with its paths."""

    rules: Mapping[str, tuple[ReleaseWriters, ...]]

    def unwritten(
        self,
        rule_id: str,
        versions: SpecifierSet | None,
        framework: str | None,
        printed: Mapping[str, str],
        releases: Mapping[str, tuple[Version, ...]],
    ) -> str | None:
        """Why the step writes nothing into the rule's global in this run, or None when a path may run.
        `releases`: framework -> the releases the job may have run (absent: every release read). Each
        release the job may have run must have been read, and each of the rule's own framework must
        show a path into the step; the other frameworks' paths (their patches call the same writers) count too."""
        read = self.rules.get(rule_id)
        if not read or framework is None:
            return None
        considered: list[ReleaseWriters] = []
        for name in dict.fromkeys(entry.framework for entry in read):
            entries = [entry for entry in read if entry.framework == name]
            wanted = releases.get(name)
            if wanted is not None:
                entries = [entry for entry in entries if _version(entry.release) in wanted]
                if len({entry.release for entry in entries}) < len(set(wanted)):
                    return None  # a release the job may have run was not read
            elif name == framework and versions is not None:
                entries = [
                    entry
                    for entry in entries
                    if (version := _version(entry.release)) and versions.contains(version, prereleases=True)
                ]
            considered.extend(entries)
        own = [entry for entry in considered if entry.framework == framework]
        if not own or any(not entry.paths for entry in own):
            return None  # no release read, or one whose step writes nothing seen: the allocation decides
        paths = [path for entry in considered for path in entry.paths]
        if any(decide(AllOf(path.guards), printed) is not False for path in paths):
            return None
        leaves = {leaf.switch: leaf for path in paths for guard in path.guards for leaf in deciding(guard, printed)}
        settings = " and ".join(f"{switch} is {printed[switch]}" for switch in sorted(leaves))
        newest = max(own, key=lambda entry: _version(entry.release) or Version("0"))
        where = ", ".join(
            dict.fromkeys(
                leaf.at for path in newest.paths for guard in path.guards for leaf in deciding(guard, printed) if leaf.at
            )
        )
        others = " or ".join(entry.release for entry in own if entry is not newest)
        where += f"; likewise {others}" if others else ""
        return f"{settings}: nothing the step runs writes it ({framework} {newest.release} {where})"


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def writers_from_json(data: dict[str, Any]) -> Writers:
    if data.get("format") != FORMAT:
        raise ValueError(f"{WRITERS_FILE}: format {data.get('format')!r}, this reader takes {FORMAT}")
    return Writers(_BuiltOnRead(data["rules"]))


class _BuiltOnRead(Mapping[str, tuple[ReleaseWriters, ...]]):
    """Each rule's releases built from the file's JSON when first read: a diagnose asks for the few rules
    its suspects name, and building all of them costs more than reading the file."""

    def __init__(self, rules: dict[str, list[dict[str, Any]]]):
        self._json = rules
        self._built: dict[str, tuple[ReleaseWriters, ...]] = {}

    def __getitem__(self, rule_id: str) -> tuple[ReleaseWriters, ...]:
        if rule_id not in self._built:
            self._built[rule_id] = tuple(
                ReleaseWriters(
                    entry["framework"],
                    entry["release"],
                    tuple(WritePath(tuple(map(guard_from_json, path["guards"])), tuple(path["via"])) for path in entry["paths"]),
                )
                for entry in self._json[rule_id]
            )
        return self._built[rule_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._json)

    def __len__(self) -> int:
        return len(self._json)


@cache
def load_writers(folder: Path) -> Writers:
    """The derived writers shipped in the knowledge folder; none when the file is not there."""
    path = folder / WRITERS_FILE
    if not path.is_file():
        return Writers({})
    return writers_from_json(json.loads(path.read_text(encoding="utf-8")))


def paths_json(paths: Iterable[WritePath]) -> list[dict[str, Any]]:
    return [{"guards": [guard_to_json(guard) for guard in path.guards], "via": list(path.via)} for path in paths]
