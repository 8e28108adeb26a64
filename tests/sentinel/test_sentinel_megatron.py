"""The sentinel on a real megatron-core GPT/MoE model, under the emulated backend.

The model is megatron-core's GPTModel with MoE (aux-loss-free balancing, rotary embeddings), built
and trained on CPU for two steps (tests/fixtures/sentinel/megatron_gpt_moe.py). Then the fault
marks every tensor unsafe, and the unpatched recovery repairs what the adaptor's repair repairs:
the parameters and the optimizer state, each copied (copy_) from the replica's bytes, and one more
buffer, RotaryEmbedding.inv_freq, copied the same way. The sentinel must then name the globals the
held-back fixes (the knowledge base's rules for this release) would repair, each with its rule, and
nothing the recovery did repair. After the fix (heal mode for the scenario-1 rules, the replica's
copy for the scenario-2 one, as the generated receive block does it), it must name none of them.
0.16.1 runs in this process; 0.12.1, whose layer-wise tracker lives in parallel_state under another
rule, runs from a pip target in a subprocess (tests/fixtures/sentinel/release_run.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_module

from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.sentinel import SentinelReport

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "sentinel"


def _load_fixture():
    return load_module("megatron_gpt_moe", FIXTURES / "megatron_gpt_moe.py", register=True)


gpt = _load_fixture()

SHAPE = gpt.Shape(layers=2, hidden=64, experts=4, expert_hidden=128, heads=4, vocabulary=1024)
PACKAGES = ["megatron"]
MOE = "megatron.core.transformer.moe"
ROTARY = "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding"

# What the held-back fixes repair on megatron-core 0.16.1: each global, with its rule and scenario
# in knowledge_base/rules/megatron.yaml. RotaryEmbedding.forward is an lru cache of device tensors:
# the sentinel checks its results (the garbage collector lists them) and its rule clears it.
HELD_BACK = {
    f"{MOE}.moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER": ("megatron.moe-layer-wise-tracker-moe-utils", 1),
    "megatron.core.parallel_state._GLOBAL_MEMORY_BUFFER": ("megatron.global-memory-buffer", 1),
    f"{MOE}.router.TopKRouter.local_tokens_per_expert": ("megatron.router-local-tokens-per-expert", 1),
    f"{MOE}.router.TopKRouter.expert_bias": ("megatron.router-expert-bias", 2),
    f"{ROTARY}.forward": ("megatron.rotary-emb-cache", 1),
}
# Unsafe after the fault, but the next step writes them before it reads them: the all-gather token
# dispatcher's per-step maps are bound anew in its preprocessing, and schedules.forward_step copies
# the aux-loss scale in (set_loss_scale) before the backward reads it. The knowledge base says so
# (knowledge_base/step_written.yaml): the sentinel names them apart and never stops for them.
DISPATCHER = f"{MOE}.token_dispatcher.MoEAllGatherTokenDispatcher"
WRITTEN_BY_THE_STEP = {
    f"{DISPATCHER}.local_map": "megatron.moe-allgather-dispatcher-step",
    f"{DISPATCHER}.local_probs": "megatron.moe-allgather-dispatcher-step",
    f"{DISPATCHER}.reversed_local_input_permutation_mapping": "megatron.moe-allgather-dispatcher-step",
    f"{MOE}.moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale": "megatron.moe-aux-loss-scale",
}
REFRESHED_BY_THE_RECOVERY = f"{ROTARY}.inv_freq"
# Where older releases keep the layer-wise tracker, and the rule that names it there.
TRACKERS = {
    "0.12.1": ("megatron.core.parallel_state._MOE_LAYER_WISE_LOGGING_TRACKER", "megatron.moe-layer-wise-tracker"),
}


@pytest.fixture(scope="session")  # once per xdist worker; "module" rebuilds it each time other files' tests come between
def recovery():
    with gpt.megatron_on_cpu():
        recovered = gpt.fault_and_recover(gpt.train(SHAPE, steps=2), PACKAGES)
        gpt.forget_rotary_cache()
    return recovered


def named(report: SentinelReport) -> set[str]:
    return {item.name.dotted for item in report.still_unsafe}


def test_the_sentinel_names_every_global_the_held_back_fixes_repair_with_its_rule_and_scenario(recovery):
    found = {item.name.dotted: (item.rule, item.scenario) for item in recovery.before.unsafe}
    assert {name: found.get(name) for name in HELD_BACK} == HELD_BACK
    scenarios = {rule.id: rule.scenario for rule in load_knowledge().rules}
    assert all(scenarios[rule] == scenario for rule, scenario in HELD_BACK.values())
    assert {item.name.dotted for item in recovery.before.unsafe if item.cached} == {f"{ROTARY}.forward"}
    assert {item.backend for item in recovery.before.unsafe} == {recovery.before.summary.backend} == {"emulated"}
    assert recovery.before.summary.stopped_early is None


def test_the_sentinel_names_exactly_the_held_back_globals_and_none_after_the_fix(recovery):
    assert named(recovery.before) == HELD_BACK.keys()
    assert named(recovery.after) == set()


def test_what_the_step_writes_before_reading_is_named_apart_with_the_knowledge_that_says_so(recovery):
    written = {item.name.dotted: item.written_by_step for item in recovery.before.unsafe if item.written_by_step}
    assert written == WRITTEN_BY_THE_STEP
    assert recovery.before.summary.unsafe_globals == len(HELD_BACK)  # the summary counts what a step would die on


def test_no_false_alarm_on_parameters_optimizer_state_or_a_buffer_the_recovery_refreshed_with_copy(recovery):
    found = {item.name.dotted for item in recovery.before.unsafe}
    assert not found & recovery.parameter_holders
    assert recovery.optimizer_holder not in found
    assert REFRESHED_BY_THE_RECOVERY not in found
    assert found == HELD_BACK.keys() | WRITTEN_BY_THE_STEP.keys()
    assert recovery.before.summary.tensors_checked > recovery.repaired  # they were checked, and found safe


def test_heal_runs_the_scenario_1_rules_and_their_globals_check_safe_but_never_heals_scenario_2(recovery):
    outcome = {item.name.dotted: (item.healed, item.heal_error) for item in recovery.healed.unsafe}
    scenario_1 = {name for name, (_, scenario) in HELD_BACK.items() if scenario == 1}
    assert {name: outcome[name] for name in scenario_1} == dict.fromkeys(scenario_1, (True, None))
    assert outcome[f"{MOE}.router.TopKRouter.expert_bias"] == (False, None)
    assert named(recovery.healed) == {f"{MOE}.router.TopKRouter.expert_bias"}


@pytest.mark.parametrize("version", TRACKERS)
def test_on_older_releases_the_sentinel_names_the_held_back_globals_where_the_release_keeps_them(version, megatron_core_release):
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(megatron_core_release(version)), str(ROOT)]),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    run = subprocess.run(
        [sys.executable, str(FIXTURES / "release_run.py")],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    said = json.loads(run.stdout)
    tracker, rule = TRACKERS[version]
    held_back = {**{name: value for name, value in HELD_BACK.items() if "TRACKER" not in name}, tracker: (rule, 1)}
    before = {name: tuple(value) for name, value in said["before"].items()}
    assert said["release"] == version
    assert {name: before.get(name) for name in held_back} == held_back
    assert said["still_unsafe"] == sorted(held_back)
    assert said["parameters_named"] == [] and REFRESHED_BY_THE_RECOVERY not in before
    assert all(said["healed"][name] == [True, None] for name, (_, scenario) in held_back.items() if scenario == 1)
    assert said["after"] == []
