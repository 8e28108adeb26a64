"""A CPU stand-in for the parts of torch_npu that the sample logs need.

The sample workers run on gloo/CPU, where torch_npu cannot load. This module gives them:

- ``UnsafeCheckMode``: a torch dispatch mode that raises torch_npu's exact unsafe-data error when
  an op reads a storage marked unsafe. Semantics follow torch_npu (see the project's domain notes):
  a storage is safe or unsafe as a whole (keyed by ``data_ptr``); ``copy_`` checks only its source
  and makes its destination safe; a fresh allocation is safe; views and metadata never check;
  communication ops (``c10d``) neither check nor refresh.
- Device faults: ``inject_device_error`` makes the next op raise torch_npu's "UCE ERROR" /
  "HBM MULTI BIT ECC ERROR" text, the way the NPU task queue reports a hardware fault.
- A ``torch_npu`` shim module (``npu.stop_device``, ``npu.restart_device``,
  ``npu.check_uce_in_memory``, ``npu.current_device``, ``npu._recovery.update_npu_tensor_to_safe``)
  so recovery adaptors can be written exactly as they are for a real NPU.

Memory allocated while the mode is active counts as NPU memory; tensors made before it (the
dataset) or wrapped from Python data by ``torch.tensor(...)`` count as host memory, which
torch_npu never checks.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

UNSAFE_DATA = "There is unsafe data in the input tensor."

# torch_npu's ErrCode text for the codes the samples use (NPUException.cpp formatErrorCode).
ERR_VALUE = "ERR00003 PTA invalid value"
ERR_ACL = "ERR00100 PTA call acl api failed"
ERR_HCCL = "ERR02200 DIST call hccl api failed"

_COPY_OPS = {torch.ops.aten.copy_.default}
_DISPATCH_PLUMBING = ("torch/_compile.py", "torch/_dynamo/eval_frame.py", "torch/utils/_python_dispatch.py")
_SOURCE_FILE = "build/CMakeFiles/torch_npu.dir/compiler_depend.ts"  # __FILE__ in torch_npu release builds


def pta_error(code: str) -> str:
    """torch_npu's PTA_ERROR suffix: a newline and the ``[ERROR] ... ERRxxxxx`` line."""
    now = datetime.datetime.now().strftime("%Y-%m-%d-%H:%M:%S")
    device = os.environ.get("LOCAL_RANK", "-1")
    rank = os.environ.get("RANK", "-1")
    return f"\n[ERROR] {now} (PID:{os.getpid()}, Device:{device}, RankID:{rank}) {code}"


def uce_error() -> str:
    """What the task queue raises after an uncorrectable memory error (NPUQueue.cpp)."""
    return "UCE ERROR, " + pta_error(ERR_ACL)


def hbm_ecc_error() -> str:
    """The NPU_CHECK_ERROR text for ACL_ERROR_RT_HBM_MULTI_BIT_ECC_ERROR (NPUException.h)."""
    now = datetime.datetime.now()
    return (
        f"npuSynchronizeDevice:{_SOURCE_FILE}:124 NPU function error: "
        f"HBM MULTI BIT ECC ERROR.time is {int(now.timestamp() * 1e6)}, error code is 507054"
        + pta_error(ERR_ACL)
    )


def force_stop_error() -> str:
    """What an op in flight raises once MindIO's stop callback has called stop_device."""
    return "FORCE STOP, " + pta_error(ERR_ACL)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class UnsafeCheckMode(TorchDispatchMode):
    """Checks every op's tensor inputs against the set of unsafe storages."""

    def __init__(self, cpp_stacktrace: bool = False) -> None:
        super().__init__()
        self.device_storages: set[int] = set()
        self.unsafe: set[int] = set()
        self.pending_error: str | None = None
        self.cpp_stacktrace = cpp_stacktrace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.pending_error is not None:
            error, self.pending_error = self.pending_error, None
            raise RuntimeError(error)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func.namespace == "aten" and not func.is_view:
            read = inputs[1:] if func in _COPY_OPS else inputs
            for tensor in read:
                if _storage_key(tensor) in self.unsafe:
                    raise RuntimeError(self._unsafe_error(func))
        out = func(*args, **kwargs)
        if func.namespace != "aten":
            return out
        if func in _COPY_OPS:
            self.unsafe.discard(_storage_key(args[0]))
        input_keys = {_storage_key(t) for t in inputs}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                key = _storage_key(tensor)
                if key and key not in input_keys:
                    self.device_storages.add(key)
                    self.unsafe.discard(key)
        return out

    def _unsafe_error(self, func) -> str:
        message = UNSAFE_DATA + pta_error(ERR_VALUE)
        if self.cpp_stacktrace:
            message += _cpp_stack(func)
        return message


def _cpp_stack(func) -> str:
    """The c10::Error backtrace torch_npu appends when C++ stack traces are on."""
    op = func.name().split("::")[-1].replace(".", "_")
    lib = "/work/main/.venv/lib/python3.11/site-packages"
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
        "\nException raised from check_npu_tensor_is_safe at "
        f"{_SOURCE_FILE}:41 "
        "(most recent call first):\n"
        + "\n".join(f"frame #{i}: {frame}" if not frame.startswith("<omitting") else frame
                    for i, frame in enumerate(frames))
        + "\n"
    )


_MODE: UnsafeCheckMode | None = None


def activate(cpp_stacktrace: bool = False) -> UnsafeCheckMode:
    """Enter the unsafe-check mode for this thread and install the ``torch_npu`` shim."""
    global _MODE
    _MODE = UnsafeCheckMode(cpp_stacktrace)
    _MODE.__enter__()
    _install_shim()
    sys.excepthook = _hide_emulator_frames(sys.excepthook)
    return _MODE


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
    _MODE.pending_error = text


# --- the torch_npu shim --------------------------------------------------------------------

def _check_uce_in_memory(device: int) -> int:
    """Marks every NPU block unsafe (the worst case: the UCE range covers persistent memory)."""
    _MODE.unsafe |= _MODE.device_storages
    return 3


def _update_npu_tensor_to_safe(tensor: torch.Tensor) -> None:
    _MODE.unsafe.discard(_storage_key(tensor))


def _install_shim() -> None:
    torch_npu = types.ModuleType("torch_npu")
    npu = types.ModuleType("torch_npu.npu")
    recovery = types.ModuleType("torch_npu.npu._recovery")
    recovery.update_npu_tensor_to_safe = _update_npu_tensor_to_safe
    npu._recovery = recovery
    npu.check_uce_in_memory = _check_uce_in_memory
    npu.current_device = lambda: int(os.environ.get("LOCAL_RANK", 0))
    npu.stop_device = lambda device: 0
    npu.restart_device = lambda device, rebuild_all_resources=False: None
    torch_npu.npu = npu
    sys.modules.update({"torch_npu": torch_npu, "torch_npu.npu": npu, "torch_npu.npu._recovery": recovery})


# --- tracebacks ------------------------------------------------------------------------------

def hide_emulator_frames(error: BaseException) -> None:
    """Cut ``error``'s traceback (and its cause/context) where the emulation raised it.

    torch_npu raises from C++, so a real traceback ends at the user's line. Here the error comes
    from this module's ``__torch_dispatch__``, reached through torch's dispatch-mode plumbing;
    both are artefacts of running on CPU and are dropped.
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
        if __file__ in files:
            cut = files.index(__file__)
            while cut > 0 and files[cut - 1].endswith(_DISPATCH_PLUMBING):
                cut -= 1
            if cut == 0:
                error.__traceback__ = None
            else:
                entries[cut - 1].tb_next = None
        error = error.__cause__ or error.__context__


def _hide_emulator_frames(previous_hook):
    def hook(exc_type, exc, tb):
        if exc is not None:
            hide_emulator_frames(exc)
            tb = exc.__traceback__
        previous_hook(exc_type, exc, tb)

    return hook
