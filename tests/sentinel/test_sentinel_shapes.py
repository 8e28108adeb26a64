"""Every shape of object a step can read a tensor through, in a real package of real files: the
sentinel must find the tensor, under the emulated fault, by a readable path and the holder a rule
names (the module global, or the class attribute). And where the walk stops at its depth limit,
the summary must say so, with how many objects it did not open and the first one's path."""

from __future__ import annotations

import logging

import pytest
from conftest import importable_package

from unsafe_doctor.log.sentinel_lines import parse_line
from unsafe_doctor.npu.backend import EmulatedBackend
from unsafe_doctor.sentinel import Limits, check, examine

SHAPES = """
    import argparse
    import dataclasses
    import functools
    import types

    import torch


    def _make_hook():
        buffer = torch.zeros(2)

        def hook():
            return buffer

        return hook


    class Meter:
        def __init__(self):
            self.total = torch.zeros(1)

        def update(self, value):
            self.total += value


    class Slotted:
        __slots__ = ("state", "__private")

        def __init__(self):
            self.state = torch.zeros(1)
            self.__private = torch.zeros(1)


    @dataclasses.dataclass(slots=True)
    class RunState:
        ema: torch.Tensor
        steps: int = 0


    class Registry(dict):
        pass


    class History(list):
        pass


    class Callbacks:
        on_step = Meter().update


    def scale_by(value, factor=torch.ones(1)):
        return value * factor


    def shift_by(value, *, shift=torch.zeros(1)):
        return value + shift


    step_closure = _make_hook()
    HOOKS = {"loss": _make_hook()}
    step_hook = Meter().update
    scaled = functools.partial(torch.mul, torch.ones(1))
    shifted = functools.partial(torch.add, other=torch.zeros(1))
    partial_hook = functools.partial(_make_hook())
    SLOTTED = Slotted()
    RUN_STATE = RunState(torch.zeros(1))
    NAMESPACE = types.SimpleNamespace(grad_norm=torch.zeros(1))
    _GLOBAL_ARGS = argparse.Namespace(lr=1e-4, loss_scale=torch.ones(1))
    REGISTRY = Registry(entry=torch.zeros(1))
    REGISTRY.extra = torch.zeros(1)
    HISTORY = History([torch.zeros(1)])
    HISTORY.last = torch.zeros(1)
"""

MODULE = "shapepkg.shapes"
# (holder as a rule names it, the path of each tensor behind it)
EXPECTED = {
    "closure cell of a global function": ("step_closure", ["step_closure.<closure>.buffer"]),
    "closure cell of a function in a container": ("HOOKS", ["HOOKS['loss'].<closure>.buffer"]),
    "bound method's __self__": ("step_hook", ["step_hook.__self__.total"]),
    "bound method held by a class attribute": ("Callbacks.on_step", ["Callbacks.on_step.__self__.total"]),
    "partial's args": ("scaled", ["scaled.args[0]"]),
    "partial's keywords": ("shifted", ["shifted.keywords['other']"]),
    "partial's function's closure": ("partial_hook", ["partial_hook.func.<closure>.buffer"]),
    "function's default": ("scale_by", ["scale_by.<default>.factor"]),
    "function's keyword-only default": ("shift_by", ["shift_by.<default>.shift"]),
    "__slots__ object": ("SLOTTED", ["SLOTTED.state", "SLOTTED.__private"]),
    "dataclass(slots=True)": ("RUN_STATE", ["RUN_STATE.ema"]),
    "types.SimpleNamespace": ("NAMESPACE", ["NAMESPACE.grad_norm"]),
    "argparse.Namespace (Megatron's global args)": ("_GLOBAL_ARGS", ["_GLOBAL_ARGS.loss_scale"]),
    "dict subclass: items and attributes": ("REGISTRY", ["REGISTRY['entry']", "REGISTRY.extra"]),
    "list subclass: items and attributes": ("HISTORY", ["HISTORY[0]", "HISTORY.last"]),
}


@pytest.fixture
def shapes(tmp_path, monkeypatch):
    with importable_package(tmp_path, monkeypatch, "shapepkg", {"shapes.py": SHAPES}):
        import shapepkg.shapes

        yield shapepkg.shapes


def faulted(**options):
    """The fault marks every tensor unsafe, reads of unsafe data raise, and the sentinel walks shapepkg."""
    backend = EmulatedBackend()
    with backend.activate():
        backend.mark_all_unsafe()
        backend.set_check(enabled=True)
        return examine(packages=["shapepkg"], backend=backend, **options)


@pytest.mark.parametrize("shape", EXPECTED)
def test_the_tensor_is_found_by_its_path_and_holder(shapes, shape):
    variable, paths = EXPECTED[shape]
    report = faulted()
    found = {item.name.dotted: list(item.paths) for item in report.unsafe}
    assert found[f"{MODULE}.{variable}"] == [f"{MODULE}.{path}" for path in paths]
    holder = next(item for item in report.unsafe if item.name.dotted == f"{MODULE}.{variable}")
    owner, _, name = variable.rpartition(".")
    assert (holder.name.module, holder.name.owner or "", holder.name.variable) == (MODULE, owner, name)


def test_every_shape_at_once_is_named_and_nothing_else(shapes):
    report = faulted()
    assert {item.name.dotted for item in report.unsafe} == {f"{MODULE}.{variable}" for variable, _ in EXPECTED.values()}
    assert (report.summary.stopped_early, report.summary.not_walked) == (None, 0)


def test_a_function_does_not_lend_its_module_globals_or_its_code(shapes):
    """``scale_by`` reads ``torch`` and ``RUN_STATE`` through its module's globals: they are named by
    their own globals, never through the function; the function holds its default alone."""
    report = faulted()
    paths = [path for item in report.unsafe for path in item.paths]
    assert not any("__globals__" in path or "__code__" in path for path in paths)
    assert [path for path in paths if path.startswith(f"{MODULE}.scale_by")] == [f"{MODULE}.scale_by.<default>.factor"]


def test_a_tensor_past_the_depth_limit_is_counted_and_its_first_place_named(shapes):
    """12 levels are walked: a tensor at the 12th is found; one at the 20th is not, and the summary says where it cut."""
    within, beyond = shapes.torch.zeros(1), shapes.torch.zeros(1)
    shapes.SHALLOW, shapes.DEEP = _nested(within, 12), _nested(beyond, 20)
    report = faulted()
    found = {item.name.dotted: list(item.paths) for item in report.unsafe}
    assert found[f"{MODULE}.SHALLOW"] == [f"{MODULE}.SHALLOW" + "[0]" * 12]
    assert f"{MODULE}.DEEP" not in found
    assert report.summary.stopped_early == (
        f"depth limit of 12 levels: 1 object not opened, the first {MODULE}.DEEP" + "[0]" * 12
    )


def test_every_cut_is_counted_and_the_summary_line_diagnose_reads_says_so(shapes, caplog):
    shapes.DEEP = [_nested(shapes.torch.zeros(1), 5) for _ in range(3)]
    backend = EmulatedBackend()
    with backend.activate(), caplog.at_level(logging.WARNING, logger="unsafe_doctor.sentinel"):
        backend.mark_all_unsafe()
        report = check(packages=["shapepkg"], backend=backend, limits=Limits(depth=3))
    assert report.summary.stopped_early.startswith(
        f"depth limit of 3 levels: 3 objects not opened, the first {MODULE}.DEEP[0][0][0]"
    )
    [line] = [record.getMessage() for record in caplog.records if '"event": "summary"' in record.getMessage()]
    assert parse_line(line) == report.summary
    assert "stopped early: depth limit of 3 levels: 3 objects not opened" in line


def _nested(tensor, depth: int) -> list:
    """``tensor`` ``depth`` list levels below the list returned."""
    value = [tensor]
    for _ in range(depth - 1):
        value = [value]
    return value
