"""Which framework release the job ran, from the log's frames alone.

Each frame in a framework's package folder (`megatron/core/...`) names a file; the index
(`unsafe_doctor.source.index`) knows every release's version of it. A release agrees with the frame
when its file has the frame's printed line at the frame's line number (a 16-bit line hash), or,
when the log printed no line, has that many lines. The releases that agree with the most frames
are the job's candidates; the newest of them is the one the diagnosis reads (`chosen`), and its
file versions stand in for the job's files.

A frame no release agrees with (a patched file, a release newer than the index) still counts in
`frames` but narrows nothing; when no frame agrees with any release there is no match. A frame in a
package folder only newer releases ship (`megatron/training/`, in megatron-core's wheels from 0.17;
every Megatron-LM checkout has it) counts only when its printed line agrees with a release: else it
may be an older checkout's file, which says nothing of the release.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.source.index import FileVersion, FrameworkIndex, IndexedFramework
from unsafe_doctor.source.printed import first_line
from unsafe_doctor.source.skeleton import line_hash


@dataclass(frozen=True)
class ReleaseMatch:
    framework: IndexedFramework
    candidates: tuple[int, ...]  # indices of the releases that agree with the most frames, oldest first
    agreeing: int  # frames those releases agree with
    frames: int  # the framework's distinct frames in the log

    @property
    def chosen(self) -> int:
        return self.candidates[-1]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.framework.releases[index].name for index in self.candidates)

    @property
    def version(self) -> Version | None:
        """The chosen release as a version, when its name is one (`2.3.0_core_r0.12.1` -> 2.3.0)."""
        return release_version(self.framework.releases[self.chosen].name)

    def describe(self) -> str:
        """`megatron-core 0.12.0–0.12.1, from 7 frames` (`0.12.0, 0.13.1` when not consecutive)."""
        consecutive = self.candidates == tuple(range(self.candidates[0], self.candidates[-1] + 1))
        shown = releases_shown(self.names, consecutive=consecutive)
        counted = f"{self.agreeing} of {self.frames} frames" if self.agreeing < self.frames else _frames(self.frames)
        return f"{self.framework.name} {shown}, from {counted}"

    def version_of(self, path: str) -> FileVersion | None:
        """The chosen release's version of a file of this framework."""
        return self.framework.version_in(path, self.chosen)


def releases_shown(names: Sequence[str], *, consecutive: bool) -> str:
    """`0.12.0–0.12.1` for releases one after another in the index, else `0.12.0, 0.13.1`."""
    return names[0] if len(names) == 1 else (f"{names[0]}–{names[-1]}" if consecutive else ", ".join(names))


def _frames(count: int) -> str:
    return f"{count} frame" if count == 1 else f"{count} frames"


_LEADING_VERSION = re.compile(r"\d+(?:\.\d+)*")


def release_version(name: str) -> Version | None:
    found = _LEADING_VERSION.match(name)
    try:
        return Version(found.group(0)) if found else None
    except InvalidVersion:
        return None


def agreeing_releases(framework: IndexedFramework, path: str, frame: Frame) -> set[int]:
    """The releases whose version of `path` holds the frame's printed line at its line number."""
    printed = first_line(frame.source)
    if frame.line is None or frame.line < 1:
        return set()
    found: set[int] = set()
    for version in framework.versions(path):
        if frame.line > len(version.hashes):
            continue
        if printed is None or version.hashes[frame.line - 1] == line_hash(printed):
            found.update(version.releases)
    return found


def fingerprint(frames: Iterable[Frame], index: FrameworkIndex) -> dict[str, ReleaseMatch]:
    """Per framework the log's frames run in, the releases that fit them best."""
    votes: dict[str, Counter[int]] = {}
    counted: dict[str, int] = {}
    frameworks: dict[str, IndexedFramework] = {}
    for frame in {(frame.file, frame.line, frame.source): frame for frame in frames}.values():
        located = index.framework_of(frame.file)
        if located is None:
            continue
        framework, path = located
        agreeing = agreeing_releases(framework, path, frame)
        if not framework.ships_folder_everywhere(path) and (first_line(frame.source) is None or not agreeing):
            continue  # a folder older releases do not ship: only a printed line one release holds tells anything
        frameworks[framework.name] = framework
        counted[framework.name] = counted.get(framework.name, 0) + 1
        votes.setdefault(framework.name, Counter()).update(agreeing)
    matches = {}
    for name, tally in votes.items():
        if not tally:
            continue
        best = max(tally.values())
        candidates = tuple(sorted(release for release, count in tally.items() if count == best))
        matches[name] = ReleaseMatch(frameworks[name], candidates, best, counted[name])
    return matches
