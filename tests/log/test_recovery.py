"""Recovery context from MindIO / adaptor lines, and the phase a traceback was raised in.

Line texts are the published or source-quoted formats of the domain notes (§1, §4).
"""

from __future__ import annotations

import pytest

from unsafe_doctor.log.lines import LogLine, split_lines
from unsafe_doctor.log.recovery import (
    LOSS_SCALING_MARKERS,
    MARKERS,
    MINDIO_RELEASES,
    UNTRACED_FORMS,
    RecoveryContext,
    catch_form,
    mindio_form,
    phase_of,
    read_loss_scaling,
    read_recovery,
)
from unsafe_doctor.log.tracebacks import Frame, Traceback

CAUGHT_UNSAFE = "rank:3 catch OTHER exception, error_code:， ex instance:There is unsafe data in the input tensor."
# the catch line of MindIO v7.3.0 to v7.3.2 (`ttp_decorator.py`): no error_code field
CAUGHT_V73 = "rank:3 catch OTHER exception, ex instance:There is unsafe data in the input tensor."
NPU_ERROR = "[ERROR] 2024-09-26-19:58:19 (PID:991527, Device:3, RankID:3) ERR00003 PTA invalid value"
CONTROLLER_STATUS = "status error, rank:8 step: 3 npu_status: 2 run_status: 0 data_aval: 0 data_status: 0 diff_time : 0"
REPAIR_LINE = "[repair] rank 3, repair type:2, src ranks:[11], dst ranks:[3], rank list:[3, 11], optim idxs:[0], step:1200"

# (line text, rank of the writer from its prefix, expected kind, rank, step)
EVENT_LINES = [
    ("rank:3 catch UCE ERROR exception, error_code:， ex instance:UCE ERROR.", None, "fault", 3, None),
    ("RuntimeError: HBM MULTI BIT ECC ERROR, time is 2024-09-26-19:58:00", 5, "fault", 5, None),
    ("rank 3 check uce memory result: 3", None, "fault", 3, None),
    ("rank 3 check uce memory result: 0", None, "clean", 3, None),
    ("RuntimeError: NPU function error: device error type 0x2a", 6, "fault", 6, None),
    (CAUGHT_UNSAFE, None, "caught", 3, None),
    (CAUGHT_UNSAFE.replace("，", ","), None, "caught", 3, None),
    (CAUGHT_V73, None, "caught", 3, None),
    ("other exception str is : There is unsafe data in the input tensor.", 3, "caught", 3, None),
    ("rank:3 receive device stop message", None, "stop", 3, None),
    ("start notify all device stop...", None, "stop", None, None),
    ("[stop] rank:3 stop consumed:0.012s, ret:0", None, "stop", 3, None),
    # MindIO's stop handler raises FORCE STOP on a rank that did not fault (tests/log/test_catch_names.py: every name)
    ("rank:3 catch FORCE STOP exception, error_code:， ex instance:FORCE STOP", None, "stop", 3, None),
    ("[clean] rank:3, type:retry, cost:0.350s, ret:0", None, "clean", 3, None),
    ("rank:3 start to repair callback, repair_id_:7", None, "repair", 3, None),
    (REPAIR_LINE, None, "repair", 3, 1200),
    ("rank:3 start to rollback callback, repair_id_:7", None, "rollback", 3, None),
    ("rank:3 successfully gather and rollback at iteration 1200", None, "rollback", 3, 1200),
    ("[rollback] rank 3 rollback total time consumed:1.250s", None, "rollback", 3, None),
    ("repair failed, ret: 1", 3, "repair-failed", 3, None),
    ("rollback failed, ret: 1", 3, "rollback-failed", 3, None),
    ("(0, 'Mindio do repair operation ok', {}, 'retry')", 0, "recovered", 0, None),
]


def _line(text: str, rank: int | None = None, offset: int = 0, source: str = "train.log") -> LogLine:
    return LogLine(rank, text, source, offset)


@pytest.mark.parametrize("text, writer, kind, rank, step", EVENT_LINES)
def test_recovery_line_becomes_one_event(text, writer, kind, rank, step):
    (event,) = read_recovery([_line(text, writer, offset=40)]).events
    assert (event.kind, event.rank, event.step, event.text, event.offset) == (kind, rank, step, text, 40)


@pytest.mark.parametrize("text, writer, kind, rank, step", EVENT_LINES)
def test_every_event_line_contains_a_marker(text, writer, kind, rank, step):
    assert any(marker in text.encode() for marker in MARKERS)


def test_markers_are_few_distinct_and_nonempty():
    assert 1 <= len(MARKERS) <= 12
    assert len(set(MARKERS)) == len(MARKERS)
    assert all(marker for marker in MARKERS)


@pytest.mark.parametrize(
    "text",
    [
        NPU_ERROR,
        CONTROLLER_STATUS,
        '  File "/x/mindspeed_llm/core/high_availability/tft_optimizer_data_repair.py", line 90, in recv_rank_repair',
        "[repair stage] rank:3 empty_cache cost:0.01s",
        "iteration     1200/  5000 | lm loss: 1.5",
    ],
)
def test_lines_that_are_not_recovery_events_are_ignored(text):
    assert read_recovery([_line(text, 3)]).events == ()


def test_rank_in_the_message_wins_over_the_writers_prefix():
    (event,) = read_recovery([_line("rank:3 receive device stop message", rank=0)]).events
    assert event.rank == 3


def test_rank_id_names_the_rank_and_minus_one_falls_back_to_the_writer():
    text = "RuntimeError: UCE ERROR. (PID:1, Device:6, RankID:{}) ERR00100 PTA call acl api failed"
    assert read_recovery([_line(text.format(6), rank=None)]).events[0].rank == 6
    assert read_recovery([_line(text.format(-1), rank=2)]).events[0].rank == 2


def test_a_line_given_twice_counts_once():
    line = _line(REPAIR_LINE, offset=99)
    assert len(read_recovery([line, line]).events) == 1


def test_context_from_a_real_looking_log():
    log = "\n".join(
        [
            "[rank3]: RuntimeError: UCE ERROR.",
            "2026-06-04 09:24:31.767278 warn 3062106 [TTP controller.cpp:2510] " + CONTROLLER_STATUS,
            "2026-06-04 09:24:31.800001 info 3062106 [TTP controller.cpp:900] start notify all device stop...",
            "[2024-12-24 11:56:59,095][10][INFO][ttp_processor:88] rank:3 receive device stop message",
            "[12345][PYH tft_stop_clean.py:40] rank 3 check uce memory result: 3",
            "[12345][PYH tft_stop_clean.py:60] [clean] rank:3, type:retry, cost:0.350s, ret:0",
            "[12345][PYH tft_optimizer_data_repair.py:50] " + REPAIR_LINE.replace("step:1200", "step:1199"),
            "[rank3]: [12345][PYH tft_rollback.py:88] rank:3 successfully gather and rollback at iteration 1200",
            "[rank3]: Traceback (most recent call last):",
            "[rank3]: RuntimeError: There is unsafe data in the input tensor.",
            "[rank3]: " + NPU_ERROR,
            CAUGHT_UNSAFE,
        ]
    )
    context = read_recovery(split_lines(log, source="train.log", base_offset=0, rank_hint=None))
    assert context.seen
    assert context.fault_ranks == (3,)
    assert context.step == 1200
    assert [event.kind for event in context.events] == [
        "fault",
        "stop",
        "stop",
        "fault",
        "clean",
        "repair",
        "rollback",
        "caught",
    ]
    offsets = [event.offset for event in context.events]
    assert offsets == sorted(offsets)


def test_fault_ranks_are_sorted_and_unique():
    lines = [
        _line("rank:9 catch UCE ERROR exception, error_code:， ex instance:UCE ERROR.", offset=1),
        _line("rank 2 check uce memory result: 3", offset=2),
        _line("rank 9 check uce memory result: 3", offset=3),
        _line("RuntimeError: UCE ERROR.", rank=None, offset=4),  # writer unknown: no rank to report
    ]
    context = read_recovery(lines)
    assert context.fault_ranks == (2, 9)
    assert not context.seen  # faults alone do not show that recovery ran


def test_no_recovery_lines_means_nothing_seen():
    assert read_recovery([]) == RecoveryContext(seen=False, fault_ranks=(), step=None, events=())


def test_caught_error_alone_is_not_recovery():
    assert not read_recovery([_line(CAUGHT_UNSAFE)]).seen


def test_failed_repair_shows_recovery_ran():
    assert read_recovery([_line("repair failed, ret: 1", 3)]).seen


# --- phase_of -------------------------------------------------------------------------------------

HA = "/site/mindspeed_llm/core/high_availability"


def _frame(function: str, file: str = "/site/megatron/training/training.py") -> Frame:
    return Frame(file=file, line=10, function=function, source=None)


def _traceback(*functions: str | Frame, caused_by: Traceback | None = None) -> Traceback:
    frames = tuple(f if isinstance(f, Frame) else _frame(f) for f in functions)
    return Traceback(
        rank=3,
        source="train.log",
        offset=0,
        frames=frames,
        exception_type="RuntimeError",
        message="There is unsafe data in the input tensor.",
        error_code="ERR00003",
        npu_rank=3,
        device=3,
        truncated=False,
        caused_by=caused_by,
        chain_kind="cause" if caused_by else None,
    )


SEEN = read_recovery([_line("rank:3 successfully gather and rollback at iteration 1200")])
NOT_SEEN = read_recovery([])


def test_error_inside_repair_callback_is_repair_phase():
    tb = _traceback("execute_repair", "repair_callback", "recv_rank_repair", "recv_and_load_optim_param_state")
    assert phase_of(tb, NOT_SEEN) == "repair"


def test_error_inside_training_log_repair_is_rollback_phase():
    # the name says "repair", but the adaptor runs it from rollback_callback
    tb = _traceback("execute_rollback", "rollback_callback", "training_log_repair", "training_log", "track_moe_metrics")
    assert phase_of(tb, SEEN) == "rollback"


def test_adaptor_build_dataset_is_rollback_phase_even_when_cut_off():
    tb = _traceback(_frame("build_dataset", f"{HA}/tft_rollback.py"), "build_pretraining_data_loader")
    assert phase_of(tb, SEEN) == "rollback"


def test_a_framework_build_dataset_is_not_rollback():
    tb = _traceback("pretrain", _frame("build_dataset", "/site/megatron/core/datasets/builder.py"))
    assert phase_of(tb, SEEN) == "after-recovery"


def test_rollback_frame_in_the_cause_of_a_chain_counts():
    cause = _traceback("rollback_callback", "feature_rollback", "copy_")
    tb = _traceback("wrapper", "report_and_wait", caused_by=cause)
    assert phase_of(tb, SEEN) == "rollback"


def test_innermost_callback_frame_decides():
    tb = _traceback("rollback_callback", "feature_rollback", "send_rank_repair")
    assert phase_of(tb, SEEN) == "repair"


def test_error_in_training_after_recovery():
    tb = _traceback("wrapper", "train", "train_step", "forward_step", "save_to_aux_losses_tracker")
    assert phase_of(tb, SEEN) == "after-recovery"


def test_no_recovery_seen_and_no_callback_frame_is_none():
    tb = _traceback("train", "train_step", "save_to_aux_losses_tracker")
    assert phase_of(tb, NOT_SEEN) == "none"


# --- read_loss_scaling ----------------------------------------------------------------------------

# Megatron's training_log line (printed by the last rank) and _print_args line, as torchrun --tee
# and the PyTorch excepthook prefix them.
ITERATION = (
    "[default3]: [2026-11-30 05:10:42] iteration      120/    1000 | consumed samples:          960 | "
    "elapsed time per iteration (ms): 70.3 | learning rate: 1.500000E-04 | global batch size:     8 | "
    "lm loss: 4.028615E+00 | loss scale: {} | number of skipped iterations:   0 | number of nan iterations:   0 |"
)
ARGUMENT = "[rank0]:   {} {} {}"  # name, 48 - len(name) dots, value


def argument(name: str, value: object) -> str:
    return ARGUMENT.format(name, "." * (48 - len(name)), value)


def loss_scaling_of(*raw: str):
    return read_loss_scaling(split_lines("\n".join(raw), source="train.log", base_offset=0, rank_hint=None))


@pytest.mark.parametrize(
    "raw, expected",
    [
        ([ITERATION.format("1.0")], "none"),
        ([ITERATION.format("65536.0")], "grad-scaler"),
        ([ITERATION.format("4096.0"), ITERATION.format("2048.0")], "grad-scaler"),  # backed off
        ([argument("fp16", True)], "grad-scaler"),
        ([argument("bf16", True), argument("fp16", False)], "none"),
        # a dynamic scale that collapsed to its minimum, 1.0: the argument still tells fp16
        ([argument("fp16", True), ITERATION.format("1.0")], "grad-scaler"),
    ],
)
def test_loss_scaling_from_iteration_lines_and_the_argument_dump(raw, expected):
    assert loss_scaling_of(*raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        [],
        ["iteration     1200/  5000 | lm loss: 1.5 | grad norm: 0.9 |"],  # a log that prints no scale
        [argument("fp16_lm_cross_entropy", True), argument("bf16", True)],  # other arguments
        ["casting the model to fp16 ........ done"],
        [ITERATION.format("n/a")],
        [ITERATION.format("1.0"), ITERATION.format("65536.0").replace("[default3]", "[default7]")],  # disagree
    ],
)
def test_loss_scaling_is_unknown_when_the_lines_do_not_tell(raw):
    assert loss_scaling_of(*raw) is None


@pytest.mark.parametrize("raw", [ITERATION.format("65536.0"), argument("fp16", True)])
def test_every_loss_scaling_line_contains_a_marker(raw):
    assert any(marker in raw.encode() for marker in LOSS_SCALING_MARKERS)


# The catch line of each MindIO release for the unsafe-data error (`framework_ttp/ttp_decorator.py` at
# mind-cluster 492fde0c, v7.3.0 to v7.3.2, v26.0.0 on), in MindIO's stdout format.
CATCH_LINES_BY_FORM = [
    ("[8123][PYH ttp_decorator.py:928] other exception str is : There is unsafe data in the input tensor.", "first-public"),
    ("2026-02-03 10:11:12.5071 warn 31 [8123][PYH ttp_decorator.py:922] " + CAUGHT_V73, "v7.3"),
    ("2026-06-03 10:11:12.5071 warn 31 [8123][PYH ttp_decorator.py:938] " + CAUGHT_UNSAFE, "v26"),
]


@pytest.mark.parametrize("text, form", CATCH_LINES_BY_FORM)
def test_catch_line_tells_the_mindio_release_that_wrote_it(text, form):
    assert catch_form(text) == form
    assert mindio_form(read_recovery([_line(text, rank=3)])) == form


def test_lines_that_are_no_catch_line_tell_no_release():
    assert catch_form("rank:3 catch other exception") is None  # first public: the line before the traceback
    assert mindio_form(read_recovery([_line(REPAIR_LINE)])) is None


def test_newest_form_wins_when_inputs_mix_releases():
    context = read_recovery([_line(CATCH_LINES_BY_FORM[0][0], 1), _line(CAUGHT_UNSAFE, offset=9), _line(CAUGHT_V73, offset=20)])
    assert mindio_form(context) == "v26"


def test_only_the_forms_without_a_traceback_are_untraced():
    assert UNTRACED_FORMS == {"v7.3", "v26"}
    assert set(MINDIO_RELEASES) == {form for _, form in CATCH_LINES_BY_FORM}
