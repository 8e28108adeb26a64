"""The sentinel's modes by name: what `sentinel install --mode` offers, the block writes and the
sentinel's lines report. Kept apart from the lines' format (`sentinel_lines`) so that building the
command line, `--help` included, loads none of the log reading."""

from __future__ import annotations

from typing import Literal

SentinelMode = Literal["report", "raise", "heal"]
MODES: tuple[SentinelMode, ...] = ("report", "raise", "heal")
GUARDED: tuple[SentinelMode, ...] = ("report", "heal")  # whose block logs a sentinel missing or broken, and goes on
