"""A stand-in for MindIO TFT (``mindio_ttp``) for the sample workers.

Real MindIO runs a controller in rank 0's process and a processor in every rank. When a rank
reports a hardware fault, the controller drives the callbacks a framework registered, on every
rank and in this order: stop -> clean -> repair -> rollback -> "notify normal", and the
decorated ``train()`` is called again. This emulation drives the same callbacks in the same order
across the real worker processes, coordinated through torchrun's TCPStore, and prints MindIO's
stdout log format::

    2026-06-04 09:24:31.767278 warn 3062106 [TTP controller.cpp:2510] status error, rank:8 ...
    2025-09-08 11:34:00.400331 warn 1900637 [77840][PYH tft_replica_optimizer.py:659] ...

Message texts are MindIO's (mind-cluster ``controller.cpp``, ``processor.cpp``,
``ttp_decorator.py``); source line numbers other than controller.cpp:2510 are placeholders.

When ``train()`` raises an error MindIO cannot classify ("OTHER"), what is logged and how the rank
ends depends on the release, chosen with ``EMULATED_MINDIO_RELEASE`` (mind-cluster's
``ttp_decorator.py`` at each; tests/corpus/README.md has the lines):

- unset (the sample logs): the v26 catch line, then, once every rank has either failed or is
  blocked in a collective (when the controller would stop them all), the error is re-raised, as
  the MindIO of the seed FAQ's screenshot did, so the log carries the traceback a diagnosis needs;
- ``first-public`` (2025-11-28): ``LOGGER.exception("rank:%s catch other exception")`` with the
  traceback, ``other exception str is : …``, then the error is re-raised (a second traceback);
- ``v7.3`` (v7.3.0 to v7.3.2) and ``v26`` (v26.0.0 on): one warning, no traceback anywhere; the
  controller ends the job: every rank logs "receive exit message" and leaves with ``os._exit(2)``
  (without MindIO's 10 s grace period).

Device collectives: a gloo collective would hang forever when a peer has died, where HCCL's would
be aborted by MindIO's stop callback. Workers call ``collective_guard()`` before each collective;
it waits until every rank has arrived, or, when a peer reported a fault, waits for the
controller's stop and raises torch_npu's "FORCE STOP" as the aborted HCCL op would.
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch.distributed as dist

import torch_npu_standin

RT_SEND, RT_UCE_HIGHLEVEL = 0, 1  # mindio_ttp RepairType values
RET_OK, RET_ERROR = 0, 1
RET_K8S = 2  # the exit status of a rank MindIO ends
RELEASES = ("first-public", "v7.3", "v26")

_HANDLERS: dict[str, object] = {}


@dataclass(frozen=True)
class FaultPlan:
    """Which ranks a hardware fault strikes, when, and at which point of the training step."""

    iteration: int
    ranks: tuple[int, ...]
    kind: str  # "uce" or "hbm"
    point: str  # "forward" or "after-optimizer"

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        """Read ``SAMPLE_FAULT=<iteration>:<rank>,<rank>:<uce|hbm>:<point>``."""
        spec = os.environ.get("SAMPLE_FAULT")
        if not spec:
            return None
        iteration, ranks, kind, point = spec.split(":")
        return cls(int(iteration), tuple(int(r) for r in ranks.split(",")), kind, point)

    def strike(self, iteration: int, point: str) -> None:
        """Inject the device error on a faulty rank, once, before any recovery happened."""
        if (_P.epoch == 0 and iteration == self.iteration and point == self.point
                and _P.rank in self.ranks):
            text = torch_npu_standin.uce_error() if self.kind == "uce" else torch_npu_standin.hbm_ecc_error()
            torch_npu_standin.inject_device_error(text)

    def repair_info(self, rank: int) -> dict | None:
        """The repair message a rank receives: faulty ranks receive from their replica partner."""
        for dst in self.ranks:
            src = dst ^ 1
            if rank in (src, dst):
                return {"type": [0], "repair_type": RT_SEND if rank == src else RT_UCE_HIGHLEVEL,
                        "src": [src], "dst": [dst], "rank_list": sorted([src, dst])}
        return None

    def repair_rank_count(self) -> int:
        return 2 * len(self.ranks)


class _Processor:
    rank = 0
    world_size = 1
    epoch = 0  # recoveries completed by this rank
    completed_step = 0
    guard_seq = 0
    stop_started = 0.0
    train_args: tuple = ()
    store: dist.Store | None = None
    plan: FaultPlan | None = None
    release: str | None = None  # EMULATED_MINDIO_RELEASE
    update_times: tuple[int | None, int | None] = (None, None)  # the optimizer's last update, in µs


_P = _Processor()


# --- log format --------------------------------------------------------------------------------

def _emit(level: str, source: str, message: str) -> None:
    now = datetime.datetime.now()
    line = f"{now:%Y-%m-%d %H:%M:%S}.{now.microsecond} {level} {threading.get_native_id()} {source} {message}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _cpp(level: str, where: str, message: str) -> None:
    _emit(level, f"[TTP {where}]", message)


def _py(level: str, where: str, message: str) -> None:
    _emit(level, f"[{threading.get_ident() % 100000}][PYH {where}]", message)


def py_log(level: str, where: str, message: str) -> None:
    """MindIO's Python logger (``ttp_logger.LOGGER``), which the legacy adaptor and taskd log through."""
    _py(level, where, message)


def _py_exception(where: str, message: str, error: BaseException) -> None:
    """mindio's LOGGER.exception: the message, a newline, then the formatted traceback."""
    torch_npu_standin.hide_emulator_frames(error)
    tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    _py("error", where, message + "\n" + tb)


# --- registration API (names as in mindio_ttp.framework_ttp) ------------------------------------

def tft_register_stop_handler(func, ctx=None):
    _HANDLERS["stop"] = func


def tft_register_clean_handler(func, ctx=None):
    _HANDLERS["clean"] = func


def tft_register_repair_handler(func, ctx=None):
    _HANDLERS["repair"] = func


def tft_register_rollback_handler(func, ctx=None):
    _HANDLERS["rollback"] = func


def strike(iteration: int, point: str) -> None:
    """Let the planned hardware fault (``SAMPLE_FAULT``) strike if this is its time and place."""
    if _P.plan is not None:
        _P.plan.strike(iteration, point)


def tft_end_updating_os(step: int) -> None:
    """The optimizer finished updating for ``step``: recovery can roll back to it."""
    _P.completed_step = step


def tft_set_update_start_time() -> None:
    """mindio_ttp.utils': the optimizer starts updating (the first public release logs it)."""
    _P.update_times = (time.time_ns() // 1000, None)


def tft_set_update_end_time() -> None:
    _P.update_times = (_P.update_times[0], time.time_ns() // 1000)


def tft_init_processor(rank: int, world_size: int) -> None:
    """Connect this rank to the store; rank 0 also starts the controller."""
    _P.rank, _P.world_size = rank, world_size
    _P.store = _connect()
    _P.plan = FaultPlan.from_env()
    _P.release = os.environ.get("EMULATED_MINDIO_RELEASE") or None
    if _P.release not in (None, *RELEASES):
        raise ValueError(f"EMULATED_MINDIO_RELEASE={_P.release!r}: choose from {RELEASES}")
    if rank == 0 and _P.plan is not None:
        threading.Thread(target=_controller, args=(_P.plan, world_size), daemon=True).start()


def _connect() -> dist.Store:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=120))
    return dist.PrefixStore("sample-ttp", store)


def _wait_key(store: dist.Store, key: str) -> None:
    while not store.check([key]):
        time.sleep(0.01)


def _wait_count(store: dist.Store, key: str, count: int) -> None:
    while store.add(key, 0) < count:
        time.sleep(0.01)


# --- controller (rank 0) ------------------------------------------------------------------------

def _controller(plan: FaultPlan, world_size: int) -> None:
    store = _connect()
    for rank in plan.ranks:
        _wait_key(store, f"0/report/{rank}")
    step = min(int(store.get(f"0/report/{rank}")) for rank in plan.ranks)
    for rank in plan.ranks:
        _cpp("warn", "controller.cpp:2510", f"status error, rank:{rank} step: {step} npu_status: 2 "
             "run_status: 0 data_aval: 0 data_status: 0 diff_time : 0")
    _cpp("info", "controller.cpp:1391", "controller collect latest status end...")
    _cpp("info", "controller.cpp:1398", "controller:0 pre lock start.")
    _cpp("info", "controller.cpp:1402", f"controller prelock step: {step} try times: 1")
    _cpp("info", "controller.cpp:1404", "controller:0 pre lock success.")
    store.set("0/step", str(step))
    _cpp("info", "controller.cpp:1183", "start notify all device stop...")
    store.set("0/stop", "1")
    _wait_count(store, "0/stop_done", world_size)
    _cpp("info", "controller.cpp:1190", "start notify all device clean...")
    store.set("0/clean", "1")
    _wait_count(store, "0/clean_done", world_size)
    _cpp("info", "controller.cpp:1219", "notify all device stop & clean ok!")
    store.set("0/repair", "1")
    _wait_count(store, "0/repair_done", plan.repair_rank_count())
    _cpp("info", "controller.cpp:1255", "start rollback")
    store.set("0/rollback", "1")
    _wait_count(store, "0/rollback_done", world_size)
    if any(store.get(f"0/rollback_ret/{rank}") != b"0" for rank in range(world_size)):
        _cpp("error", "controller.cpp:1269", "controller:0 notify processor rollback failed")
        store.set("0/exit", "1")
        return
    _cpp("info", "controller.cpp:1262", "start notify all rank normal...")
    store.set("0/normal", "1")


# --- processor side, run in the training thread -------------------------------------------------

def collective_guard() -> None:
    """Call before a device collective; see the module docstring."""
    _P.guard_seq += 1
    epoch, store = _P.epoch, _P.store
    key = f"{epoch}/arrive/{_P.guard_seq}"
    store.add(key, 1)
    while store.add(key, 0) < _P.world_size:
        if store.check([f"{epoch}/abnormal"]):
            store.add(f"{epoch}/settled", 1)
            if epoch > 0:  # the emulated controller drives one recovery; after it a collective hangs
                while not store.check([f"{epoch}/exit"]):  # until the controller ends the job (v7.3+)
                    time.sleep(0.01)
                _exit_on_controller_order()
            _wait_key(store, f"{epoch}/stop")
            _cpp("info", "processor.cpp:754", f"rank:{_P.rank} receive device stop message")
            _P.stop_started = time.time()
            _execute("stop", _P.train_args, None)
            raise RuntimeError(torch_npu_standin.force_stop_error())
        time.sleep(0.002)


def _classify(err_str: str) -> str:
    if "UCE ERROR" in err_str:
        return "UCE ERROR"
    if "HBM MULTI BIT ECC" in err_str:
        return "HBM MULTI BIT ECC can repair"
    if "FORCE STOP" in err_str:
        return "FORCE STOP"
    return "OTHER"


def _error_code(err_str: str) -> str:
    match = re.search(r"\bdevice error type\s*([0-9a-fA-F]+)\b", err_str, re.IGNORECASE)
    return match.group(1) if match else ""


def _log_catch(exception: str, error: RuntimeError) -> None:
    """The line the release logs for a RuntimeError it caught (ttp_decorator.py of each release)."""
    rank, err_str = _P.rank, str(error)
    if _P.release == "first-public":
        start, end = _P.update_times
        _py("info", "ttp_decorator.py:912", f"rank:{rank} optimizer start update time:{start}, end update time:{end}")
        if exception == "OTHER":
            _py_exception("ttp_decorator.py:927", f"rank:{rank} catch other exception", error)
            _py("info", "ttp_decorator.py:928", f"other exception str is : {err_str}")
        else:  # it names the pattern it matched, "HBM MULTI BIT ECC" without "can repair"
            pattern = exception.removesuffix(" can repair")
            _py("warn", "ttp_decorator.py:878", f"rank:{rank} catch {pattern} exception, ex instance:{err_str}")
    elif _P.release == "v7.3":
        _py("warn", "ttp_decorator.py:922", f"rank:{rank} catch {exception} exception, ex instance:{err_str}")
    elif _P.release == "v26":
        _py("warn", "ttp_decorator.py:938", f"rank:{rank} catch {exception} exception, "
            f"error_code:{_error_code(err_str)}， ex instance:{err_str}")
    else:
        _py("warn", "ttp_decorator.py:782", f"rank:{rank} catch {exception} exception, "
            f"error_code:{_error_code(err_str)}， ex instance:{err_str}")


def _settle_unknown() -> None:
    """Report the unknown error and wait until every rank has failed or is blocked in a collective."""
    _P.store.set(f"{_P.epoch}/abnormal", "1")
    _P.store.add(f"{_P.epoch}/settled", 1)
    _wait_count(_P.store, f"{_P.epoch}/settled", _P.world_size)


def _empty_cache(stage: str, where: str) -> None:
    started = time.time()
    gc.collect()
    _py("info", where, f"[{stage} stage] rank:{_P.rank} empty_cache cost:{time.time() - started}s")


def _exit_on_controller_order() -> None:
    """v7.3+: the controller answers an unknown error by ending the job: every processor receives
    the exit message and MindIO's exit thread ends the process (processor.cpp, controller.cpp)."""
    if _P.rank == 0:
        _cpp("info", "controller.cpp:1399", "ExitCallBack return TTP_STOP_SERVICE, controller exit done...")
    _cpp("info", "processor.cpp:1312", f"rank:{_P.rank} receive exit message")
    _cpp("info", "processor.cpp:487", f"rank:{_P.rank} processor exit done.")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(RET_K8S)


def _end_on_unknown() -> None:
    """What the release does after logging an unknown error, up to re-raising it (unset, first
    public); from v7.3 on, the controller ends the job and this never returns."""
    _settle_unknown()
    if _P.release == "first-public":  # its finally block runs before the error propagates
        _empty_cache("repair", "ttp_decorator.py:946")
        _empty_cache("normal", "ttp_decorator.py:956")
    if _P.release in ("v7.3", "v26"):
        _empty_cache("repair", "ttp_decorator.py:934" if _P.release == "v7.3" else "ttp_decorator.py:951")
        _P.store.set(f"{_P.epoch}/exit", "1")
        _exit_on_controller_order()


def tft_exception_handler(func):
    """Decorate ``train``: recover from device faults and call it again."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        args = list(args)  # as MindIO passes them on: the adaptor may replace the model and optimizer
        _P.train_args = args
        while True:
            try:
                return func(*args, **kwargs)
            except RuntimeError as e:
                exception = _classify(str(e))
                _log_catch(exception, e)
                if exception == "OTHER":
                    _end_on_unknown()
                    raise
            # Outside the except block: mindio runs the callbacks in its processor thread, so an
            # error they raise is not chained to the fault.
            _recover(faulty=exception != "FORCE STOP", train_args=args)

    return wrapper


def _execute(name: str, *args) -> int:
    """SaveHandler.execute_*: run a callback, log and swallow its exception."""
    try:
        ret = _HANDLERS[name](*args)
    except Exception as e:  # MindIO catches everything a callback raises
        _py_exception("ttp_decorator.py:325", f"An error occurred: {str(e)}", e)
        return RET_ERROR
    return RET_OK if ret is None else ret


def _recover(faulty: bool, train_args: tuple) -> None:
    rank, epoch, store = _P.rank, _P.epoch, _P.store
    if faulty:
        store.set(f"{epoch}/report/{rank}", str(_P.completed_step))
        store.set(f"{epoch}/abnormal", "1")
        _wait_key(store, f"{epoch}/stop")
        _cpp("info", "processor.cpp:754", f"rank:{rank} receive device stop message")
        _execute("stop", train_args, None)
        _py("info", "ttp_decorator.py:509", f"rank:{rank} uce or hccl error , no need wait, end stop callback")
    else:
        _py("info", "ttp_decorator.py:516",
            f"[stop] rank:{rank} stop consumed:{time.time() - _P.stop_started:.3f}s, ret:0")
    _cpp("info", "processor.cpp:777", f"rank:{rank} reply device stop result success")
    store.add(f"{epoch}/stop_done", 1)

    _wait_key(store, f"{epoch}/clean")
    _cpp("info", "processor.cpp:787", f"rank:{rank} receive device clean message")
    ret = _execute("clean", faulty, train_args, None)
    if ret != RET_OK:
        _cpp("error", "processor.cpp:808", f"rank:{rank} device clean failed, ret: {ret}")
    _cpp("info", "processor.cpp:821", f"rank:{rank} reply device clean result success")
    _cpp("info", "processor.cpp:830", f"rank:{rank} end wait clean action.. waitRet: 0")
    store.add(f"{epoch}/clean_done", 1)
    started = time.time()
    gc.collect()
    _py("info", "ttp_decorator.py:805", f"[repair stage] rank:{rank} empty_cache cost:{time.time() - started}s")

    step = int(store.get(f"{epoch}/step"))
    repair_info = _P.plan.repair_info(rank)
    _wait_key(store, f"{epoch}/repair")
    if repair_info is not None:
        _cpp("info", "processor.cpp:839", f"rank:{rank} receive repair message")
        _py("info", "ttp_decorator.py:536", f"rank:{rank} start to repair callback, repair_id_:{epoch + 1}")
        need_rebuild = repair_info["repair_type"] == RT_UCE_HIGHLEVEL
        ret = _execute("repair", step, need_rebuild, repair_info["dst"], repair_info, train_args, None)
        if ret != RET_OK:
            _cpp("error", "processor.cpp:881", f"rank:{rank} repair failed, ret: {ret}")
        _cpp("info", "processor.cpp:890", f"rank:{rank} reply repair result success")
        store.add(f"{epoch}/repair_done", 1)

    _wait_key(store, f"{epoch}/rollback")
    _cpp("info", "processor.cpp:967", f"rank:{rank} receive rollback message")
    _py("info", "ttp_decorator.py:544", f"rank:{rank} start to rollback callback, repair_id_:{epoch + 1}")
    ret = _execute("rollback", step, train_args, None)
    if ret != RET_OK:
        _cpp("error", "processor.cpp:993", f"rank:{rank} rollback failed, ret: {ret}")
    _cpp("info", "processor.cpp:1003", f"rank:{rank} reply rollback result success")
    store.set(f"{epoch}/rollback_ret/{rank}", str(ret))
    store.add(f"{epoch}/rollback_done", 1)

    while not store.check([f"{epoch}/normal"]):
        if store.check([f"{epoch}/exit"]):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)  # mindio's exit_proc_thread: RET_K8S, without its 10 s grace period
        time.sleep(0.01)
    _cpp("info", "processor.cpp:1096", f"rank:{rank} receive notify normal message")
    started = time.time()
    gc.collect()
    _py("info", "ttp_decorator.py:812", f"[normal stage] rank:{rank} empty_cache cost:{time.time() - started}s")
    _P.epoch += 1
    _P.guard_seq = 0
