"""The run's arguments, from the dump a Megatron-based job prints at start-up.

Megatron-LM's `_print_args` prints, on rank 0, a title line `------------------------ arguments
------------------------`, then one line per argument, `  name ..... value` (the name, a run of dots
to column 48, the value's `str`), sorted, then `-------------------- end of arguments
---------------------`. MindSpeed-LLM prints its own dump in the same frame under another title
(`MindSpeed-LLM Arguments`). A log without a traceback still tells, through it, which features the
job ran: whether MoE, MTP, sequence parallelism or rotary embeddings were on.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from unsafe_doctor.log.lines import LogLine

# What the input stage looks for, in a log's first bytes: the argument lines' dots (eight or more:
# names of up to 40 characters, every feature switch read here), looked for only between a title and
# an end line; the rule both of those hold; and what tells the end line from the title.
DUMP_MARKERS: tuple[bytes, bytes, bytes] = (b"........ ", b"rguments ----", b"end of ")
# The longest name whose line the input stage keeps: `_print_args` pads each name with dots to column 48.
LONGEST_NAME_READ = 48 - len(DUMP_MARKERS[0].rstrip())
# Patterns over a line stay linear in its length (a log is untrusted: a regex's `(.*?)\s*$` or
# `-{8,} … -{8,}` searched over a 64 KB run of spaces or dashes takes seconds): a rule's dashes and
# a value's trailing spaces are found with str methods, and a run of dashes opens a rule only at its start.
_RULE_OPENING = re.compile(r"(?<!-)-{8,} ")
_ARGUMENT = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*) \.{3,} ")


@dataclass(frozen=True)
class RunArguments:
    """The arguments of the first complete dump in the log, each value as printed."""

    title: str  # "arguments" (Megatron-LM) or "MindSpeed-LLM Arguments"
    values: dict[str, str]
    source: str  # the input it was read from
    offset: int  # of its title line

    def get(self, name: str) -> str | None:
        return self.values.get(name)


def read_arguments(lines: Iterable[LogLine]) -> RunArguments | None:
    """The first dump that has its title, at least one argument and its end line, per source, in the
    order given; None when the log has none (it was cut, or the job prints none)."""
    open_dumps: dict[str, RunArguments] = {}
    for line in lines:
        text = line.text
        current = open_dumps.get(line.source)
        title, end = _frame_line(text)
        if title is not None:
            open_dumps[line.source] = RunArguments(title, {}, line.source, line.offset)
        elif current is None:
            continue
        elif end:
            if current.values:
                return current
            del open_dumps[line.source]
        elif m := _ARGUMENT.match(text):
            current.values.setdefault(m[1], text[m.end() :].rstrip())
    return None


def _frame_line(text: str) -> tuple[str | None, bool]:
    """(the title, whether an end line) of a line `-------- TITLE --------`, TITLE ending in "rguments"
    and the end line's starting with "end of "; (None, False) for any other line."""
    inner = text.rstrip()
    dashes = len(inner) - len(inner.rstrip("-"))
    inner = inner[: len(inner) - dashes]
    if dashes < 8 or not inner.endswith("rguments "):
        return None, False
    inner = inner[:-1]
    end = False
    for opening in _RULE_OPENING.finditer(inner, 0, len(inner) - len("rguments")):
        title = inner[opening.end() :]
        if not title.startswith("end of "):
            return title, False
        end = end or len(title) >= len("end of rguments")
    return None, end
