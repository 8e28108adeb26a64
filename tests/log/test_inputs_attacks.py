"""Hostile-input attacks, each kept as a regression test on real files, FIFOs and processes:
a bad file in a log folder, paths that loop or are too long, pipes that cannot seek, closed stdin, a log
truncated while it is read, nesting past the recursion limit, floods of markers, huge sources, YAML alias
bombs, an audit that wandered above its package, and a reader that leaves the pipe early."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
from helpers import refused, run_cli

from unsafe_doctor.log import inputs, reading

ROOT = Path(__file__).resolve().parents[2]
ERROR_LOG = ROOT / "samples" / "logs" / "megatron_moe_tracker.log"
CLEAN = " iteration        1/ 100000 | lm loss: 2.0 |\n"
UNSAFE_LINE = b"[rank3]: RuntimeError: There is unsafe data in the input tensor.\n"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}


def doctor(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """The CLI in this process, for what the input holds: its output left bytes."""
    return run_cli(*args, stdin=stdin, env={"NO_COLOR": "1"}, encoding=None)


def doctor_in_a_process(*args: str) -> subprocess.CompletedProcess[bytes]:
    """The CLI in a process of its own: where a skipped input is said (on the process's own stderr,
    sys.__stderr__, which no redirection in this process catches), and where a regression would block
    for ever (opening a FIFO no one writes) or depends on the stack (nesting past the recursion limit,
    which the test's own frames would deepen): the 60 s timeout ends it."""
    return subprocess.run([sys.executable, "-m", "unsafe_doctor", *args], capture_output=True, env=ENV, timeout=60)


def in_shell(command: str) -> subprocess.CompletedProcess[bytes]:
    """A bash command line with `$DOCTOR` standing for the CLI, for what only a shell can set up."""
    doctor_command = f"{sys.executable} -m unsafe_doctor"
    return subprocess.run(["bash", "-c", command], capture_output=True, env={**ENV, "DOCTOR": doctor_command}, timeout=60)


PEAK_AT_EXIT = """
import atexit
def _peak():
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    with open(PEAK_FILE, "w") as out:
        out.write(peak)
atexit.register(_peak)
"""


def run_measured(script: str, *args: str) -> tuple[int, int, str]:
    """(exit code, peak RSS in MB, stdout) of a Python script run in a fresh process. The peak is the
    process's own (VmHWM): a child's ru_maxrss also counts the parent's pages it shared before exec."""
    with tempfile.TemporaryDirectory() as folder:
        peak_file = Path(folder) / "peak"
        prelude = f"PEAK_FILE = {str(peak_file)!r}\n" + PEAK_AT_EXIT
        result = subprocess.run([sys.executable, "-c", prelude + script, *args], stdout=subprocess.PIPE, env=ENV, timeout=120)
        return result.returncode, int(peak_file.read_text()) // 1024, result.stdout.decode()


# --- 1. one bad file does not stop a folder run -------------------------------------------------------


def rank_folder(tmp_path: Path) -> Path:
    """Per-rank logs: two clean ranks, one with the unsafe-data error, a truncated .gz and a core dump."""
    folder = tmp_path / "ranks"
    folder.mkdir()
    (folder / "rank_0.log").write_text(CLEAN)
    (folder / "rank_1.log").write_text(CLEAN)
    shutil.copy(ERROR_LOG, folder / "rank_3.log")
    whole = gzip.compress(CLEAN.encode() * 2000)
    (folder / "rank_2.log.gz").write_bytes(whole[: len(whole) // 2])
    (folder / "core.out").write_bytes(Path(os.path.realpath(sys.executable)).read_bytes()[:65536])
    return folder


def test_a_truncated_gz_and_a_core_dump_are_skipped_with_one_warning_each_and_the_rest_diagnosed(tmp_path):
    result = doctor_in_a_process("diagnose", str(rank_folder(tmp_path)), "--no-input")
    warnings = [line for line in result.stderr.decode().splitlines() if line.startswith("unsafe-doctor: skipped ")]
    assert result.returncode == 1, result.stderr  # the error in rank_3.log was found
    assert "Traceback" not in result.stderr.decode()
    assert len(warnings) == 2
    assert any("core.out" in line and "not a text log" in line for line in warnings)
    assert any("rank_2.log.gz" in line and "corrupt gzip data" in line for line in warnings)


def test_json_lists_the_skipped_inputs_with_their_reasons(tmp_path):
    result = doctor("diagnose", str(rank_folder(tmp_path)), "--format", "json")
    document = json.loads(result.stdout)
    skipped = {Path(item["name"]).name: item["reason"] for item in document["skipped_inputs"]}
    assert skipped.keys() == {"core.out", "rank_2.log.gz"}
    assert {Path(item["name"]).name for item in document["inputs"]} == {"rank_0.log", "rank_1.log", "rank_3.log"}
    assert document["findings"]


def test_a_folder_with_nothing_readable_exits_2_in_one_line(tmp_path):
    folder = tmp_path / "ranks"
    folder.mkdir()
    (folder / "core.out").write_bytes(bytes(range(256)) * 64)
    (folder / "rank_0.log.gz").write_bytes(gzip.compress(CLEAN.encode() * 2000)[:100])
    refused(doctor_in_a_process("diagnose", str(folder)), "none of the 2 inputs could be read")


def test_a_fifo_inside_a_log_folder_is_not_opened(tmp_path):
    folder = tmp_path / "ranks"
    folder.mkdir()
    (folder / "rank_0.log").write_text(CLEAN)
    os.mkfifo(folder / "rank_1.log")  # nobody writes it: opening it would wait forever
    result = doctor_in_a_process("diagnose", str(folder), "--format", "json")
    assert result.returncode == 0, result.stderr
    assert [item["name"] for item in json.loads(result.stdout)["inputs"]] == [str(folder / "rank_0.log")]


# --- 2. no tracebacks -----------------------------------------------------------------------------------


def hostile_paths(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Name -> (path, the phrase its one-line error holds)."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "file.log").write_text(CLEAN)
    return {
        "symlink loop": (str(tmp_path / "loop"), "too many levels of symbolic links"),
        "ENOTDIR": (str(tmp_path / "file.log" / "x"), "not a directory"),
        "over NAME_MAX": (str(tmp_path / ("a" * 300)), "file name too long"),
        "over PATH_MAX": (str(tmp_path / "/".join(["a"] * 3000)), "file name too long"),
    }


@pytest.mark.parametrize("command", ["diagnose", "audit"])
@pytest.mark.parametrize("attack", ["symlink loop", "ENOTDIR", "over NAME_MAX", "over PATH_MAX"])
def test_paths_that_loop_cross_a_file_or_are_too_long_are_one_line_errors(tmp_path, command, attack):
    path, phrase = hostile_paths(tmp_path)[attack]
    refused(doctor(command, path), phrase)


def test_a_named_fifo_is_read_as_a_stream(tmp_path):
    fifo = tmp_path / "live.log"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "wb") as writer:
            writer.write(ERROR_LOG.read_bytes())

    feeder = threading.Thread(target=feed)
    feeder.start()
    result = doctor_in_a_process("diagnose", str(fifo), "--format", "json")
    feeder.join(timeout=10)
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["findings"]


def test_process_substitution_and_dev_stdin_are_read_without_seeking(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(gzip.compress(ERROR_LOG.read_bytes()))  # gzip is told by peeking, not by rewinding
    for command in (f'$DOCTOR diagnose <(cat "{log}") --format json', f'cat "{log}" | $DOCTOR diagnose /dev/stdin --format json'):
        result = in_shell(command)
        assert result.returncode == 1, (command, result.stderr)
        assert json.loads(result.stdout)["findings"], command


@pytest.mark.parametrize(("arguments", "phrase"), [("", "no input: name a log file"), ("-", "stdin is closed")])
def test_closed_stdin_is_a_one_line_usage_error(arguments, phrase):
    refused(in_shell(f"$DOCTOR diagnose {arguments} <&-"), phrase)


TRUNCATE_WHILE_READING = """
import sys
from unsafe_doctor.log import inputs
inputs.PARALLEL_MIN = 1 << 62  # read here, where the progress callback runs between two reads
path = sys.argv[1]
truncated = []
def progress(count):
    if not truncated:
        open(path, "wb").close()  # another process rotating the log: the file shrinks to nothing
        truncated.append(count)
scan = inputs.scan([path], (), progress=progress)
print(scan.inputs[0].bytes, truncated[0])
"""


def test_a_log_truncated_while_it_is_read_ends_the_read_instead_of_killing_the_process(tmp_path):
    """A memory-mapped log that shrinks raises SIGBUS on the next page touched (exit 135); the mapped
    reader reported progress every 64 MB, hence a log past that."""
    log = tmp_path / "train.log"
    log.write_bytes(CLEAN.encode() * ((80 << 20) // len(CLEAN)))
    size = log.stat().st_size
    code, _, output = run_measured(TRUNCATE_WHILE_READING, str(log))
    assert code == 0
    read, before_the_cut = map(int, output.split())
    assert read == before_the_cut < size  # what was read before the cut, and nothing after


NESTED_CALLS = "_STATE" + "()" * 950  # parses, but deeper than Python's recursion limit lets a walker follow
# Parses on Python 3.10 to 3.13 (3.11's parser stops near 2,750 terms), but is deeper than a study
# of the file can follow on each (3.13 follows 950 terms).
NESTED_SUM = "+".join(["_STATE"] * 2500)
TOO_DEEP_TO_PARSE = "-" * 30_000 + "loss"  # no Python parses it: its parser's stack overflows (a MemoryError)


def deep_package(tmp_path: Path, expression: str) -> Path:
    package = tmp_path / "src" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "state.py").write_text(
        textwrap.dedent(f"""\
        import torch

        _STATE = {{}}

        def step(name, loss):
            if name not in _STATE:
                _STATE[name] = torch.zeros(4, device=torch.cuda.current_device())
            _STATE[name] = {expression}
        """)
    )
    return package


def deep_log(tmp_path: Path, package: Path, line: int, source: str) -> Path:
    log = tmp_path / "train.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        f'  File "{package / "state.py"}", line {line}, in step\n'
        f"    {source}\n"
        "RuntimeError: There is unsafe data in the input tensor.\n"
    )
    return log


def test_a_culprit_line_nested_too_deeply_is_a_note_not_a_crash_in_locate(tmp_path):
    package = deep_package(tmp_path, NESTED_CALLS)
    result = doctor_in_a_process(
        "diagnose", str(deep_log(tmp_path, package, 8, f"_STATE[name] = {NESTED_CALLS}")), "--format", "json"
    )
    assert result.returncode == 1, result.stderr.decode()[-2000:]
    (finding,) = json.loads(result.stdout)["findings"]
    assert any("nested too deeply to analyse" in note for note in finding["notes"])


def test_a_file_nested_too_deeply_is_left_out_of_the_heuristics_in_diagnose_and_audit(tmp_path):
    package = deep_package(tmp_path, NESTED_SUM)
    log = deep_log(tmp_path, package, 7, "_STATE[name] = torch.zeros(4, device=torch.cuda.current_device())")
    diagnosed = doctor_in_a_process("diagnose", str(log), "--format", "json")
    assert diagnosed.returncode == 1, diagnosed.stderr.decode()[-2000:]
    assert "nested too deeply to read" in json.loads(diagnosed.stdout)["findings"][0]["reason"]
    audited = doctor_in_a_process("audit", str(package), "--format", "json")
    assert audited.returncode == 1, audited.stderr.decode()[-2000:]
    (holder,) = json.loads(audited.stdout)["holders"]
    assert "nested too deeply to read" in json.dumps(holder)


def test_a_file_too_deep_to_parse_is_said_so_not_sent_to_a_source_root(tmp_path):
    package = deep_package(tmp_path, TOO_DEEP_TO_PARSE)
    log = deep_log(tmp_path, package, 7, "_STATE[name] = torch.zeros(4, device=torch.cuda.current_device())")
    diagnosed = doctor_in_a_process("diagnose", str(log), "--format", "json")
    assert diagnosed.returncode == 1, diagnosed.stderr.decode()[-2000:]
    (finding,) = json.loads(diagnosed.stdout)["findings"]
    assert f"{package / 'state.py'}, which defines it, is nested too deeply or too complex to parse" in finding["reason"]
    assert "--source-root" not in finding["reason"]
    assert f"{package / 'state.py'} is nested too deeply or too complex to parse (generated code?)" in finding["notes"]


# --- 3. bounded memory ------------------------------------------------------------------------------


def test_a_marker_on_every_line_keeps_no_more_than_the_excerpt_budget_and_counts_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "EXCERPT_BUDGET", 2 << 20)
    log = tmp_path / "flood.log"
    log.write_bytes(UNSAFE_LINE * ((24 << 20) // len(UNSAFE_LINE)))
    scan = inputs.scan([str(log)], ())
    kept = sum(len(window.text) for window in scan.windows)
    assert kept <= reading.EXCERPT_BUDGET + reading.BEFORE + reading.AFTER
    assert scan.hits == log.stat().st_size // len(UNSAFE_LINE)
    assert scan.hits_not_parsed > scan.hits * 0.8


FLOOD = """
import sys
from unsafe_doctor.log import reading
reading.EXCERPT_BUDGET = 2 << 20  # the budget and the windows scaled down with the input, so the test stays fast
reading.BEFORE = reading.AFTER = 4 << 10
from unsafe_doctor.cli import main
main(["diagnose", sys.argv[1], "--format", "json"])
"""


def test_peak_memory_does_not_grow_with_a_flood_of_markers(tmp_path):
    """Both sizes exceed the bytes the reader keeps whatever the input (its history and the budget)."""
    peaks = []
    for megabytes in (64, 128):
        log = tmp_path / f"flood{megabytes}.log"
        log.write_bytes(UNSAFE_LINE * ((megabytes << 20) // len(UNSAFE_LINE)))
        code, peak, output = run_measured(FLOOD, str(log))
        assert code == 1
        assert json.loads(output)["summary"]["unsafe_messages_not_parsed"] > 0
        peaks.append(peak)
        log.unlink()
    assert peaks[1] - peaks[0] < 16, peaks  # 64 MB more input, nearly no more memory


def test_a_frame_pointing_at_a_2gb_source_file_does_not_read_it(tmp_path):
    huge = tmp_path / "huge.py"
    with huge.open("wb") as handle:
        handle.truncate(2 << 30)  # sparse: no disk used, but 2 GB to whoever reads it
    log = tmp_path / "train.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        f'  File "{huge}", line 3, in step\n'
        "    _STATE += 1\n"
        "RuntimeError: There is unsafe data in the input tensor.\n"
    )
    script = "import sys\nfrom unsafe_doctor.cli import main\nmain(['diagnose', sys.argv[1], '--format', 'json'])"
    code, peak, output = run_measured(script, str(log))
    assert code == 1
    assert peak < 400, peak
    (finding,) = json.loads(output)["findings"]
    assert any("larger than 16 MB: not read" in note for note in finding["notes"])


def generated_module(path: Path, size: int) -> int:
    """A module of `size` bytes of small functions, as code generators write them; its last line."""
    lines = ["import torch", "_BUF = torch.zeros(4)"]
    written = sum(map(len, lines))
    while written < size:
        lines.append(f"def f{len(lines)}(a, b):\n    return a + b * {len(lines)} - _BUF[0]")
        written += len(lines[-1])
    path.write_text("\n".join(lines) + "\n")
    return path.read_text().count("\n")


def test_a_4mb_generated_module_is_not_parsed_in_diagnose_nor_in_audit(tmp_path):
    """The 16 MB cap once bounded the bytes read, not the tree built from them: a frame naming
    this 4 MB module took diagnose to 2.1 GB (its tree alone is 880 MB)."""
    package = tmp_path / "generated"
    package.mkdir()
    module = package / "ops.py"
    last = generated_module(module, 4 << 20)
    shutil.copy(ROOT / "samples" / "framework" / "toytrain" / "state.py", package / "state.py")
    log = tmp_path / "train.log"
    log.write_text(
        f'Traceback (most recent call last):\n  File "{module}", line {last}, in f\n    return _BUF[0]\n'
        "RuntimeError: There is unsafe data in the input tensor.\n"
    )
    script = "import sys\nfrom unsafe_doctor.cli import main\nmain(['diagnose', sys.argv[1], '--format', 'json'])"
    code, peak, output = run_measured(script, str(log))
    assert code == 1 and peak < 400, peak
    (finding,) = json.loads(output)["findings"]
    assert any("has more than 300,000 tokens (generated code?): not parsed" in note for note in finding["notes"])

    script = "import sys\nfrom unsafe_doctor.cli import main\nmain(['audit', sys.argv[1]])"
    code, peak, output = run_measured(script, str(package))
    assert code == 1 and peak < 400, peak
    assert "1 file not scanned" in output and "ops.py" in output and "LOSS_LOG" in output


ALIAS_BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
rules: [{id: x, references: *f}]
"""


@pytest.mark.parametrize("command", [["rules", "validate"], ["diagnose", "-", "--rules"]])
def test_a_yaml_alias_bomb_is_refused_in_one_line_before_it_expands(tmp_path, command):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB)
    assert len(ALIAS_BOMB) < 320
    result = doctor(*command, str(bomb), stdin=CLEAN.encode())
    refused(result, "aliases expand this file past", prefix="")  # rules validate names the file first


def test_a_yaml_alias_that_contains_itself_is_refused(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.write_text("rules: &r [*r]\n")
    refused(doctor("rules", "validate", str(loop)), "an alias refers to a node that contains it", prefix="")  # the file first


def test_a_fifo_given_as_rules_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "rules.yaml"
    os.mkfifo(fifo)
    refused(doctor_in_a_process("rules", "validate", str(fifo)), "not a regular file", prefix="")  # the file first


def test_a_rules_file_with_thousands_of_problems_prints_a_bounded_number_of_lines(tmp_path):
    rules = tmp_path / "many.yaml"
    rules.write_text("rules:\n" + "".join(f"  - id: r{index}\n" for index in range(2000)))
    result = doctor("rules", "validate", str(rules))
    lines = result.stderr.decode().splitlines()
    assert result.returncode != 0
    assert 1 < len(lines) <= 51
    assert "more schema problems not shown" in lines[-1]


# --- 4. audit reads only what it is given ---------------------------------------------------------------

COUNT_OPENS = """
import json
import sys
opened = set()
outside = sys.argv[1]
def hook(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].startswith(outside) and args[0].endswith(".py"):
        opened.add(args[0])
sys.addaudithook(hook)
from unsafe_doctor.cli import main
try:
    main(["audit", sys.argv[2], "--format", "json"])
finally:
    print(json.dumps(sorted(opened)), file=sys.stderr)
"""


def test_audit_reads_no_python_file_beside_the_package_and_never_opens_a_fifo_there(tmp_path):
    package = deep_package(tmp_path, "_STATE[name] + 1")
    parent = package.parent
    for index in range(50):
        (parent / f"script_{index}.py").write_text("from pkg.state import _STATE\n\ndef f():\n    _STATE.clear()\n")
    os.mkfifo(parent / "waiting.py")  # nobody writes it: opening it would hang the audit
    result = subprocess.run(
        [sys.executable, "-c", COUNT_OPENS, str(parent), str(package)], capture_output=True, env=ENV, timeout=60
    )
    assert result.returncode == 1, result.stderr.decode()[-2000:]
    opened = json.loads(result.stderr.decode().strip().splitlines()[-1])
    assert all(Path(path).is_relative_to(package) for path in opened if Path(path).exists()), opened
    assert json.loads(result.stdout)["holders"]


# --- 5. a reader that leaves early ----------------------------------------------------------------------


@pytest.mark.parametrize("output_format", ["json", "text", "sarif"])
def test_a_reader_closing_the_pipe_keeps_the_exit_code_the_result_deserves(tmp_path, output_format):
    clean = tmp_path / "clean.log"
    clean.write_text(CLEAN)
    for log, deserved in ((clean, 0), (ERROR_LOG, 1)):
        read_end, write_end = os.pipe()
        os.close(read_end)  # `| head -c0`: gone before anything is written
        try:
            result = subprocess.run(
                [sys.executable, "-m", "unsafe_doctor", "diagnose", str(log), "--format", output_format, "--no-input"],
                stdout=write_end,
                stderr=subprocess.PIPE,
                env=ENV,
                timeout=60,
            )
        finally:
            os.close(write_end)
        assert result.returncode == deserved, (log.name, result.stderr)
        for noise in (b"Traceback", b"BrokenPipe", b"Broken pipe", b"Exception ignored"):
            assert noise not in result.stderr


def test_a_skipped_file_whose_name_holds_escape_sequences_is_named_escaped(tmp_path):
    folder = tmp_path / "ranks"
    folder.mkdir()
    shutil.copy(ERROR_LOG, folder / "rank_0.log")
    (folder / "core\x1b]0;owned\x07.out").write_bytes(b"\x00\x01\x02 binary")
    result = doctor_in_a_process("diagnose", str(folder), "--no-input")
    assert result.returncode == 1, result.stderr
    assert b"\x1b" not in result.stderr and b"\x07" not in result.stderr
    assert b"core\\x1b]0;owned\\x07.out" in result.stderr


@pytest.mark.parametrize("command", [("diagnose",), ("diagnose", "--format", "json"), ("audit", "--format", "json")])
def test_a_report_that_cannot_be_written_is_one_line_and_exit_2(command):
    target = ROOT / "samples" / ("framework" if command[0] == "audit" else "logs/faq_modellink.log")
    with open("/dev/full", "wb") as full:
        result = subprocess.run(
            [sys.executable, "-m", "unsafe_doctor", command[0], str(target), *command[1:]],
            stdout=full,
            stderr=subprocess.PIPE,
            env=ENV,
            timeout=120,
        )
    assert result.returncode == 2
    assert result.stderr.decode().splitlines() == [
        "unsafe-doctor: cannot write the report to standard output: no space left on device"
    ]
