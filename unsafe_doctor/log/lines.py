"""Raw log text -> clean, rank-attributed lines.

Input excerpts come from `inputs.py` (already decoded with replacement). This module strips the
noise a real multi-rank log carries (ANSI colour, CR, NUL, timestamps, logger prefixes, launcher and
kubectl prefixes) and recognises which rank wrote each line, so later stages can reassemble each
rank's traceback even when ranks interleave.

Prefixes are peeled from the start of a line, in any order, as long as one is recognised. Each
removal takes exactly the prefix and the one space its writer adds after it, so the indentation of
traceback lines survives (`[rank3]:   File "x.py"` -> `  File "x.py"`). torchrun's tee prefix is
the exception: it writes `[default3]:` straight before the line (torch `tail_log.py`), so no space
is taken after it. When several rank prefixes stack, the most specific one names the rank:

1. `[rank3]:`          PyTorch >= 2.3 excepthook: the global rank.
2. `[default3]:`       torchrun `--tee` / `--redirects` (`[<role><n>]:`): usually the local rank.
3. `3: `               a bare number at line start (srun `-l` / launcher labels); recognised only
                       before any bracketed rank prefix, and never in `12:30:01` (no space).
4. `[pod/name-3/c] `   kubectl `--prefix`: the pod's trailing ordinal. It is used only when nothing
                       finer is on the line, because a pod ordinal is not always the rank (a
                       PyTorchJob's `worker-0` is rank 1 when a master pod exists).

Timestamps and logger headers are removed too: ISO dates, kubectl `--timestamps`, Python logging
(`2026-01-01 10:00:00,123 ERROR [launcher] `, `%(asctime)s - %(name)s - %(levelname)s - `),
syslog stamps (`Jan  1 10:00:00 host proc[123]: `), MindIO's stdout, file and Python formats, and
the container runtime's (CRI) `2026-01-01T10:00:00.123456789Z stderr F `. torch_npu's
`[ERROR] 2024-09-26-19:58:19 (PID:…, Device:…, RankID:…) ERR00003 …` line is left verbatim, the
traceback parser reads it. ANSI colour codes go first, wherever they are.

A CRI line marked `P` (partial) was cut by the runtime at its buffer size (16 KiB in containerd);
the next line of the same stream continues it. `split_lines` joins the pieces before anything
else reads them, per stream, since stdout and stderr interleave; the joined line keeps the first
piece's offset and the prefixes before the first piece's CRI header. The byte search of
`inputs.py` runs before any joining, so the error message itself must arrive in one piece; it does
unless its line is longer than the runtime's buffer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate


@dataclass(frozen=True, slots=True)
class LogLine:
    rank: int | None  # from the line's own prefix, else the input's rank hint, else None
    text: str  # the line without colour codes, CR, timestamps, logger/launcher/rank prefixes
    source: str  # name of the input it came from
    offset: int  # byte offset of the line in that input: orders lines of one input
    # the line as written, prefixes kept (a CRI writer's: its first piece): the logger it names tells who
    # wrote it; "" where it was not kept (a line made by a later stage)
    written: str = field(default="", compare=False)


# CSI (`ESC [ … final`), OSC (`ESC ] … BEL|ST`) and two-byte escapes; a stray ESC goes too.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])?")

_DATE_TIME = r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
_LEVEL = r"(?i:trace|debug|info|warn|warning|error|critical|fatal)"

# A rank is at most RANK_DIGITS digits, in every pattern that reads one (here, in `recovery`,
# `sentinel_lines` and `reading`'s count of the ranks tagged): a longer run is no rank (and `int`
# refuses 4,300 digits).
RANK_DIGITS = 9
RANK_NUMBER = rf"\d{{1,{RANK_DIGITS}}}"

# Rank prefixes, with the specificity used when several stack on one line.
_RANK_PREFIX = re.compile(rf"\[rank({RANK_NUMBER})\]:")
_ROLE_PREFIX = re.compile(r"\[[A-Za-z_][\w-]*\]:")  # the role's number ends its name: `_role_rank` reads it
_NUMERIC_PREFIX = re.compile(rf"({RANK_NUMBER}):(?= .)")
_POD_PREFIX = re.compile(r"\[pod/([^/\]\s]+)/[^\]\s]+\]")
_POD_ORDINAL = re.compile(rf"-({RANK_NUMBER})$")
_RANK_SPECIFICITY, _ROLE_SPECIFICITY, _NUMERIC_SPECIFICITY, _POD_SPECIFICITY = 4, 3, 2, 1

# A container runtime's log line (CRI format, as containerd and CRI-O write it): time, stream, tag, one space.
_CRI_FIELDS = r"(stdout|stderr) ([FP])(?= )"
_CRI_HEADER = re.compile(rf"{_DATE_TIME} {_CRI_FIELDS} ")

# Logger headers. Bracketed: `[2024-12-24 11:56:59,095]`, optionally followed by MindIO's older
# Python fields `[10][ERROR][ttp_mindx_api:56]`. Bare: an ISO or RFC 3339 timestamp, optionally
# followed by MindIO stdout's `warn 3062106`, MindIO's spdlog file `3062106 info`, Python
# logging's ` - name - INFO -` or ` ERROR [name]`, or a CRI line's stream and tag.
_LOG_HEADER = re.compile(
    rf"\[{_DATE_TIME}\](?:\[\d+\])?(?:\[{_LEVEL}\])?(?:\[[\w.]+:\d+\])?"
    rf"|{_DATE_TIME}(?: {_LEVEL} \d+| \d+ {_LEVEL}| - \S+ - {_LEVEL} -| {_LEVEL}(?: \[[\w.-]+\])?(?= )| {_CRI_FIELDS})?"
)
# Syslog (RFC 3164, as rsyslog writes it): `Jan  1 10:00:00 host tag[pid]: `; the host may be missing.
_SYSLOG_HEADER = re.compile(
    r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [ \d]?\d \d\d:\d\d:\d\d(?: [\w.-]+)?? [\w./-]+(?:\[\d+\])?:"
)
# MindIO source tags: C++ `[TTP controller.cpp:2510]`, Python-origin `[12345][PYH tft_rollback.py:88]`.
_PYH_TAG = r"\[PYH ([^\]\s]+):\d+\]"  # the Python file MindIO's logger was called from
_MINDIO_TAG = re.compile(rf"\[TTP [^\]\s]+:\d+\]|\[\d+\]{_PYH_TAG}")
# The file a line of MindIO's Python logger names: today's `[12345][PYH tft_rollback.py:88]`, or the older
# Python format's `[10][ERROR][ttp_mindx_api:56]` (its module, no `.py`), as MindIO's own level names read.
_MINDIO_FILE = re.compile(rf"\]{_PYH_TAG}|\]\[(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\]\[([\w.]+):\d+\]")

_PREFIX_START = frozenset("[0123456789JFMASOND")  # a bracket, a digit, a month's initial


def _match_prefix(text: str, pos: int, *, numeric_allowed: bool) -> tuple[re.Match[str] | None, int, int | None]:
    """The prefix at `pos`, with the specificity and rank it tells (0 and None for a header)."""
    first = text[pos]
    if first == "[":
        if m := _RANK_PREFIX.match(text, pos):
            return m, _RANK_SPECIFICITY, int(m[1])
        if (m := _ROLE_PREFIX.match(text, pos)) and (rank := _role_rank(m[0])) is not None:
            return m, _ROLE_SPECIFICITY, rank
        if m := _POD_PREFIX.match(text, pos):
            ordinal = _POD_ORDINAL.search(m[1])
            return m, _POD_SPECIFICITY, int(ordinal[1]) if ordinal else None
        return _LOG_HEADER.match(text, pos) or _MINDIO_TAG.match(text, pos), 0, None
    if not first.isdigit():
        return _SYSLOG_HEADER.match(text, pos), 0, None
    if m := _LOG_HEADER.match(text, pos):
        return m, 0, None
    if numeric_allowed and (m := _NUMERIC_PREFIX.match(text, pos)):
        return m, _NUMERIC_SPECIFICITY, int(m[1])
    return None, 0, None


def _role_rank(prefix: str) -> int | None:
    """The number that ends a role prefix's name (`[worker12]:` is 12), read backwards: a lazy
    `[\\w-]*?(\\d+)` takes time quadratic in a run of digits."""
    name = prefix[1:-2]
    digits = len(name) - len(name.rstrip("0123456789"))
    return int(name[-digits:]) if 0 < digits <= RANK_DIGITS else None


def _peel(text: str) -> tuple[int, int | None, str]:
    """Strip leading prefixes; return (specificity of the best rank, that rank, rest)."""
    specificity, rank = 0, None
    pos = 0
    numeric_allowed = True
    while pos < len(text) and text[pos] in _PREFIX_START:
        m, found_specificity, found_rank = _match_prefix(text, pos, numeric_allowed=numeric_allowed)
        if m is None:
            break
        if found_specificity > _POD_SPECIFICITY:
            numeric_allowed = False  # a bare number after a rank prefix is message text
        if found_rank is not None and found_specificity > specificity:
            specificity, rank = found_specificity, found_rank
        pos = m.end()
        if m.re is not _ROLE_PREFIX and text.startswith(" ", pos):
            pos += 1  # the one space the prefix's writer adds
    return specificity, rank, text[pos:]


def normalise(raw: str) -> tuple[int | None, str]:
    """Return (rank from the line's prefix or None, cleaned text).

    A lone CR (progress bars) keeps what a terminal shows last: the text after the last CR that
    is not at the end of the line. Prefixes before that CR still name the rank, since launchers
    prefix the start of each line only.
    """
    if "\x00" in raw:
        raw = raw.replace("\x00", "")
    if "\x1b" in raw:
        raw = _ANSI.sub("", raw)
    raw = raw.rstrip("\r\n")
    if "\r" not in raw and raw[:1] not in _PREFIX_START:
        return None, raw  # fast path: nothing to peel
    specificity, rank, text = _peel(raw)
    if "\r" in text:
        inner_specificity, inner_rank, text = _peel(text[text.rfind("\r") + 1 :])
        if inner_specificity > specificity:
            rank = inner_rank
    return rank, text


def mindio_file(written: str) -> str | None:
    """The Python file a line of MindIO's logger names (`tft_rollback.py`), None on any other line."""
    shown = _MINDIO_FILE.search(written)
    return None if shown is None else shown[1] or f"{shown[2]}.py"


def split_lines(text: str, *, source: str, base_offset: int, rank_hint: int | None) -> list[LogLine]:
    """Split an excerpt of one input into normalised lines, CRI partial lines joined.

    Lines end at LF only (CRs are handled by `normalise`). Offsets count the UTF-8 length of the
    decoded text; where the input held invalid bytes (decoded to U+FFFD) they drift from the true
    byte offsets, but stay monotonic, which is all they are used for: ordering the lines of one
    input and interleaving ranks.
    """
    pieces = _pieces(text)
    offsets = _offsets(pieces, base_offset, ascii_only=text.isascii())
    written = pieces
    if " stdout P " in text or " stderr P " in text:
        offsets, pieces, written = _join_partial_lines(offsets, pieces)
    lines = []
    for offset, piece, as_written in zip(offsets, pieces, written, strict=True):
        rank, clean = normalise(piece)
        lines.append(LogLine(rank if rank is not None else rank_hint, clean, source, offset, as_written.rstrip("\r\n")))
    return lines


def _pieces(text: str) -> list[str]:
    pieces = text.split("\n")
    if pieces[-1] == "":
        pieces.pop()  # the excerpt ended with a newline; there is no line after it
    return pieces


def _offsets(pieces: list[str], offset: int, *, ascii_only: bool) -> list[int]:
    """Where each line starts: the offset, then each line's UTF-8 length and its LF added up."""
    if ascii_only:
        return list(accumulate(map((1).__add__, map(len, pieces[:-1])), initial=offset)) if pieces else []
    offsets = []
    for piece in pieces:
        offsets.append(offset)
        offset += (len(piece) if piece.isascii() else len(piece.encode("utf-8", "surrogatepass"))) + 1
    return offsets


_CRI_SEARCH_SPAN = 400  # how far into a line its CRI header may start, after prefixes added outside it


def _join_partial_lines(offsets: list[int], pieces: list[str]) -> tuple[list[int], list[str], list[str]]:
    """Join each CRI `P` piece with the lines of its stream that continue it, up to the `F` one.

    The joined line stands where its first piece stood. A run still open at the excerpt's end is
    kept as far as it goes: the window cut it, the runtime did not finish it here. Returned: the
    offsets, the lines, and each line's first piece.
    """
    joined_offsets: list[int] = []
    joined: list[str] = []
    firsts: list[str] = []
    open_runs: dict[str, tuple[int, list[str]]] = {}  # stream -> (index in joined, pieces so far)
    for offset, piece in zip(offsets, pieces, strict=True):
        header = _CRI_HEADER.search(piece, 0, _CRI_SEARCH_SPAN)
        if header is None:
            joined_offsets.append(offset)
            joined.append(piece)
            firsts.append(piece)
            continue
        stream = header[1]
        run = open_runs.pop(stream, None)
        if run is None:
            run = (len(joined), [piece])
            joined_offsets.append(offset)
            joined.append(piece)
            firsts.append(piece)
        else:
            run[1].append(piece[header.end() :])
        if header[2] == "P":
            open_runs[stream] = run
        else:
            joined[run[0]] = "".join(run[1])
    for index, parts in open_runs.values():
        joined[index] = "".join(parts)
    return joined_offsets, joined, firsts


def by_rank(lines: Iterable[LogLine]) -> dict[int | None, list[LogLine]]:
    """Group lines per rank, keeping each rank's order."""
    groups: dict[int | None, list[LogLine]] = {}
    for line in lines:
        groups.setdefault(line.rank, []).append(line)
    return groups
