"""A suspect exists in this run only when the arguments make the code that writes it run.

The guards come from the frameworks' own code (`scripts/derive_writers.py` -> knowledge_base/writers.json);
here they are derived again from the real megatron-core 0.12.1 wheel when it can be had, checked as
shipped, and applied to dumps written in Megatron-LM's format and to a develop log of the corpus.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import script_module
from test_suspects import CATCH_V73, MOE, PTA_ERROR, TASKD_LINES, dump, shortlist_of, write_log

from unsafe_doctor.knowledge.loading import load_knowledge, shipped_knowledge_dir
from unsafe_doctor.knowledge.writers import WRITERS_FILE, AllOf, Leaf, decide, load_writers

ROOT = Path(__file__).parents[2]
TRACKER = "megatron.moe-layer-wise-tracker"  # megatron-core 0.8-0.12's parallel_state tracker
NO_AUX_LOSS = {**MOE, "moe_router_load_balancing_type": "none", "moe_z_loss_coeff": "None", "seq_aux": "False"}


@pytest.fixture(scope="module")
def megatron_0_12_1(tmp_path_factory) -> dict[str, bytes]:
    """The real wheel's megatron/core files; the test skips where the package index cannot give it."""
    folder = tmp_path_factory.mktemp("wheel")
    try:
        download = ["download", "--quiet", "--no-deps", "--only-binary=:all:", "megatron-core==0.12.1", "-d", str(folder)]
        subprocess.run([sys.executable, "-m", "pip", *download], check=True, capture_output=True, timeout=300)
    except (subprocess.SubprocessError, OSError):
        pytest.skip("megatron-core 0.12.1 cannot be downloaded here")
    wheel = next(folder.glob("megatron_core-0.12.1-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = [name for name in archive.namelist() if name.startswith("megatron/core/") and name.endswith(".py")]
        return {name: archive.read(name) for name in names}


@pytest.fixture(scope="module")
def derive_writers():
    return script_module("derive_writers")


def _leaves(paths) -> set[tuple[str, str, object]]:
    """Every test on a setting in the paths, as (switch, test, value)."""

    def flat(guard):
        return [guard] if isinstance(guard, Leaf) else [leaf for item in getattr(guard, "items", ()) for leaf in flat(item)]

    return {(leaf.switch, leaf.test, leaf.value) for path in paths for guard in path.guards for leaf in flat(guard)}


def test_the_router_guards_are_derived_from_megatron_core_0_12_1(megatron_0_12_1, derive_writers):
    rule = next(rule for rule in load_knowledge().rules if rule.id == TRACKER)
    program = derive_writers.Program(megatron_0_12_1, foreign=False)
    target = derive_writers.target_of(rule)
    seeds, _ = derive_writers.inner_seeds(program, target, set())
    paths = derive_writers.paths(program, seeds)
    assert {"save_to_aux_losses_tracker"} == {seed[0].name for seed in seeds} - {"track_moe_metrics"}
    leaves = _leaves(paths)
    assert ("moe_z_loss_coeff", "is not None", None) in leaves  # TopKRouter.apply_z_loss
    assert ("moe_router_load_balancing_type", "==", "seq_aux_loss") in leaves  # routing -> seq_aux_loss_load_balancing
    assert ("moe_router_load_balancing_type", "==", "aux_loss") in leaves  # routing -> aux_loss_load_balancing
    assert all(path.via[-1].endswith(" forward") for path in paths)  # every path starts at the step
    assert all(decide(AllOf(path.guards), NO_AUX_LOSS) is False for path in paths)
    assert any(decide(AllOf(path.guards), {**NO_AUX_LOSS, "moe_router_load_balancing_type": "aux_loss"}) for path in paths)


def test_an_early_return_on_a_setting_and_another_test_never_rules_the_write_out(derive_writers):
    """`if self.training and X is None: return` before a write: the write runs whenever training is
    off, so the path must not need `X is not None` (the negation of a weakened `and` is no weakening)."""
    source = (
        b"_TRACKER = {}\n"
        b"def save(x):\n    _TRACKER['values'] = x\n"
        b"class Router:\n    def forward(self, x):\n"
        b"        if self.training and self.config.moe_z_loss_coeff is None:\n            return x\n"
        b"        save(x)\n"
    )
    program = derive_writers.Program({"megatron/core/tracker.py": source}, foreign=False)
    seeds, _ = derive_writers.inner_seeds(program, derive_writers.Target("_TRACKER", None, "megatron.core.tracker"), set())
    [path] = derive_writers.paths(program, seeds)
    assert path.via[-1] == "megatron/core/tracker.py:8 forward"
    assert decide(AllOf(path.guards), {"moe_z_loss_coeff": "None"}) is not False


def test_the_shipped_writers_name_shipped_rules_and_say_where_each_guard_is():
    writers = load_writers(shipped_knowledge_dir())
    rules = {rule.id for rule in load_knowledge().rules}
    assert TRACKER in writers.rules and set(writers.rules) <= rules
    megatron = {entry.release for entry in writers.rules[TRACKER] if entry.framework == "megatron-core"}
    assert {"0.12.0", "0.12.1"} <= megatron
    data = json.loads((shipped_knowledge_dir() / WRITERS_FILE).read_text())
    assert "derive_writers.py" in data["generated_by"]
    for entries in writers.rules.values():
        for entry in entries:
            for path in entry.paths:
                assert path.via, (entry.release, path)
                assert all(leaf.at.count(":") == 1 for leaf in path.guards if isinstance(leaf, Leaf))


def _excluded(tmp_path: Path, values: dict[str, str]) -> dict[str, str]:
    log = write_log(tmp_path, dump(values), TASKD_LINES, [CATCH_V73, PTA_ERROR])
    _, shortlist = shortlist_of(log)  # taskd's elastic callbacks: megatron-core 0.8.0 or 0.12.1 (its pairs_with)
    return {item.rule: item.why for item in shortlist.excluded} | {s.rule.id: "" for s in shortlist.suspects}


@pytest.mark.parametrize("balancing", ["none", "sinkhorn"])
def test_no_aux_loss_balancing_and_no_z_loss_rule_the_tracker_out_naming_the_guards(tmp_path, balancing):
    why = _excluded(tmp_path, {**NO_AUX_LOSS, "moe_router_load_balancing_type": balancing})[TRACKER]
    assert why.startswith(f"moe_router_load_balancing_type is {balancing} and moe_z_loss_coeff is None")
    assert "megatron-core 0.12.1 megatron/core/transformer/moe/router.py:" in why


def test_aux_loss_load_balancing_keeps_the_tracker(tmp_path):
    assert _excluded(tmp_path, {**NO_AUX_LOSS, "moe_router_load_balancing_type": "aux_loss"})[TRACKER] == ""


def test_a_setting_absent_from_the_dump_keeps_the_tracker(tmp_path):
    values = {name: value for name, value in NO_AUX_LOSS.items() if name != "moe_z_loss_coeff"}
    assert _excluded(tmp_path, values)[TRACKER] == ""


def test_a_develop_corpus_log_with_the_tracker_as_culprit_keeps_it_first():
    """untraced-v26-taskd-elastic-layer-wise-tracker.log is in the develop half (tests/corpus/untraced_split.yaml)."""
    log = ROOT / "tests" / "corpus" / "logs" / "untraced-v26-taskd-elastic-layer-wise-tracker.log"
    _, shortlist = shortlist_of(log)
    assert TRACKER in {shortlist.suspects[0].rule.id, *shortlist.suspects[0].alternatives}
