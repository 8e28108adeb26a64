"""Which megatron-core releases a job's arguments dump fits.

Megatron-LM's `_print_args` prints every attribute of the parsed arguments, so a dump holds every
`dest` its release's parser adds, and parsers add and drop names release by release
(`knowledge_base/index/megatron-core-arguments.json`, derived from each pinned release's own parser
by `scripts/derive_arguments.py`). A release's misfit is the count of its dests the dump lacks plus
the count of printed names that only other releases' parsers add; the releases of least misfit fit.
Names no release's parser adds (MindSpeed's and MindSpeed-LLM's own, the fields validate_args
derives) are no evidence either way, nor are names too long for the dump lines the input stage keeps
(`log.arguments.LONGEST_NAME_READ`: 41 characters and more, fewer than eight dots).

Thresholds, from the real parsers: consecutive releases with different parsers differ by 6 names
(0.17.0 to 0.17.1) to 131 (0.15.3 to 0.16.0), so one name decides; a real dump misses only the
options its parser adds behind an optional import (2 of 808 in 0.19: NVIDIA Kitchen's). A dump whose
best fit misses more than a tenth of that release's dests is cut short, or no Megatron-LM dump, and
decides nothing.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from functools import cache

from packaging.version import Version

from unsafe_doctor.log.arguments import LONGEST_NAME_READ
from unsafe_doctor.source.fingerprint import releases_shown
from unsafe_doctor.source.index import INDEX_FOLDER, index_folder

FRAMEWORK = "megatron-core"
ARGUMENTS_FILE = INDEX_FOLDER / "megatron-core-arguments.json"  # scripts/derive_arguments.py writes it
MOST_MISSING = 0.1  # of the best fit's dests: a dump missing more was cut short


@dataclass(frozen=True)
class DumpFit:
    """The releases the dump fits best, oldest first, and by how many names the next best fits worse."""

    releases: tuple[Version, ...]
    deciding: int

    def describe(self) -> str:
        """`megatron-core 0.18.0–0.18.2, from the arguments dump` (`0.12.3, 0.13.1` when not consecutive)."""
        shown = releases_shown([str(release) for release in self.releases], consecutive=_consecutive(self.releases))
        return f"{FRAMEWORK} {shown}, from the arguments dump"


@dataclass(frozen=True)
class NoDecision:
    """The dump is too partial to tell: its best fit lacks `missing` of that release's `dests`."""

    missing: int
    dests: int


@dataclass(frozen=True)
class _Parsers:
    releases: tuple[Version, ...]
    dests: tuple[frozenset[str], ...]  # per release, the names its parser adds
    known: frozenset[str]  # every name some release's parser adds


@cache
def _parsers() -> _Parsers:
    derived = json.loads((index_folder() / ARGUMENTS_FILE.name).read_text())
    releases = tuple(Version(entry["release"]) for entry in derived["releases"])
    dests: list[set[str]] = [set() for _ in releases]
    readable = {name: held for name, held in derived["arguments"].items() if len(name) <= LONGEST_NAME_READ}
    for name, held in readable.items():
        for index in held:
            dests[index].add(name)
    return _Parsers(releases, tuple(map(frozenset, dests)), frozenset(readable))


def _consecutive(releases: tuple[Version, ...]) -> bool:
    shipped = _parsers().releases
    first = shipped.index(releases[0])
    return releases == shipped[first : first + len(releases)]


def dump_releases(printed: Collection[str]) -> DumpFit | NoDecision:
    """The releases whose parser fits the dump's names best, or no decision for a dump cut short."""
    parsers = _parsers()
    evidence = parsers.known.intersection(printed)
    misfits = [(len(dests - evidence) + len(evidence - dests), len(dests - evidence), len(dests)) for dests in parsers.dests]
    best = min(misfit for misfit, _, _ in misfits)
    chosen = [index for index, (misfit, _, _) in enumerate(misfits) if misfit == best]
    _, missing, dests = misfits[chosen[-1]]
    if missing > MOST_MISSING * dests:
        return NoDecision(missing, dests)
    others = [misfit for index, (misfit, _, _) in enumerate(misfits) if index not in chosen]
    return DumpFit(tuple(parsers.releases[index] for index in chosen), min(others, default=best) - best)
