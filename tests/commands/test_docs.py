"""The README and docs/ say what is true: their links resolve, their options tables are each
command's --help, and the commands they mark to run do what the page says when run as printed.

Marks a page may carry, each an HTML comment on the line before a fence or a table:

* `<!-- run: exit 1 0 -->` before a ```bash fence: every command of the block (a line, with its
  `\\` continuations; comments and blank lines aside) runs in bash, in order, with the venv's
  `unsafe-doctor` on PATH, in a temporary folder holding a copy of `samples/`; the numbers are the
  exit codes of the commands, one each. A page's blocks run in one folder, in page order, as a
  reader following the page would run them; and every page's blocks run again in one shared
  folder, page after page (README first), as a reader following them all from one folder would:
  a page's files and folders are its own (a second `cp -r` into an existing folder nests).
* `<!-- output -->` before a fence: what the last run block printed on stdout, or on stderr,
  whitespace and timings normalised: the stream's lines as printed, from its first to its last,
  except where a line `[…]` of its own stands for printed lines left out (at the top, between
  two lines, or at the bottom; each cut leaves out at least one line). Nothing is left out
  silently. `<!-- output: with megatron-core -->` is output that holds where megatron-core is
  installed (the page says so): where it is not, the block is not compared, and the test says so.
* `<!-- options: COMMAND -->` before a table: one row per option of `unsafe-doctor COMMAND --help`;
  `<!-- options: shared -->` is the table of the options several commands share, one column per
  command (tests/cli/test_cli_options.py holds it against every --help).
* `<!-- test-command -->` before the README's test-command fence.

A count of what ships is written `N rules ship` or `N templates ship` (the noun may be bold), and
is what `unsafe-doctor rules list` lists.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COLUMNS = "100"
README_LIMIT = 15_000  # bytes: a page a newcomer reads in two minutes

_FENCE = re.compile(r"^(`{3,})")
_MARK = re.compile(r"^<!--\s*(run|output|options|test-command)\s*:?\s*(.*?)\s*-->$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_TIME = re.compile(r"\b\d+(?:\.\d+)? s\b")


@dataclass
class Block:
    """A fenced block: its language, its lines, and the mark on the line before it (if any)."""

    language: str
    lines: list[str]
    mark: tuple[str, str] | None
    line: int  # where it starts in the page, for messages


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    prose: list[str] = field(default_factory=list)  # the lines outside fences
    marks: list[tuple[int, str, str]] = field(default_factory=list)  # every mark: its index in prose, kind, argument

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


@cache
def read_page(path: Path) -> Page:
    page = Page(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    index, mark = 0, None
    while index < len(lines):
        line = lines[index]
        fence = _FENCE.match(line)
        if fence:
            end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith(fence.group(1)))
            page.blocks.append(Block(line[len(fence.group(1)) :].strip(), lines[index + 1 : end], mark, index + 1))
            page.prose.append("")
            index, mark = end + 1, None
            continue
        found = _MARK.match(line.strip())
        if found:
            page.marks.append((len(page.prose), found.group(1), found.group(2)))
            mark = (found.group(1), found.group(2))
        elif line.strip():
            mark = None if not line.startswith("|") else mark  # a table keeps the mark above it
        page.prose.append(line)
        index += 1
    return page


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- links -----------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in read_page(path).prose:
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            base = slug(heading.group(1))
            name, count = base, 0
            while name in found:
                count += 1
                name = f"{base}-{count}"
            found.add(name)
    return found


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_every_relative_link_resolves_to_a_file_and_anchor(path):
    broken = []
    links = [target for line in read_page(path).prose for target in _LINK.findall(re.sub(r"`[^`]*`", "", line))]
    for target in links:
        if re.match(r"^[a-z][a-z+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.is_relative_to(ROOT) or not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (destination.suffix != ".md" or anchor not in anchors(destination)):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    assert not broken, broken


def test_the_readme_links_every_docs_page():
    """No page of docs/ is an orphan: the README links every one."""
    readme = read_page(ROOT / "README.md")
    linked = {(ROOT / target.partition("#")[0]).resolve() for line in readme.prose for target in _LINK.findall(line)}
    assert set(PAGES[1:]) <= linked, sorted(page_id(p) for p in set(PAGES[1:]) - linked)


# --- options tables --------------------------------------------------------------------------------


def run_cli(words: list[str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", *words],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean_environment(), "COLUMNS": "250"},
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def run_help(words: list[str]) -> str:
    return run_cli([*words, "--help"])


def help_options(text: str) -> set[str]:
    """The option names (long and short) of a --help's Options panel."""
    names: set[str] = set()
    for line in text.splitlines():
        match = re.match(r"│\s+(--[\w-]+)(?:\s+(-\w))?\s", line)
        if match:
            names.update(name for name in match.groups() if name)
    return names


def table_after(page: Page, line_index: int) -> list[list[str]]:
    """The rows of the table that starts after a mark, header and rule left out, as cells."""
    rows = []
    for line in page.prose[line_index + 1 :]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
    return rows[2:]


def option_names(cell: str) -> set[str]:
    spans = re.findall(r"`([^`]*)`", cell)
    assert spans, cell
    return set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", spans[0]))


def command_tables() -> list[tuple[str, Path, int]]:
    return [
        (argument, path, index)
        for path in PAGES
        for index, kind, argument in read_page(path).marks
        if kind == "options" and argument != "shared"
    ]


@pytest.mark.parametrize(("command", "path", "index"), command_tables(), ids=[command for command, _, _ in command_tables()])
def test_a_commands_options_table_lists_exactly_its_help_options(command, path, index):
    text = run_help(command.split())
    rows = table_after(read_page(path), index)
    listed = [option_names(row[0]) for row in rows]
    assert set().union(*listed) == help_options(text), (command, path.name)
    assert len(listed) == len({frozenset(names) for names in listed})  # each option once
    for row, names in zip(rows, listed, strict=True):
        if "--format" in names:  # the formats the row names are the parser's choices
            choices = re.search(r"│\s+--format\b.*?\[([a-z|]+)\]", text).group(1).split("|")
            assert sorted(re.findall(r"`([a-z]+)`", row[1])) == sorted(choices), (command, row)


def test_every_command_has_an_options_table_and_the_shared_table_agrees_with_them():
    shared_page = read_page(ROOT / "docs" / "configuration.md")
    [index] = [i for i, kind, argument in shared_page.marks if kind == "options" and argument == "shared"]
    header = next(line for line in shared_page.prose[index:] if line.startswith("| option |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")][1:]
    tables = {command: option_names_of(path, i) for command, path, i in command_tables()}
    assert set(tables) == set(columns), "one options table per command of the shared table"
    for row in table_after(shared_page, index):
        names = option_names(row[0])
        for command, cell in zip(columns, row[1:], strict=True):
            assert bool(names & tables[command]) == bool(cell), (command, names)


def option_names_of(path: Path, index: int) -> set[str]:
    return set().union(*(option_names(row[0]) for row in table_after(read_page(path), index)))


# --- counts ----------------------------------------------------------------------------------------

_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
_SHIPPED = re.compile(rf"\b(\d+|{'|'.join(_NUMBER_WORDS)}) (?:\*\*)?(rules|templates)(?:\*\*)? ship\b", re.IGNORECASE)


def test_a_page_that_counts_the_shipped_rules_and_templates_counts_what_rules_list_lists():
    """ "N rules ship", "N templates ship": N is what `rules list` lists (its templates are the
    `generic.*` rows), so a rule added to the knowledge base cannot leave the count behind."""
    listed = json.loads(run_cli(["rules", "list", "--format", "json"]))
    shipped = {"rules": len(listed["rules"]), "templates": len(listed["templates"])}
    said = [
        (page_id(path), kind.lower(), int(number) if number.isdigit() else _NUMBER_WORDS.index(number.lower()))
        for path in PAGES
        for number, kind in _SHIPPED.findall(" ".join(read_page(path).prose))
    ]
    assert {kind for _, kind, _ in said} == set(shipped), said  # docs/knowledge-base.md says both
    assert [(page, kind, count) for page, kind, count in said if count != shipped[kind]] == [], shipped


# --- commands run as printed -----------------------------------------------------------------------


def clean_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith(("UNSAFE_DOCTOR_", "_UNSAFE_DOCTOR"))}


def commands_of(block: Block) -> list[str]:
    """The block's commands: `\\`-continued lines joined; blank lines and whole-line comments left out."""
    commands, pending = [], ""
    for line in block.lines:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        commands.append(pending)
        pending = ""
    assert not pending, f"a continuation runs off the end of the block at line {block.line}"
    return commands


def normalised(line: str) -> str:
    return _TIME.sub("<T> s", " ".join(line.split()))


CUT = "[…]"  # a line of its own in an output block: printed lines left out here


def without_blank_edges(lines: list[str]) -> list[str]:
    start = next((i for i, line in enumerate(lines) if line), len(lines))
    end = next((i for i in range(len(lines), start, -1) if lines[i - 1]), start)
    return lines[start:end]


def shown_runs(expected: list[str], where: str) -> list[list[str]]:
    """The block's lines, normalised, as the runs between its cuts: an empty first or last run is a
    cut at the top or the bottom."""
    runs: list[list[str]] = [[]]
    for line in map(normalised, expected):
        if line == CUT:
            runs.append([])
        else:
            runs[-1].append(line)
    runs = [without_blank_edges(run) for run in runs]
    assert all(runs[1:-1]) and any(runs), f"{where}: two cuts with nothing shown between them"
    return runs


def mismatch(runs: list[list[str]], printed: list[str]) -> str | None:
    """Why the runs are not the printed lines with cuts where the block marks them (None: they are).
    Each run after a cut is matched at its first place after the run before: no later place could
    leave more room for the runs after it."""
    position = 0
    for index, run in enumerate(runs):
        if not run:  # a cut at the top or at the bottom
            continue
        if index == 0:
            found = 0 if printed[: len(run)] == run else None
        else:
            found = next(
                (start for start in range(position, len(printed) - len(run) + 1) if printed[start : start + len(run)] == run),
                None,
            )
        if found is None:
            return f"not printed as one run{' after the run before' if index else ' from the first line'}:\n" + "\n".join(run)
        if index and not any(printed[position:found]):
            return f"a cut before this run leaves nothing out:\n{run[0]}"
        position = found + len(run)
    if runs[-1] and position < len(printed):
        return f"printed after the block's last line, with no cut to say so:\n{printed[position]}"
    if not runs[-1] and not any(printed[position:]):
        return "the cut at the bottom leaves nothing out"
    return None


def assert_printed(expected: list[str], stdout: str, stderr: str, where: str) -> None:
    """The block is stdout's lines or stderr's lines, with each line it leaves out marked by a cut."""
    runs = shown_runs(expected, where)
    why = {
        name: mismatch(runs, without_blank_edges([normalised(line) for line in text.splitlines()]))
        for name, text in (("stdout", stdout), ("stderr", stderr))
    }
    if None not in why.values():
        raise AssertionError(
            f"{where}: the block is neither stream as printed\n"
            + "".join(f"--- {name}: {reason}\n" for name, reason in why.items())
            + f"--- stdout\n{stdout}\n--- stderr\n{stderr}"
        )


@pytest.mark.parametrize(
    ("block", "holds"),
    [
        (["a", "b", "c", "d"], True),
        (["[…]", "c", "d"], True),
        (["a", "[…]", "d"], True),
        (["a", "b", "[…]"], True),
        (["[…]", "b", "[…]"], True),
        (["a", "c", "d"], False),  # b left out with no cut
        (["b", "c", "d"], False),  # a left out at the top with no cut
        (["a", "b", "c"], False),  # d left out at the bottom with no cut
        (["a", "[…]", "b", "c", "d"], False),  # a cut that leaves nothing out
        (["a", "b", "c", "d", "[…]"], False),
        (["c", "[…]", "a"], False),  # out of order
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else str(value),
)
def test_an_output_block_leaves_printed_lines_out_only_where_a_cut_says_so(block, holds):
    printed = "a\nb\nc\nd\n"
    if holds:
        assert_printed(block, printed, "", "page")
        assert_printed(block, "", printed, "page")  # or all on stderr
    else:
        with pytest.raises(AssertionError):
            assert_printed(block, printed, "", "page")


def runnable_pages() -> list[Path]:
    return [path for path in PAGES if any(kind == "run" for _, kind, _ in read_page(path).marks)]


def megatron_core_installed() -> bool:
    """Whether the venv that runs the pages (this one) has megatron-core: outputs marked
    `with megatron-core` name its release."""
    try:
        metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return False
    return True


def reader_folder(folder: Path) -> dict[str, str]:
    """Lay out the folder a reader runs the pages from (a copy of samples/), and return the
    environment the commands run in there."""
    executable = Path(sys.executable).parent / "unsafe-doctor"
    assert executable.exists(), f"{executable}: install the project (pip install -e .) to run its pages"
    shutil.copytree(ROOT / "samples", folder / "samples", ignore=shutil.ignore_patterns("__pycache__"))
    return {
        **clean_environment(),
        "COLUMNS": COLUMNS,
        "PATH": f"{executable.parent}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(folder),
        "NO_COLOR": "1",
        "TERM": "dumb",
    }


def run_page(path: Path, folder: Path, environment: dict[str, str]) -> list[str]:
    """Run the page's run blocks in the folder, in page order, and hold each output block against
    what the run block before it printed. Returns the output blocks not compared here, with why."""
    last: tuple[str, str] | None = None
    ran, not_compared = 0, []
    for block in read_page(path).blocks:
        where = f"{page_id(path)}:{block.line}"
        if block.mark and block.mark[0] == "run":
            assert block.language in ("bash", "sh"), where
            codes = [int(code) for code in re.sub(r"^exit\s*", "", block.mark[1]).split()]
            commands = commands_of(block)
            assert len(codes) == len(commands), f"{where}: one exit code per command"
            stdout, stderr = [], []
            for command, code in zip(commands, codes, strict=True):
                result = subprocess.run(
                    ["bash", "-c", command],
                    cwd=folder,
                    env=environment,
                    capture_output=True,
                    text=True,
                    timeout=300,
                    stdin=subprocess.DEVNULL,
                )
                assert result.returncode == code, f"{where}: {command}\n{result.stdout}\n{result.stderr}"
                stdout.append(result.stdout)
                stderr.append(result.stderr)
            last = ("".join(stdout), "".join(stderr))
            ran += 1
        elif block.mark and block.mark[0] == "output":
            assert last is not None, f"{where}: an output with no run block before it"
            assert block.mark[1] in ("", "with megatron-core"), f"{where}: unknown output mark {block.mark[1]!r}"
            if block.mark[1] and not megatron_core_installed():
                not_compared.append(f"{where} (megatron-core is not installed: the output names its release)")
                continue
            assert_printed(block.lines, *last, where)
    assert ran
    return not_compared


@pytest.mark.parametrize("path", runnable_pages(), ids=page_id)
def test_the_commands_a_page_marks_to_run_exit_and_print_as_it_says(path, tmp_path):
    """A reader who follows one page from a fresh clone."""
    not_compared = run_page(path, tmp_path, reader_folder(tmp_path))
    if not_compared:
        pytest.skip(f"every other block held; not compared: {'; '.join(not_compared)}")


def test_the_pages_run_one_after_another_in_one_folder_as_each_says(tmp_path):
    """A reader who follows the README, then each page, from one folder: no page's files are
    another's (a second `cp -r` into an existing folder nests, a patched copy is not a fresh one)."""
    environment = reader_folder(tmp_path)
    not_compared = [where for path in runnable_pages() for where in run_page(path, tmp_path, environment)]
    if not_compared:
        pytest.skip(f"every other block held; not compared: {'; '.join(not_compared)}")


def test_pages_replay_at_most_three_times():
    """`verify` is the slow command: the pages' run blocks call it three times at most, together."""
    calls = [
        command
        for path in runnable_pages()
        for block in read_page(path).blocks
        if block.mark and block.mark[0] == "run"
        for command in commands_of(block)
        if " verify " in f" {command} "
    ]
    assert len(calls) <= 3, calls


# --- the README ------------------------------------------------------------------------------------


def test_the_readme_stays_a_two_minute_read():
    assert len((ROOT / "README.md").read_bytes()) <= README_LIMIT


def test_the_readme_opens_with_install_and_run_on_a_sample_then_the_test_command():
    page = read_page(ROOT / "README.md")
    first, second = page.blocks[:2]
    assert first.line <= 8 and second.line <= 14, "the title, a sentence, then the two commands"
    [install] = first.lines
    words = shlex.split(install)
    assert words[:3] == ["pip", "install", "."] and words[3] == "&&" and words[4] == "unsafe-doctor", install
    assert (ROOT / words[-1]).is_file(), words[-1]
    assert second.mark == ("test-command", "")
    [test_command] = second.lines
    assert test_command.startswith("pip install torch==2.13.0 -e '.[test]' && python -m pytest"), test_command


def test_ci_runs_the_readme_test_command():
    """.ci/run runs the README's test command; the only difference it may make is pip's --quiet."""
    [test_command] = next(block for block in read_page(ROOT / "README.md").blocks if block.mark == ("test-command", "")).lines
    ci = [line.replace("pip install --quiet ", "pip install ", 1) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci
