"""The input stage: which bytes are found and kept, from files, folders, gzip and stdin."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unsafe_doctor.errors import UsageError
from unsafe_doctor.log import inputs, reading
from unsafe_doctor.log.arguments import DUMP_MARKERS
from unsafe_doctor.log.lines import split_lines

ERROR_LINE = "RuntimeError: There is unsafe data in the input tensor.\n"
MARKERS = (b"check uce memory result",)
FACT_MARKERS = (b"| loss scale: ", b"fp16 ........")


def iteration(step: int, scale: str) -> str:
    return f" iteration {step:>8d}/ 100000 | lm loss: 1.234E+00 | loss scale: {scale} |\n"


def noise(count: int, start: int = 0) -> str:
    return "".join(f" iteration {i:>8d}/ 100000 | lm loss: 1.234E+00 |\n" for i in range(start, start + count))


def write(path, text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    path.write_bytes(data)
    return str(path)


def test_window_holds_whole_lines_around_the_hit_and_nothing_far_away(tmp_path):
    text = noise(100_000) + "Traceback (most recent call last):\n" + ERROR_LINE + noise(100_000, 100_000)
    scan = inputs.scan([write(tmp_path / "train.log", text)], MARKERS)
    assert scan.hits == 1
    [window] = scan.windows
    assert ERROR_LINE in window.text and "Traceback (most recent call last):\n" in window.text
    assert len(window.text.encode()) <= reading.BEFORE + reading.AFTER
    assert window.text.startswith(" iteration") and window.text.endswith("|\n")  # no cut lines
    assert text.encode().index(window.text.encode()) == window.start


def test_recovery_lines_before_the_error_are_kept_as_single_lines(tmp_path):
    text = "rank 3 check uce memory result: 3\n" + noise(40_000) + ERROR_LINE
    scan = inputs.scan([write(tmp_path / "train.log", text)], MARKERS)
    assert [excerpt.text for excerpt in scan.context] == ["rank 3 check uce memory result: 3\n"]
    assert scan.context[0].start == 0


def test_only_the_last_fact_line_before_the_first_error_is_kept(tmp_path):
    fp16 = "  fp16 ............................................ True\n"
    text = (
        fp16
        + iteration(1, "65536.0")
        + noise(20_000)
        + iteration(2, "32768.0")
        + noise(100)
        + ERROR_LINE
        + iteration(3, "16384.0")
        + ERROR_LINE
    )
    scan = inputs.scan([write(tmp_path / "train.log", text)], MARKERS, fact_markers=FACT_MARKERS)
    assert [fact.text for fact in scan.facts] == [fp16, iteration(2, "32768.0")]
    assert [text.encode().index(fact.text.encode()) for fact in scan.facts] == [fact.start for fact in scan.facts]


def test_an_input_without_the_error_gives_the_fact_lines_at_its_end(tmp_path):
    """torchrun --log-dir: the last rank prints the iteration lines, another rank the traceback."""
    printer = write(tmp_path / "rank_7.log", iteration(1, "1.0") + noise(40_000) + iteration(2, "65536.0") + noise(10))
    failed = write(tmp_path / "rank_3.log", noise(10) + ERROR_LINE)
    scan = inputs.scan([failed, printer], MARKERS, fact_markers=FACT_MARKERS)
    [fact] = scan.facts
    assert (fact.source, fact.rank_hint, fact.text) == (printer, 7, iteration(2, "65536.0"))


def test_a_fact_line_cut_by_the_searched_span_is_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "CONTEXT_SPAN", 1000)
    monkeypatch.setattr(reading, "BEFORE", 1000)
    long_line = "x" * 2500 + " | loss scale: 65536.0 |\n"  # begins before the 2000 bytes searched
    text = noise(100) + iteration(1, "1.0") + long_line + ERROR_LINE
    scan = inputs.scan([write(tmp_path / "x.log", text)], MARKERS, fact_markers=FACT_MARKERS)
    assert scan.hits == 1 and scan.facts == ()


def test_an_input_past_the_budget_is_counted_without_facts(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "EXCERPT_BUDGET", reading.BEFORE + reading.AFTER)
    text = "rank 3 check uce memory result: 3\n" + iteration(1, "65536.0") + ERROR_LINE
    paths = [write(tmp_path / f"rank_{rank}.log", text) for rank in (0, 1)]
    scan = inputs.scan(paths, MARKERS, fact_markers=FACT_MARKERS)
    assert (scan.hits, scan.hits_not_parsed, len(scan.windows)) == (2, 1, 1)
    assert [fact.source for fact in scan.facts] == [paths[0]]


def test_input_without_the_error_keeps_only_its_tail(tmp_path):
    text = noise(50_000) + "RuntimeError: HCCL timeout\n"
    scan = inputs.scan([write(tmp_path / "train.log", text)], MARKERS)
    assert scan.hits == 0 and not scan.windows
    [tail] = scan.tails
    assert tail.text.endswith("RuntimeError: HCCL timeout\n")
    assert len(tail.text) <= reading.TAIL


def test_a_files_end_is_cut_into_text_only_when_no_input_has_a_hit(tmp_path):
    quiet = write(tmp_path / "rank_0.log", noise(5_000) + "RuntimeError: HCCL timeout\n")
    size, status = os.path.getsize(quiet), os.stat(quiet)
    with open(quiet, "rb") as handle:
        found, _ = reading.read(handle, reading.Reading(quiet, 0), regular=True)
    assert found.tail == reading.Unread(max(0, size - reading.TAIL), size, (status.st_dev, status.st_ino))
    [tail] = inputs.scan([quiet], MARKERS).tails
    piped = inputs.scan(["-"], MARKERS, stdin=io.BytesIO(Path(quiet).read_bytes()))
    assert (tail.start, tail.text) == (piped.tails[0].start, piped.tails[0].text)
    faulty = write(tmp_path / "rank_1.log", noise(10) + ERROR_LINE)
    assert inputs.scan([quiet, faulty], MARKERS).tails == ()


def test_a_file_named_twice_gives_each_tail_its_own_name(tmp_path):
    """`-` with a file redirected into stdin is read as /proc/self/fd/0: named that way too, the same
    path is two inputs, and each tail keeps its own name."""
    log = write(tmp_path / "quiet.log", noise(100) + "RuntimeError: HCCL timeout\n")
    script = (
        "from unsafe_doctor.log import inputs; "
        "print([tail.source for tail in inputs.scan(['-', '/proc/self/fd/0'], (b'x',)).tails])"
    )
    with open(log, "rb") as stdin:
        shown = subprocess.run([sys.executable, "-c", script], stdin=stdin, capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "['<stdin>', '/proc/self/fd/0']"


@pytest.mark.parametrize("change", ["written anew in its place", "cut shorter", "removed"])
def test_the_end_of_a_file_changed_since_it_was_read_is_not_taken_for_what_was_read(tmp_path, change):
    path = write(tmp_path / "rank_0.log", noise(100) + "RuntimeError: HCCL timeout\n")
    with open(path, "rb") as handle:
        found, _ = reading.read(handle, reading.Reading(path, 0), regular=True)
    assert isinstance(found.tail, reading.Unread)
    if change == "written anew in its place":
        os.unlink(path)
        write(Path(path), noise(100) + "RuntimeError: another job\n")
    elif change == "cut shorter":
        os.truncate(path, 100)
    else:
        os.unlink(path)
    with pytest.raises(reading.Unreadable, match="replaced or cut shorter|read failed"):
        reading.tail_of(path, found.tail, reading.Reading(path, 0))


def test_gzip_is_recognised_by_magic_bytes_not_name(tmp_path):
    path = tmp_path / "rank_5.txt"
    path.write_bytes(gzip.compress((noise(10) + ERROR_LINE).encode()))
    scan = inputs.scan([str(path)], MARKERS)
    assert scan.hits == 1 and ERROR_LINE in scan.windows[0].text
    assert scan.inputs[0].rank_hint == 5
    assert scan.inputs[0].bytes == len((noise(10) + ERROR_LINE).encode())


def test_folder_is_searched_recursively_in_natural_order_with_torchrun_ranks(tmp_path):
    for rank in (10, 2):
        (tmp_path / "attempt_0" / str(rank)).mkdir(parents=True)
        write(tmp_path / "attempt_0" / str(rank) / "stderr.log", ERROR_LINE)
    write(tmp_path / "attempt_0" / "2" / "core.bin", b"\x00\x01")  # not a log name: ignored
    scan = inputs.scan([str(tmp_path)], MARKERS)
    assert [info.rank_hint for info in scan.inputs] == [2, 10]
    assert [window.rank_hint for window in scan.windows] == [2, 10]


@pytest.mark.parametrize(
    ("path", "rank"),
    [
        ("logs/rank_3.log", 3),
        ("worker-12.txt", 12),
        ("out/attempt_1/7/stdout.log", 7),
        ("out/attempt_0/7/stderr.log.gz", 7),
        ("train.log", None),
        ("run2024/train.log", None),
    ],
)
def test_rank_from_path(path, rank):
    assert inputs.rank_from_path(path) == rank


def test_several_inputs_keep_their_names_and_sizes(tmp_path):
    a = write(tmp_path / "a.log", noise(3))
    b = write(tmp_path / "b.log", ERROR_LINE)
    scan = inputs.scan([a, b], MARKERS)
    assert [(info.name, info.bytes) for info in scan.inputs] == [(a, len(noise(3))), (b, len(ERROR_LINE))]
    assert [window.source for window in scan.windows] == [b]


def test_invalid_utf8_and_nul_bytes_are_replaced_not_fatal(tmp_path):
    data = b"\xff\xfe garbage \x00 line\n" + ERROR_LINE.encode()
    scan = inputs.scan([write(tmp_path / "x.log", data)], MARKERS)
    assert "\ufffd" in scan.windows[0].text and ERROR_LINE in scan.windows[0].text


def test_a_line_of_many_megabytes_without_newline_is_read_in_bounded_pieces(tmp_path):
    data = b"x" * (40 << 20) + ERROR_LINE.encode()
    scan = inputs.scan([], MARKERS, stdin=io.BytesIO(data))
    assert scan.hits == 1
    # the giant line is cut by the window edge, so only the error line itself survives
    assert scan.windows[0].text == ""
    assert scan.inputs[0].bytes == len(data)


def test_hits_beyond_the_budget_are_counted_not_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "EXCERPT_BUDGET", reading.BEFORE + reading.AFTER)
    monkeypatch.setattr(reading, "WINDOW_MAX", reading.BEFORE + reading.AFTER)
    block = noise(60_000)
    text = (ERROR_LINE + block) * 3
    scan = inputs.scan([write(tmp_path / "x.log", text)], MARKERS)
    assert scan.hits == 3
    assert len(scan.windows) == 1 and scan.hits_not_parsed == 2


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(["noise", "error", "uce", "long", "scale", "fp16", "record"]),
        min_size=1,
        max_size=40,
    ),
    st.integers(min_value=7, max_value=4096),
)
def test_stdin_and_file_give_the_same_scan(tmp_path_factory, pieces, chunk):
    """A file and the same bytes on stdin keep exactly the same excerpts, whatever the chunk size."""
    parts = {
        "noise": noise(3),
        "error": "Traceback (most recent call last):\n" + ERROR_LINE,
        "uce": "rank 3 check uce memory result: 3\n",
        "long": "y" * 5000 + "\n",
        "scale": iteration(7, "65536.0"),
        "fp16": "  fp16 ............................................ True\n",
        "record": "[unsafe-doctor sentinel] rank 3 [unsafe-doctor sentinel] {}\n",
    }
    data = "".join(parts[p] for p in pieces).encode()
    path = tmp_path_factory.mktemp("same") / "x.log"
    path.write_bytes(data)
    small = dict(BEFORE=300, AFTER=200, CONTEXT_SPAN=2000, TAIL=500, WINDOW_MAX=900, CHUNK=chunk)
    saved = {name: getattr(reading, name) for name in small}
    try:
        for name, value in small.items():
            setattr(reading, name, value)
        records = (b"[unsafe-doctor sentinel]",)
        from_file = inputs.scan([str(path)], MARKERS, fact_markers=FACT_MARKERS, record_markers=records)
        from_stdin = inputs.scan(["-"], MARKERS, fact_markers=FACT_MARKERS, record_markers=records, stdin=io.BytesIO(data))
    finally:
        for name, value in saved.items():
            setattr(reading, name, value)
    assert from_stdin.hits == from_file.hits == data.count(reading.ERROR_MARKER)
    assert [(w.start, w.text) for w in from_stdin.windows] == [(w.start, w.text) for w in from_file.windows]
    assert [(c.start, c.text) for c in from_stdin.context] == [(c.start, c.text) for c in from_file.context]
    assert [t.text for t in from_stdin.tails] == [t.text for t in from_file.tails]
    assert [(f.start, f.text) for f in from_stdin.facts] == [(f.start, f.text) for f in from_file.facts]
    assert [(r.start, r.text) for r in from_stdin.records] == [(r.start, r.text) for r in from_file.records]
    assert len(from_file.records) == pieces.count("record")


def test_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        inputs.scan([str(tmp_path / "nope.log")], MARKERS)


def test_folder_without_logs_is_a_usage_error(tmp_path):
    write(tmp_path / "notes.md", "hello")
    with pytest.raises(UsageError, match="no log files"):
        inputs.scan([str(tmp_path)], MARKERS)


def test_corrupt_gzip_is_a_usage_error(tmp_path):
    data = gzip.compress(noise(1000).encode())
    with pytest.raises(UsageError, match="corrupt gzip data"):
        inputs.scan([write(tmp_path / "x.log.gz", data[: len(data) // 2])], MARKERS)


def test_binary_junk_is_a_usage_error(tmp_path):
    """A real binary (the interpreter itself) named like a log; random bytes sit too near the cut-off."""
    executable = Path(os.path.realpath(sys.executable)).read_bytes()[:4096]
    with pytest.raises(UsageError, match="not a text log"):
        inputs.scan([write(tmp_path / "x.log", executable)], MARKERS)


def test_empty_stdin_is_a_usage_error():
    with pytest.raises(UsageError, match="stdin is empty"):
        inputs.scan([], MARKERS, stdin=io.BytesIO(b""))


NOBODY = 65534


def unprivileged(action: Callable[[], object]) -> str:
    """What `action` raised (`Type: message`, '' for nothing) in a forked child that, under root,
    first becomes an ordinary user: root reads files whatever their mode."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports through the pipe and leaves without running pytest's cleanup
        report = ""
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            action()
        except BaseException as error:  # everything the child raised is the report
            report = f"{type(error).__name__}: {error}"
        finally:
            os.write(write_end, report.encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read().decode()
    os.waitpid(pid, 0)
    return report


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder anyone may enter (tmp_path is its owner's alone), so only a file's own mode stops a reader."""
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)
        yield Path(folder)


def test_unreadable_file_is_a_usage_error(open_folder):
    path = open_folder / "x.log"
    write(path, ERROR_LINE)
    path.chmod(0o644)
    assert unprivileged(lambda: inputs.scan([str(path)], MARKERS)) == ""
    path.chmod(0)
    assert unprivileged(lambda: inputs.scan([str(path)], MARKERS)) == f"UsageError: {path}: permission denied"


# --- reading in worker processes -----------------------------------------------------------------


RECORD = '[unsafe-doctor sentinel] rank 3: unsafe x {"schema": "unsafe-doctor/sentinel/v1"}\n'
DUMP = "------------------------ arguments ------------------------\n  fp16 ............................................ True\n"


def _everything(scan: inputs.Scan) -> tuple[object, ...]:
    return (
        scan.inputs,
        scan.hits,
        scan.hits_not_parsed,
        scan.skipped,
        scan.records_not_kept,
        [
            (e.source, e.start, e.text)
            for group in (scan.windows, scan.context, scan.facts, scan.tails, scan.records, scan.dumps)
            for e in group
        ],
    )


def _scan_all(paths: list[str]) -> inputs.Scan:
    return inputs.scan(
        paths, MARKERS, fact_markers=FACT_MARKERS, record_markers=(b"[unsafe-doctor sentinel]",), dump_markers=DUMP_MARKERS
    )


@pytest.mark.parametrize("layout", ["one file", "a folder", "a folder with a broken gzip"])
def test_worker_processes_keep_exactly_what_one_process_keeps(tmp_path, monkeypatch, layout):
    """Forced into workers (one file's two passes apart, or one file each), the scan is the same to the byte."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for rank in range(3 if layout != "one file" else 1):
        text = DUMP + noise(2000) + "rank 3 check uce memory result: 3\n" + RECORD + iteration(9, "4096.0")
        text += "Traceback (most recent call last):\n" + ERROR_LINE + noise(50) + RECORD * 2 + "no newline at the end"
        (logs / f"rank_{rank}.log").write_text(text)
    if layout == "a folder with a broken gzip":
        (logs / "rank_9.log.gz").write_bytes(gzip.compress(noise(2000).encode())[:500])
    paths = [str(logs / "rank_0.log")] if layout == "one file" else [str(logs)]
    monkeypatch.setattr(reading, "CHUNK", 4096)  # workers are forked: they read with the same settings
    alone = _scan_all(paths)
    monkeypatch.setattr(inputs, "PARALLEL_MIN", 1)
    monkeypatch.setattr(inputs, "PART_MIN", 1000)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    in_workers = _scan_all(paths)
    assert _everything(in_workers) == _everything(alone)
    assert len(alone.records) == 3 * len(alone.inputs) and alone.hits == len(alone.inputs)
    assert len(alone.skipped) == (layout == "a folder with a broken gzip")


def _window_lines(scan: inputs.Scan) -> Counter[tuple[int, str]]:
    """Each line the windows hold, with its offset, as often as the windows hold it."""
    counted: Counter[tuple[int, str]] = Counter()
    for window in scan.windows:
        offset = window.start
        for line in window.text.splitlines(keepends=True):
            counted[(offset, line)] += 1
            offset += len(line.encode())
    return counted


@pytest.mark.parametrize("cores", [2, 3, 5, 16])
def test_a_file_read_in_parts_keeps_what_one_reader_keeps(tmp_path, monkeypatch, cores):
    """Windows that meet across a part's edge are cut again as one (no line parsed twice); a line
    across the edge is kept once; hits, context, facts, records and dumps are the one reader's."""
    for name, value in dict(BEFORE=300, AFTER=200, CONTEXT_SPAN=2000, WINDOW_MAX=900, CHUNK=512, RECORD_LINE_MAX=400).items():
        monkeypatch.setattr(reading, name, value)
    two_tags = "[unsafe-doctor sentinel] rank 3 [unsafe-doctor sentinel] {}\n"
    text = (
        "".join(
            noise(step % 3)
            + ("rank 3 check uce memory result: 3\n" if step % 7 == 0 else "")
            + two_tags
            + ("Traceback (most recent call last):\n" + ERROR_LINE if step % 2 == 0 and step < 150 else "")
            for step in range(300)
        )
        + "[unsafe-doctor sentinel] "
        + "x" * 1000
        + "\n"
    )
    path = write(tmp_path / "x.log", text)
    alone = _scan_all([path])
    monkeypatch.setattr(inputs, "PARALLEL_MIN", 1)
    monkeypatch.setattr(inputs, "PART_MIN", 1000)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert len(inputs._tasks([(path, path, None)], cores)) == cores
    in_parts = _scan_all([path])
    in_parts_lines, alone_lines = _window_lines(in_parts), _window_lines(alone)
    assert set(in_parts_lines) == set(alone_lines)
    assert all(in_parts_lines[line] <= alone_lines[line] for line in in_parts_lines)
    assert (in_parts.hits, in_parts.hits_not_parsed, in_parts.context, in_parts.facts) == (
        alone.hits,
        alone.hits_not_parsed,
        alone.context,
        alone.facts,
    )
    assert (in_parts.records, in_parts.records_not_kept, in_parts.dumps) == (alone.records, alone.records_not_kept, alone.dumps)
    assert alone.hits == 75 and len(alone.records) == 300 and alone.records_not_kept == 1


def test_the_excerpt_budget_is_spent_in_input_order_when_workers_read_the_inputs(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "EXCERPT_BUDGET", reading.BEFORE + reading.AFTER)
    paths = [write(tmp_path / f"rank_{rank}.log", noise(10) + ERROR_LINE) for rank in range(4)]
    monkeypatch.setattr(inputs, "PARALLEL_MIN", 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    scan = inputs.scan(paths, MARKERS)
    assert [window.source for window in scan.windows] == [paths[0]]
    assert scan.hits == 4 and scan.hits_not_parsed == 3


@pytest.mark.parametrize("marker", ["error", "record"])
def test_a_marker_across_the_edge_of_two_reads_is_found_wherever_the_edge_cuts_it(tmp_path, monkeypatch, marker):
    """A chunk is searched for a marker only if it holds the bytes all markers share (`unsafe`): one cut
    by the edge must still be found, in the later chunk, for every place the edge can cut it."""
    monkeypatch.setattr(reading, "CHUNK", 4096)
    line = ERROR_LINE if marker == "error" else RECORD
    shared = line.index("unsafe")
    for cut in range(-len(line), len(line) + 1):
        lead = "x" * (4096 - shared - 6 + cut) + "\n"  # the edge falls `cut` bytes into the line's `unsafe...`
        data = (lead + line + noise(300)).encode()
        path = write(tmp_path / f"cut_{cut}.log", data)
        from_file = _scan_all([path])
        from_stdin = inputs.scan(["-"], MARKERS, record_markers=(b"[unsafe-doctor sentinel]",), stdin=io.BytesIO(data))
        for scan in (from_file, from_stdin):
            assert (scan.hits, len(scan.records)) == ((1, 0) if marker == "error" else (0, 1)), cut


def test_a_line_packed_with_record_tags_is_one_line(tmp_path):
    packed = "[unsafe-doctor sentinel]" * 1000 + "\n"
    too_long = "[unsafe-doctor sentinel]" * (reading.RECORD_LINE_MAX // 10) + "\n"
    scan = inputs.scan([write(tmp_path / "x.log", packed + too_long + RECORD)], (), record_markers=(b"[unsafe-doctor sentinel]",))
    assert [excerpt.text for excerpt in scan.records] == [packed, RECORD]
    assert scan.records_not_kept == 1  # the line too long to keep, once, not once per tag


def test_past_the_count_of_hits_parsed_hits_are_counted_only(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "HITS_PARSED", 10)
    count = 2 * reading.AFTER // len(ERROR_LINE)  # the window reaches AFTER bytes past the tenth hit, not to the end
    scan = inputs.scan([write(tmp_path / "x.log", ERROR_LINE * count)], MARKERS)
    assert scan.hits == count
    assert scan.hits_not_parsed == count - 10
    assert sum(window.text.count(ERROR_LINE) for window in scan.windows) < count * 0.6


def test_a_worker_that_dies_loses_no_input(tmp_path, monkeypatch):
    """A worker killed mid-read (out of memory, kill -9): what it had not sent back is read here."""
    paths = [write(tmp_path / f"rank_{rank}.log", noise(100) + ERROR_LINE + RECORD) for rank in range(4)]
    alone = _scan_all(paths)
    here, real_read = os.getpid(), reading.read

    def dying_read(stream, one, **options):
        if os.getpid() != here and one.name == paths[2]:
            os._exit(9)
        return real_read(stream, one, **options)

    monkeypatch.setattr(reading, "read", dying_read)
    monkeypatch.setattr(inputs, "PARALLEL_MIN", 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert _everything(_scan_all(paths)) == _everything(alone)


def test_the_progress_of_a_file_read_in_parts_adds_up_to_its_size(tmp_path, monkeypatch):
    path = write(tmp_path / "x.log", noise(20_000) + ERROR_LINE + noise(20_000))
    monkeypatch.setattr(inputs, "PARALLEL_MIN", 1)
    monkeypatch.setattr(inputs, "PART_MIN", 100_000)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert len(inputs._tasks([(path, path, None)], 3)) == 3
    counted: list[int] = []
    inputs.scan([path], MARKERS, progress=counted.append)
    assert sum(counted) == os.path.getsize(path)


STDIN_IN_PARTS = """
import os, sys
from unsafe_doctor.log import inputs
inputs.PARALLEL_MIN = inputs.PART_MIN = 1000
os.sched_getaffinity = lambda pid: {0, 1}
planned = inputs._tasks
def tasks(sources, cores):
    found = planned(sources, cores)
    print([(task.path, task.part is not None) for task in found], file=sys.stderr)
    return found
inputs._tasks = tasks
from unsafe_doctor.cli import main
main(["diagnose", "--format", "json", *sys.argv[1:]])
"""


def test_a_file_redirected_into_stdin_is_read_as_that_file_in_parts(tmp_path):
    """`unsafe-doctor < train.log`: the same findings as the file named, read in parts (a pipe cannot be)."""
    log = write(tmp_path / "train.log", noise(5000) + "Traceback (most recent call last):\n" + ERROR_LINE + noise(5000))
    with open(log, "rb") as stdin:
        redirected = subprocess.run([sys.executable, "-c", STDIN_IN_PARTS], stdin=stdin, capture_output=True, text=True)
    named = subprocess.run([sys.executable, "-c", STDIN_IN_PARTS, log], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert redirected.returncode == named.returncode == 1, redirected.stderr
    assert f"[('{inputs.STDIN_FILE}', True), ('{inputs.STDIN_FILE}', True)]" in redirected.stderr
    from_stdin, from_file = json.loads(redirected.stdout), json.loads(named.stdout)
    assert from_stdin["findings"] == from_file["findings"] and from_stdin["summary"] == from_file["summary"]
    assert [each["name"] for each in from_stdin["inputs"]] == ["<stdin>"]


@pytest.mark.parametrize("cores", [1, 3])
def test_every_rank_tag_in_the_input_is_counted_however_little_of_it_is_parsed(tmp_path, monkeypatch, cores):
    """A large log's ranks were once counted in its parsed windows only. Thousands of ranks (the
    pattern of the ranks not seen yet is built again as they come), one that speaks once far from
    any window, tags across the reader's chunk edges, and a file read in parts."""
    for name, value in dict(BEFORE=300, AFTER=200, CONTEXT_SPAN=2000, CHUNK=512, RECORD_LINE_MAX=400).items():
        monkeypatch.setattr(reading, name, value)
    ranks = list(range(3000))
    random.Random(36).shuffle(ranks)
    head = "".join(f"[rank{rank}]: starting\n" for rank in ranks)
    text = (
        head
        + noise(2000)
        + "[rank4095]: one line, far from the error\n"
        + noise(2000)
        + "[rank1234567890]: no rank has ten digits\n"
        + noise(500)
        + "[rank3]: "
        + ERROR_LINE
    )
    path = write(tmp_path / "x.log", text)
    monkeypatch.setattr(inputs, "PARALLEL_MIN", 1)
    monkeypatch.setattr(inputs, "PART_MIN", 10_000)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert len(inputs._tasks([(path, path, None)], cores)) == cores
    scan = _scan_all([path])
    parsed = "".join(window.text for window in (*scan.windows, *scan.context))
    assert "[rank3]:" in parsed and all(f"[rank{rank}]:" not in parsed for rank in (0, 4095))
    assert scan.ranks_tagged == {*range(3000), 4095}


def test_a_rank_tag_is_counted_over_the_whole_input_as_far_as_a_parsed_line_names_its_rank(tmp_path):
    """The count once took six digits at most, the lines' parser nine: `[rank1234567]:` named
    its line's rank where parsed but was not counted. Parsed or not, a tag counts when its line names a rank."""
    tags = ["[rank1234567]:", "[rank123456789]:", "[rank1234567890]:"]  # seven, nine and ten digits
    far = "".join(f"{tag} far from the error\n" for tag in tags)
    near = "".join(f"{tag} next to the error\n" for tag in tags)
    path = write(tmp_path / "x.log", far + noise(60_000) + near + "[rank3]: " + ERROR_LINE)
    scan = _scan_all([path])
    parsed = [line for window in scan.windows for line in split_lines(window.text, source="x.log", base_offset=0, rank_hint=None)]
    assert "far from the error" not in "".join(line.text for line in parsed)
    named = {line.rank for line in parsed if "next to the error" in line.text}
    assert named == {1234567, 123456789, None}
    assert scan.ranks_tagged == {1234567, 123456789, 3}
