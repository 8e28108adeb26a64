"""The sentinel runs inside the training job: in report mode it must return, whatever the globals it
walks do. A real framework package of real files holds hostile globals (overrides that raise, block,
lie about their type or length, keys whose repr raises, recursive and huge containers, proxies,
generators), each beside a good tensor, and some with a tensor inside. The walk must name every good
tensor, run none of the hostile code (each override records that it ran), and count and name in the
summary what it could not read. In raise and heal modes the only error is the sentinel's own."""

from __future__ import annotations

import logging
import sys

import pytest
from conftest import importable_package

from unsafe_doctor.log.sentinel_lines import parse_line
from unsafe_doctor.npu.backend import EmulatedBackend
from unsafe_doctor.sentinel import UnsafeStateError, check

HOSTILE = '''
    import collections.abc
    import dataclasses
    import functools
    import threading
    import types
    import weakref

    import torch
    from torch import nn

    RAN = []  # what hostile code ran: the walk must leave it empty


    def ran(what):
        RAN.append(what)
        raise RuntimeError(f"hostile {what} ran")


    class RaisingDict(dict):
        def items(self):
            ran("dict.items")

        def keys(self):
            ran("dict.keys")

        def values(self):
            ran("dict.values")

        def __iter__(self):
            ran("dict.__iter__")

        def __len__(self):
            ran("dict.__len__")

        def __getitem__(self, key):
            ran("dict.__getitem__")


    class RaisingLength(list):
        def __len__(self):
            ran("list.__len__")


    class HugeLength(list):
        def __len__(self):
            RAN.append("huge __len__")
            return 10**100


    class NegativeLength(list):
        def __len__(self):
            RAN.append("negative __len__")
            return -1


    class RaisingIter(list):
        def __iter__(self):
            ran("list.__iter__")


    class BlockingIter(list):
        def __iter__(self):
            RAN.append("blocking __iter__")
            threading.Event().wait(60)  # longer than the walk's whole budget
            return iter(())


    class DictProperty:
        def __init__(self):
            self.held = torch.zeros(1)

        @property
        def __dict__(self):
            ran("__dict__ property")


    class GetattrRaises:
        def __init__(self):
            object.__setattr__(self, "held", torch.zeros(1))

        def __getattribute__(self, name):
            ran(f"__getattribute__({name})")

        def __getattr__(self, name):
            ran(f"__getattr__({name})")


    class Liar:
        """Says it is a dict."""

        def __init__(self):
            self.held = torch.zeros(1)

        @property
        def __class__(self):
            RAN.append("__class__")
            return dict


    class Key:
        armed = False

        def __hash__(self):
            if Key.armed:
                ran("__hash__")
            return 1

        def __eq__(self, other):
            ran("__eq__")

        def __repr__(self):
            ran("__repr__")


    class Name(str):
        def __repr__(self):
            ran("str.__repr__")

        def __str__(self):
            ran("str.__str__")

        def __format__(self, spec):
            ran("str.__format__")


    class Slotted:
        __slots__ = ("state",)

        def __init__(self):
            self.state = torch.zeros(1)


    @dataclasses.dataclass(slots=True)
    class Parent:
        ema: torch.Tensor


    class Child(Parent):
        @property
        def ema(self):
            ran("slot property")


    class HostileMapping(collections.abc.Mapping):
        def __getitem__(self, key):
            ran("Mapping.__getitem__")

        def __iter__(self):
            ran("Mapping.__iter__")

        def __len__(self):
            ran("Mapping.__len__")


    class SneakyPartial(functools.partial):
        @property
        def args(self):
            ran("partial.args")


    class HostileModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("counts", torch.zeros(2))

        def named_modules(self, *args, **kwargs):
            ran("named_modules")


    class Meta(type):
        def __getattribute__(cls, name):
            ran(f"metaclass __getattribute__({name})")

        def __eq__(cls, other):
            ran("metaclass __eq__")

        __hash__ = type.__hash__


    class Configured(metaclass=Meta):
        totals = {"aux": torch.zeros(1)}


    def _generator():
        RAN.append("generator")
        yield torch.zeros(1)


    def __getattr__(name):  # a module __getattr__ (PEP 562)
        ran(f"module __getattr__({name})")


    GOOD_0 = torch.zeros(1)
    HUGE_INT_KEY = {10**5000: torch.zeros(1)}
    GOOD_1 = torch.zeros(1)
    ITEMS_RAISE = RaisingDict(inside=torch.zeros(1))
    GOOD_2 = torch.zeros(1)
    LEN_RAISES = RaisingLength([torch.zeros(1)])
    LEN_HUGE = HugeLength([torch.zeros(1)])
    LEN_NEGATIVE = NegativeLength([torch.zeros(1)])
    GOOD_3 = torch.zeros(1)
    ITER_RAISES = RaisingIter([torch.zeros(1)])
    ITER_BLOCKS = BlockingIter([torch.zeros(1)])
    GOOD_4 = torch.zeros(1)
    DICT_PROPERTY = DictProperty()
    GETATTR_RAISES = GetattrRaises()
    LIAR = Liar()
    GOOD_5 = torch.zeros(1)
    EQ_HASH_KEY = {Key(): torch.zeros(1)}
    Key.armed = True
    STR_SUBCLASS_KEY = {Name("loss"): torch.zeros(1)}
    GOOD_6 = torch.zeros(1)
    SLOT_BEHIND_PROPERTY = Slotted()
    Slotted.state = property(lambda self: ran("slot replaced by a property"))
    SLOT_SHADOWED = object.__new__(Child)
    Parent.__dict__["ema"].__set__(SLOT_SHADOWED, torch.zeros(1))
    GOOD_7 = torch.zeros(1)
    RECURSIVE = [torch.zeros(1)]
    RECURSIVE.append(RECURSIVE)
    RECURSIVE_DICT = {"tensor": torch.zeros(1)}
    RECURSIVE_DICT["self"] = RECURSIVE_DICT
    PROXY_OF_DICT = types.MappingProxyType({"inside": torch.zeros(1)})
    PROXY_OF_MAPPING = types.MappingProxyType(HostileMapping())
    GOOD_8 = torch.zeros(1)
    _referent = GetattrRaises()
    WEAK_PROXY = weakref.proxy(_referent)
    DEAD_PROXY = weakref.proxy(GetattrRaises())
    GENERATOR = _generator()
    GOOD_9 = torch.zeros(1)
    TEN_MILLION = [torch.zeros(1)] + [0] * 10_000_000
    SNEAKY_PARTIAL = SneakyPartial(print, torch.zeros(1))
    HOSTILE_MODULE = HostileModule()
    HostileModule.__getattr__ = lambda self, name: ran(f"Module.__getattr__({name})")  # once built: torch asks it
    GOOD_10 = torch.zeros(1)
'''

MODULE = "hostilepkg.hostile"
GOODS = {f"{MODULE}.GOOD_{index}": [f"{MODULE}.GOOD_{index}"] for index in range(11)}
# hostile containers and objects with a tensor the walk reaches without running their code
INSIDE = {
    "HUGE_INT_KEY": ["HUGE_INT_KEY[<int of 16,610 bits>]"],
    "ITEMS_RAISE": ["ITEMS_RAISE['inside']"],
    "LEN_RAISES": ["LEN_RAISES[0]"],
    "LEN_HUGE": ["LEN_HUGE[0]"],
    "LEN_NEGATIVE": ["LEN_NEGATIVE[0]"],
    "ITER_RAISES": ["ITER_RAISES[0]"],
    "ITER_BLOCKS": ["ITER_BLOCKS[0]"],
    "GETATTR_RAISES": ["GETATTR_RAISES.held"],
    "LIAR": ["LIAR.held"],
    "EQ_HASH_KEY": ["EQ_HASH_KEY[<Key>]"],
    "STR_SUBCLASS_KEY": ["STR_SUBCLASS_KEY[<Name>]"],
    "SLOT_SHADOWED": ["SLOT_SHADOWED.ema"],
    "RECURSIVE": ["RECURSIVE[0]"],
    "RECURSIVE_DICT": ["RECURSIVE_DICT['tensor']"],
    "PROXY_OF_DICT": ["PROXY_OF_DICT['inside']"],
    "TEN_MILLION": ["TEN_MILLION[0]"],
    "SNEAKY_PARTIAL": ["SNEAKY_PARTIAL.args[0]"],
    "Configured.totals": ["Configured.totals['aux']"],
    "HOSTILE_MODULE": ["HOSTILE_MODULE.counts"],
}
NOT_WALKED = [
    f"{MODULE}.DICT_PROPERTY (its __dict__ is a property)",
    f"{MODULE}.SLOT_BEHIND_PROPERTY.state (a slot behind a property)",
    f"{MODULE}.PROXY_OF_MAPPING (a mapping proxy over a HostileMapping)",
]


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    with importable_package(tmp_path, monkeypatch, "hostilepkg", {"hostile.py": HOSTILE}):
        import hostilepkg.hostile

        yield hostilepkg.hostile
        hostilepkg.hostile.Key.armed = False  # the dict holding a Key is freed after this
    for name in [name for name in sys.modules if name.partition(".")[0] == "hostilepkg"]:
        del sys.modules[name]


def test_report_mode_returns_names_every_good_tensor_and_runs_no_hostile_code(hostile, caplog):
    backend = EmulatedBackend()
    with backend.activate(), caplog.at_level(logging.WARNING, logger="unsafe_doctor.sentinel"):
        backend.mark_all_unsafe()
        backend.set_check(enabled=True)
        report = check(packages=["hostilepkg"], backend=backend)
    found = {item.name.dotted: list(item.paths) for item in report.unsafe}
    assert {name: found.get(name) for name in GOODS} == GOODS
    inside = {f"{MODULE}.{name}": [f"{MODULE}.{path}" for path in paths] for name, paths in INSIDE.items()}
    assert {name: found.get(name) for name in inside} == inside
    assert hostile.RAN == []
    assert report.summary.not_walked == len(NOT_WALKED)
    assert list(report.summary.not_walked_first) == NOT_WALKED
    assert report.summary.stopped_early == f"walked the first 10000 entries of {MODULE}.TEN_MILLION (10,000,001 entries)"
    [line] = [record.getMessage() for record in caplog.records if '"event": "summary"' in record.getMessage()]
    assert parse_line(line) == report.summary  # the line diagnose reads
    assert f"could not walk 3 objects, the first {NOT_WALKED[0]}" in line


def test_a_blocking_iter_never_holds_the_walk_because_it_never_runs(hostile):
    backend = EmulatedBackend()
    with backend.activate():
        backend.mark_all_unsafe()
        report = check(packages=["hostilepkg"], backend=backend)
    assert "blocking __iter__" not in hostile.RAN
    assert not (report.summary.stopped_early or "").startswith("time budget")


@pytest.mark.parametrize("mode", ["raise", "heal"])
def test_raise_and_heal_modes_raise_only_the_sentinels_own_error(hostile, mode):
    backend = EmulatedBackend()
    with backend.activate(), pytest.raises(UnsafeStateError) as raised:
        backend.mark_all_unsafe()
        check(mode=mode, packages=["hostilepkg"], backend=backend)
    assert f"{MODULE}.GOOD_0" in str(raised.value)
    assert raised.value.report.summary.not_walked == len(NOT_WALKED)
    assert hostile.RAN == []


def test_in_report_mode_a_failure_past_the_walk_is_the_summarys_reason_not_the_jobs(hostile, tmp_path, caplog):
    """A rules file that does not load fails the verdict: report mode logs why, raise mode raises it."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("rules: [{id: 1}]\n")
    backend = EmulatedBackend()
    with backend.activate(), caplog.at_level(logging.WARNING, logger="unsafe_doctor.sentinel"):
        backend.mark_all_unsafe()
        report = check(packages=["hostilepkg"], rules=[broken], backend=backend)
        with pytest.raises(Exception) as raised:
            check(mode="raise", packages=["hostilepkg"], rules=[broken], backend=backend)
    assert not isinstance(raised.value, UnsafeStateError)
    assert report.unsafe == ()
    assert report.summary.stopped_early.startswith(f"nothing checked: the sentinel failed: {type(raised.value).__name__}")
    assert [parse_line(record.getMessage()) for record in caplog.records] == [report.summary]
