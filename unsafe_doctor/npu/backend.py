"""Unsafe backends: mark tensors unsafe after a fault and check them the way torch_npu does.

One interface, two implementations. ``npu`` calls torch_npu's own recovery API
(``torch_npu.npu._recovery``). ``emulated`` reproduces its semantics on any device with a torch
dispatch mode. ``select_backend`` chooses between them. A report prints the ``name`` of the
backend that actually ran.

What torch_npu does, and what the emulation copies (sources: PTA ``NPURecovery.cpp``,
``NPUCachingAllocator.cpp``, the wrapper generator in ``torchnpugen/utils.py``,
``npu_native_functions.yaml``; the project's domain notes, §3):

- **State per memory block.** Each caching-allocator block is safe or unsafe. A tensor is looked
  up by ``storage().data_ptr()``, so all views of a storage share one state. The emulation keys
  the state by storage (the ``StorageImpl``), which is the same thing for allocator memory.
- **Fresh memory is safe.** ``malloc`` hands out a block as safe, even at the address of a freed
  unsafe one. The emulation holds each unsafe storage by weak reference and forgets it when the
  storage is freed. A later storage at the same address (data or ``StorageImpl``) starts safe.
- **Every NPU kernel checks its tensor arguments** while the check flag is on: ``self``,
  positional tensors, tensors in lists and ``out=``. Keyword-only inputs that are not ``out``
  are not checked (for example ``searchsorted(..., sorter=)``). View ops check too: ``view``,
  ``as_strided``, ``squeeze``, ``unsqueeze`` and ``unfold`` are NPU kernels, and the other views
  (``select``, ``slice``, ``transpose``, ``expand``…) reach ``as_strided``. So making a *new*
  view of an unsafe tensor raises. A view made before the fault does not raise until it is read,
  and it is unsafe because it shares the storage. ``detach()`` and ``.data`` never reach a kernel
  (``alias`` only rewraps the storage), so they don't raise.
- **copy_ / _foreach_copy_** check only their source and mark the whole destination block safe,
  so copying into any view refreshes the whole storage. Like every other check, this runs only
  while the flag is on: with the check off, ``copy_`` refreshes nothing.
- **Metadata never raises.** ``shape``, ``dtype``, ``device``, ``stride()``, ``numel()`` and
  ``is_contiguous()`` are read from the tensor object and never reach a kernel.
- **Communication neither checks nor refreshes.** HCCL ``send`` / ``recv`` / ``all_reduce`` /
  ``broadcast`` / ``all_gather`` are not generated wrappers. In torch 2.13 the c10d ops
  (``c10d::send``, ``c10d::recv_``, ``c10d::allreduce_``…) go through the dispatcher, on gloo
  too. The emulation lets every op in the ``c10d`` and ``_c10d_functional`` namespaces pass
  unchecked. A ``recv`` into an unsafe tensor leaves it unsafe. There is one exception:
  functional ``all_reduce`` and ``broadcast`` clone their input first, and that clone is a
  checked copy.
- **The flag** starts off. Nothing in the recovery flow resets it. ``mark_all_npu_tensor_unsafe``
  does not set it. ``restart_device(rebuild_all_resources=True)`` marks all blocks unsafe *and*
  sets the flag, which here is ``mark_all_unsafe()`` followed by ``set_check(enabled=True)``.
- **The error** is torch_npu's TORCH_CHECK text with PTA_ERROR(ErrCode::VALUE):
  ``There is unsafe data in the input tensor.`` then a newline and
  ``[ERROR] %Y-%m-%d-%H:%M:%S (PID:p, Device:d, RankID:r) ERR00003 PTA invalid value``. ``d`` is
  the current device. ``r`` is env ``RANK`` read like ``strtol``, or -1 when it is unset.
  ``unsafe_doctor.npu.messages`` holds the text, which locate looks for in logs.

What only the emulation has to decide:

- **Device memory.** On CPU every tensor counts as device memory, except storages passed to
  ``mark_host`` (a dataset, the harness's own bookkeeping), which are never marked.
- **Mark all.** ``mark_all_unsafe`` marks every tensor that has a Python object
  (``gc.get_objects()``: module globals, containers, ``nn.Module`` parameters and buffers,
  optimizer state, class attributes, closures) and the ``.grad`` of each leaf. That is a superset
  of what a walk from module globals reaches. Tensors held only by C++ (activations saved for
  backward, c10d work buffers) are not reached, though a real NPU marks them as well.
- **Host reads that don't dispatch on CPU.** ``.cpu()``, ``.to("cpu")``, ``.tolist()``,
  ``.numpy()`` and ``repr()`` copy device memory to the host on an NPU, which is a checked read.
  On CPU they return the data without a kernel, so the emulation checks them in a torch function
  mode. ``torch.save`` is not checked.
- **Thread-local.** Torch modes apply to the thread that entered them. Ops run by other Python
  threads are not checked.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from unsafe_doctor.errors import UsageError
from unsafe_doctor.npu.messages import unsafe_data_message

BACKEND_NAMES = ("npu", "emulated")


class UnsafeBackend(ABC):
    """Marks tensors unsafe after a fault and checks them, with torch_npu's semantics."""

    name: str
    """``"npu"`` or ``"emulated"``: what reports print, so it is always the one that ran."""
    device: torch.device
    """Where tensors must live to be checked: ``npu:N`` or ``cpu``."""

    @abstractmethod
    def mark_all_unsafe(self) -> None:
        """What a fault does to persistent memory: every tensor of the device becomes unsafe."""

    @abstractmethod
    def is_safe(self, tensor: torch.Tensor) -> bool:
        """Whether the tensor's memory block is safe. Never raises, whatever the flag."""

    @abstractmethod
    def mark_safe(self, tensor: torch.Tensor) -> None:
        """``update_npu_tensor_to_safe``: the tensor's whole block becomes safe."""

    @abstractmethod
    def set_check(self, *, enabled: bool) -> None:
        """Switch the check (torch_npu's unsafe-check flag) on or off."""

    @abstractmethod
    def check_enabled(self) -> bool:
        """Whether ops check their inputs now."""

    @abstractmethod
    def mark_host(self, *tensors: torch.Tensor) -> None:
        """Declare these tensors host memory. A fault never marks host memory unsafe."""

    @abstractmethod
    def is_device_memory(self, tensor: torch.Tensor) -> bool:
        """Whether a fault can mark this tensor: what the sentinel checks, and nothing else."""

    @abstractmethod
    def activate(self) -> contextlib.AbstractContextManager[UnsafeBackend]:
        """Context in which ops on this thread are checked."""

    @contextlib.contextmanager
    def unchecked(self) -> Iterator[None]:
        """The check off for reads of our own (a harness looking at tensors must neither trip on
        unsafe ones nor make them safe), then back as it was."""
        was_on = self.check_enabled()
        self.set_check(enabled=False)
        try:
            yield
        finally:
            self.set_check(enabled=was_on)


def unsafe_data_error(device_index: int) -> RuntimeError:
    """The error torch_npu raises when an op reads an unsafe block, text for text."""
    return RuntimeError(unsafe_data_message(device_index))


# --- the npu backend -------------------------------------------------------------------------


class NpuBackend(UnsafeBackend):
    """torch_npu's own recovery API. The NPU kernels do the checking."""

    name = "npu"

    def __init__(self, recovery: ModuleType, device_index: int) -> None:
        self._recovery = recovery
        self.device = torch.device("npu", device_index)

    def mark_all_unsafe(self) -> None:
        self._recovery.mark_all_npu_tensor_unsafe(self.device.index)

    def is_safe(self, tensor: torch.Tensor) -> bool:
        return bool(self._recovery.check_npu_tensor_is_safe(tensor))

    def mark_safe(self, tensor: torch.Tensor) -> None:
        self._recovery.update_npu_tensor_to_safe(tensor)

    def set_check(self, *, enabled: bool) -> None:
        self._recovery.set_npu_tensor_unsafe_check_flag(enabled)

    def check_enabled(self) -> bool:
        return bool(self._recovery.get_npu_tensor_unsafe_check_flag())

    def mark_host(self, *tensors: torch.Tensor) -> None:
        """Nothing to do: host tensors live off the NPU allocator, which torch_npu never checks."""

    def is_device_memory(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "npu"

    @contextlib.contextmanager
    def activate(self) -> Iterator[UnsafeBackend]:
        yield self


# --- the emulated backend --------------------------------------------------------------------


class _StorageSet:
    """Storages by identity, each forgotten when it is freed.

    A weak reference with a callback drops the entry when the storage dies. A new storage at the
    same address is then a new entry: this is how freshly allocated memory comes out safe.
    torch keeps one Python object per live storage, so the reference lives as long as the memory.
    """

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key not in self._refs:
            refs = self._refs

            def forget(_dead: weakref.ref[torch.UntypedStorage]) -> None:
                refs.pop(key, None)

            self._refs[key] = weakref.ref(storage, forget)

    def discard(self, storage: torch.UntypedStorage) -> None:
        self._refs.pop(storage._cdata, None)

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        return storage._cdata in self._refs

    def __bool__(self) -> bool:
        return bool(self._refs)


_FROZEN_TENSORS: list[weakref.ref[torch.Tensor]] = []  # the tensors frozen_heap hid from gc.get_objects()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The heap so far moved into the collector's permanent generation while inside: a collection, or
    a fault's scan for live tensors, then reads only what is newer. Before forking processes that
    share the heap, this keeps each child from touching (and so copying) every shared page; in a
    process that marks all tensors many times over, it keeps each mark from reading the whole heap.
    ``gc.get_objects()`` does not list frozen objects, so their tensors are kept here, by weak
    reference, for ``mark_all_unsafe``."""
    kept = len(_FROZEN_TENSORS)
    _FROZEN_TENSORS.extend(map(weakref.ref, _young_tensors()))
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        del _FROZEN_TENSORS[kept:]


def _live_tensors() -> list[torch.Tensor]:
    """Every tensor that has a Python object: the collector's, and those frozen_heap froze."""
    frozen = [tensor for tensor in (reference() for reference in _FROZEN_TENSORS) if tensor is not None]
    return _young_tensors() + frozen


def _young_tensors() -> list[torch.Tensor]:
    """The tensors ``gc.get_objects()`` lists, found in C loops (a Python loop over a few hundred
    thousand objects takes a good fraction of a second on a small machine)."""
    objects = gc.get_objects()
    tensor_types = {kind for kind in set(map(type, objects)) if issubclass(kind, torch.Tensor)}
    return list(itertools.compress(objects, map(tensor_types.__contains__, map(type, objects))))


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's memory, or None when it has none a fault could touch (meta, sparse, empty)."""
    if tensor.is_meta:
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage if storage.nbytes() else None


# How each op treats unsafe memory: check its tensor arguments, refresh its destination (copy),
# or do neither (communication, and the aliases that never reach a kernel).
_CHECK, _COPY, _PASS = "check", "copy", "pass"
_COPY_OPS = {torch.ops.aten.copy_.default, torch.ops.aten._foreach_copy_.default}
_ALIAS_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
_COMMUNICATION_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional"}
_CLONING_COLLECTIVES = {"_c10d_functional::all_reduce", "_c10d_functional::broadcast"}


def _rule(func: torch._ops.OpOverload) -> tuple[str, frozenset[str]]:
    """The op's treatment, and the keyword arguments it checks (its ``out`` tensors)."""
    if func in _COPY_OPS:
        return _COPY, frozenset()
    if func in _ALIAS_OPS:
        return _PASS, frozenset()
    if func.namespace in _COMMUNICATION_NAMESPACES and func._schema.name not in _CLONING_COLLECTIVES:
        return _PASS, frozenset()
    return _CHECK, frozenset(a.name for a in func._schema.arguments if a.kwarg_only and a.is_out)


class EmulatedBackend(UnsafeBackend):
    """torch_npu's unsafe-data semantics on any device, checked in a torch dispatch mode."""

    name = "emulated"

    def __init__(self, device_index: int = 0) -> None:
        self.device = torch.device("cpu")
        self.device_index = device_index
        self._unsafe = _StorageSet()
        self._host = _StorageSet()
        self._check = False
        self._rules: dict[torch._ops.OpOverload, tuple[str, frozenset[str]]] = {}

    def mark_all_unsafe(self) -> None:
        for tensor in _live_tensors():
            self.mark_unsafe(tensor)
            if tensor.is_leaf and tensor.grad is not None:
                self.mark_unsafe(tensor.grad)

    def mark_unsafe(self, tensor: torch.Tensor) -> None:
        """What a fault does to one tensor's block (the emulation alone can aim a fault)."""
        storage = _storage(tensor)
        if storage is not None and storage not in self._host:
            self._unsafe.add(storage)

    def is_safe(self, tensor: torch.Tensor) -> bool:
        storage = _storage(tensor)
        return storage is None or storage not in self._unsafe

    def mark_safe(self, tensor: torch.Tensor) -> None:
        storage = _storage(tensor)
        if storage is not None:
            self._unsafe.discard(storage)

    def set_check(self, *, enabled: bool) -> None:
        self._check = bool(enabled)

    def check_enabled(self) -> bool:
        return self._check

    def mark_host(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            storage = _storage(tensor)
            if storage is not None:
                self._host.add(storage)
                self._unsafe.discard(storage)

    def is_device_memory(self, tensor: torch.Tensor) -> bool:
        storage = _storage(tensor)
        return storage is not None and storage not in self._host

    @contextlib.contextmanager
    def activate(self) -> Iterator[UnsafeBackend]:
        _ACTIVE_EMULATIONS.append(self)
        try:
            with _HostReadCheck(self), _KernelCheck(self):
                yield self
        finally:
            _ACTIVE_EMULATIONS.remove(self)

    def _require_safe(self, tensor: torch.Tensor) -> None:
        if not self.is_safe(tensor):
            raise unsafe_data_error(self.device_index)

    def _require_all_safe(self, values: Iterable[object]) -> None:
        """Check every tensor in ``values``, one level into lists (``Tensor[]``, ``Tensor?[]``)."""
        for value in values:
            if isinstance(value, torch.Tensor):
                self._require_safe(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, torch.Tensor):
                        self._require_safe(item)

    def _before(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
        """What torch_npu's generated wrapper does before the kernel runs."""
        if not (self._check and self._unsafe):
            return
        rule = self._rules.get(func)
        if rule is None:
            rule = self._rules[func] = _rule(func)
        kind, out_names = rule
        if kind == _CHECK:
            self._require_all_safe(args)
            self._require_all_safe(value for name, value in kwargs.items() if name in out_names)
        elif kind == _COPY:
            destinations, sources = args[0], args[1]
            self._require_all_safe([sources])
            for destination in destinations if isinstance(destinations, (list, tuple)) else [destinations]:
                self.mark_safe(destination)


_ACTIVE_EMULATIONS: list[EmulatedBackend] = []


def active_emulation() -> EmulatedBackend | None:
    """The emulation checking this process's ops now (the innermost), if any: the one whose marks count."""
    return _ACTIVE_EMULATIONS[-1] if _ACTIVE_EMULATIONS else None


class _KernelCheck(TorchDispatchMode):
    """Runs torch_npu's per-kernel check before every op."""

    def __init__(self, backend: EmulatedBackend) -> None:
        super().__init__()
        self.backend = backend

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Leave ``__torch_dispatch__`` unwrapped: torch's wrapper imports dynamo (seconds) on
        the first op, for a compiler this mode never meets."""
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():  # the storage lookups need no host-read check
            self.backend._before(func, args, kwargs)
        return func(*args, **kwargs)


_HOST_READS = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__repr__}


class _HostReadCheck(TorchFunctionMode):
    """Checks the device-to-host copies that a CPU tensor makes without running a kernel."""

    def __init__(self, backend: EmulatedBackend) -> None:
        super().__init__()
        self.backend = backend

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        reads_to_host = func in _HOST_READS or (func is torch.Tensor.to and _to_host(args, kwargs))
        if reads_to_host and self.backend.check_enabled():
            self.backend._require_safe(args[0])
        return func(*args, **kwargs)


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.to(...)`` names the CPU as its target device (not another tensor's)."""
    if (len(args) > 1 and isinstance(args[1], torch.Tensor)) or "other" in kwargs:
        return False
    device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    return device is not None and device.type == "cpu"


# --- choosing a backend ----------------------------------------------------------------------


_NPU_RECOVERY = "torch_npu.npu._recovery"


def npu_unavailable_reason() -> str | None:
    """Why torch_npu's recovery API can't be used here, or None when it can."""
    try:
        import torch_npu  # noqa: F401  (registers the npu device with torch)
    except (ImportError, OSError, RuntimeError) as error:  # e.g. libhccl.so missing: no CANN here
        if isinstance(error, ModuleNotFoundError) and error.name == "torch_npu":
            return "torch_npu is not installed"
        return f"import torch_npu failed: {(str(error).splitlines() or [type(error).__name__])[0]}"
    try:
        importlib.import_module(_NPU_RECOVERY)
    except ImportError:
        version = getattr(torch_npu, "__version__", "?")
        return f"torch_npu {version} has no {_NPU_RECOVERY} (added in 6.0.rc3)"
    if not torch_npu.npu.is_available() or torch_npu.npu.device_count() == 0:
        return "torch_npu imports but sees no NPU"
    return None


def select_backend(prefer: str | None = None, device_index: int | None = None) -> UnsafeBackend:
    """The backend to replay on: ``npu`` when torch_npu and an NPU are here, else ``emulated``.

    ``prefer`` forces one. Asking for ``npu`` where there is none is a UsageError that says why.
    ``device_index`` is the NPU to use (default: the current one) or, emulated, the ``Device:``
    the error text names (default 0).
    """
    if prefer not in (None, *BACKEND_NAMES):
        raise UsageError(f"unknown backend {prefer!r}; expected one of: {', '.join(BACKEND_NAMES)}")
    if prefer != "emulated":
        reason = npu_unavailable_reason()
        if reason is None:
            import torch_npu

            if device_index is None:
                device_index = torch_npu.npu.current_device()
            else:
                torch_npu.npu.set_device(device_index)
            return NpuBackend(importlib.import_module(_NPU_RECOVERY), device_index)
        if prefer == "npu":
            raise UsageError(f"cannot use the npu backend: {reason}")
    return EmulatedBackend(0 if device_index is None else device_index)
