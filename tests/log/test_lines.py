"""Stage 2: cleaning lines and attributing them to ranks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unsafe_doctor.diagnose.locate import locate
from unsafe_doctor.log.lines import LogLine, by_rank, normalise, split_lines
from unsafe_doctor.log.tracebacks import parse_tracebacks
from unsafe_doctor.source.workspace import Workspace

NPU_ERROR = "[ERROR] 2024-09-26-19:58:19 (PID:991527, Device:3, RankID:3) ERR00003 PTA invalid value"


# --- terminal noise -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, text",
    [
        ("\x1b[31mRuntimeError\x1b[0m: boom", "RuntimeError: boom"),
        ("\x1b[2K\x1b[1;32mok\x1b[m", "ok"),
        ("\x1b]0;window title\x07shown", "shown"),
    ],
)
def test_ansi_escape_sequences_are_removed(raw, text):
    assert normalise(raw) == (None, text)


def test_ansi_codes_before_a_rank_prefix_do_not_hide_it():
    assert normalise("\x1b[33m[rank2]: warning\x1b[0m") == (2, "warning")


def test_crlf_line_end_is_removed():
    assert normalise("Traceback (most recent call last):\r") == (None, "Traceback (most recent call last):")


def test_lone_cr_keeps_what_the_terminal_shows_last():
    assert normalise("abc\rdef\rghi") == (None, "ghi")
    assert normalise("abc\rdef\rghi\r") == (None, "ghi")


def test_progress_bar_keeps_the_rank_of_its_line_prefix():
    assert normalise("[default1]: 10%|#   | 1/10\r 20%|##  | 2/10") == (1, " 20%|##  | 2/10")


def test_nul_bytes_are_removed():
    assert normalise("Runtime\x00Error\x00") == (None, "RuntimeError")


# --- rank prefixes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, rank, text",
    [
        (
            "[rank3]: RuntimeError: There is unsafe data in the input tensor.",
            3,
            "RuntimeError: There is unsafe data in the input tensor.",
        ),
        ("[default3]:iteration 10", 3, "iteration 10"),
        ("[default3]:[rank3]: iteration 10", 3, "iteration 10"),
        ("[default3]:[rank11]: Traceback (most recent call last):", 11, "Traceback (most recent call last):"),
        ("[trainer12]:hello", 12, "hello"),
        ("3: Traceback (most recent call last):", 3, "Traceback (most recent call last):"),
        ("[pod/llama-worker-3/pytorch] loss 1.5", 3, "loss 1.5"),
        ("[pod/x-1/c] [rank9]: boom", 9, "boom"),
        ("[pod/x-1/c] [default2]:boom", 2, "boom"),
        ("[pod/llama-launcher-abcde/c] boom", None, "boom"),
    ],
)
def test_rank_prefixes_are_stripped_and_name_the_rank(raw, rank, text):
    assert normalise(raw) == (rank, text)


def test_most_specific_rank_prefix_wins_regardless_of_order():
    assert normalise("[default0]:[rank8]: x") == (8, "x")
    assert normalise("[pod/w-1/c] 5: x") == (5, "x")
    assert normalise("7: [rank9]: x") == (9, "x")


def test_clock_time_at_line_start_is_not_a_rank():
    assert normalise("12:30:01 epoch done") == (None, "12:30:01 epoch done")


def test_numeric_prefix_needs_text_after_it():
    assert normalise("3: ") == (None, "3: ")


def test_number_after_a_rank_prefix_is_message_text():
    assert normalise("[rank1]: 2: second item") == (1, "2: second item")


def test_traceback_indentation_survives_prefix_removal():
    assert normalise('[rank3]:   File "x.py", line 3, in f') == (3, '  File "x.py", line 3, in f')
    assert normalise("[default3]:    x += 1") == (3, "    x += 1")  # torchrun's tee adds no space
    assert normalise('[default3]:[rank3]:   File "x.py", line 3, in f') == (3, '  File "x.py", line 3, in f')
    assert normalise("3:     ^^^^^") == (3, "    ^^^^^")


# --- timestamps and logger headers ---------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, text",
    [
        ("2026-06-04 09:24:31.767278 iteration 5", "iteration 5"),
        ("2024-09-26 19:58:19,123 iteration 5", "iteration 5"),
        ("[2024-12-24 11:56:59,095] iteration 5", "iteration 5"),
        ("2024-06-16T20:34:34.123456789Z iteration 5", "iteration 5"),
        (
            "2026-06-04 09:24:31.767278 warn 3062106 [TTP controller.cpp:2510] status error, rank:8 step: 3 "
            "npu_status: 2 run_status: 0 data_aval: 0 data_status: 0 diff_time : 0",
            "status error, rank:8 step: 3 npu_status: 2 run_status: 0 data_aval: 0 data_status: 0 diff_time : 0",
        ),
        ("2026-06-04 09:24:31.7 3062106 info receive repair message", "receive repair message"),
        ("[2024-12-24 11:56:59,095][10][ERROR][ttp_mindx_api:56] remove broken link", "remove broken link"),
        ("2024-01-01 00:00:00,000 - megatron.training - INFO - iteration 5", "iteration 5"),
        (
            "[12345][PYH tft_rollback.py:88] rank:3 successfully gather and rollback at iteration 1200",
            "rank:3 successfully gather and rollback at iteration 1200",
        ),
        (
            "2026-06-04 09:24:31.767278 info 3062106 [61234][PYH tft_optimizer_data_repair.py:50] rank:3 ok",
            "rank:3 ok",
        ),
        ("INFO:root:msg", "INFO:root:msg"),
    ],
)
def test_timestamps_and_logger_headers_are_removed(raw, text):
    assert normalise(raw) == (None, text)


def test_torch_npu_error_code_line_is_kept_verbatim():
    assert normalise(NPU_ERROR) == (None, NPU_ERROR)
    assert normalise("[rank3]: " + NPU_ERROR) == (3, NPU_ERROR)


def test_rank_prefix_then_logger_header_are_both_removed():
    assert normalise("[rank4]: 2024-09-26 19:58:19,123 - root - WARNING - slow step") == (4, "slow step")


def test_plain_line_passes_unchanged():
    line = "    parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER[name][layer_number - 1] += loss.detach()"
    assert normalise(line) == (None, line)


# --- splitting ------------------------------------------------------------------------------------


def test_split_lines_gives_byte_offsets_from_the_excerpt_start():
    text = "héllo\r\n[rank1]: wörld\nlast"
    lines = split_lines(text, source="a.log", base_offset=100, rank_hint=None)
    assert lines == [
        LogLine(None, "héllo", "a.log", 100),
        LogLine(1, "wörld", "a.log", 100 + len("héllo\r\n".encode())),
        LogLine(None, "last", "a.log", 100 + len("héllo\r\n[rank1]: wörld\n".encode())),
    ]


def test_split_lines_uses_the_rank_hint_only_for_lines_without_a_prefix():
    lines = split_lines("a\n[rank5]: b\n", source="rank_2.log", base_offset=0, rank_hint=2)
    assert [(line.rank, line.text) for line in lines] == [(2, "a"), (5, "b")]


def test_split_lines_keeps_empty_lines_and_no_phantom_last_line():
    lines = split_lines("a\n\nb\n", source="x", base_offset=0, rank_hint=None)
    assert [line.text for line in lines] == ["a", "", "b"]


def test_split_lines_offsets_stay_monotonic_over_replaced_bytes():
    raw = b"ok\n\xff\xfe bad\n\xe4\xb8 cut\nend\n"
    lines = split_lines(raw.decode("utf-8", "replace"), source="x", base_offset=0, rank_hint=None)
    offsets = [line.offset for line in lines]
    assert offsets == sorted(set(offsets))
    assert [line.text for line in lines][-1] == "end"


def test_split_lines_handles_megabytes():
    """How fast is measured by benchmarks/diagnose_speed.py; here, that 4 MB split line for line."""
    block = (
        "[default3]:[rank3]: iteration 10/100 | loss 1.5 | lr 1e-4\n"
        "plain line without any prefix at all, just text\n"
        "2024-09-26 19:58:19,123 - root - INFO - step done\n"
        '[rank3]:   File "x.py", line 3, in f\n'
    )
    text = block * (4_000_000 // len(block))
    lines = split_lines(text, source="big.log", base_offset=0, rank_hint=None)
    assert len(lines) == 4 * (4_000_000 // len(block))
    assert {line.rank for line in lines[:4]} == {3, None}


def test_by_rank_groups_in_order():
    lines = split_lines("[rank1]: a\n[rank0]: b\n[rank1]: c\nd\n", source="x", base_offset=0, rank_hint=None)
    groups = by_rank(lines)
    assert {rank: [line.text for line in group] for rank, group in groups.items()} == {
        1: ["a", "c"],
        0: ["b"],
        None: ["d"],
    }


# --- property: interleaved ranks come apart in order ----------------------------------------------

_PREFIX_STYLES = (
    lambda rank, other: f"[rank{rank}]: ",
    lambda rank, other: f"[default{rank}]:",  # torchrun's tee: no space after it
    lambda rank, other: f"{rank}: ",
    lambda rank, other: f"[default{other}]:[rank{rank}]: ",
    lambda rank, other: f"[pod/job-worker-{other}/main] [rank{rank}]: ",
    lambda rank, other: f"[pod/job-worker-{rank}/main] ",
    lambda rank, other: f"\x1b[32m[rank{rank}]: ",
)
_BODY = st.builds(
    lambda indent, first, rest: indent + first + rest,
    st.sampled_from(["", " ", "  ", "    "]),  # traceback indentation must survive
    st.sampled_from("abcXYZ"),
    st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=30),
)
_LINE = st.tuples(
    st.one_of(st.none(), st.integers(0, 63)),
    st.integers(0, len(_PREFIX_STYLES) - 1),
    st.integers(0, 63),
    _BODY,
)


@settings(deadline=None)  # hypothesis' 200 ms per example is a speed check; speed is benchmarks/' job
@given(st.lists(_LINE, max_size=40))
def test_by_rank_recovers_each_ranks_lines_in_order(entries):
    raw_lines = [body if rank is None else _PREFIX_STYLES[style](rank, other) + body for rank, style, other, body in entries]
    text = "".join(line + "\n" for line in raw_lines)
    lines = split_lines(text, source="mixed.log", base_offset=7, rank_hint=None)

    expected: dict[int | None, list[str]] = {}
    for rank, _, _, body in entries:
        expected.setdefault(rank, []).append(body)
    assert {rank: [line.text for line in group] for rank, group in by_rank(lines).items()} == expected

    encoded = text.encode()
    for line, raw in zip(lines, raw_lines, strict=True):
        assert encoded[line.offset - 7 :].startswith(raw.encode())


# --- prefixes of the tools between a job and its log file -----------------------------------------

CRI_TIME = "2026-12-01T13:00:33.79284Z"


@pytest.mark.parametrize(
    "raw, rank, text",
    [
        # container runtime (CRI), as containerd and CRI-O write it
        (f'{CRI_TIME} stderr F [rank3]:   File "x.py", line 3, in f', 3, '  File "x.py", line 3, in f'),
        ("2026-12-01T13:00:33Z stdout F iteration 5", None, "iteration 5"),
        ("2026-12-01T13:00:33.5+08:00 stdout F    indented", None, "   indented"),
        # Python logging
        ("2026-01-01 10:00:00,123 ERROR [launcher] [rank3]:     x += 1", 3, "    x += 1"),
        ("2026-01-01 10:00:00,123 INFO iteration 5", None, "iteration 5"),
        ("2026-01-01 10:00:00,123 - launcher - ERROR - [default2]:  Traceback", 2, "  Traceback"),
        # syslog (RFC 3164, rsyslog), with and without a host, day space-padded or not
        ('Dec  1 13:00:33 node1 torchrun[4242]: [rank5]:   File "x.py"', 5, '  File "x.py"'),
        ("Dec 01 13:00:33 node1 kernel: iteration 5", None, "iteration 5"),
        ("Jan  1 10:00:00 torchrun[77]: [default1]:x", 1, "x"),
        # kubectl logs --prefix --timestamps
        (f"[pod/train-worker-3/pytorch] {CRI_TIME} [rank9]:   File", 9, "  File"),
    ],
)
def test_each_prefix_kind_is_peeled(raw, rank, text):
    assert normalise(raw) == (rank, text)


def test_words_like_a_month_or_a_stream_are_message_text():
    assert normalise("Dec 1 was the day") == (None, "Dec 1 was the day")
    assert normalise("Mar  3 12:00:00 is when") == (None, "Mar  3 12:00:00 is when")
    assert normalise("During handling of the above exception") == (None, "During handling of the above exception")
    assert normalise("2026-12-01 13:00:33 stdout F-score") == (None, "stdout F-score")  # a timestamp, then text


@pytest.mark.parametrize(
    "raw",
    [
        # the runtime outermost, as a container's log file holds it
        f'{CRI_TIME} stderr F 2026-01-01 10:00:00,123 ERROR [launcher] [default3]:[rank3]:   File "x.py"',
        # a forwarder's syslog stamp outside the runtime's line
        f'Dec  1 13:00:33 node1 containerd[1]: {CRI_TIME} stderr F [default3]:[rank3]:   File "x.py"',
        # kubectl outside a logging formatter, syslog inside it
        f"[pod/job-worker-0/c] {CRI_TIME} 2026-01-01 10:00:00,123 - root - ERROR - "
        'Dec  1 13:00:33 h p[2]: [rank3]:   File "x.py"',
        # colour around and inside every prefix
        f"\x1b[2m{CRI_TIME}\x1b[0m stderr F 2026-01-01 10:00:00,123 \x1b[31mERROR\x1b[0m [launcher] "
        '\x1b[36m[default3]:\x1b[0m[rank3]:   File "x.py"',
        'Dec  1 13:00:33 node1 torchrun[4242]: \x1b[33m[pod/x-1/c]\x1b[0m [rank3]:   File \x1b[1m"x.py"\x1b[0m',
    ],
)
def test_stacked_prefixes_peel_in_any_order(raw):
    assert normalise(raw) == (3, '  File "x.py"')


def test_cri_partial_lines_are_joined_per_stream():
    text = (
        f'{CRI_TIME} stderr P [rank3]:   File "/usr/lib/pyth\n'
        f"{CRI_TIME} stdout F [rank0]: iteration 10\n"
        f'{CRI_TIME} stderr P on3.11/x.py", line 3,\n'
        f"{CRI_TIME} stdout P [rank0]: iter\n"
        f"{CRI_TIME} stderr F  in f\n"
        f"{CRI_TIME} stdout F ation 11\n"
        f"{CRI_TIME} stderr F [rank3]:     x += 1\n"
    )
    lines = split_lines(text, source="c.log", base_offset=10, rank_hint=None)
    line_starts = [10 + offset for offset in range(len(text)) if offset == 0 or text[offset - 1] == "\n"]
    assert [(line.rank, line.text, line.offset) for line in lines] == [
        (3, '  File "/usr/lib/python3.11/x.py", line 3, in f', line_starts[0]),
        (0, "iteration 10", line_starts[1]),
        (0, "iteration 11", line_starts[3]),
        (3, "    x += 1", line_starts[6]),
    ]


def test_cri_pieces_behind_outer_prefixes_are_joined():
    text = (
        f"Dec  1 13:00:33 node1 containerd[1]: {CRI_TIME} stderr P [rank3]: Runtime\n"
        f"Dec  1 13:00:33 node1 containerd[1]: {CRI_TIME} stderr F Error: boom\n"
    )
    assert [(line.rank, line.text) for line in split_lines(text, source="c", base_offset=0, rank_hint=None)] == [
        (3, "RuntimeError: boom")
    ]


def test_colour_code_cut_by_the_runtime_is_removed_once_joined():
    text = f"{CRI_TIME} stderr P [rank3]: \x1b[1;3\n{CRI_TIME} stderr F 1mRuntimeError\x1b[0m: boom\n"
    assert [(line.rank, line.text) for line in split_lines(text, source="c", base_offset=0, rank_hint=None)] == [
        (3, "RuntimeError: boom")
    ]


def test_a_partial_line_cut_by_the_excerpt_end_is_kept_as_far_as_it_goes():
    text = f'{CRI_TIME} stderr P [rank3]:   File "x.py", li\n'
    assert [(line.rank, line.text) for line in split_lines(text, source="c", base_offset=0, rank_hint=None)] == [
        (3, '  File "x.py", li')
    ]


# --- property: any stack of prefixes over a traceback gives the same finding ----------------------

_TRACEBACK = """Traceback (most recent call last):
  File "/opt/lib/megatron/core/transformer/moe/router.py", line 272, in apply_z_loss
    save_to_aux_losses_tracker(
  File "/opt/lib/megatron/core/transformer/moe/moe_utils.py", line 172, in save_to_aux_losses_tracker
    parallel_state._MOE_LAYER_WISE_LOGGING_TRACKER[name][layer_number - 1] += loss.detach()
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~^^^^^^^^^^^^^^^^^^^^^^
RuntimeError: There is unsafe data in the input tensor.
[ERROR] 2026-11-30-03:40:12 (PID:991527, Device:3, RankID:3) ERR00003 PTA invalid value
""".splitlines()


@dataclass(frozen=True)
class _Line:
    stream: str
    text: str


def _cri(limit: int) -> Callable[[list[_Line]], list[_Line]]:
    """containerd's writer with a `limit`-byte buffer; the other stream's next line lands between pieces."""

    def pieces(line: _Line) -> list[_Line]:
        cuts = [line.text[at : at + limit] for at in range(0, len(line.text), limit)] or [""]
        tags = ["P"] * (len(cuts) - 1) + ["F"]
        return [_Line(line.stream, f"{CRI_TIME} {line.stream} {tag} {cut}") for tag, cut in zip(tags, cuts, strict=True)]

    def layer(lines: list[_Line]) -> list[_Line]:
        out, index = [], 0
        while index < len(lines):
            own = pieces(lines[index])
            if len(own) > 1 and index + 1 < len(lines) and lines[index + 1].stream != lines[index].stream:
                out += own[:1] + pieces(lines[index + 1]) + own[1:]
                index += 2
            else:
                out += own
                index += 1
        return out

    return layer


def _prefixing(prefix: str) -> Callable[[list[_Line]], list[_Line]]:
    return lambda lines: [_Line(line.stream, prefix + line.text) for line in lines]


_OUTER_PREFIXES = {
    "logging": "2026-01-01 10:00:00,123 ERROR [launcher] ",
    "logging-default": "2026-01-01 10:00:00,123 - launcher - \x1b[31mERROR\x1b[0m - ",
    "syslog": "Dec  1 13:00:33 node1 torchrun[4242]: ",
    "kubectl": f"[pod/job-master/pytorch] {CRI_TIME} ",
    "ansi": "\x1b[2m",
}
_STACK = st.tuples(
    st.lists(st.sampled_from(sorted(_OUTER_PREFIXES)), unique=True).flatmap(st.permutations),
    st.one_of(st.none(), st.integers(8, 160)),  # the CRI buffer, if a runtime writes the log
    st.integers(0, 5),  # where the runtime sits among the other writers
    st.booleans(),  # torchrun's --tee prefix before the excepthook's
)


def _findings(text: str) -> list[tuple[object, ...]]:
    lines = split_lines(text, source="train.log", base_offset=0, rank_hint=None)
    tracebacks = [traceback for group in by_rank(lines).values() for traceback in parse_tracebacks(group)]
    return [
        (f.ranks, f.culprit, f.tensor, f.traceback.frames, f.traceback.exception_type, f.traceback.message, f.traceback.npu_rank)
        for f in locate(tracebacks, Workspace(()))
    ]


def _stacked(stack: tuple[list[str], int | None, int, bool]) -> str:
    outer, cri_limit, cri_position, tee = stack
    rank_prefix = ("[default3]:" if tee else "") + "[rank3]: "
    lines = []
    for index, text in enumerate(_TRACEBACK):
        lines.append(_Line("stderr", rank_prefix + text))
        lines.append(_Line("stdout", f"[default0]:iteration {index}"))  # another rank, interleaved
    layers = [_prefixing(_OUTER_PREFIXES[name]) for name in outer]
    if cri_limit is not None:
        layers.insert(min(cri_position, len(layers)), _cri(cri_limit))
    for layer in layers:
        lines = layer(lines)
    return "".join(line.text + "\n" for line in lines)


_BARE_FINDINGS = _findings("".join("[rank3]: " + text + "\n" for text in _TRACEBACK))


def test_the_bare_traceback_gives_one_finding():
    assert len(_BARE_FINDINGS) == 1
    assert _BARE_FINDINGS[0][0] == (3,)


@settings(deadline=None, max_examples=60)
@given(_STACK)
def test_any_stack_of_prefixes_gives_the_same_finding(stack):
    assert _findings(_stacked(stack)) == _BARE_FINDINGS
