"""torch_npu on the CPU for the sample and corpus workers: the replay's emulation and what a job sees around it.

The unsafe-data rules are ``unsafe_doctor.npu.backend.EmulatedBackend``, the emulation that proves
fixes, so the logs and the replay agree on what a fault leaves unsafe (views, fresh memory, copies,
communication). Around it this module gives the workers:

- device faults: ``inject_device_error`` makes the next op raise torch_npu's "UCE ERROR" or
  "HBM MULTI BIT ECC ERROR" text, the way the NPU task queue reports a hardware fault;
- a ``torch_npu`` module (``npu.stop_device``, ``npu.restart_device``, ``npu.check_uce_in_memory``,
  ``npu.current_device``, ``npu._recovery.update_npu_tensor_to_safe``), so recovery adaptors are
  written exactly as for an NPU. ``check_uce_in_memory`` takes the worst case: the UCE hit persistent
  memory, every device tensor becomes unsafe and the check is on (what
  ``restart_device(rebuild_all_resources=True)`` does). Optimizers' step counters are spared: torch
  keeps them in host memory (unless capturable), as the replay's harness assumes too;
- tracebacks that end at the user's line, as torch_npu's errors raised from C++ do.

Tensors passed to ``activate(host=...)`` (a dataset) are host memory, which a fault never marks.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
import time
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from unsafe_doctor.npu.messages import ERR_ACL, UNSAFE_DATA, pta_error
from unsafe_doctor.npu import backend as emulation

UCE_HIGH_LEVEL = 3  # check_uce_in_memory: persistent memory was hit
_EMULATION_FILES = {__file__, emulation.__file__}
_DISPATCH_PLUMBING = ("torch/_compile.py", "torch/_dynamo/eval_frame.py", "torch/utils/_python_dispatch.py",
                      "torch/overrides.py")
_SOURCE_FILE = "build/CMakeFiles/torch_npu.dir/compiler_depend.ts"  # __FILE__ in torch_npu release builds
_LIBRARIES = "/usr/local/lib/python3.11/site-packages"


def device_index() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def uce_error() -> str:
    """What the task queue raises after an uncorrectable memory error (NPUQueue.cpp)."""
    return "UCE ERROR, " + pta_error(ERR_ACL, device_index())


def hbm_ecc_error() -> str:
    """The NPU_CHECK_ERROR text for ACL_ERROR_RT_HBM_MULTI_BIT_ECC_ERROR (NPUException.h)."""
    now = datetime.datetime.now()
    return (
        f"npuSynchronizeDevice:{_SOURCE_FILE}:124 NPU function error: "
        f"HBM MULTI BIT ECC ERROR.time is {int(now.timestamp() * 1e6)}, error code is 507054"
        + pta_error(ERR_ACL, device_index())
    )


def force_stop_error() -> str:
    """What an op in flight raises once MindIO's stop callback has called stop_device."""
    return "FORCE STOP, " + pta_error(ERR_ACL, device_index())


class _DeviceFaults(TorchDispatchMode):
    """Raises a pending device error on the next op; optionally appends torch_npu's C++ stack to
    the unsafe-data error, as a build with C++ stack traces on prints it."""

    def __init__(self, cpp_stacktrace: bool) -> None:
        super().__init__()
        self.pending_error: str | None = None
        self.cpp_stacktrace = cpp_stacktrace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.pending_error is not None:
            error, self.pending_error = self.pending_error, None
            raise RuntimeError(error)
        try:
            return func(*args, **(kwargs or {}))
        except RuntimeError as error:
            if not (self.cpp_stacktrace and str(error).startswith(UNSAFE_DATA)):
                raise
            raise RuntimeError(str(error) + _cpp_stack(func)) from None


def _cpp_stack(func) -> str:
    """The c10::Error backtrace torch_npu appends when C++ stack traces are on."""
    op = func.name().split("::")[-1].replace(".", "_")
    lib = _LIBRARIES
    frames = [
        f"c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f3c8a1b4446 in {lib}/torch/lib/libc10.so)",
        "c10::detail::torchCheckFail(char const*, char const*, unsigned int, std::string const&) + 0x6a "
        f"(0x7f3c8a15d7ea in {lib}/torch/lib/libc10.so)",
        f"c10_npu::check_npu_tensor_is_safe(at::Tensor const&) + 0x1a4 (0x7f3b2c0e43f4 in {lib}/torch_npu/lib/libtorch_npu.so)",
        f"at_npu::native::wrapper__{op}(at::Tensor const&, at::Tensor const&) + 0x5c "
        f"(0x7f3b2b8d2a1c in {lib}/torch_npu/lib/libtorch_npu.so)",
        f"<unknown function> + 0x2c6f1e3 (0x7f3c6f26f1e3 in {lib}/torch/lib/libtorch_cpu.so)",
        f"at::_ops::{op}::call(at::Tensor const&, at::Tensor const&) + 0x1b2 (0x7f3c6fd09c52 in {lib}/torch/lib/libtorch_cpu.so)",
        f"<unknown function> + 0x6a2c9b (0x7f3c8a8a2c9b in {lib}/torch/lib/libtorch_python.so)",
        "<omitting python frames>",
        "__libc_start_main + 0xf3 (0x7f3c8c8f5083 in /lib/x86_64-linux-gnu/libc.so.6)",
    ]
    return (
        f"\nException raised from check_npu_tensor_is_safe at {_SOURCE_FILE}:41 (most recent call first):\n"
        + "\n".join(f"frame #{i}: {frame}" if not frame.startswith("<omitting") else frame
                    for i, frame in enumerate(frames))
        + "\n"
    )


_ACTIVE = contextlib.ExitStack()
_BACKEND: emulation.EmulatedBackend | None = None
_FAULTS: _DeviceFaults | None = None


def activate(cpp_stacktrace: bool = False, host: tuple[torch.Tensor, ...] = ()) -> emulation.EmulatedBackend:
    """Check this thread's ops from now on and install the ``torch_npu`` module; ``host`` is host memory."""
    global _BACKEND, _FAULTS
    _BACKEND = emulation.EmulatedBackend(device_index())
    _BACKEND.mark_host(*host)
    _FAULTS = _DeviceFaults(cpp_stacktrace)
    _ACTIVE.enter_context(_BACKEND.activate())
    _ACTIVE.enter_context(_FAULTS)  # entered last, so it sees every op first
    _install_module(_BACKEND)
    sys.excepthook = _hiding_emulator_frames(sys.excepthook)
    return _BACKEND


def warn_internal_format() -> None:
    """The c10 warning torch_npu prints once per rank at start-up (as seen in MindCluster docs)."""
    now_ns = time.time_ns()
    now = datetime.datetime.fromtimestamp(now_ns / 1e9)
    sys.stderr.write(
        f"[rank{os.environ.get('RANK', 0)}]:[W{now:%m%d} {now:%H:%M:%S}.{now_ns % 1_000_000_000:09d} "
        "compiler_depend.ts:335] Warning: Cannot create tensor with interal format while "
        "allow_internel_format=False, tensor will be created with base format. (function operator())\n")
    sys.stderr.flush()


def inject_device_error(text: str) -> None:
    """Make the next op raise ``text``, as the NPU task queue does after a device fault."""
    assert _FAULTS is not None, "activate() first"
    _FAULTS.pending_error = text


def _install_module(backend: emulation.EmulatedBackend) -> None:
    def check_uce_in_memory(device: int) -> int:
        backend.mark_host(*_step_counters())
        backend.mark_all_unsafe()
        backend.set_check(enabled=True)
        return UCE_HIGH_LEVEL

    torch_npu = types.ModuleType("torch_npu")
    npu = types.ModuleType("torch_npu.npu")
    recovery = types.ModuleType("torch_npu.npu._recovery")
    recovery.update_npu_tensor_to_safe = backend.mark_safe
    npu._recovery = recovery
    npu.check_uce_in_memory = check_uce_in_memory
    npu.current_device = device_index
    npu.stop_device = lambda device: 0
    npu.restart_device = lambda device, rebuild_all_resources=False: None
    torch_npu.npu = npu
    sys.modules.update({"torch_npu": torch_npu, "torch_npu.npu": npu, "torch_npu.npu._recovery": recovery})


def _step_counters() -> list[torch.Tensor]:
    # type(), not isinstance(), which asks every object for __class__ (deprecated aliases warn)
    optimizers = [item for item in gc.get_objects() if issubclass(type(item), torch.optim.Optimizer)]
    steps = [state.get("step") for optimizer in optimizers for state in optimizer.state.values()]
    return [step for step in steps if isinstance(step, torch.Tensor)]


# --- tracebacks ------------------------------------------------------------------------------

def hide_emulator_frames(error: BaseException | None) -> None:
    """Cut ``error``'s traceback (and its cause/context) where the emulation raised it.

    torch_npu raises from C++, so a real traceback ends at the user's line. Here the error comes
    from the emulation's modes, reached through torch's mode plumbing; both are artefacts of
    running on CPU and are dropped.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        entries = []
        tb = error.__traceback__
        while tb is not None:
            entries.append(tb)
            tb = tb.tb_next
        files = [entry.tb_frame.f_code.co_filename for entry in entries]
        cut = next((index for index, name in enumerate(files) if name in _EMULATION_FILES), None)
        if cut is not None:
            while cut > 0 and files[cut - 1].endswith(_DISPATCH_PLUMBING):
                cut -= 1
            if cut == 0:
                error.__traceback__ = None
            else:
                entries[cut - 1].tb_next = None
        error = error.__cause__ or error.__context__


def _hiding_emulator_frames(previous_hook):
    def hook(exc_type, exc, tb):
        if exc is not None:
            hide_emulator_frames(exc)
            tb = exc.__traceback__
        previous_hook(exc_type, exc, tb)

    return hook
