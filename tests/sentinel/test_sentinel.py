"""The sentinel in a real process: a package of real files on sys.path holding the kinds of state a
framework keeps (module globals, a singleton with a keyed buffer, class attributes, containers, an
lru-cached function), a real model and optimizer, an emulated fault and the recovery an adaptor usually does
(parameters and optimizer state refreshed). The sentinel must name exactly what the recovery left
unsafe, by readable paths, and report, raise or heal as asked. The npu backend's test runs where
torch_npu sees an NPU."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import importable_package

from unsafe_doctor.log.sentinel_lines import parse_line
from unsafe_doctor.npu.backend import EmulatedBackend, npu_unavailable_reason, select_backend
from unsafe_doctor.sentinel import Limits, UnsafeStateError, check, examine

PACKAGE = {
    "__init__.py": "",
    "state.py": """
        import collections
        import functools
        import logging

        import torch

        LOSS_LOG = {}
        EMA = None
        HISTORY = collections.deque()
        LIMITS = (torch.ones(2),)  # built at import: a tensor the fault marks too
        logger = logging.getLogger(__name__)


        class ScratchBuffer:
            def __init__(self):
                self.buffer = {}

            def get(self, name, dtype):
                key = (name, dtype)
                if key not in self.buffer:
                    self.buffer[key] = torch.empty(4, dtype=dtype)
                return self.buffer[key]


        SCRATCH = ScratchBuffer()


        class Tracker:
            totals = {}


        @functools.lru_cache
        def causal_mask(size):
            return torch.ones(size, size).tril()


        def populate():
            LOSS_LOG["lm"] = torch.zeros(())
            global EMA
            EMA = torch.ones(())
            HISTORY.append(torch.zeros(3))
            SCRATCH.get("mpu", torch.bfloat16)
            Tracker.totals["aux"] = [torch.zeros(2), torch.zeros(2)]
            causal_mask(4)
    """,
}

RULES = """
rules:
  - id: sentinelpkg.loss-log
    title: the loss log
    match: {variable: LOSS_LOG, module: sentinelpkg.state}
    scenario: 1
    phase: rollback
    fix:
      imports: [import torch, from sentinelpkg import state]
      code: |
        for key, value in list(state.LOSS_LOG.items()):
            state.LOSS_LOG[key] = torch.zeros(value.shape, dtype=value.dtype, device=value.device)
    reason: zeroed every step
  - id: sentinelpkg.scratch
    title: the scratch buffer
    match: {variable: SCRATCH, module: sentinelpkg.state}
    scenario: 1
    phase: rollback
    fix:
      imports: [from sentinelpkg import state]
      code: |
        state.SCRATCH.buffer["broken"].add_(1)
    reason: a fix that fails, for the test
  - id: sentinelpkg.causal-mask
    title: the cached mask
    match: {variable: causal_mask, module: sentinelpkg.state}
    scenario: 1
    phase: rollback
    fix:
      imports: [from sentinelpkg import state]
      code: |
        state.causal_mask.cache_clear()
    reason: rebuilt on the next call
  - id: sentinelpkg.ema
    title: the running average
    match: {variable: EMA, module: sentinelpkg.state}
    scenario: 2
    phase: repair
    fix:
      imports: [import torch.distributed as dist, from sentinelpkg import state]
      send: |
        dist.send(state.EMA, dst=$dst, group=$group)
      recv: |
        dist.recv(state.EMA, src=$src, group=$group)
    reason: carries from step to step
"""

EXPECTED = {
    "sentinelpkg.state.LOSS_LOG": ["sentinelpkg.state.LOSS_LOG['lm']"],
    "sentinelpkg.state.EMA": ["sentinelpkg.state.EMA"],
    "sentinelpkg.state.HISTORY": ["sentinelpkg.state.HISTORY[0]"],
    "sentinelpkg.state.LIMITS": ["sentinelpkg.state.LIMITS[0]"],
    "sentinelpkg.state.SCRATCH": ["sentinelpkg.state.SCRATCH.buffer[('mpu', torch.bfloat16)]"],
    "sentinelpkg.state.Tracker.totals": [
        "sentinelpkg.state.Tracker.totals['aux'][0]",
        "sentinelpkg.state.Tracker.totals['aux'][1]",
    ],
    "sentinelpkg.state.causal_mask": ["sentinelpkg.state.causal_mask(…)[0]"],
}


@pytest.fixture
def package(tmp_path, monkeypatch):
    with importable_package(tmp_path, monkeypatch, "sentinelpkg", PACKAGE):
        import sentinelpkg.state

        sentinelpkg.state.populate()
        yield sentinelpkg.state


@pytest.fixture
def rules(tmp_path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    return path


@pytest.fixture
def trained():
    """A model and an optimizer that has stepped: parameters, buffers and optimizer state exist."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def fault_and_recover(backend: EmulatedBackend, model, optimizer, state) -> None:
    """What a UCE and the usual adaptor leave: everything unsafe, then parameters, optimizer state and
    model buffers refreshed by copy_ (as a replica repair does); the step counters are host memory."""
    backend.mark_host(*(value["step"] for value in optimizer.state.values()))
    saved = [tensor.detach().clone() for tensor in [*model.parameters(), *model.buffers(), *_optimizer_tensors(optimizer)]]
    backend.mark_host(*saved)  # what the replica sends: not this device's memory
    backend.mark_all_unsafe()
    backend.set_check(enabled=True)
    for tensor, copy in zip([*model.parameters(), *model.buffers(), *_optimizer_tensors(optimizer)], saved, strict=True):
        tensor.data.copy_(copy)


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for key, value in state.items() if key != "step"]


def named(report) -> dict[str, list[str]]:
    return {item.name.dotted: list(item.paths) for item in report.unsafe}


def test_names_exactly_what_the_recovery_left_unsafe_by_readable_paths(package, trained):
    model, optimizer = trained
    backend = EmulatedBackend()
    with backend.activate():
        fault_and_recover(backend, model, optimizer, package)
        report = examine(model, optimizer, packages=["sentinelpkg"], backend=backend)
    assert named(report) == EXPECTED
    assert report.summary.backend == "emulated"
    assert report.summary.unsafe_tensors == 8 and report.summary.unsafe_globals == 7
    assert report.summary.stopped_early is None


def test_parameters_optimizer_state_and_copied_buffers_are_not_named(package, trained):
    """The recovery refreshed them: checked, safe, and not reported (no false alarm)."""
    model, optimizer = trained
    backend = EmulatedBackend()
    with backend.activate():
        fault_and_recover(backend, model, optimizer, package)
        report = examine(model, optimizer, packages=[], backend=backend)
    assert report.unsafe == ()
    parameters_and_state = len([*model.parameters(), *model.buffers(), *_optimizer_tensors(optimizer)])
    assert report.summary.tensors_checked == parameters_and_state  # the host step counters are not checked


def test_an_unrepaired_model_buffer_is_held_by_its_module_class_and_attribute(trained):
    """A rule names a buffer by its owner class (TopKRouter.expert_bias): so does the sentinel."""
    model, optimizer = trained
    backend = EmulatedBackend()
    with backend.activate():
        backend.mark_unsafe(model[1].running_mean)
        report = examine(model, optimizer, packages=[], backend=backend)
    assert named(report) == {"torch.nn.modules.batchnorm.BatchNorm1d.running_mean": ["model.1.running_mean"]}


def test_an_lru_caches_results_are_checked_and_named_by_the_cached_function(package, rules):
    """Python does not list an lru cache's values; the garbage collector does, so they are checked,
    and heal clears the cache through its rule."""
    backend = EmulatedBackend()
    with backend.activate():
        backend.mark_unsafe(package.causal_mask(4))
        report = examine(packages=["sentinelpkg"], backend=backend)
        assert named(report) == {"sentinelpkg.state.causal_mask": ["sentinelpkg.state.causal_mask(…)[0]"]}
        package.causal_mask.cache_clear()
        assert examine(packages=["sentinelpkg"], backend=backend).unsafe == ()


def test_the_standard_library_and_torch_are_never_walked(package):
    """`json`, `logging` and `torch` hold tensors nowhere a step reads them: asking for them walks nothing."""
    backend = EmulatedBackend()
    with backend.activate():
        report = examine(packages=["json", "logging", "torch", "collections"], backend=backend)
    assert report.summary.tensors_checked == 0


def test_a_big_container_is_walked_in_part_and_the_report_says_which(package):
    package.HISTORY.extend(torch.zeros(1) for _ in range(50))
    backend = EmulatedBackend()
    with backend.activate():
        backend.mark_all_unsafe()
        report = examine(packages=["sentinelpkg"], backend=backend, limits=Limits(entries=10))
    assert report.summary.stopped_early == "walked the first 10 entries of sentinelpkg.state.HISTORY (51 entries)"
    assert next(item for item in report.unsafe if item.name.variable == "HISTORY").tensors == 10


def test_the_time_budget_stops_the_walk_and_says_so(package):
    package.HISTORY.extend([[i] for i in range(5000)])
    backend = EmulatedBackend()
    with backend.activate():
        report = examine(packages=["sentinelpkg"], backend=backend, limits=Limits(seconds=0))
    assert report.summary.stopped_early.startswith("time budget of 0 s spent after 1,024 objects")


def test_check_logs_one_line_per_record_that_diagnose_can_read_back(package, trained, caplog, rules):
    model, optimizer = trained
    backend = EmulatedBackend()
    with backend.activate(), caplog.at_level(logging.WARNING, logger="unsafe_doctor.sentinel"):
        fault_and_recover(backend, model, optimizer, package)
        report = check(model, optimizer, packages=["sentinelpkg"], rules=[rules], backend=backend)
    records = [parse_line(record.getMessage()) for record in caplog.records]
    assert records == [*report.unsafe, report.summary]
    by_name = {item.name.dotted: item for item in report.unsafe}
    loss_log = by_name["sentinelpkg.state.LOSS_LOG"]
    assert (loss_log.scenario, loss_log.rule) == (1, "sentinelpkg.loss-log")
    assert by_name["sentinelpkg.state.EMA"].scenario == 2
    assert by_name["sentinelpkg.state.HISTORY"].scenario is None  # no rule: diagnose classifies it from the source


def test_check_defaults_to_the_framework_packages_and_the_callers(package, tmp_path):
    """An adaptor calling check() gets its own package's globals walked with no argument."""
    (tmp_path / "src" / "sentinelpkg" / "adaptor.py").write_text(
        "from unsafe_doctor.sentinel import check\n\ndef feature_rollback(backend):\n    return check(backend=backend)\n"
    )
    from sentinelpkg.adaptor import feature_rollback

    backend = EmulatedBackend()
    with backend.activate():
        backend.mark_unsafe(package.EMA)
        report = feature_rollback(backend)
    assert named(report) == {"sentinelpkg.state.EMA": ["sentinelpkg.state.EMA"]}


def test_raise_mode_stops_the_recovery_naming_every_unsafe_global(package, trained):
    model, optimizer = trained
    backend = EmulatedBackend()
    with backend.activate(), pytest.raises(UnsafeStateError) as raised:
        fault_and_recover(backend, model, optimizer, package)
        check(model, optimizer, mode="raise", packages=["sentinelpkg"], backend=backend)
    message = str(raised.value)
    assert message.startswith("unsafe-doctor sentinel: the recovery left 7 global(s) unsafe on this process (emulated backend): ")
    assert all(name in message for name in EXPECTED)
    assert "There is unsafe data" not in message  # not to be read as the error it prevents


def test_raise_mode_returns_when_nothing_is_unsafe(package, trained):
    model, optimizer = trained
    backend = EmulatedBackend()
    with backend.activate():
        assert check(model, optimizer, mode="raise", packages=["sentinelpkg"], backend=backend).still_unsafe == ()


def test_heal_runs_scenario_1_rule_fixes_in_place_and_never_scenario_2(package, rules):
    backend = EmulatedBackend()
    with backend.activate():
        backend.mark_all_unsafe()
        backend.set_check(enabled=True)
        old_entry = package.LOSS_LOG["lm"]
        with pytest.raises(UnsafeStateError) as raised:
            check(mode="heal", packages=["sentinelpkg"], rules=[rules], backend=backend)
        report = raised.value.report
        assert package.LOSS_LOG["lm"] is not old_entry and backend.is_safe(package.LOSS_LOG["lm"])
    by_name = {item.name.dotted: item for item in report.unsafe}
    assert by_name["sentinelpkg.state.LOSS_LOG"].healed
    assert by_name["sentinelpkg.state.causal_mask"].healed and package.causal_mask.cache_info().currsize == 0
    assert not by_name["sentinelpkg.state.EMA"].healed and by_name["sentinelpkg.state.EMA"].heal_error is None  # scenario 2
    assert by_name["sentinelpkg.state.SCRATCH"].heal_error == "KeyError: 'broken'"  # the rule's code failed: said, not raised
    assert "LOSS_LOG" not in str(raised.value) and "sentinelpkg.state.EMA" in str(raised.value)


def test_with_no_unsafe_backend_nothing_is_checked_and_the_report_says_why(package):
    if npu_unavailable_reason() is None:
        pytest.skip("an NPU is here: the npu backend checks")
    report = check(mode="raise", packages=["sentinelpkg"])
    assert report.summary.backend == "none"
    assert report.summary.stopped_early.startswith("nothing checked: no unsafe backend here (")


def test_the_active_emulation_is_the_backend_by_default(package):
    backend = EmulatedBackend()
    with backend.activate():
        backend.mark_unsafe(package.EMA)
        report = examine(packages=["sentinelpkg"])
    assert report.summary.backend == "emulated" and named(report) == {"sentinelpkg.state.EMA": ["sentinelpkg.state.EMA"]}


@pytest.mark.skipif(npu_unavailable_reason() is not None, reason=f"npu backend: {npu_unavailable_reason()}")
def test_npu_backend_names_what_torch_npu_marks_unsafe(package):  # pragma: no cover - runs only with an NPU
    backend = select_backend("npu")
    package.EMA = torch.ones((), device=backend.device)
    package.LOSS_LOG["lm"] = torch.zeros((), device=backend.device)
    backend.mark_all_unsafe()
    backend.mark_safe(package.LOSS_LOG["lm"])
    report = examine(packages=["sentinelpkg"], backend=backend)
    assert report.summary.backend == "npu"
    assert "sentinelpkg.state.EMA" in named(report) and "sentinelpkg.state.LOSS_LOG" not in named(report)


def test_the_walk_reads_no_tensor_data_even_with_the_check_on(package):
    """Printing a key that holds a tensor would read it: unsafe, that raises. Keys are named without it."""
    key_tensor = torch.arange(3)
    package.LOSS_LOG[("lm", key_tensor)] = torch.zeros(())
    backend = EmulatedBackend()
    with backend.activate():
        backend.mark_all_unsafe()
        backend.set_check(enabled=True)
        report = examine(packages=["sentinelpkg"], backend=backend)
    paths = named(report)["sentinelpkg.state.LOSS_LOG"]
    assert "sentinelpkg.state.LOSS_LOG[('lm', <Tensor>)]" in paths
    assert "sentinelpkg.state.LOSS_LOG.keys()[('lm', <Tensor>)][1]" in paths


def test_the_report_keeps_every_path_and_the_log_line_the_first_five(package, caplog):
    package.HISTORY.extend(torch.zeros(1) for _ in range(7))
    backend = EmulatedBackend()
    with backend.activate(), caplog.at_level(logging.WARNING, logger="unsafe_doctor.sentinel"):
        backend.mark_all_unsafe()
        report = check(packages=["sentinelpkg"], backend=backend)
    history = next(item for item in report.unsafe if item.name.variable == "HISTORY")
    assert history.paths == tuple(f"sentinelpkg.state.HISTORY[{index}]" for index in range(8)) and history.tensors == 8
    logged = next(parse_line(record.getMessage()) for record in caplog.records if "HISTORY" in record.getMessage())
    assert logged.paths == history.paths[:5] and logged.tensors == 8
