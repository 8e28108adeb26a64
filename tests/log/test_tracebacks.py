"""Stage 3: one rank's clean lines -> traceback records.

Most inputs are produced by raising real exceptions and formatting them with `traceback`, so the
text is exactly what Python prints; the rest (older Pythons, torch_npu, cut logs) is written by hand.
"""

from __future__ import annotations

import re
import subprocess
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unsafe_doctor.diagnose.locate import locate
from unsafe_doctor.log.lines import LogLine
from unsafe_doctor.log.tracebacks import Frame, Marker, Traceback, parse_tracebacks
from unsafe_doctor.source.workspace import Workspace

PY311 = sys.version_info >= (3, 11)  # caret lines and exception groups
needs_py311 = pytest.mark.skipif(not PY311, reason="Python 3.11+ output")
UNSAFE = "There is unsafe data in the input tensor."
NPU_ERROR = "[ERROR] 2024-09-26-19:58:19 (PID:991527, Device:3, RankID:3) ERR00003 PTA invalid value"
CPP_STACK = (
    "Exception raised from check_npu_tensor_is_safe at /usr1/02/workspace/j_vqN6BFvg/pytorch/"
    "torch_npu/csrc/core/npu/NPUCachingAllocator.cpp:1234 (most recent call first):\n"
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 "
    "(0x7f3c1e0a3897 in /usr/local/python3.9/lib/python3.9/site-packages/torch/lib/libc10.so)\n"
    "frame #1: <unknown function> + 0x1c9e1f4 (0x7f3b9c8ae1f4 in /usr/local/python3.9/lib/"
    "python3.9/site-packages/torch_npu/lib/libtorch_npu.so)"
)

# The FAQ's screenshot (python3.8: no caret lines), as a hand-written log excerpt.
FAQ_TRACEBACK = f"""\
Traceback (most recent call last):
  File "pretrain_gpt.py", line 121, in <module>
    pretrain(train_valid_test_datasets_provider,
  File "/home/ModelLink/modellink/core/transformer/moe/router.py", line 88, in apply_z_loss
    save_to_aux_losses_tracker("z_loss", z_loss, self.layer_number, self.config.num_layers)
  File "/home/ModelLink/megatron/core/transformer/moe/moe_utils.py", line 172, in save_to_aux_losses_tracker
    parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER[name][layer_number - 1] += loss.detach()
RuntimeError: {UNSAFE}
{NPU_ERROR}"""


def log_lines(text: str, *, rank: int | None = 3, source: str = "train.log", start: int = 0) -> list[LogLine]:
    """One LogLine per text line, offsets as byte offsets from `start`."""
    lines, offset = [], start
    for line in text.split("\n"):
        lines.append(LogLine(rank, line, source, offset))
        offset += len(line.encode()) + 1
    return lines


def parse(text: str) -> list[Traceback]:
    return parse_tracebacks(log_lines(text))


def formatted(function, *args) -> tuple[str, BaseException]:
    """What Python prints for the exception `function(*args)` raises, without the final newline."""
    try:
        function(*args)
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt is one of the cases
        return "".join(traceback.format_exception(exc)).rstrip("\n"), exc
    raise AssertionError("no exception raised")


def unmarked(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """Frames without their position markers (tested on their own below)."""
    return tuple(replace(frame, marker=None) for frame in frames)


def printed_frames(exc: BaseException) -> tuple[Frame, ...]:
    return tuple(Frame(f.filename, f.lineno, f.name, f.line or None) for f in traceback.extract_tb(exc.__traceback__))


# --- exceptions to raise ----------------------------------------------------------------------


def raise_runtime_error(message: str):
    raise RuntimeError(message)


def call_twice(message: str):
    raise_runtime_error(message)


def index_missing_key():
    table = {"a": [1]}
    return table["a"][0] + table["b"]


def raise_keyboard_interrupt():
    raise KeyboardInterrupt


def raise_with_context():
    try:
        raise_runtime_error("first")
    except RuntimeError:
        raise ValueError("second")  # noqa: B904 -- the implicit context ("During handling ...") is what this makes


def raise_with_cause():
    try:
        raise_runtime_error("first")
    except RuntimeError as exc:
        raise ValueError("second") from exc


def raise_from_unraised_cause():
    raise RuntimeError("outer") from ValueError("never raised")


class DistBackendError(RuntimeError):
    pass


DistBackendError.__module__ = "torch.distributed"


def raise_dist_backend_error():
    raise DistBackendError(
        "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled system error, NCCL version 2.20.5\n"
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.\n"
        "Last error:\n"
        "socketStartConnect: Connect to 10.0.0.1<45678> failed : Software caused connection abort"
    )


def recurse(depth: int):
    return recurse(depth + 1)


def raise_group():
    try:
        raise_runtime_error(UNSAFE)
    except RuntimeError as exc:
        raise ExceptionGroup("step failed", [exc, ExceptionGroup("nested", [TypeError("t")])])  # noqa: B904, F821 -- chained as context on purpose


def raise_syntax_error():
    exec("x = (")


# --- the basic shape --------------------------------------------------------------------------


def test_frames_type_and_message_match_what_python_printed():
    text, exc = formatted(call_twice, "boom")
    [tb] = parse(text)
    assert unmarked(tb.frames) == printed_frames(exc)
    assert [f.function for f in tb.frames][-2:] == ["call_twice", "raise_runtime_error"]
    assert (tb.exception_type, tb.message) == ("RuntimeError", "boom")
    assert (tb.truncated, tb.caused_by, tb.chain_kind, tb.error_code) == (False, None, None, None)


def test_rank_source_and_offset_come_from_the_first_line():
    text, _ = formatted(call_twice, "boom")
    lines = log_lines("iteration 10 | loss 1.5\n" + text, rank=5, source="rank_5.log", start=100)
    [tb] = parse_tracebacks(lines)
    assert (tb.rank, tb.source, tb.offset) == (5, "rank_5.log", lines[1].offset)


@needs_py311
def test_caret_lines_are_not_sources_or_frames():
    text, exc = formatted(index_missing_key)
    assert "^^^" in text  # Python >= 3.11 prints them
    [tb] = parse(text)
    assert unmarked(tb.frames) == printed_frames(exc)
    assert tb.frames[-1].source == 'return table["a"][0] + table["b"]'


def test_hand_written_caret_and_tilde_lines_are_skipped():
    text = """\
Traceback (most recent call last):
  File "train.py", line 9, in step
    total = tracker[name] + loss
            ~~~~~~~^^^^^^
  File "train.py", line 3, in helper
    helper()
    ^^^^^^^^
RuntimeError: boom"""
    [tb] = parse(text)
    assert [(f.line, f.source) for f in tb.frames] == [(9, "total = tracker[name] + loss"), (3, "helper()")]


# --- position markers (3.11+): which part of the printed line raised ------------------------

# Real tracebacks of fixtures/tracebacks/marked.py, one per case, as Python 3.11 and 3.13 print them
# (the script's folder printed as /job/): users' jobs run either, and the two mark a line apiece.
TRACEBACKS = Path(__file__).parents[1] / "fixtures" / "tracebacks"
PYTHONS = ("python3.11", "python3.13")
CASES = sorted(path.stem for path in (TRACEBACKS / PYTHONS[0]).glob("*.log"))


def stored(python: str, case: str) -> Traceback:
    [tb] = parse((TRACEBACKS / python / f"{case}.log").read_text().rstrip("\n"))
    return tb


def marked(frame: Frame) -> tuple[str, str] | None:
    """The marked text of a frame's printed line, and its `^` part."""
    if frame.marker is None or frame.source is None:
        return None
    start, end = frame.marker.primary
    return frame.source[frame.marker.start : frame.marker.end], frame.source[start:end]


@pytest.mark.parametrize("case", CASES)
def test_the_stored_tracebacks_are_what_this_python_prints(tmp_path, case):
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if python not in PYTHONS:
        pytest.skip(f"tracebacks are stored as {' and '.join(PYTHONS)} print them")
    script = tmp_path / "marked.py"
    script.write_text((TRACEBACKS / "marked.py").read_text())
    done = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True, check=False, cwd=tmp_path)
    assert done.stderr.replace(f"{tmp_path}/", "/job/") == (TRACEBACKS / python / f"{case}.log").read_text()


# case -> (frame, (marked text, its `^` part) as 3.11 prints it, as 3.13 prints it); None: no markers
MARKERS = {
    "binary": ("step", ("_UNSAFE * 2", "*"), ("_UNSAFE * 2", "*")),  # `~~~~~~~~^~~`: the operator is `^`
    "subscript": ("step", ('_TABLE["é"][0]', "[0]"), ('_TABLE["é"][0]', "[0]")),  # columns count characters, not bytes
    "method": ("step", None, ("_SAFE.add_(_UNSAFE)", "(_UNSAFE)")),  # the whole line: 3.11 prints no markers
    "call": ("step", ("helper(_UNSAFE)", "helper(_UNSAFE)"), ("helper(_UNSAFE)", "(_UNSAFE)")),  # 3.13: the callee `~`
    "lambda": ("<lambda>", ("t.sum()", "t.sum()"), ("t.sum()", "()")),
    "multi-line": ("step", ("cat(", "cat("), None),  # 3.11: to the end of the printed line; 3.13: no markers
    "parameter": ("pair", ("a.mul(b)", "a.mul(b)"), ("a.mul(b)", "(b)")),
}


@pytest.mark.parametrize("case", sorted(MARKERS))
def test_position_markers_are_kept_on_their_frame(case):
    function, *expected = MARKERS[case]
    for python, markers in zip(PYTHONS, expected, strict=True):
        frame = next(frame for frame in stored(python, case).frames if frame.function == function)
        assert marked(frame) == markers, python


def test_a_comprehension_runs_in_a_frame_of_its_own_before_python_3_12():
    """PEP 709: from 3.12 a comprehension runs inline, in its function's frame."""
    before, after = (stored(python, "dictcomp").frames[-3:-2] for python in PYTHONS)
    assert [(frame.function, marked(frame)) for frame in before] == [("<dictcomp>", ("v.sum()", "v.sum()"))]
    assert [(frame.function, marked(frame)) for frame in after] == [("step", ("v.sum()", "()"))]


def test_a_statement_over_several_lines_is_its_first_line():
    """3.11 prints the first line of the statement; 3.13 all of it (the rest is skipped), or with
    `...<N lines>...` for its middle."""
    for case in ("multi-line", "long"):
        for python in PYTHONS:
            frame = stored(python, case).frames[-3]
            assert (frame.function, frame.source) == ("step", "total = cat("), (case, python)


# What matters of a traceback: the culprit line and the global it read, whichever Python printed it,
# with the script's source and from the log alone.
CULPRITS = {  # case -> (frame, its line's text, tensor with source, tensor from the log alone)
    "binary": ("step", "y = _SAFE + _UNSAFE * 2", "_UNSAFE", "_UNSAFE"),
    "subscript": ("step", 'return 1 + _TABLE["é"][0]', '_TABLE["é"]', '_TABLE["é"]'),
    "method": ("step", "_SAFE.add_(_UNSAFE)", "_SAFE", "_SAFE"),
    "call": ("helper", "return t.sum()", "_UNSAFE", "t"),  # the parameter, followed to the caller's argument
    "lambda": ("<lambda>", "return (lambda t: 1 + t.sum())(_UNSAFE)", "t", "t"),
    "dictcomp": ("step", "return {k: v.sum() for k, v in _TABLE.items()}", "_TABLE", "_TABLE"),
    "multi-line": ("step", "total = cat(", "_SAFE", None),  # the log alone does not print the arguments
    "long": ("step", "total = cat(", "_SAFE", None),
    "parameter": ("pair", "return a.mul(b)", "_SAFE", "a"),
}


@pytest.mark.parametrize("case", CASES)
def test_both_pythons_tracebacks_give_the_same_culprit(case):
    function, printed, with_source, log_alone = CULPRITS[case]
    for python in PYTHONS:
        for workspace, tensor in ((Workspace([TRACEBACKS]), with_source), (Workspace([], log_only=True), log_alone)):
            [finding] = locate([stored(python, case)], workspace)
            assert finding.culprit is not None
            culprit = (finding.culprit.file, finding.culprit.function, finding.culprit.source)
            assert culprit == ("/job/marked.py", function, printed), python
            assert (finding.tensor.expression if finding.tensor else None) == tensor, (python, workspace.log_only)


@needs_py311
def test_marker_columns_are_counted_from_the_source_lines_own_indentation(tmp_path):
    """A prefix that shifts every line alike (here two more spaces) shifts the markers too."""
    text = "\n".join(f"  {line}" if line.startswith(" ") else line for line in formatted(index_missing_key)[0].split("\n"))
    [tb] = parse(text)
    assert marked(tb.frames[-1]) == ('table["b"]', '["b"]')


def test_lines_without_markers_or_with_markers_that_do_not_fit_leave_no_marker():
    text = """\
Traceback (most recent call last):
  File "train.py", line 9, in step
    total = tracker[name] + loss
  File "train.py", line 12, in helper
    out = x + y
              ~~~~~~~~~~~^^^^^^^^^
  File "train.py", line 15, in inner
    out = x + y
  iteration 5 | loss 2.0
          ^^^^^
  File "train.py", line 18, in last
    out = x + y
^^^^^
RuntimeError: boom"""
    [tb] = parse(text)
    assert [frame.marker for frame in tb.frames] == [None, None, None, None]  # none, too long, foreign line, too far left
    assert [frame.source for frame in tb.frames] == ["total = tracker[name] + loss", "out = x + y", "out = x + y", "out = x + y"]


def test_a_log_cut_after_a_marker_line_keeps_the_marker():
    text = """\
Traceback (most recent call last):
  File "train.py", line 9, in step
    total = tracker[name] + loss
            ~~~~~~~^^^^^^"""
    [tb] = parse(text)
    assert tb.truncated
    assert tb.frames[0].marker == Marker(8, 21, (15, 21))


def test_frames_without_source_lines():
    text = """\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/usr/lib/python3.11/site-packages/torch/distributed/run.py", line 905, in <module>
    main()
  File "<string>", line 1, in <module>
  File "/opt/x.py", line None, in gone
RuntimeError: boom"""
    [tb] = parse(text)
    assert tb.frames == (
        Frame("<frozen runpy>", 198, "_run_module_as_main", None),
        Frame("<frozen runpy>", 88, "_run_code", None),
        Frame("/usr/lib/python3.11/site-packages/torch/distributed/run.py", 905, "<module>", "main()"),
        Frame("<string>", 1, "<module>", None),
        Frame("/opt/x.py", None, "gone", None),
    )


def test_previous_line_repeated_note_is_skipped():
    text, exc = formatted(recurse, 0)
    assert "[Previous line repeated" in text
    [tb] = parse(text)
    assert tb.exception_type == "RecursionError"
    assert [f.function for f in tb.frames] == ["formatted", "recurse", "recurse", "recurse"]
    assert all(f.source == "return recurse(depth + 1)" for f in tb.frames[1:])


def test_syntax_error_location_is_not_a_frame():
    text, exc = formatted(raise_syntax_error)
    [tb] = parse(text)
    assert unmarked(tb.frames) == printed_frames(exc)
    assert "<string>" not in [f.file for f in tb.frames]
    assert (tb.exception_type, tb.message) == ("SyntaxError", "'(' was never closed")


# --- the exception line -----------------------------------------------------------------------


def test_dotted_type_and_multi_line_message():
    text, exc = formatted(raise_dist_backend_error)
    [tb] = parse(text)
    assert tb.exception_type == "torch.distributed.DistBackendError"
    assert tb.message == str(exc)


def test_bare_type_without_message():
    text, _ = formatted(raise_keyboard_interrupt)
    assert text.endswith("\nKeyboardInterrupt")
    [tb] = parse(text)
    assert (tb.exception_type, tb.message, tb.truncated) == ("KeyboardInterrupt", "", False)


def test_multi_line_message_ends_at_a_blank_line():
    text, _ = formatted(call_twice, "line one\nline two")
    [tb] = parse(text + "\n\nsaving checkpoint\nstep 2")
    assert tb.message == "line one\nline two"


def test_lines_between_a_message_and_the_next_traceback_are_foreign():
    # logger.exception("…") output once logs.py has stripped the record prefixes
    first, _ = formatted(call_twice, "first")
    second, _ = formatted(call_twice, "second")
    tracebacks = parse(f"{first}\nretrying step 12\nError: checkpoint save failed\n{second}")
    assert [tb.message for tb in tracebacks] == ["first", "second"]


# --- chains -----------------------------------------------------------------------------------


def test_context_chain_is_returned_once_as_its_last_link():
    text, _ = formatted(raise_with_context)
    assert "During handling of the above exception" in text
    [tb] = parse(text)
    assert (tb.exception_type, tb.message, tb.chain_kind) == ("ValueError", "second", "context")
    assert [(link.exception_type, link.message) for link in tb.chain()] == [("ValueError", "second"), ("RuntimeError", "first")]
    assert tb.caused_by.chain_kind is None
    assert tb.caused_by.frames[-1].function == "raise_runtime_error"


def test_cause_chain():
    text, _ = formatted(raise_with_cause)
    assert "direct cause" in text
    [tb] = parse(text)
    assert tb.chain_kind == "cause"
    assert tb.caused_by.message == "first"


def test_cause_that_was_never_raised_is_a_link_without_frames():
    text, _ = formatted(raise_from_unraised_cause)
    assert text.startswith("ValueError: never raised\n")
    [tb] = parse(text)
    cause = tb.caused_by
    assert (cause.exception_type, cause.message, cause.frames, cause.truncated) == ("ValueError", "never raised", (), False)
    assert cause.offset == 0 and tb.offset > 0


def test_excerpt_starting_at_a_separator_keeps_the_chain_kind():
    text, _ = formatted(raise_with_cause)
    [tb] = parse(text[text.index("The above exception") :])
    assert (tb.message, tb.chain_kind, tb.caused_by) == ("second", "cause", None)


def test_two_chains_in_a_row_are_two_results():
    text, _ = formatted(raise_with_context)
    tracebacks = parse(f"{text}\n{text}")
    assert [len(tb.chain()) for tb in tracebacks] == [2, 2]


# --- torch_npu's error text ---------------------------------------------------------------------


def test_npu_suffix_on_the_next_line():
    [tb] = parse(FAQ_TRACEBACK)
    assert (tb.exception_type, tb.message) == ("RuntimeError", UNSAFE)
    assert (tb.error_code, tb.npu_rank, tb.device) == ("ERR00003", 3, 3)
    assert tb.frames[-1] == Frame(
        "/home/ModelLink/megatron/core/transformer/moe/moe_utils.py",
        172,
        "save_to_aux_losses_tracker",
        "parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER[name][layer_number - 1] += loss.detach()",
    )


def test_npu_suffix_from_a_real_exception_message():
    text, _ = formatted(call_twice, UNSAFE + "\n" + NPU_ERROR.replace("Device:3, RankID:3", "Device:5, RankID:13"))
    [tb] = parse(text)
    assert (tb.message, tb.error_code, tb.npu_rank, tb.device) == (UNSAFE, "ERR00003", 13, 5)


def test_npu_suffix_joined_to_the_message_line():
    [tb] = parse(FAQ_TRACEBACK.replace(f"{UNSAFE}\n[ERROR]", f"{UNSAFE} [ERROR]"))
    assert (tb.message, tb.error_code, tb.npu_rank, tb.device) == (UNSAFE, "ERR00003", 3, 3)


def test_unset_rank_and_device_are_none():
    [tb] = parse(FAQ_TRACEBACK.replace("Device:3, RankID:3", "Device:-1, RankID:-1"))
    assert (tb.error_code, tb.npu_rank, tb.device) == ("ERR00003", None, None)


def test_compact_error_output():
    [tb] = parse(FAQ_TRACEBACK.replace(NPU_ERROR, "ERR00003 PTA invalid value"))
    assert (tb.message, tb.error_code, tb.npu_rank, tb.device) == (UNSAFE, "ERR00003", None, None)


def test_no_error_code_at_all():
    [tb] = parse(FAQ_TRACEBACK.removesuffix("\n" + NPU_ERROR))
    assert (tb.message, tb.error_code) == (UNSAFE, None)


def test_cpp_stack_is_neither_message_nor_frames():
    text, exc = formatted(call_twice, f"{UNSAFE}\n{NPU_ERROR}\n{CPP_STACK}")
    [tb] = parse(text + "\niteration 11 | loss 1.4")
    assert (tb.message, tb.error_code) == (UNSAFE, "ERR00003")
    assert unmarked(tb.frames) == printed_frames(exc)


def test_cpp_stack_without_error_code_ends_the_message():
    text, _ = formatted(call_twice, f"{UNSAFE}\n{CPP_STACK}")
    [tb] = parse(text)
    assert (tb.message, tb.error_code) == (UNSAFE, None)


def test_npu_suffix_ends_the_message():
    [tb] = parse(FAQ_TRACEBACK + "\nrank:3 catch OTHER exception, error_code:， ex instance:" + UNSAFE)
    assert tb.message == UNSAFE


# --- truncated and partial tracebacks ---------------------------------------------------------


def test_header_and_frames_without_exception_line_at_end_of_log():
    text = FAQ_TRACEBACK.split("\nRuntimeError")[0]
    [tb] = parse(text)
    assert (tb.truncated, tb.exception_type, tb.message, len(tb.frames)) == (True, "", "", 3)


def test_header_and_frames_followed_by_a_run_of_log_lines():
    text = FAQ_TRACEBACK.split("\nRuntimeError")[0]
    noise = "\n".join(f"iteration {i} | loss 1.{i}" for i in range(10))
    [tb] = parse(f"{text}\n{noise}\n{UNSAFE}")
    assert (tb.truncated, tb.exception_type, len(tb.frames)) == (True, "", 3)


def test_frames_without_header_then_exception_line():
    text = FAQ_TRACEBACK.split("\n", 3)[3]  # starts at the second frame
    [tb] = parse(text)
    assert tb.truncated
    assert (tb.exception_type, tb.message, tb.error_code) == ("RuntimeError", UNSAFE, "ERR00003")
    assert [f.function for f in tb.frames] == ["apply_z_loss", "save_to_aux_losses_tracker"]


def test_header_without_frames_is_truncated():
    [tb] = parse(f"Traceback (most recent call last):\nRuntimeError: {UNSAFE}")
    assert (tb.truncated, tb.frames, tb.message) == (True, (), UNSAFE)


def test_orphan_exception_line_is_not_a_traceback():
    assert parse(f"step 3 done\nRuntimeError: {UNSAFE}\n{NPU_ERROR}\nstep 4 done\nRuntimeError: {UNSAFE}") == []


def test_printed_stack_without_exception_is_not_a_traceback():
    stack = "".join(traceback.format_stack()).rstrip("\n")
    assert parse(f"Stack (most recent call last):\n{stack}\nstep done") == []


# --- foreign lines inside a traceback ---------------------------------------------------------


def test_log_line_between_frames_is_skipped():
    lines = FAQ_TRACEBACK.split("\n")
    lines.insert(3, "iteration 1201/ 5000 | consumed samples: 1201 | lm loss: 2.31")
    [tb] = parse("\n".join(lines))
    assert [tb2.frames for tb2 in parse(FAQ_TRACEBACK)] == [tb.frames]
    assert (tb.truncated, tb.message) == (False, UNSAFE)


def test_log_line_between_frames_and_exception_line_is_skipped():
    lines = FAQ_TRACEBACK.split("\n")
    lines.insert(7, "saving checkpoint at iteration 1200")
    [tb] = parse("\n".join(lines))
    assert (tb.truncated, tb.exception_type, tb.message, len(tb.frames)) == (False, "RuntimeError", UNSAFE, 3)


def test_log_line_shaped_like_an_exception_line_between_frames_is_skipped():
    lines = FAQ_TRACEBACK.split("\n")
    lines.insert(3, "Epoch: 3")
    [tb] = parse("\n".join(lines))
    assert (tb.exception_type, tb.message, len(tb.frames), tb.truncated) == ("RuntimeError", UNSAFE, 3, False)


def test_a_long_run_of_log_lines_ends_the_traceback():
    lines = FAQ_TRACEBACK.split("\n")
    lines[3:3] = [f"iteration {i} | loss 2.0" for i in range(6)]
    first, second = parse("\n".join(lines))
    assert (first.truncated, first.exception_type, len(first.frames)) == (True, "", 1)
    assert (second.truncated, second.message, len(second.frames)) == (True, UNSAFE, 2)


# --- exception groups -------------------------------------------------------------------------


@needs_py311
def test_exception_group_gives_its_own_traceback_and_skips_sub_exceptions():
    text, exc = formatted(raise_group)
    assert "+-+---------------- 1 ----------------" in text
    after, _ = formatted(call_twice, "after the group")
    tracebacks = parse(f"{text}\n{after}")
    assert [tb.exception_type for tb in tracebacks] == ["ExceptionGroup", "RuntimeError"]
    group = tracebacks[0]
    assert group.message == "step failed (2 sub-exceptions)"
    assert unmarked(group.frames) == printed_frames(exc)
    assert (group.caused_by.message, group.chain_kind) == (UNSAFE, "context")
    assert tracebacks[1].message == "after the group"


@needs_py311
def test_exception_group_without_traceback_gives_nothing():
    text = "".join(traceback.format_exception(ExceptionGroup("g", [ValueError(1)])))  # noqa: F821
    assert parse(text) == []


# --- size -------------------------------------------------------------------------------------


def test_megabyte_message_line_is_parsed():
    message = "x" * 1_000_000
    text, _ = formatted(call_twice, message)
    [tb] = parse(f"{'y' * 1_000_000}\n{text}\n{NPU_ERROR}")
    assert (tb.message, tb.error_code) == (message, "ERR00003")


def test_ten_thousand_frames_are_parsed():
    frames = [traceback.FrameSummary(f"/src/m{i % 7}.py", i + 1, f"f{i}", line=f"f{i + 1}()") for i in range(10_000)]
    text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) + "RecursionError: deep"
    [tb] = parse(text)
    assert tb.frames == tuple(Frame(f.filename, f.lineno, f.name, f.line) for f in frames)


def test_importing_the_module_does_not_import_torch():
    code = "import sys, unsafe_doctor.log.tracebacks; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# --- properties -------------------------------------------------------------------------------


def is_traceback_syntax(line: str) -> bool:
    """Lines Python or torch_npu print as part of a traceback (so neither noise nor free text)."""
    stripped = line.strip()
    return (
        not stripped
        or stripped.endswith("(most recent call last):")
        or stripped.startswith(('File "', "[Previous line repeated", "Exception raised from", "frame #", "|", "+"))
        or stripped.startswith(("During handling of the above", "The above exception was"))
        or re.search(r"ERR\d{5}", stripped) is not None
        or set(stripped) <= set("^~ ")
    )


printable = st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"))
free_line = st.text(printable, min_size=1, max_size=40).filter(lambda line: not is_traceback_syntax(line))
noise_line = st.one_of(
    st.sampled_from(
        [
            "iteration      100/    1000 | consumed samples: 1600 | lm loss: 7.3E+00",
            "rank:3 catch OTHER exception, error_code:， ex instance:" + UNSAFE,
            "Epoch: 3",
            "Done",
            f"RuntimeError: {UNSAFE}",
            "    indented debug output",
            "status error, rank:8 step: 3 npu_status: 2 run_status: 0",
        ]
    ),
    free_line,
)

SAMPLES = [
    formatted(call_twice, "plain")[0],
    formatted(call_twice, "two\nlines")[0],
    formatted(call_twice, f"{UNSAFE}\n{NPU_ERROR}")[0],
    formatted(call_twice, f"{UNSAFE}\n{NPU_ERROR}\n{CPP_STACK}")[0],
    formatted(raise_with_context)[0],
    formatted(raise_with_cause)[0],
    formatted(raise_keyboard_interrupt)[0],
    formatted(index_missing_key)[0],
    formatted(recurse, 0)[0],
    FAQ_TRACEBACK,
    *([formatted(raise_group)[0]] if PY311 else []),
]


def numbered(blocks: list[list[str]], gaps: list[list[str]]) -> list[LogLine]:
    """Traceback lines get offsets 1000, 2000, … whatever the gaps; gap lines fall in between."""
    lines, number = [], 0
    for block, gap in zip(blocks, gaps, strict=True):
        for k, text in enumerate(gap):
            lines.append(LogLine(0, text, "noisy.log", number * 1000 + 1 + k))
        for text in block:
            number += 1
            lines.append(LogLine(0, text, "noisy.log", number * 1000))
    return lines


@settings(max_examples=150, deadline=None)
@given(data=st.data(), picks=st.lists(st.sampled_from(range(len(SAMPLES))), min_size=1, max_size=4))
def test_noise_between_whole_tracebacks_changes_nothing(data, picks):
    # Noise after the last traceback is left out: at the end of a log it cannot be told apart
    # from the rest of a multi-line message.
    blocks = [SAMPLES[i].split("\n") for i in picks]
    gaps = [data.draw(st.lists(noise_line, max_size=5)) for _ in blocks]
    clean = parse_tracebacks(numbered(blocks, [[] for _ in blocks]))
    assert len(clean) == len(picks)
    assert parse_tracebacks(numbered(blocks, gaps)) == clean


identifier = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,11}", fullmatch=True)
frame_spec = st.tuples(
    st.text(printable, min_size=1, max_size=30),
    st.integers(0, 999),
    st.one_of(identifier, st.sampled_from(["<module>", "<lambda>", "<genexpr>"])),
    st.one_of(st.none(), free_line.map(str.strip).filter(bool)),
)


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(frame_spec, min_size=1, max_size=8),
    module=st.lists(identifier, max_size=2).map(".".join),
    name=identifier,
    first_line=st.text(printable, max_size=40).filter(lambda line: re.search(r"ERR\d{5}", line) is None),
    more_lines=st.lists(free_line, max_size=3),
)
def test_round_trip_of_python_formatted_tracebacks(specs, module, name, first_line, more_lines):
    # Distinct line numbers: Python folds four identical frames into "[Previous line repeated …]".
    frames = [Frame(file, 1000 * i + line, function, source) for i, (file, line, function, source) in enumerate(specs)]
    message = "\n".join([first_line, *more_lines]) if first_line else ""
    error_type = type(name, (Exception,), {"__module__": module or "builtins", "__qualname__": name})
    summaries = [traceback.FrameSummary(f.file, f.line, f.function, line=f.source or "") for f in frames]
    text = (
        "Traceback (most recent call last):\n"
        + "".join(traceback.format_list(summaries))
        + "".join(traceback.format_exception_only(error_type(message)))
    )
    [tb] = parse(text)
    assert tb.frames == tuple(frames)
    assert tb.exception_type == (f"{module}.{name}" if module else name)
    assert tb.message == message
    assert not tb.truncated


@pytest.mark.parametrize("marker", ["    ^^^^^^^^", "  ~~^~~", "^"])
def test_a_marker_line_right_after_the_header_is_no_frame_and_no_crash(marker):
    """A `^^^^` line with no frame above it once raised IndexError from a plain log."""
    [tb] = parse(f"Traceback (most recent call last):\n{marker}\nRuntimeError: There is unsafe data in the input tensor.\n")
    assert tb.frames == () and tb.exception_type == "RuntimeError"
