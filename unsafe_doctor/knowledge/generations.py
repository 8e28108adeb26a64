"""Which adaptor generation ran, read from the messages its adaptor logged.

`knowledge_base/adaptor_messages.json` holds every message each generation's adaptor files can log,
derived from their real files by `scripts/derive_messages.py` (the legacy wheel's, never published,
are recorded with where each is known from). Each message is a pattern anchored on its literal text,
its holes wildcards; all of them are looked for in each line at once (an RE2 set).

A line counts for the message it matches most specifically (the most literal text: MindSpeed-LLM
2.3's receive line also fits 26's shorter one), and only where the line's logger agrees: a line of
MindIO's logger (`[PYH tft_rollback.py:52]`) is the message of an adaptor that logs through MindIO
from that file, a line naming a Python logger is that module's. The generation whose messages the
log matches most (distinct messages; one shared by several generations counts for each) is the one;
several with as many tie, and none matched says nothing.

Two more kinds of evidence come from the knowledge's profiles, not the derived file: a traceback
frame in a file a profile's `files` globs match is that profile's (one message per glob), and a
user's profile may list `log_evidence` texts, each a message of that profile whoever logs it.
"""

from __future__ import annotations

import functools
import json
import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from types import MappingProxyType
from typing import Any, Literal

import re2  # type: ignore[import-untyped]

from unsafe_doctor.knowledge.loading import shipped_knowledge_dir
from unsafe_doctor.knowledge.rules import AdaptorProfile
from unsafe_doctor.log.lines import LogLine, mindio_file
from unsafe_doctor.log.tracebacks import Traceback

MESSAGES_FILE = "adaptor_messages.json"
MINDIO_LOGGER = "mindio"  # an adaptor that logs through MindIO's logger: its lines name the file
ANY_LOGGER = "any"  # a user's profile's log_evidence: its text counts whoever logs it
FRAME_LOGGER = "traceback frame"  # no message: a frame in one of a profile's files
# A message's needle goes to the scan only with NEEDLE_WORDS words (runs of two letters) or more and
# NEEDLE_CHARS characters or more beside its outer spaces: a shorter one is phrasing any library prints
# (torch_npu writes `not supported` on every line of some logs). Its message still matches in lines
# other markers keep.
NEEDLE_WORDS, NEEDLE_CHARS = 2, 14
WORD = re.compile(r"[A-Za-z]{2,}")  # a word of a message: what tells it from others
# decided: one generation matched most; tie: several as many; none: no adaptor message in the log
Decision = Literal["decided", "tie", "none"]


@dataclass(frozen=True)
class AdaptorMessage:
    text: str  # the format, `{}` for each hole, literal braces doubled
    logger: str  # the module's name, MINDIO_LOGGER, "root", "unknown", ANY_LOGGER or FRAME_LOGGER
    files: tuple[str, ...]  # the adaptor files known to log it (their names are in MindIO's lines)
    generations: tuple[str, ...]  # profile ids of adaptors.yaml
    where: str  # where it comes from: a release's file and line, or what records it

    @property
    def literal(self) -> tuple[str, ...]:
        """Its literal runs: a hole lies between each two (a leading or trailing one needs no pattern)."""
        return tuple(literal for literal, _, _, _ in string.Formatter().parse(self.text) if literal)

    @property
    def needle(self) -> str:
        """Its longest literal part: what the scan looks for to keep the line."""
        return max(self.literal, key=len)

    @property
    def scanned(self) -> bool:
        """Whether its needle is specific enough for the scan to keep lines by (NEEDLE_WORDS, NEEDLE_CHARS)."""
        needle = self.needle.strip()
        return len(needle) >= NEEDLE_CHARS and len(WORD.findall(needle)) >= NEEDLE_WORDS


@dataclass(frozen=True)
class MessageEvidence:
    line: str  # the log line as written (a CRI writer's: its first piece), or the frame as Python prints it
    source: str  # the input it is in
    offset: int  # its byte offset there
    message: AdaptorMessage


@dataclass(frozen=True)
class GenerationEvidence:
    """What the log's adaptor lines say of the generation that ran."""

    decision: Decision
    generations: tuple[str, ...]  # the one decided, or those tied; empty for none
    counts: Mapping[str, int]  # per generation, the distinct messages of it the log shows (read-only)
    evidence: tuple[MessageEvidence, ...]  # each line that matched, by input and offset

    def shown(self, possible: Sequence[str]) -> tuple[tuple[MessageEvidence, int], ...]:
        """Each message a generation still `possible` logs that the log shows, once, by its first line,
        with how many lines show it."""
        lines = [item for item in self.evidence if set(item.message.generations) & set(possible)]
        return tuple(
            (next(item for item in lines if item.message == message), count)
            for message, count in Counter(item.message for item in lines).items()
        )


@functools.cache
def shipped_messages() -> tuple[AdaptorMessage, ...]:
    """The derived messages, then the recorded ones."""
    data = json.loads((shipped_knowledge_dir() / MESSAGES_FILE).read_text(encoding="utf-8"))
    return (*map(_derived, data["messages"]), *map(_recorded, data["recorded"]))


def _derived(item: dict[str, Any]) -> AdaptorMessage:
    first = item["found"][0]
    where = f"{first['repo']} {first['refs'][0]} {first['path']}:{first['line']}"
    return AdaptorMessage(item["text"], item["logger"], (item["file"],), tuple(item["generations"]), where)


def _recorded(item: dict[str, Any]) -> AdaptorMessage:
    files = " or ".join(f"{file} ({known_from})" for file, known_from in item["files"].items())
    return AdaptorMessage(
        item["text"],
        item["logger"],
        tuple(item["files"]),
        tuple(item["generations"]),
        f"recorded: {item['known_from']}; from {files}",
    )


def profile_messages(profiles: Sequence[AdaptorProfile]) -> tuple[AdaptorMessage, ...]:
    """Each `log_evidence` text of a (user's) profile, as a message of that profile, whoever logs it."""
    return tuple(
        AdaptorMessage(
            text.replace("{", "{{").replace("}", "}}"),
            ANY_LOGGER,
            (),
            (profile.id,),
            f"the profile's log_evidence in {profile.origin.rpartition(':')[0]}",
        )
        for profile in profiles
        for text in profile.log_evidence
    )


def needles(messages: Sequence[AdaptorMessage]) -> tuple[bytes, ...]:
    """The literal parts the scan keeps lines by: each message's longest, where specific enough, once each."""
    return tuple(dict.fromkeys(message.needle.encode() for message in messages if message.scanned))


def read_generation(
    messages: Sequence[AdaptorMessage],
    lines: Iterable[LogLine],
    tracebacks: Iterable[Traceback],
    profiles: Sequence[AdaptorProfile],
) -> GenerationEvidence:
    """The generation the lines and the tracebacks' frames show, among `profiles` (the knowledge's,
    in its order: ties are listed in it). A message is matched in a line's text, its logger in the
    line as written."""
    generations = [profile.id for profile in profiles]
    known = tuple(message for message in messages if set(message.generations) & set(generations))
    matcher, modules = _matcher(known), _module_names(known)
    evidence: list[MessageEvidence] = []
    seen: set[tuple[str, int]] = set()
    for line in lines:
        if (line.source, line.offset) in seen:
            continue
        seen.add((line.source, line.offset))
        matched = matcher.Match(line.text)
        if not matched:  # most lines: no logger to read
            continue
        written = line.written or line.text
        best = _best(written, [known[index] for index in matched], modules)
        evidence.extend(MessageEvidence(written, line.source, line.offset, message) for message in best)
    evidence.extend(_frame_evidence(tracebacks, profiles))
    evidence.sort(key=lambda item: (item.source, item.offset))
    counts = {
        generation: len({item.message for item in evidence if generation in item.message.generations})
        for generation in generations
    }
    most = max(counts.values(), default=0)
    winners = tuple(generation for generation in generations if most and counts[generation] == most)
    decision: Decision = "none" if not winners else "decided" if len(winners) == 1 else "tie"
    return GenerationEvidence(decision, winners, MappingProxyType(counts), tuple(evidence))


def _frame_evidence(tracebacks: Iterable[Traceback], profiles: Sequence[AdaptorProfile]) -> Iterable[MessageEvidence]:
    """Each frame in a file one of the profiles' `files` globs match, as evidence for the profiles that list the glob."""
    globs: dict[str, list[str]] = {}
    for profile in profiles:
        for glob in profile.files:
            globs.setdefault(glob, []).append(profile.id)
    messages = [
        AdaptorMessage(
            f"a traceback frame in {glob}", FRAME_LOGGER, (), tuple(ids), f"the profile's files ({', '.join(ids)}): {glob}"
        )
        for glob, ids in globs.items()
    ]
    for traceback in tracebacks:
        for frame in traceback.frames:
            path = PurePath(frame.file)
            for message, glob in zip(messages, globs, strict=True):
                if path.match(glob):
                    yield MessageEvidence(
                        f'File "{frame.file}", line {frame.line}, in {frame.function}',
                        traceback.source,
                        traceback.offset,
                        message,
                    )


def _best(text: str, matched: list[AdaptorMessage], modules: Any) -> list[AdaptorMessage]:
    """The matched messages the line's logger allows, those with the most literal text."""
    named_file = mindio_file(text)
    named = modules.search(text) if modules is not None and named_file is None else None
    logger = named.group(1) if named else None
    allowed = [
        message
        for message in matched
        if message.logger == ANY_LOGGER
        or (
            named_file in message.files
            if message.logger == MINDIO_LOGGER
            else named_file is None and logger in (None, message.logger)
        )
    ]
    if not allowed:
        return []
    most = max(sum(map(len, message.literal)) for message in allowed)
    return [message for message in allowed if sum(map(len, message.literal)) == most]


@functools.cache
def _matcher(messages: tuple[AdaptorMessage, ...]) -> Any:
    matcher = re2.Set.SearchSet()
    for message in messages:
        matcher.Add(".*".join(re2.escape(part) for part in message.literal))
    matcher.Compile()
    return matcher


@functools.cache
def _module_names(messages: tuple[AdaptorMessage, ...]) -> Any:
    """A pattern for the Python logger names the messages are logged under, as a log line names one."""
    names = sorted({message.logger for message in messages if "." in message.logger}, key=len, reverse=True)
    return re2.compile(f"({'|'.join(map(re2.escape, names))})(?:[^\\w.]|$)") if names else None
