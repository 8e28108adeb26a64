"""One rank of a replay: build the global state, train, fault, recover with the adaptor's code, resume.

Every rank runs the plan twice in one process group: ``unpatched`` (the adaptor with our blocks
taken out) and ``patched`` (as written). Each run, in MindIO's order:

1. build: each target's probe creates its global's tensors; ``steps`` training steps touch them;
2. fault, on the faulty rank: the global's bytes are scrambled (what a UCE leaves), every tensor
   is marked unsafe and the check switched on (``restart_device``); the model and optimizer in
   ``train_args`` are made safe again, as the adaptor's own repair of them does;
3. repair: the replica runs the send function, the faulty rank the receive function;
4. rollback: every rank runs the rollback function;
5. check: unsafe tensors still reachable from each global on the faulty rank, and for scenario 2
   the global's bytes against the replica's;
6. resume: each probe's step runs again under the check, as the first step after recovery does.

*block* mode runs exactly the marked blocks of each function (read back from the file), with the
function's parameters bound here; *adaptor* mode imports the adaptor's files and calls its real
functions. Nothing here prints: results are ``replay.results`` for ``verify`` to judge.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import importlib
import importlib.util
import inspect
import linecache
import pickle
import re
import sys
import time
import traceback
import types
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from unsafe_doctor.npu.backend import UnsafeBackend, select_backend
from unsafe_doctor.npu.messages import UNSAFE_DATA
from unsafe_doctor.replay.plan import RUNS, ReplayPlan
from unsafe_doctor.replay.probes import NO_TRAIN_ARGS, Probe, ProbeError, make_probe, refresh
from unsafe_doctor.replay.results import FailureKind, FixFailure, Milestone, RankResult, RunResult, StepOutcome
from unsafe_doctor.sentinel import FRAMEWORK_PACKAGES, examine
from unsafe_doctor.sentinel.reachable import reachable_tensors

if TYPE_CHECKING:
    from unsafe_doctor.knowledge.rules import ParameterRole

_HERE = str(Path(__file__).resolve().parents[1])  # unsafe_doctor/: frames from here are the harness's own
_TORCH = str(Path(torch.__file__).resolve().parent)
_GETTER_STANDIN = "megatron.training"


class Progress:
    """Where this rank is, one milestone per line (JSON), so a launcher can say where a stuck rank waits."""

    def __init__(self, path: str | None) -> None:
        self._stream = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 (lives as long as the rank)
        self.last: Milestone | None = None  # where a crash of this rank happened

    def __call__(self, milestone: Milestone) -> None:
        self.last = milestone
        if self._stream:
            self._stream.write(milestone.to_json() + "\n")
            self._stream.flush()


def run_rank(plan: ReplayPlan, rank: int, device_index: int, progress: Progress, backend: str | None = None) -> RankResult:
    """Both runs on this rank of an initialised process group.
    ``device_index`` is this rank's NPU (its local rank), or the ``Device:`` the emulated error names;
    ``backend`` forces one (``select_backend``'s ``prefer``)."""
    for root in plan.source_roots:
        if root not in sys.path:
            sys.path.insert(0, root)
    notes = _install_standins(plan)
    runs = {}
    backend_name = ""
    for run in RUNS:
        unsafe = select_backend(backend, device_index)
        backend_name = unsafe.name
        runs[run] = _Run(plan, run, rank, unsafe, progress).execute()
        dist.barrier()
    return RankResult(rank, backend_name, runs["unpatched"], runs["patched"], tuple(notes))


class _Run:
    def __init__(self, plan: ReplayPlan, run: str, rank: int, backend: UnsafeBackend, progress: Progress) -> None:
        self.plan, self.run, self.rank, self.backend, self.progress = plan, run, rank, backend, progress
        self.built: dict[str, str] = {}
        self.not_modelled: dict[str, str] = {}
        self.fix_failures: list[FixFailure] = []
        self.resume: dict[str, StepOutcome] = {}
        self.unsafe_left: dict[str, int] = {}
        self.equal: dict[str, bool] = {}
        self.seconds: dict[str, float] = {}
        self.adaptor_unavailable: str | None = None
        self.sentinel: tuple[str, ...] | None = None  # faulty rank: the globals the sentinel names after the rollback
        self.probes: dict[str, Probe] = {}
        self.group: dist.ProcessGroup | None = None  # the repair group, on the faulty and the replica rank
        self.at_fault: dict[str, list[bytes]] | None = None  # on the replica: each global's bytes at the fault
        self._modules: dict[str, types.ModuleType] | None = None  # adaptor mode: function name -> its module

    def execute(self) -> RunResult:
        with self.backend.activate():
            self._phase("build", self._build)
            self._phase("fault", self._fault)
            self._phase("repair", self._repair)
            self._phase("rollback", lambda: self._call("rollback"))
            if self.adaptor_unavailable is None:  # else nothing recovered, on any rank (all import it alike): no step
                self._phase("sentinel", self._sentinel)
                self._phase("check", self._check)
                self._phase("resume", self._resume)
        return RunResult(self.built, self.not_modelled, tuple(self.fix_failures), self.resume, self.unsafe_left,
                         self.equal, self.seconds, self.adaptor_unavailable, self.sentinel)

    def _phase(self, name: str, action: Callable[[], None]) -> None:
        role = self._role(name)
        self.progress(Milestone(self.run, name, self.plan.functions.get(role, "") if role else None))
        start = time.perf_counter()
        action()
        self.seconds[name] = time.perf_counter() - start

    def _role(self, phase: str) -> str | None:
        if phase == "repair" and self.rank in (self.plan.faulty, self.plan.replica):
            return "send" if self.rank == self.plan.replica else "recv"
        return "rollback" if phase == "rollback" else None

    # --- phases ----------------------------------------------------------------------------------

    def _build(self) -> None:
        refresh(target.module for target in self.plan.targets if target.probe is None)  # the rules' probes reset their own
        for target in self.plan.targets:
            try:
                probe = make_probe(target, self.backend.device, self.plan.probe)
                probe.build()
            except Exception as error:  # state this machine cannot build is not modelled (exit 2), never a crash
                self.not_modelled[target.key] = _not_built(error, "the probe's build")
                continue
            self.probes[target.key] = probe
            self.built[target.key] = probe.how
        for probe in self.probes.values():  # a later build may have emptied it (toytrain's init_state clears LOSS_LOG)
            if not probe.tensors():
                probe.build()
        for _ in range(self.plan.steps):
            for key, probe in list(self.probes.items()):
                try:
                    probe.step()
                except Exception as error:  # before the fault nothing is unsafe: the probe itself fails here
                    self.not_modelled[key] = f"{self.built.pop(key)}; {_not_built(error, 'its step before the fault')}"
                    del self.probes[key]
        for key, probe in self.probes.items():
            _advance(probe.tensors(), key)

    def _fault(self) -> None:
        if self.rank == self.plan.replica:  # what recovery must give back to the faulty rank
            self.at_fault = {key: [_bytes(tensor) for tensor in probe.tensors()] for key, probe in self.probes.items()}
        if self.rank == self.plan.faulty:
            self.backend.set_check(False)
            for probe in self.probes.values():
                _scramble(probe.tensors())
            self.backend.mark_host(*_host_resident(self._train_args()))
            self.backend.mark_all_unsafe()
            if self.plan.mode == "block":  # the adaptor's own repair of them is not run; the globals stay unsafe
                globals_memory = {_address(tensor) for probe in self.probes.values() for tensor in probe.tensors()}
                for tensor in reachable_tensors(*(item for item in self._train_args() if item is not None)):
                    if _address(tensor) not in globals_memory:
                        self.backend.mark_safe(tensor)
            self.backend.set_check(True)
        dist.barrier()

    def _repair(self) -> None:
        pair = sorted({self.plan.faulty, self.plan.replica})
        if self.rank not in pair:
            return
        self.group = dist.new_group(pair, timeout=datetime.timedelta(seconds=self.plan.timeout), use_local_synchronization=True)
        self._call("send" if self.rank == self.plan.replica else "recv")

    def _sentinel(self) -> None:
        """On the faulty rank, where the rollback ends: what the sentinel names still unsafe (not what the
        step writes before reading), walking the framework's and the targets' packages from
        ``train_args`` as an installed sentinel would."""
        if self.rank != self.plan.faulty:
            return
        packages = {*FRAMEWORK_PACKAGES, *(target.module.partition(".")[0] for target in self.plan.targets)}
        roots = [item for item in self._train_args() if item is not None]
        report = examine(*roots, packages=packages, backend=self.backend)
        self.sentinel = tuple(item.dotted for item in report.still_unsafe)

    def _check(self) -> None:
        """On the faulty rank: what is still unsafe, and (scenario 2) whether each global holds the
        bytes the replica had at the fault, the state training had reached on every healthy rank."""
        was_on = self.backend.check_enabled()
        self.backend.set_check(False)  # the harness's own reads must not trip, nor refresh anything
        try:
            mine = {}
            if self.rank == self.plan.faulty:
                for key, probe in self.probes.items():
                    tensors = probe.tensors()
                    self.unsafe_left[key] = sum(not self.backend.is_safe(tensor) for tensor in tensors)
                    mine[key] = [_bytes(tensor) for tensor in tensors]
            gathered = gather_objects(self.at_fault, self.backend.device)
            if self.rank == self.plan.faulty:
                reference = gathered[self.plan.replica] or {}
                for target in self.plan.targets:
                    if target.scenario == 2 and target.key in mine:
                        self.equal[target.key] = mine[target.key] == reference.get(target.key)
        finally:
            self.backend.set_check(was_on)

    def _resume(self) -> None:
        for key, probe in self.probes.items():
            try:
                probe.step()
            except RuntimeError as error:
                if UNSAFE_DATA not in str(error):
                    raise
                self.resume[key] = StepOutcome(str(error).splitlines()[0], _where(error), self._unsafe_global(error))
            else:
                self.resume[key] = StepOutcome()

    def _unsafe_global(self, error: BaseException) -> str | None:
        """The global the failing step read: of the names on the user's lines of the traceback
        (innermost first) that are module-level, or reached through a module or a class, the first
        with an unsafe tensor behind it. It may be another global than the probe's: the next one
        no fix covers."""
        was_on = self.backend.check_enabled()
        self.backend.set_check(False)  # looking must not trip, nor refresh anything
        try:
            for frame, line in reversed(list(traceback.walk_tb(error.__traceback__))):
                if not _is_users(frame.f_code.co_filename):
                    continue
                for label, value in _globals_on_line(linecache.getline(frame.f_code.co_filename, line), frame):
                    if any(not self.backend.is_safe(tensor) for tensor in reachable_tensors(value)):
                        return label
        finally:
            self.backend.set_check(was_on)
        return None

    # --- running the adaptor's code --------------------------------------------------------------

    def _call(self, role: str) -> None:
        function = self.plan.functions.get(role)
        if function is None:
            return
        values = self._values(role)
        if self.plan.mode == "adaptor":
            try:
                self._adaptor_modules()
            except (Exception, SystemExit) as error:  # its imports missing here, or its own code failing or exiting at import
                self.adaptor_unavailable = f"{type(error).__name__}: {_first_line(error)}"
                return
        try:
            if self.plan.mode == "adaptor":
                self._call_function(role, function, values)
            else:
                self._run_blocks(role, values)
        except Exception as error:  # the adaptor's code may fail in any way: that is a finding
            failure = FixFailure(role, function, f"{type(error).__name__}: {_first_line(error)}", _where(error),
                                 _failure_kind(error))
            self.progress(Milestone(self.run, "rollback" if role == "rollback" else "repair", function, failure))
            self.fix_failures.append(failure)

    def _values(self, role: str) -> dict[str, object]:
        """What MindIO passes, by role: this replay's single (replica -> faulty) repair. Ranks come as
        one-entry lists, or as the ranks themselves where the profile's are no lists; one parameter
        for both (a `peer`) holds the other side's rank: the faulty one where the function sends."""
        train_args = self._train_args()
        lists = self.plan.ranks_are_lists
        source = [self.plan.replica] if lists else self.plan.replica
        destination = [self.plan.faulty] if lists else self.plan.faulty
        ranks: list[tuple[ParameterRole, object]] = [("src_ranks", source), ("dest_ranks", destination)]
        by_role: list[tuple[ParameterRole, object]] = [
            *(ranks if role == "send" else ranks[::-1]),  # the other side's rank bound last
            ("optim_idxs", [0]),
            ("rank_list", sorted({self.plan.faulty, self.plan.replica})),
            ("train_args", train_args),
            ("need_rebuild", True),
        ]
        values: dict[str, object] = {"step": self.plan.steps}
        for held, value in by_role:
            for name in self.plan.parameters.get(held, ()):
                _bind(values, name, value)
        if self.plan.group_parameter is not None:
            values[self.plan.group_parameter] = self.group
        return values

    def _run_blocks(self, role: str, values: dict[str, object]) -> None:
        if self.run != "patched":
            return
        for block in self.plan.blocks_for(role):
            namespace: dict[str, object] = {"__name__": f"unsafe_doctor_block_{block.function}"}
            namespace.update({name: values.get(name) for name in block.parameters})
            if block.own_group:
                namespace[block.own_group] = self.group
            code = compile("\n" * (block.line - 1) + block.code, block.path, "exec")
            with self._group_getters(role):
                exec(code, namespace)  # noqa: S102 (the user's own fix, read back from their adaptor)

    @contextlib.contextmanager
    def _group_getters(self, role: str) -> Iterator[None]:
        """Block mode: the profile's repair-group getter gives this replay's group."""
        if role == "rollback":
            yield
            return
        saved = {}
        group = self.group
        for line in self.plan.repair_group_imports:
            module_name, names = _from_import(line)
            if module_name is None:
                continue
            standin = types.ModuleType(module_name)
            for name in names:
                setattr(standin, name, lambda *args, **kwargs: group)
            saved[module_name] = sys.modules.get(module_name)
            sys.modules[module_name] = standin
        try:
            yield
        finally:
            for module_name, module in saved.items():
                if module is None:
                    sys.modules.pop(module_name, None)
                else:
                    sys.modules[module_name] = module

    def _call_function(self, role: str, name: str, values: dict[str, object]) -> None:
        module = self._adaptor_modules().get(name)
        if module is None:
            raise LookupError(f"no function {name}() in the adaptor's files")
        function = getattr(module, name)
        arguments = {}
        for parameter in inspect.signature(function).parameters.values():
            if parameter.name in values:
                arguments[parameter.name] = values[parameter.name]
            elif parameter.default is inspect.Parameter.empty:
                arguments[parameter.name] = None
        function(**arguments)

    def _adaptor_modules(self) -> dict[str, types.ModuleType]:
        """Each adaptor file executed as its module (this run's text), by the functions it defines."""
        if self._modules is None:
            modules: dict[str, types.ModuleType] = {}
            for code in self.plan.files:
                module = types.ModuleType(code.module)
                module.__file__ = code.path
                module.__package__ = code.module.rpartition(".")[0]
                sys.modules[code.module] = module
                text = code.patched if self.run == "patched" else code.unpatched
                exec(compile(text, code.path, "exec"), module.__dict__)  # noqa: S102 (the user's adaptor)
                for function in code.functions:
                    modules.setdefault(function, module)
            self._modules = modules
        return self._modules

    def _train_args(self) -> tuple:
        return next(iter(self.probes.values())).train_args() if self.probes else NO_TRAIN_ARGS


# --- helpers ---------------------------------------------------------------------------------------


def _bind(values: dict[str, object], name: str, value: object) -> None:
    """`values[name] = value`; a dotted name (`recv_args.src_ranks`) sets the attribute of an object
    standing for the parameter, as MindIO's named tuples of repair arguments hold the ranks."""
    root, *attributes = name.split(".")
    if not attributes:
        values[root] = value
        return
    holder = values.setdefault(root, types.SimpleNamespace())
    for attribute in attributes[:-1]:
        if not hasattr(holder, attribute):
            setattr(holder, attribute, types.SimpleNamespace())
        holder = getattr(holder, attribute)
    setattr(holder, attributes[-1], value)


def _install_standins(plan: ReplayPlan) -> list[str]:
    """Block mode on a machine without Megatron's training package: the fixes' guards read
    ``get_args()``, which here answers with the switches the targets' rules need, all on."""
    switches = sorted({name for target in plan.targets for name in target.switches})
    if plan.mode != "block" or not switches or _importable(_GETTER_STANDIN):
        return []
    arguments = types.SimpleNamespace(**{name: True for name in switches})
    standin = types.ModuleType(_GETTER_STANDIN)
    vars(standin)["get_args"] = lambda: arguments
    sys.modules[_GETTER_STANDIN] = standin
    return [f"{_GETTER_STANDIN} is not installed: get_args() stood in, with {', '.join(switches)} on"]


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _from_import(line: str) -> tuple[str | None, list[str]]:
    statement = ast.parse(line).body[0]
    if isinstance(statement, ast.ImportFrom) and statement.level == 0 and statement.module:
        return statement.module, [alias.asname or alias.name for alias in statement.names]
    return None, []


def _host_resident(train_args: tuple) -> list[torch.Tensor]:
    """Optimizer step counters: torch keeps them in host memory (unless capturable), out of a fault's reach.
    The optimizer is an item of train_args, or what a wrapper of one holds in ``.optimizer`` (Megatron)."""
    optimizers = [getattr(item, "optimizer", item) for item in train_args]
    found = []
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            continue
        for state in optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device.type == "cpu":
                found.append(step)
    return found


def _advance(tensors: list[torch.Tensor], key: str) -> None:
    """Training has moved the state: values no reset can reproduce, the same on every rank."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    for tensor in tensors:
        if tensor.dtype == torch.bool:
            value = torch.rand(tensor.shape, generator=generator) > 0.5
        elif tensor.is_floating_point() or tensor.is_complex():
            value = torch.rand(tensor.shape, generator=generator) + 0.5
        else:
            value = torch.randint(1, 100, tensor.shape, generator=generator)
        tensor.copy_(value.to(dtype=tensor.dtype, device=tensor.device))


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _scramble(tensors: list[torch.Tensor]) -> None:
    """What an uncorrectable error leaves in memory: other bits (every byte changed)."""
    for tensor in tensors:
        storage = tensor.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        raw.bitwise_not_()


def _bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes, read from a host copy's storage: no numpy (torch's CPU wheel does without it)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    start = flat.storage_offset()
    return bytes(flat.untyped_storage())[start:start + flat.numel()] if flat.numel() else b""


def gather_objects(value: object, device: torch.device | None = None) -> list:
    """Every rank's ``value``, in rank order: ``dist.all_gather_object`` without numpy (torch's reads
    the gathered bytes back through ``.numpy()``, which a torch without numpy cannot). Pickled into
    uint8 tensors on ``device`` (the default group's: the NPU under hccl), padded to the longest."""
    payload = pickle.dumps(value)
    world = dist.get_world_size()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(item.item()) for item in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [pickle.loads(_bytes(tensor)[:length]) for tensor, length in zip(gathered, lengths, strict=True)]  # noqa: S301 (our own ranks)


def _failure_kind(error: BaseException) -> FailureKind:
    """Read once, here, from the exception itself: torch_npu's text, gloo's timeout, a send to oneself."""
    text = str(error)
    if UNSAFE_DATA in text:
        return "unsafe-data"
    if "timed out" in text.lower():
        return "timeout"
    if "destination rank" in text:
        return "send-to-self"
    return "other"


def _not_built(error: Exception, what: str) -> str:
    """Why a probe could not build its global's state: a ProbeError says it; anything else is named."""
    if isinstance(error, ProbeError):
        return str(error)
    where = _where(error)
    return f"{what} raised {type(error).__name__}: {_first_line(error)}" + (f" at {where}" if where else "")


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]


def _where(error: BaseException) -> str | None:
    """The innermost frame of the user's code (not torch's, not the harness's): file:line."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if _is_users(frame.filename):
            return f"{frame.filename}:{frame.lineno}"
    return None


def _is_users(filename: str) -> bool:
    return not filename.startswith("<") and not str(Path(filename).resolve()).startswith((_TORCH, _HERE))


_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\s*\.\s*[A-Za-z_]\w*)*")


def _globals_on_line(text: str, frame: types.FrameType) -> Iterator[tuple[str, object]]:
    """Each global a line names, as (module.name, its value): a name of the frame's module that is
    no local, or an attribute reached through modules and classes (`state._EMA`, `Cache.masks`)."""
    local = {} if frame.f_locals is frame.f_globals else frame.f_locals  # a module's own frame: its names are its globals
    for match in _DOTTED.finditer(text.split("#", 1)[0]):
        root, *attributes = [part.strip() for part in match.group(0).split(".")]
        if root in local or root not in frame.f_globals:
            continue
        value: object = frame.f_globals[root]
        label = value.__name__ if isinstance(value, types.ModuleType) else f"{frame.f_globals.get('__name__', '?')}.{root}"
        for attribute in attributes:
            if not isinstance(value, (types.ModuleType, type)) or not hasattr(value, attribute):
                break
            value, label = getattr(value, attribute), f"{label}.{attribute}"
        if not isinstance(value, types.ModuleType):
            yield label, value
