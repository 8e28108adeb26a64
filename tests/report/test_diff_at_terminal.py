"""The coloured diff at a terminal: a patch copied from the screen applies, so no line is
folded into one without its `+`, `-` or space; and a folder name's escape sequences in the `---` and
`+++` headers are shown as escapes, not run by the terminal. Run at a real pseudo-terminal, 80 columns."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from terminal import at_terminal

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples"
HOSTILE = "w\x1b]0;owned\x07\x1b[2J"  # sets the terminal's title, then clears the screen
SGR = re.compile(r"\x1b\[[0-9;]*m")  # the diff's own colours


def dry_run_at_80_columns(tmp_path: Path, folder: str) -> tuple[str, list[str]]:
    """`fix --dry-run` at an 80-column terminal, the framework copied into `folder`: the screen, and its
    lines without the diff's colours."""
    toy = tmp_path / folder
    shutil.copytree(SAMPLES / "framework", toy)
    code, screen = at_terminal(
        [
            "fix",
            str(SAMPLES / "logs" / "toytrain_ema"),
            "--source-root",
            str(toy),
            "--adaptor",
            str(toy / "toytrain" / "recovery.py"),
            "--dry-run",
        ],
        columns=80,
        cwd=tmp_path,
    )
    assert code == 0, screen
    return screen, [SGR.sub("", line) for line in screen.replace("\r\n", "\n").split("\n")]


def test_the_diff_at_an_80_column_terminal_is_whole_lines_with_names_escaped(tmp_path):
    screen, lines = dry_run_at_80_columns(tmp_path, HOSTILE)
    start = next(index for index, line in enumerate(lines) if line.startswith("--- "))
    end = next(index for index in range(start, len(lines)) if lines[index].startswith("unsafe-doctor: "))
    diff = lines[start:end]
    assert diff[:2] == [
        "--- a/w\\x1b]0;owned\\x07\\x1b[2J/toytrain/recovery.py",
        "+++ b/w\\x1b]0;owned\\x07\\x1b[2J/toytrain/recovery.py",
    ]
    assert any(len(line) > 80 for line in diff)  # the block has lines wider than the terminal, left whole
    assert all(line[:1] in (" ", "+", "-", "@") for line in diff), "\n".join(diff)
    assert sum(line.startswith("+") for line in diff) == 1 + 8 + 10  # the +++ header, then each block's lines (tensor template)
    assert "\x1b]" not in screen and "\x1b[2J" not in screen


def test_a_line_separator_in_a_diff_line_is_shown_escaped(tmp_path):
    """U+2028 in a folder name: a terminal may start a new line there, splitting the `---` header."""
    screen, lines = dry_run_at_80_columns(tmp_path, "w\u2028x")
    assert "--- a/w\\u2028x/toytrain/recovery.py" in lines, screen
    assert "+++ b/w\\u2028x/toytrain/recovery.py" in lines, screen
