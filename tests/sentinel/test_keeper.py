"""The traceback keeper (unsafe_doctor/sentinel/keeper.py), on MindIO's real exception handler.

MindIO's real `framework_ttp/ttp_decorator.py` at five refs of mind-cluster (../shared/real/mind-cluster-mindio/,
the real fixture: the first public version, v7.3.0, v7.3.2, v26.0.0 and 2026-08) is imported as MindIO's package
imports it, with what it imports and this machine lacks replaced by stand-ins written here:

- `ttp_c2python_api`, the SWIG module over MindIO's C++ library: its `log(level, text)` keeps the texts, printed
  as MindIO's C++ logger prints them (`MindIOOutput.printed`); the processor's calls answer as the controller
  answers an error it cannot classify: no repair, the job ends;
- `torch_npu` (the memory figures the handler logs) and the few helpers of `controller_ttp` and `utils`;
- `controller_ttp/ttp_logger.py`, where ../shared/real has no copy of it beside the ref's ttp_decorator.py (the
  real one is used where it has): MindIO's LOGGER, one file at all five refs (mind-cluster 492fde0c), is no
  `logging.Logger`: each method tags the text with the thread and the caller's `file.py:line`, applies the
  arguments and passes it to `ttp_c2python_api.log`; `exception()` appends `traceback.format_exc()`. The stand-in
  below does that.

A job's step reads a global tensor that a fault left unsafe (the emulated backend raises torch_npu's exact error),
inside the real `tft_exception_handler`, which logs it through the real code; what MindIO printed is then read by
`diagnose`.
"""

from __future__ import annotations

import atexit
import datetime
import importlib.util
import re
import sys
import threading
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.npu.backend import EmulatedBackend
from unsafe_doctor.npu.messages import UNSAFE_DATA
from unsafe_doctor.sentinel.keeper import AlreadyKept, Kept, NoMindIO, NotKept, keep_tracebacks

FIRST_PUBLIC = "492fde0c"  # LOGGER.exception: the traceback was printed
REFS = (FIRST_PUBLIC, "v7.3.0", "v7.3.2", "v26.0.0", "22bb3d98")
RANK = 7
TRACEBACK_HEADER = "Traceback (most recent call last):"
# MindIO's levels 0-3 as its C++ logger names them: on stdout (OutLogger), and in ttp_log.log (spdlog, one level up)
STDOUT_LEVELS = ("debug", "info", "warn", "error")
FILE_LEVELS = ("debug", "info", "warning", "error")

LOGGER_STANDIN = '''\
"""controller_ttp/ttp_logger.py's LOGGER: the text, tagged, to ttp_c2python_api.log (a stand-in)."""
import os
import sys
import threading
import traceback

import ttp_c2python_api


class _Logger:
    def _log(self, level, msg, args, tail=""):
        caller = sys._getframe(2)  # the frame that called debug(), info(), ...
        where = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
        ttp_c2python_api.log(level, f"[{threading.get_ident() % 100000}][PYH {where}] {msg}" % args + tail)

    def debug(self, msg, *args):
        self._log(0, msg, args)

    def info(self, msg, *args):
        self._log(1, msg, args)

    def warning(self, msg, *args):
        self._log(2, msg, args)

    def error(self, msg, *args):
        self._log(3, msg, args)

    def exception(self, msg, *args):
        self._log(3, msg, args, "\\n" + traceback.format_exc())


LOGGER = _Logger()
'''

JOB = """\
import torch

LOSS_LOG = {"loss": torch.zeros(1)}


def record_loss(loss):
    LOSS_LOG["loss"] += loss


def train_step():
    record_loss(torch.ones(1))
"""


class JobEnds(Exception):
    """The controller's answer to an error MindIO cannot classify: no repair. Real MindIO then exits the
    process (`os._exit` after 10 s); the stand-in raises this where its processor would answer."""


@dataclass
class MindIOOutput:
    """What reaches MindIO's C++ logger: each `log(level, text)` call, and the lines it prints."""

    texts: list[tuple[int, str]] = field(default_factory=list)

    def log(self, level: int, text: str) -> None:
        self.texts.append((level, text))

    def printed(self, to: str = "stdout") -> str:
        """The lines as MindIO's C++ logger writes them: to `logs/ttp_log.log.<pid>` by default (spdlog's
        `%Y-%m-%d %H:%M:%S.%f %t %l %v`, the text after `[tid]`: `ttp_logger.cpp`), or on stdout with
        `TTP_LOG_STDOUT=1` (`<date> <time>.<usec> <level> <tid> <text>`: `common_loggers.h`)."""
        stamp = datetime.datetime(2026, 8, 21, 10, 0, 0, 123456)
        tid = threading.get_native_id()
        if to == "stdout":
            lines = (
                f"{stamp:%Y-%m-%d %H:%M:%S}.{stamp.microsecond} {STDOUT_LEVELS[level]} {tid} {text}" for level, text in self.texts
            )
        else:
            lines = (f"{stamp:%Y-%m-%d %H:%M:%S.%f} {tid} {FILE_LEVELS[level]} [{tid}]{text}" for level, text in self.texts)
        return "".join(line + "\n" for line in lines)


def swig_standin(output: MindIOOutput) -> types.ModuleType:
    """`ttp_c2python_api` as the handler's path uses it: enum values (distinct, as SWIG's are), the log, the processor."""
    module = types.ModuleType("ttp_c2python_api")
    names = (
        "ReportState_RS_NORMAL ReportState_RS_RETRY ReportState_RS_UCE ReportState_RS_UCE_CORRUPTED "
        "ReportState_RS_HCCL_FAILED ReportState_RS_UNKNOWN ReportState_RS_INIT_FINISH "
        "ReportState_RS_PREREPAIR_FINISH ReportState_RS_STEP_FINISH RepairType_RT_SEND RepairType_RT_UCE_HIGHLEVEL "
        "RepairType_RT_UCE_LOWLEVEL RepairType_RT_ROLLBACK RepairType_RT_RECV_REPAIR RepairType_RT_LOAD_CKPT "
        "RepairType_RT_LOAD_REBUILD"
    ).split()
    for value, name in enumerate(names):
        setattr(module, name, value)
    module.RepairContext = type("RepairContext", (), {})
    module.log = output.log
    module.report_status = lambda *state: 0
    module.destroy_processor = lambda: 0

    def wait_repair_action() -> int:
        raise JobEnds("the controller ends the job: no repair for an unknown error")

    module.wait_repair_action = wait_repair_action
    return module


def helper_modules() -> dict[str, dict[str, object]]:
    """The names the handler imports from MindIO's other modules; none is on its path to the log line."""
    return {
        "mindio_ttp.controller_ttp.ttp_controller": {"tft_destroy_controller": lambda: None},
        "mindio_ttp.controller_ttp.ttp_utils": {
            "is_zero_ip": lambda ip: False,
            "input_ip_transform": lambda ip: ip,
            "get_env_var_int_safely": lambda name, default, low, high: default,
        },
        "mindio_ttp.utils": {"tft_can_do_uce_repair": lambda error_time: True, "get_l2_hbm_error_time": lambda text: 0},
        "mindio_ttp.utils.uce_utils": {"get_update_start_end_time": lambda: (0, 0)},
    }


def torch_npu_standin() -> types.ModuleType:
    npu = types.SimpleNamespace(
        memory_allocated=lambda: 0,
        max_memory_allocated=lambda: 0,
        memory_reserved=lambda: 0,
        max_memory_reserved=lambda: 0,
        empty_cache=lambda: None,
    )
    module = types.ModuleType("torch_npu")
    module.npu = npu
    return module


def load_file(name: str, path: Path, monkeypatch) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    spec.loader.exec_module(module)
    return module


@dataclass
class MindIO:
    decorator: types.ModuleType  # the real ttp_decorator
    output: MindIOOutput


def load_mindio(real: Path, ref: str, monkeypatch, tmp_path: Path) -> MindIO:
    """The real ttp_decorator.py of `ref`, imported as `mindio_ttp.framework_ttp.ttp_decorator`."""
    output = MindIOOutput()
    monkeypatch.setitem(sys.modules, "ttp_c2python_api", swig_standin(output))
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu_standin())
    for name in ("mindio_ttp", "mindio_ttp.controller_ttp", "mindio_ttp.framework_ttp", "mindio_ttp.utils"):
        package = types.ModuleType(name)
        package.__path__ = []
        monkeypatch.setitem(sys.modules, name, package)
    for name, attributes in helper_modules().items():
        module = sys.modules[name] if name in sys.modules else types.ModuleType(name)
        vars(module).update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    folder = real / "mind-cluster-mindio" / ref
    logger = folder / "controller_ttp" / "ttp_logger.py"
    if not logger.is_file():
        logger = tmp_path / "ttp_logger.py"
        logger.write_text(LOGGER_STANDIN)
    load_file("mindio_ttp.controller_ttp.ttp_logger", logger, monkeypatch)
    decorator = load_file("mindio_ttp.framework_ttp.ttp_decorator", folder / "framework_ttp" / "ttp_decorator.py", monkeypatch)
    atexit.unregister(decorator.tft_destroy_processor)  # a stand-in processor has nothing to destroy
    monkeypatch.setattr(decorator, "rank_", RANK)
    monkeypatch.setattr(decorator, "ACTION_TIMEOUT", 0)  # its wait for a last checkpoint: none is coming
    return MindIO(decorator, output)


def load_job(folder: Path, monkeypatch) -> types.ModuleType:
    """A job's module whose global LOSS_LOG a fault left unsafe."""
    folder.mkdir(exist_ok=True)
    (folder / "lossjob.py").write_text(JOB)
    monkeypatch.setenv("RANK", str(RANK))  # torch_npu's error line names it
    return load_file("lossjob", folder / "lossjob.py", monkeypatch)


def run_on_npu(step: Callable[[], None], job_file: str) -> None:
    """`step` with the emulated NPU; the error it raises ends at the job's line, as torch_npu's (raised
    from C++) does: the emulation's frames are cut off."""
    try:
        step()
    except RuntimeError as error:
        entries = list(traceback.walk_tb(error.__traceback__))
        last_job = max(index for index, (frame, _) in enumerate(entries) if frame.f_code.co_filename == job_file)
        tb = error.__traceback__
        for _ in range(last_job):
            tb = tb.tb_next
        tb.tb_next = None
        raise


def fail_one_step(mindio: MindIO, job: types.ModuleType) -> BaseException:
    """The first step after a recovery, under MindIO's real exception handler; what ends the call."""
    backend = EmulatedBackend(device_index=0)

    @mindio.decorator.tft_exception_handler
    def train():
        run_on_npu(job.train_step, job.__file__)

    with backend.activate():
        backend.set_check(enabled=True)
        backend.mark_unsafe(job.LOSS_LOG["loss"])
        try:
            train()
        except (RuntimeError, JobEnds) as error:
            return error
    raise AssertionError("the step read no unsafe tensor")


def without_clock(logged: tuple[int, str]) -> tuple[int, str]:
    """What two runs do not share: how long empty_cache took, and the time in torch_npu's error line."""
    level, text = logged
    text = re.sub(r"cost:\S+s\b", "cost:<seconds>s", text)
    return level, re.sub(r"\[ERROR\] \S+ \(PID", "[ERROR] <time> (PID", text)


def tracebacks(printed: str) -> int:
    return printed.count(TRACEBACK_HEADER)


# --- on the real handler -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Runs:
    """One failed step under a ref's real handler, without the keeper and with it: what MindIO logged."""

    ref: str
    plain: MindIOOutput
    kept: MindIOOutput
    plain_ended: BaseException  # what ended the call without the keeper
    job_file: str


@pytest.fixture(scope="module", params=REFS)
def runs(request, real, tmp_path_factory) -> Runs:
    """Two runs per ref, shared by the tests below (the handler's own gc.collect() takes a second each)."""
    ref = request.param
    folder = tmp_path_factory.mktemp(f"mindio-{ref}")
    outputs, ended = [], []
    for keep in (False, True):
        with pytest.MonkeyPatch.context() as monkeypatch:
            job = load_job(folder / "job", monkeypatch)
            mindio = load_mindio(real, ref, monkeypatch, folder)
            if keep:
                assert keep_tracebacks() == Kept()
            ended.append(fail_one_step(mindio, job))
            outputs.append(mindio.output)
    return Runs(ref, outputs[0], outputs[1], ended[0], str(folder / "job" / "lossjob.py"))


def test_without_the_keeper_only_the_first_public_version_prints_a_traceback(runs):
    printed = runs.plain.printed()
    assert UNSAFE_DATA in printed
    if runs.ref == FIRST_PUBLIC:
        assert isinstance(runs.plain_ended, RuntimeError)  # logged with LOGGER.exception and raised again
        assert tracebacks(printed) == 1 and "in record_loss" in printed
    else:
        assert isinstance(runs.plain_ended, JobEnds)  # logged as one warning; MindIO waits for the controller
        assert tracebacks(printed) == 0 and "record_loss" not in printed
        [catch] = [text for level, text in runs.plain.texts if UNSAFE_DATA in text]
        assert "catch OTHER exception" in catch


def test_with_the_keeper_every_version_prints_one_full_traceback_in_mindios_output(runs):
    printed = runs.kept.printed()
    assert tracebacks(printed) == 1, printed
    trace = printed[printed.index(TRACEBACK_HEADER) :]
    assert f'File "{runs.job_file}", line 7, in record_loss\n    LOSS_LOG["loss"] += loss\n' in trace
    assert f'File "{runs.job_file}", line 11, in train_step\n' in trace
    assert "in wrapper\n    iteration = func(*args, **kwargs)\n" in trace  # from MindIO's own frame down
    assert f"RuntimeError: {UNSAFE_DATA}\n" in trace
    [(level, carrier)] = [(level, text) for level, text in runs.kept.texts if TRACEBACK_HEADER in text]
    if runs.ref == FIRST_PUBLIC:  # LOGGER.exception's own traceback; the keeper adds none to the info line after it
        assert level == 3 and "catch other exception\n" in carrier
    else:  # the warning, at its own level
        assert level == 2 and "catch OTHER exception" in carrier


def test_the_keeper_changes_only_the_unsafe_data_line(runs):
    """Without then with the keeper: every other text MindIO logs is the same, to the byte."""
    assert len(runs.kept.texts) == len(runs.plain.texts)
    pairs = zip(map(without_clock, runs.plain.texts), map(without_clock, runs.kept.texts), strict=True)
    changed = [(before, after) for before, after in pairs if before != after]
    if runs.ref == FIRST_PUBLIC:
        assert changed == []
    else:
        [((level, before), (same_level, after))] = changed
        assert level == same_level == 2 and UNSAFE_DATA in before
        assert after.startswith(before + "\n" + TRACEBACK_HEADER)


@pytest.mark.parametrize("to", ["stdout", "file"])
def test_diagnose_locates_the_raising_frame_in_what_mindio_printed(runs, to, tmp_path):
    log = tmp_path / f"mindio-{to}.log"
    log.write_text(runs.kept.printed(to))
    diagnosis = diagnose([str(log)], groundwork(source_roots=[Path(runs.job_file).parent]))
    [diagnosed] = diagnosis.findings
    finding = diagnosed.finding
    assert finding.culprit is not None and finding.tensor is not None
    assert (finding.culprit.file, finding.culprit.line, finding.culprit.function) == (runs.job_file, 7, "record_loss")
    assert (finding.tensor.name.module, finding.tensor.name.variable) == ("lossjob", "LOSS_LOG")
    assert finding.ranks == (RANK,)
    assert diagnosis.untraced_ranks == ()


# --- the keeper alone --------------------------------------------------------------------------------


@pytest.fixture
def sink(monkeypatch) -> MindIOOutput:
    output = MindIOOutput()
    module = types.ModuleType("ttp_c2python_api")
    module.log = output.log
    monkeypatch.setitem(sys.modules, "ttp_c2python_api", module)
    return output


def unsafe_error() -> RuntimeError:
    return RuntimeError(UNSAFE_DATA)


def test_without_mindio_nothing_is_wrapped(monkeypatch):
    monkeypatch.delitem(sys.modules, "ttp_c2python_api", raising=False)
    assert keep_tracebacks() == NoMindIO()


def test_installing_twice_wraps_once(sink):
    assert keep_tracebacks() == Kept()
    assert keep_tracebacks() == AlreadyKept()
    wrapped = sys.modules["ttp_c2python_api"].log
    assert wrapped.log == sink.log  # the original, wrapped once
    try:
        raise unsafe_error()
    except RuntimeError:
        sys.modules["ttp_c2python_api"].log(2, f"catch OTHER exception, ex instance:{UNSAFE_DATA}")
    [(_, text)] = sink.texts
    assert tracebacks(text) == 1


def test_a_log_function_that_cannot_be_replaced_is_reported_not_raised(monkeypatch):
    class Frozen(types.ModuleType):
        def __setattr__(self, name, value):
            raise AttributeError(f"{name} is read-only")

    frozen = Frozen("ttp_c2python_api")
    vars(frozen)["log"] = lambda level, text: None
    monkeypatch.setitem(sys.modules, "ttp_c2python_api", frozen)
    outcome = keep_tracebacks()
    assert outcome == NotKept("ttp_c2python_api.log could not be wrapped: AttributeError: log is read-only")


def test_texts_without_the_unsafe_data_error_pass_unchanged(sink):
    keep_tracebacks()
    log = sys.modules["ttp_c2python_api"].log
    log(1, "no exception being handled, no unsafe text")
    log(2, f"the text alone, no exception being handled: {UNSAFE_DATA}")
    try:
        raise KeyError("another error")
    except KeyError:
        log(3, "an error being handled, but not the unsafe-data one")
        log(2, f"the unsafe text, while another error is handled: {UNSAFE_DATA}")
    try:
        raise unsafe_error()
    except RuntimeError:
        log(1, "the unsafe-data error is handled, but this text does not name it")
    assert [text for _, text in sink.texts] == [
        "no exception being handled, no unsafe text",
        f"the text alone, no exception being handled: {UNSAFE_DATA}",
        "an error being handled, but not the unsafe-data one",
        f"the unsafe text, while another error is handled: {UNSAFE_DATA}",
        "the unsafe-data error is handled, but this text does not name it",
    ]


def test_an_error_gets_its_traceback_once_and_each_new_error_its_own(sink):
    keep_tracebacks()
    log = sys.modules["ttp_c2python_api"].log
    for _ in range(2):  # two failed steps: two errors
        try:
            raise unsafe_error()
        except RuntimeError:
            log(2, f"catch OTHER exception, ex instance:{UNSAFE_DATA}")
            log(1, f"other exception str is : {UNSAFE_DATA}")
    assert [tracebacks(text) for _, text in sink.texts] == [1, 0, 1, 0]


def test_a_hostile_error_or_text_never_raises_into_the_job(sink):
    class Unprintable(RuntimeError):
        def __str__(self):
            raise ValueError("no text")

    keep_tracebacks()
    log = sys.modules["ttp_c2python_api"].log
    try:
        raise Unprintable()
    except RuntimeError:
        log(2, f"catch OTHER exception, ex instance:{UNSAFE_DATA}")
        log(2, b"bytes, not text")
    assert sink.texts == [(2, f"catch OTHER exception, ex instance:{UNSAFE_DATA}"), (2, b"bytes, not text")]
