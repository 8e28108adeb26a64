"""The unsafe backends keep torch_npu's unsafe-data semantics (domain notes §3).

The cases follow torch_npu's own recovery tests (``test_catch_data_check_error``,
``test_mark_all_npu_tensors_unsafe_and_update_safe``): a fault marks tensors unsafe, a read
raises the exact error, a fresh allocation and ``copy_`` make memory safe again. Each test runs
on every backend this machine has. The npu backend is skipped, with its reason, where torch_npu
or an NPU is missing.
"""

from __future__ import annotations

import gc
import os
import re
import socket
import sys
import types
from collections import deque
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.distributed import _functional_collectives as funcol

from unsafe_doctor.errors import UsageError
from unsafe_doctor.npu.backend import (
    BACKEND_NAMES,
    EmulatedBackend,
    frozen_heap,
    npu_unavailable_reason,
    select_backend,
)
from unsafe_doctor.npu.messages import UNSAFE_DATA
from unsafe_doctor.sentinel.reachable import reachable_tensors

ERROR_LINE = re.compile(
    r"\[ERROR\] \d{4}-\d{2}-\d{2}-\d{2}:\d{2}:\d{2} \(PID:(\d+), Device:(-?\d+), RankID:(-?\d+)\) "
    r"ERR00003 PTA invalid value"
)
# torch_npu's own pattern for its error-code line (torch_npu/utils/_error_code.py)
PTA_ERROR_CODE = re.compile(r"\[ERROR\] [0-9\-\:]* \(PID:\d*, Device:\-?\d*, RankID:\-?\d*\) ERR\d{5}")
RAISES_UNSAFE = {"expected_exception": RuntimeError, "match": re.escape(UNSAFE_DATA)}


@pytest.fixture(params=BACKEND_NAMES)
def backend(request):
    """An active backend with the check on, as after ``restart_device(rebuild_all_resources=True)``."""
    try:
        chosen = select_backend(request.param)
    except UsageError as error:
        pytest.skip(str(error))
    with chosen.activate():
        chosen.set_check(enabled=True)
        yield chosen
        chosen.set_check(enabled=False)


def randn(backend, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=backend.device)


# --- marking, reading, the error -------------------------------------------------------------


def test_mark_all_makes_live_tensors_unsafe_and_later_allocations_safe(backend):
    tensor_a, tensor_b = randn(backend, 2, 16, 16), randn(backend, 2, 16, 16)
    assert backend.is_safe(tensor_a) and backend.is_safe(tensor_b)

    backend.mark_all_unsafe()

    assert not backend.is_safe(tensor_a) and not backend.is_safe(tensor_b)
    del tensor_a
    tensor_a_new = randn(backend, 2, 16, 16)
    assert backend.is_safe(tensor_a_new)
    tensor_b.copy_(tensor_a_new)
    assert backend.is_safe(tensor_b)


def test_mark_all_reaches_the_tensors_a_frozen_heap_hides_from_the_collector():
    """frozen_heap moves the heap into the permanent generation, which gc.get_objects() skips: the
    tensors made before it (a module global, a freed one's weak reference aside) and inside it are
    all marked, and after it the collector lists the old ones again."""
    backend = EmulatedBackend()
    before, freed = torch.ones(3), torch.ones(3)
    with frozen_heap():
        assert not any(item is before for item in gc.get_objects())
        del freed
        inside = torch.ones(3)
        backend.mark_all_unsafe()
    assert not backend.is_safe(before) and not backend.is_safe(inside)
    assert any(item is before for item in gc.get_objects())


def test_an_op_on_unsafe_tensors_raises_torch_npus_error_text(backend, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    tensor_a, tensor_b = randn(backend, 2, 8), randn(backend, 2, 8)
    backend.mark_all_unsafe()

    with pytest.raises(RuntimeError) as raised:
        tensor_a + tensor_b

    first, second = str(raised.value).split("\n")
    assert first == UNSAFE_DATA
    pid, device, rank = ERROR_LINE.fullmatch(second).groups()
    assert (int(pid), int(device), int(rank)) == (os.getpid(), backend.device.index or 0, 3)
    assert PTA_ERROR_CODE.search(second)


def test_rank_id_is_minus_one_when_rank_is_unset(backend, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    tensor = randn(backend, 4)
    backend.mark_all_unsafe()

    with pytest.raises(RuntimeError) as raised:
        tensor.sum()

    assert ERROR_LINE.search(str(raised.value)).group(3) == "-1"


def test_emulated_error_names_the_device_index_it_was_given():
    backend = select_backend("emulated", device_index=5)
    tensor = torch.ones(2)
    with backend.activate():
        backend.set_check(enabled=True)
        backend.mark_all_unsafe()
        with pytest.raises(RuntimeError) as raised:
            tensor * 2

    assert ERROR_LINE.search(str(raised.value)).group(2) == "5"


def add_in_place(unsafe, one, ok):
    unsafe += 1


READS = {
    "+=": add_in_place,
    "zero_": lambda unsafe, one, ok: unsafe.zero_(),
    "fill_": lambda unsafe, one, ok: unsafe.fill_(0.0),
    "item": lambda unsafe, one, ok: one.item(),
    "float()": lambda unsafe, one, ok: float(one),
    "cpu": lambda unsafe, one, ok: unsafe.cpu(),
    "to cpu": lambda unsafe, one, ok: unsafe.to("cpu"),
    "tolist": lambda unsafe, one, ok: unsafe.tolist(),
    "repr": lambda unsafe, one, ok: repr(unsafe),
    "zeros_like": lambda unsafe, one, ok: torch.zeros_like(unsafe),
    "empty_like": lambda unsafe, one, ok: torch.empty_like(unsafe),
    "torch.add": lambda unsafe, one, ok: torch.add(ok, unsafe),
    "torch.cat([ok, unsafe])": lambda unsafe, one, ok: torch.cat([ok, unsafe]),
    "clone": lambda unsafe, one, ok: unsafe.clone(),
    "to(dtype)": lambda unsafe, one, ok: unsafe.to(torch.float64),
    "out= unsafe": lambda unsafe, one, ok: torch.add(ok, ok, out=unsafe),
    "copy_ from unsafe": lambda unsafe, one, ok: ok.copy_(unsafe),
    "new view": lambda unsafe, one, ok: unsafe.view(-1),
    "indexing": lambda unsafe, one, ok: unsafe[0],
    "transpose": lambda unsafe, one, ok: unsafe.t(),
}


@pytest.mark.parametrize("read", READS.values(), ids=READS.keys())
def test_reading_an_unsafe_tensor_raises(backend, read):
    unsafe, one = randn(backend, 2, 3), randn(backend, 1)
    backend.mark_all_unsafe()
    ok = torch.ones(2, 3, device=backend.device)

    with pytest.raises(**RAISES_UNSAFE):
        read(unsafe, one, ok)


def test_with_the_check_off_nothing_raises_and_the_marks_stay(backend):
    unsafe, one = randn(backend, 2, 3), randn(backend, 1)
    backend.mark_all_unsafe()
    ok = torch.ones(2, 3, device=backend.device)
    backend.set_check(enabled=False)

    assert not backend.check_enabled()
    for read in READS.values():
        read(unsafe, one, ok)
    assert not backend.is_safe(unsafe)

    backend.set_check(enabled=True)
    with pytest.raises(**RAISES_UNSAFE):
        unsafe.sum()


def test_mark_safe_makes_a_tensor_readable(backend):
    tensor = randn(backend, 3)
    backend.mark_all_unsafe()

    backend.mark_safe(tensor)

    assert backend.is_safe(tensor)
    tensor.add_(1)


def test_keyword_only_inputs_other_than_out_are_not_checked():
    """torch_npu's wrappers check self, out= and positional tensors; searchsorted's sorter is none."""
    backend = EmulatedBackend()
    sorter = torch.tensor([1, 2, 0])  # argsort of the sequence below
    with backend.activate():
        backend.set_check(enabled=True)
        backend.mark_all_unsafe()
        sequence, values = torch.tensor([3.0, 1.0, 2.0]), torch.tensor([2.5])

        position = torch.searchsorted(sequence, values, sorter=sorter)

        backend.set_check(enabled=False)
        assert position.tolist() == [2]


def test_metadata_of_an_unsafe_tensor_never_raises(backend):
    tensor = randn(backend, 2, 3)
    backend.mark_all_unsafe()

    assert tensor.shape == (2, 3) and tensor.size(0) == 2 and tensor.dim() == 2 and tensor.ndim == 2
    assert tensor.dtype == torch.float32 and tensor.device == backend.device
    assert tensor.stride() == (3, 1) and tensor.storage_offset() == 0 and tensor.is_contiguous()
    assert tensor.numel() == 6 and tensor.element_size() == 4 and tensor.nbytes == 24 and len(tensor) == 2
    assert tensor.is_floating_point() and not tensor.requires_grad and tensor.layout == torch.strided
    assert tensor.data_ptr() != 0
    assert not backend.is_safe(tensor)


# --- what makes memory safe again -------------------------------------------------------------


def test_copy_checks_only_its_source_and_refreshes_its_destination(backend):
    tensor = randn(backend, 4)
    backend.mark_all_unsafe()
    fresh = torch.arange(4.0, device=backend.device)

    tensor.copy_(fresh)

    assert backend.is_safe(tensor)
    assert (tensor + 1).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_foreach_copy_refreshes_every_destination(backend):
    first, second = randn(backend, 2), randn(backend, 3)
    backend.mark_all_unsafe()
    sources = [torch.zeros(2, device=backend.device), torch.ones(3, device=backend.device)]

    torch._foreach_copy_([first, second], sources)

    assert backend.is_safe(first) and backend.is_safe(second)


def test_copy_with_the_check_off_does_not_refresh(backend):
    """torch_npu's copy wrapper checks and refreshes inside the same ``if (flag)``."""
    tensor = randn(backend, 4)
    backend.mark_all_unsafe()
    backend.set_check(enabled=False)

    tensor.copy_(torch.zeros(4, device=backend.device))

    assert not backend.is_safe(tensor)


def test_a_tensor_rebuilt_from_metadata_is_safe(backend):
    unsafe = randn(backend, 2, 3).to(torch.bfloat16)
    backend.mark_all_unsafe()

    rebuilt = torch.zeros(unsafe.shape, dtype=unsafe.dtype, device=unsafe.device)

    assert backend.is_safe(rebuilt) and not backend.is_safe(unsafe)
    assert (rebuilt + 1).sum().item() == 6


def test_an_allocation_at_a_freed_unsafe_address_is_safe(backend):
    unsafe = [torch.empty(256, device=backend.device) for _ in range(32)]
    freed_addresses = {tensor.data_ptr() for tensor in unsafe}
    backend.mark_all_unsafe()
    del unsafe

    fresh = [torch.empty(256, device=backend.device) for _ in range(64)]

    reused = [tensor for tensor in fresh if tensor.data_ptr() in freed_addresses]
    if not reused:
        pytest.skip("the allocator handed out none of the freed addresses")
    assert all(backend.is_safe(tensor) for tensor in reused)
    reused[0].fill_(1.0)


def test_a_new_storage_over_freed_unsafe_memory_is_safe():
    """Emulation only: two storages over one buffer, so the address is reused every time."""
    backend = EmulatedBackend()
    memory = bytearray(64)
    unsafe = torch.frombuffer(memory, dtype=torch.float32)
    address = unsafe.data_ptr()
    with backend.activate():
        backend.set_check(enabled=True)
        backend.mark_all_unsafe()
        del unsafe

        fresh = torch.frombuffer(memory, dtype=torch.float32)

        assert fresh.data_ptr() == address
        assert backend.is_safe(fresh)
        fresh.add_(1)


# --- views ---------------------------------------------------------------------------------


def test_views_share_their_storage_state(backend):
    base = randn(backend, 4, 4)
    row, column = base[0], base[:, 1]  # views made while the memory was safe
    backend.mark_all_unsafe()

    assert not backend.is_safe(row) and not backend.is_safe(column)
    with pytest.raises(**RAISES_UNSAFE):
        row.sum()


def test_detach_and_data_are_not_kernels_and_do_not_raise(backend):
    tensor = randn(backend, 4)
    backend.mark_all_unsafe()

    detached, data = tensor.detach(), tensor.data

    assert not backend.is_safe(detached) and not backend.is_safe(data)


def test_copy_into_one_view_refreshes_the_whole_storage(backend):
    """torch_npu marks the block of ``dst.storage().data_ptr()``: the whole storage."""
    base = randn(backend, 4, 4)
    row, other_row = base[0], base[1]
    backend.mark_all_unsafe()

    row.copy_(torch.zeros(4, device=backend.device))

    assert backend.is_safe(base) and backend.is_safe(other_row)
    other_row.sum()


def test_data_copy_refreshes_the_tensor(backend):
    """The FAQ's repair: ``global_tensor.data.copy_(received)``."""
    tensor = randn(backend, 4)
    backend.mark_all_unsafe()

    tensor.data.copy_(torch.ones(4, device=backend.device))

    assert backend.is_safe(tensor)
    assert tensor.sum().item() == 4


# --- mark all ------------------------------------------------------------------------------


class Tracker:
    totals: dict = {}

    def __init__(self, device):
        self.values = {"loss": [torch.ones(2, device=device)]}


class Slotted:
    __slots__ = ("scale",)

    def __init__(self, device):
        self.scale = torch.ones(1, device=device)


def training_state(device) -> types.ModuleType:
    """A module with the kinds of global state a framework keeps, after one training step."""
    state = types.ModuleType("replay_probe_state")
    state.LOSS_SCALE = torch.ones(1, device=device)
    state.TRACKER = {
        "moe": {"aux_loss": [torch.zeros(3, device=device)]},
        "queue": deque([torch.ones(2, device=device)]),
    }
    state.MODEL = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).to(device)
    state.OPTIMIZER = torch.optim.SGD(state.MODEL.parameters(), lr=0.1, momentum=0.9)
    state.Tracker, state.SINGLETON, state.SLOTTED = Tracker, Tracker(device), Slotted(device)
    Tracker.totals["step"] = torch.zeros(1, device=device)
    state.MODEL(torch.randn(4, 3, device=device)).sum().backward()
    state.OPTIMIZER.step()
    return state


def expected_tensors(state: types.ModuleType) -> dict[str, torch.Tensor]:
    momentum = [s["momentum_buffer"] for s in state.OPTIMIZER.state.values()]
    named = {
        "global": state.LOSS_SCALE,
        "nested dict": state.TRACKER["moe"]["aux_loss"][0],
        "deque": state.TRACKER["queue"][0],
        "class attribute": Tracker.totals["step"],
        "instance attribute": state.SINGLETON.values["loss"][0],
        "slot": state.SLOTTED.scale,
        "batchnorm buffer": state.MODEL[1].running_mean,
        "optimizer state": momentum[0],
    }
    for name, parameter in state.MODEL.named_parameters():
        named[f"parameter {name}"] = parameter
        named[f"grad {name}"] = parameter.grad
    return named


def test_reachable_tensors_walks_globals_containers_modules_and_optimizer_state():
    state = training_state(torch.device("cpu"))

    found = reachable_tensors(state)

    found_ids = {id(tensor) for tensor in found}
    assert len(found_ids) == len(found)
    missing = [name for name, tensor in expected_tensors(state).items() if id(tensor) not in found_ids]
    assert missing == []


def test_reachable_tensors_does_not_follow_other_modules_or_properties():
    root = types.ModuleType("replay_probe_root")
    other = types.ModuleType("replay_probe_other")
    other.HIDDEN = torch.ones(1)

    class Lazy:
        @property
        def built(self):
            raise AssertionError("a property was evaluated")

    root.OTHER, root.LAZY, root.KEPT = other, Lazy(), torch.zeros(1)

    assert [id(t) for t in reachable_tensors(root)] == [id(root.KEPT)]


def test_mark_all_reaches_globals_containers_modules_and_optimizer_state(backend, monkeypatch):
    state = training_state(backend.device)
    monkeypatch.setitem(sys.modules, state.__name__, state)

    backend.mark_all_unsafe()

    still_safe = [name for name, tensor in expected_tensors(state).items() if backend.is_safe(tensor)]
    assert still_safe == []


def test_host_tensors_are_never_marked(backend):
    host = torch.arange(3.0)  # CPU memory: the host on an NPU machine, declared so when emulated
    backend.mark_host(host)

    backend.mark_all_unsafe()

    assert backend.is_safe(host)
    assert (host + 1).tolist() == [1.0, 2.0, 3.0]


# --- communication -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def exchange_after_fault(rank: int, backend_name: str, port: int) -> None:
    """One rank of the communication test. Rank 0 sends, rank 1 receives, both are faulted."""
    torch.set_num_threads(1)  # as torch's forked DataLoader workers do: OpenMP does not survive fork
    backend = select_backend(backend_name, device_index=rank)
    dist.init_process_group(
        "hccl" if backend.name == "npu" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    try:
        tensor = torch.full((4,), float(rank + 1), device=backend.device)
        with backend.activate():
            backend.set_check(enabled=True)
            backend.mark_all_unsafe()

            if rank == 0:
                dist.send(tensor, dst=1)  # an unsafe source: communication does not check
            else:
                dist.recv(tensor, src=0)  # an unsafe destination: filled, but still unsafe
            dist.all_reduce(tensor)

            assert not backend.is_safe(tensor)
            with pytest.raises(**RAISES_UNSAFE):
                tensor + 1
            with pytest.raises(**RAISES_UNSAFE):  # functional all_reduce clones its input first
                funcol.all_reduce(tensor, "sum", dist.group.WORLD)
            backend.set_check(enabled=False)
            assert tensor.tolist() == [2.0] * 4
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_send_and_recv_neither_check_nor_refresh(backend_name):
    if backend_name == "npu":
        reason = npu_unavailable_reason()
        if reason or torch.npu.device_count() < 2:
            pytest.skip(reason or "needs two NPUs for an hccl pair")
    # Forked ranks start in a blink (no second import of torch); an NPU runtime must not be
    # forked once initialised, so NPU ranks are spawned.
    start_method = "spawn" if backend_name == "npu" else "fork"

    torch.multiprocessing.start_processes(
        exchange_after_fault, args=(backend_name, free_port()), nprocs=2, start_method=start_method
    )


# --- choosing a backend --------------------------------------------------------------------


def test_auto_selection_takes_the_npu_only_where_there_is_one():
    reason = npu_unavailable_reason()

    assert select_backend().name == ("emulated" if reason else "npu")
    assert select_backend("emulated").name == "emulated"


def test_asking_for_the_npu_where_there_is_none_says_why():
    reason = npu_unavailable_reason()
    if reason is None:
        pytest.skip("this machine has an NPU")

    with pytest.raises(UsageError) as raised:
        select_backend("npu")

    assert reason in str(raised.value) and "\n" not in str(raised.value)


def test_an_unknown_backend_name_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown backend 'gpu'"):
        select_backend("gpu")
