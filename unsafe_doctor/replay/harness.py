"""One rank of a replay: build the global state, train, fault, recover with the adaptor's code, resume.

Every rank runs the plan twice in one process group: ``unpatched`` (the adaptor with our blocks
taken out) and ``patched`` (as written). Each run, in MindIO's order:

1. build: each target's probe creates its global's tensors; ``steps`` training steps touch them;
2. fault, on the faulty rank: the global's bytes are scrambled (what a UCE leaves), every tensor
   is marked unsafe and the check switched on (``restart_device``); the model and optimizer in
   ``train_args`` are made safe again, as the adaptor's own repair of them does;
3. repair: the replicas run the send function, the faulty rank the receive function, with
   MindIO's arguments (several optimizer indices per pair, two replicas where the world allows)
   on a device repair group and a gloo one, each transfer logged (``replay.transfers``);
4. rollback: every rank runs the rollback function;
5. check: unsafe tensors still reachable from each global on the faulty rank, and for scenario 2
   the global's bytes against the replica's;
6. resume: each probe's step runs again under the check, as the first step after recovery does.

The adaptor's files run as their modules, with stand-ins for what the unpatched adaptor imports
and this machine lacks (``replay.standins``). *adaptor* mode calls the adaptor's own functions; one
whose own code cannot run here (it raised in the unpatched run) has its fix blocks run alone, in
its scope (``replay.scoped``), and the verdict says so. *block* mode runs only the blocks. Nothing
here prints: results are ``replay.results`` for ``verify`` to judge.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import importlib
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

from unsafe_doctor.knowledge.rules import GROUP_PARAMETERS
from unsafe_doctor.npu.backend import UnsafeBackend, select_backend
from unsafe_doctor.npu.messages import UNSAFE_DATA
from unsafe_doctor.replay import standins
from unsafe_doctor.replay.plan import RUNS, ReplayPlan
from unsafe_doctor.replay.probes import NO_TRAIN_ARGS, Probe, ProbeError, load_as_main, make_probe, refresh
from unsafe_doctor.replay.results import FailureKind, FixFailure, Milestone, RankResult, RunResult, StepOutcome
from unsafe_doctor.replay.scoped import scoped_function
from unsafe_doctor.replay.transfers import TransferLog, unmatched
from unsafe_doctor.sentinel import FRAMEWORK_PACKAGES, examine
from unsafe_doctor.sentinel.reachable import reachable_tensors

if TYPE_CHECKING:
    from unsafe_doctor.knowledge.rules import ParameterRole

_HERE = str(Path(__file__).resolve().parents[1])  # unsafe_doctor/: frames from here are the harness's own
_TORCH = str(Path(torch.__file__).resolve().parent)


class _RepairGroups:
    """This run's repair groups, as the stand-in getters hand them out (None outside the repair)."""

    def __init__(self) -> None:
        self.device: dist.ProcessGroup | None = None
        self.gloo: dist.ProcessGroup | None = None

    def __call__(self, *, gloo: bool) -> dist.ProcessGroup | None:
        return self.gloo if gloo else self.device


_GROUPS = _RepairGroups()


class RankProgress:
    """Where this rank is, one milestone per line (JSON), so a launcher can say where a stuck rank waits."""

    def __init__(self, path: str | None) -> None:
        self._stream = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 (lives as long as the rank)
        self.last: Milestone | None = None  # where a crash of this rank happened

    def __call__(self, milestone: Milestone) -> None:
        self.last = milestone
        if self._stream:
            self._stream.write(milestone.to_json() + "\n")
            self._stream.flush()


def _run_compiled_code_eagerly() -> None:
    """Functions under `torch.compile` (megatron-core's router, its fusions) run as plain Python: the
    replay proves where data flows in a recovery, which compiling does not change, and dynamo traced
    each of them again on every rank, in both runs (4 s a rank for the router's expert bias). Only
    where dynamo is loaded (`torch.compile` loads it): loading it takes a second. torch before 2.6
    has no stance to set; there they compile as before."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None and "torch._dynamo" in sys.modules:
        set_stance("force_eager")


def run_rank(plan: ReplayPlan, rank: int, device_index: int, progress: RankProgress, backend: str | None = None) -> RankResult:
    """Both runs on this rank of an initialised process group.
    ``device_index`` is this rank's NPU (its local rank), or the ``Device:`` the emulated error names;
    ``backend`` forces one (``select_backend``'s ``prefer``)."""
    for root in plan.source_roots:
        if root not in sys.path:
            sys.path.insert(0, root)
    _run_compiled_code_eagerly()
    switches = tuple(sorted({name for target in plan.targets for name in target.switches}))
    stood_in = standins.install_standins(plan.standins, plan.group_getters, _GROUPS, switches)
    notes = [f"stand-ins for what the adaptor imports and this machine lacks: {', '.join(stood_in)}"] if stood_in else []
    runs = {}
    backend_name = ""
    alone: dict[str, str] = {}  # filled by the unpatched run: functions whose own code cannot run here
    for run in RUNS:
        unsafe = select_backend(backend, device_index)
        backend_name = unsafe.name
        runs[run] = _Run(plan, run, rank, unsafe, progress, alone=alone).execute()
        dist.barrier()
    return RankResult(rank, backend_name, runs["unpatched"], runs["patched"], tuple(notes))


class _Run:
    def __init__(
        self, plan: ReplayPlan, run: str, rank: int, backend: UnsafeBackend, progress: RankProgress, *, alone: dict[str, str]
    ) -> None:
        self.plan, self.run, self.rank, self.backend, self.progress = plan, run, rank, backend, progress
        self.alone = alone
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
        self.unmatched: tuple[str, ...] = ()  # faulty rank: repair transfers whose two sides differ
        self.stood_in: tuple[str, ...] = ()  # the items of train_args the adaptor's functions got as stand-ins
        self._modules: dict[str, types.ModuleType] | None = None  # function name -> the module of this run's text

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
        return RunResult(
            self.built,
            self.not_modelled,
            tuple(self.fix_failures),
            self.resume,
            self.unsafe_left,
            self.equal,
            self.seconds,
            self.adaptor_unavailable,
            self.sentinel,
            dict(self.alone),
            self.unmatched,
            self.stood_in,
        )

    def _phase(self, name: str, action: Callable[[], None]) -> None:
        role = self._role(name)
        self.progress(Milestone(self.run, name, self.plan.functions.get(role, "") if role else None))
        start = time.perf_counter()
        action()
        self.seconds[name] = time.perf_counter() - start

    def _role(self, phase: str) -> str | None:
        if phase == "repair" and self.rank in (self.plan.faulty, *self.plan.replicas):
            return "send" if self.rank in self.plan.replicas else "recv"
        return "rollback" if phase == "rollback" else None

    # --- phases ----------------------------------------------------------------------------------

    def _build(self) -> None:
        refresh(target.name.module for target in self.plan.targets if target.probe is None and not target.as_main)
        for name in dict.fromkeys(target.name.module for target in self.plan.targets if target.as_main):
            with contextlib.suppress(Exception):  # its probe says why it does not load
                load_as_main(name)
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
        lineage = 0 if self.rank in (self.plan.faulty, *self.plan.replicas) else self.rank
        for key, probe in self.probes.items():
            _advance(probe.tensors(), f"{key}:{lineage}")

    def _fault(self) -> None:
        if self.rank == self.plan.replica:  # what recovery must give back to the faulty rank
            self.at_fault = {key: [_bytes(tensor) for tensor in probe.tensors()] for key, probe in self.probes.items()}
        if self.rank == self.plan.faulty:
            with self.backend.unchecked():
                for probe in self.probes.values():
                    _scramble(probe.tensors())
                self.backend.mark_host(*_host_resident(self._train_args()))
                self.backend.mark_all_unsafe()
                if self.plan.mode == "block" or None in self._train_args():  # no adaptor code repairs them here
                    self._stand_for_own_repair()
            self.backend.set_check(enabled=True)  # from here on, as after a real fault
        dist.barrier()

    def _stand_for_own_repair(self) -> None:
        """The adaptor's own repair of the model and the optimizer does not run here: what it makes
        safe is made safe (all of the model where the generation rebuilds it, else its parameters
        and the optimizer's state only), and the globals stay unsafe."""
        if self.rank != self.plan.faulty:
            return
        with self.backend.unchecked():
            globals_memory = {_address(tensor) for probe in self.probes.values() for tensor in probe.tensors()}
            for tensor in _repaired_by_the_adaptor(self._train_args(), rebuilds_model=self.plan.rebuilds_model):
                if _address(tensor) not in globals_memory:
                    self.backend.mark_safe(tensor)

    def _repair(self) -> None:
        """The repair on the faulty rank and its replicas, each with its own groups (device and
        gloo), then every rank's transfers gathered, for the faulty rank to match pair by pair."""
        members = sorted({self.plan.faulty, *self.plan.replicas})
        transfers = []
        if self.rank in members:
            timeout = datetime.timedelta(seconds=self.plan.timeout)
            self.group = dist.new_group(members, timeout=timeout, use_local_synchronization=True)
            gloo = dist.new_group(members, timeout=timeout, use_local_synchronization=True, backend="gloo")
            _GROUPS.device, _GROUPS.gloo = self.group, gloo
            log = TransferLog(
                self.group, gloo, self.backend.is_device_memory, check_kinds=self.backend.name == "emulated", timeout=timeout
            )
            try:
                with log.recording():
                    self._call("send" if self.rank in self.plan.replicas else "recv")
            finally:
                _GROUPS.device = _GROUPS.gloo = None
            transfers = log.transfers
        gathered = gather_objects(transfers, self.backend.device)
        if self.rank == self.plan.faulty:
            self.unmatched = tuple(unmatched(dict(enumerate(gathered))))

    def _sentinel(self) -> None:
        """On the faulty rank, where the rollback ends: what the sentinel names still unsafe (not what the
        step writes before reading), walking the framework's and the targets' packages from
        ``train_args`` as an installed sentinel would."""
        if self.rank != self.plan.faulty:
            return
        packages = {*FRAMEWORK_PACKAGES, *(target.name.module.partition(".")[0] for target in self.plan.targets)}
        roots = [item for item in self._train_args() if item is not None]
        report = examine(*roots, packages=packages, backend=self.backend)
        self.sentinel = tuple(item.name.dotted for item in report.still_unsafe)

    def _check(self) -> None:
        """On the faulty rank: what is still unsafe, and (scenario 2) whether each global holds the
        bytes the replica had at the fault, the state training had reached on every healthy rank."""
        with self.backend.unchecked():  # the harness's own reads must not trip, nor refresh anything
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
        with self.backend.unchecked():  # looking must not trip, nor refresh anything
            for frame, line in reversed(list(traceback.walk_tb(error.__traceback__))):
                if not _is_users(frame.f_code.co_filename):
                    continue
                for label, value in _globals_on_line(linecache.getline(frame.f_code.co_filename, line), frame):
                    if any(not self.backend.is_safe(tensor) for tensor in reachable_tensors(value)):
                        return label
        return None

    # --- running the adaptor's code --------------------------------------------------------------

    def _call(self, role: str) -> None:
        function = self.plan.functions.get(role)
        if function is None:
            return
        try:
            module = self._adaptor_modules().get(function)
        except (Exception, SystemExit) as error:  # its own code failing or exiting at import, or a fix's import missing
            self.adaptor_unavailable = f"{type(error).__name__}: {_first_line(error)}"
            return
        if module is None:  # the role's function is in a file not given (taskd's rollback): nothing of it runs
            return
        for values in self._calls(role):
            try:
                self._run_function(function, module, values)
            except Exception as error:  # the adaptor's code may fail in any way: that is a finding
                failure = FixFailure(
                    role, function, f"{type(error).__name__}: {_first_line(error)}", _where(error), _failure_kind(error)
                )
                self.progress(Milestone(self.run, "rollback" if role == "rollback" else "repair", function, failure))
                self.fix_failures.append(failure)

    def _run_function(self, name: str, module: types.ModuleType, values: dict[str, object]) -> None:
        """The adaptor's own function; where its own code cannot run here (it raised in the unpatched
        run, for a reason of its own), its fix blocks alone, in its scope."""
        own = self.plan.mode == "adaptor" and name not in self.alone
        if own and self.run == "unpatched":
            try:
                _call_with(getattr(module, name), values)
            except Exception as error:
                if _failure_kind(error) == "unsafe-data":
                    raise
                at = _where(error)
                self.alone[name] = f"{type(error).__name__}: {_first_line(error)}" + (f" at {at}" if at else "")
                self._stand_for_own_repair()
            return
        if own:
            _call_with(getattr(module, name), values)
            return
        if self.plan.mode == "adaptor":
            self._stand_for_own_repair()
        blocks = [block for block in self.plan.blocks if block.function == name]
        if self.run == "unpatched" or not blocks:
            return
        code = next(code for code in self.plan.files if code.path == blocks[0].path)
        spans = [(block.line, block.line + len(block.code.splitlines()) - 1) for block in blocks]
        bound = frozenset(block.own_group for block in blocks if block.own_group)
        function = scoped_function(module, code.patched, code.path, name, spans, bound=bound)
        _call_with(function, {**values, **dict.fromkeys(bound, self.group)})

    def _calls(self, role: str) -> list[dict[str, object]]:
        """What MindIO passes, call by call: the pairs (source, destination, optimizer index) this
        rank takes part in, as lists in one call, or one call per pair where the profile's ranks
        are no lists; rollback gets them all."""
        first, *others = self.plan.replicas
        pairs = [(first, self.plan.faulty, 0), (first, self.plan.faulty, 1)]
        pairs += [(other, self.plan.faulty, 2 + number) for number, other in enumerate(others)]
        if role != "rollback":
            pairs = [pair for pair in pairs if pair[0 if role == "send" else 1] == self.rank]
        if self.plan.ranks_are_lists or not pairs:
            return [self._values(role, pairs)]
        firsts = {pair[:2]: pair for pair in reversed(pairs)}  # each (source, destination) once
        return [self._values(role, [pair]) for pair in pairs if firsts[pair[:2]] is pair]

    def _values(self, role: str, pairs: list[tuple[int, int, int]]) -> dict[str, object]:
        """The arguments of one call, by role; one parameter for both ranks (a `peer`) holds the other
        side's rank: the destination where the function sends."""
        lists = self.plan.ranks_are_lists
        sources, destinations = [pair[0] for pair in pairs], [pair[1] for pair in pairs]
        source = sources if lists or not sources else sources[0]
        destination = destinations if lists or not destinations else destinations[0]
        ranks: list[tuple[ParameterRole, object]] = [("src_ranks", source), ("dest_ranks", destination)]
        by_role: list[tuple[ParameterRole, object]] = [
            *(ranks if role == "send" else ranks[::-1]),  # the other side's rank bound last
            ("optim_idxs", [pair[2] for pair in pairs]),
            ("rank_list", sorted({self.plan.faulty, *self.plan.replicas})),
            ("train_args", self._arguments_of_train()),
            ("need_rebuild", True),
        ]
        values: dict[str, object] = {"step": self.plan.steps, "rank": self.rank}  # as MindIO's callbacks pass them on
        for held, value in by_role:
            for name in self.plan.parameters.get(held, ()):
                _bind(values, name, value)
        for value in values.values():  # MindIO's named tuples of repair arguments carry the step too
            if isinstance(value, types.SimpleNamespace) and not hasattr(value, "step"):
                value.step = self.plan.steps
        if self.plan.group_parameter is not None:
            values[self.plan.group_parameter] = self.group
        for name in GROUP_PARAMETERS:  # a hook that takes the repair group gets it, as its caller gives it
            values.setdefault(name, self.group)
        return values

    def _adaptor_modules(self) -> dict[str, types.ModuleType]:
        """Each adaptor file executed as its module (this run's text), by the functions it defines."""
        if self._modules is None:
            modules: dict[str, types.ModuleType] = {}
            for code in self.plan.files:
                module = types.ModuleType(code.module)
                module.__file__ = code.path
                module.__package__ = code.module.rpartition(".")[0]
                if Path(code.path).name == "__init__.py":
                    module.__path__ = [str(Path(code.path).parent)]
                    module.__package__ = code.module
                _register(module, Path(code.path))
                text = code.patched if self.run == "patched" else code.unpatched
                exec(compile(text, code.path, "exec"), module.__dict__)  # noqa: S102 (the user's adaptor)
                for function in code.functions:
                    modules.setdefault(function, module)
            self._modules = modules
        return self._modules

    def _arguments_of_train(self) -> tuple:
        """train_args as the adaptor's functions get them: what this replay did not build (the
        optimizer, the scheduler; the model where the probe has none) stood in, so that the
        adaptor's own repair of them runs through (the fault model makes them safe)."""
        arguments = self._train_args()
        missing = tuple(f"train_args[{index}]" for index, item in enumerate(arguments) if item is None)
        self.stood_in = tuple(dict.fromkeys((*self.stood_in, *missing)))
        return tuple(standins.StandIn(f"train_args[{index}]") if item is None else item for index, item in enumerate(arguments))

    def _train_args(self) -> tuple:
        return next(iter(self.probes.values())).train_args() if self.probes else NO_TRAIN_ARGS


# --- helpers ---------------------------------------------------------------------------------------


def _register(module: types.ModuleType, path: Path) -> None:
    """The module in sys.modules, its packages too where nothing else gives them (an adaptor
    package outside every source root), each bound on its parent."""
    parts = module.__name__.split(".")
    folder = path.parent.parent if path.name == "__init__.py" else path.parent  # the innermost package's
    for end in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:end])
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 (not importable here: a package of the adaptor's own folders)
                package = types.ModuleType(name)
                package.__path__ = [str(folder)]
                sys.modules[name] = package
        folder = folder.parent
    sys.modules[module.__name__] = module
    if len(parts) > 1:
        setattr(sys.modules[".".join(parts[:-1])], parts[-1], module)


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


def _call_with(function: Callable[..., object], values: dict[str, object]) -> None:
    """Call with the values its parameters name; a required one with no value gets None."""
    arguments = {}
    for parameter in inspect.signature(function).parameters.values():
        if parameter.name in values:
            arguments[parameter.name] = values[parameter.name]
        elif parameter.default is inspect.Parameter.empty and parameter.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            arguments[parameter.name] = None
    function(**arguments)


def _repaired_by_the_adaptor(train_args: tuple, *, rebuilds_model: bool) -> list[torch.Tensor]:
    """What recovery gives back safe: everything train_args reach where the model is rebuilt; else
    (MindSpeed-LLM 26.x's clean) the parameters, their gradients and the optimizer's state, not the
    model's registered buffers."""
    items = [item for item in train_args if item is not None]
    if rebuilds_model:
        return reachable_tensors(*items)
    chunks = [chunk for item in items for chunk in (item if isinstance(item, (list, tuple)) else [item])]
    modules = [chunk for chunk in chunks if isinstance(chunk, torch.nn.Module)]
    parameters = [
        tensor
        for module in modules
        for parameter in module.parameters()
        for tensor in (parameter, parameter.grad)
        if tensor is not None
    ]
    return parameters + reachable_tensors(*(chunk for chunk in chunks if not isinstance(chunk, torch.nn.Module)))


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
    """The tensor's bytes, copied from a contiguous host copy's memory in one go: no numpy (torch's CPU
    wheel does without it), and no element-wise read (a storage's iteration is one torch op per byte)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return ctypes.string_at(flat.data_ptr(), flat.numel()) if flat.numel() else b""


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
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
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
    no local, an attribute reached through modules and classes (`state._EMA`, `Cache.masks`), or an
    attribute of `self` (`TopKRouter.local_tokens_per_expert`)."""
    local = {} if frame.f_locals is frame.f_globals else frame.f_locals  # a module's own frame: its names are its globals
    for match in _DOTTED.finditer(text.split("#", 1)[0]):
        root, *attributes = [part.strip() for part in match.group(0).split(".")]
        if root == "self" and "self" in local and attributes:  # a module's buffer: its class's state, as rules name it
            owner = type(local["self"])
            yield f"{owner.__module__}.{owner.__qualname__}.{attributes[0]}", getattr(local["self"], attributes[0], None)
            continue
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
