"""The replay's rule probes on the real megatron-core releases their rules claim, and on some they do not.

Each release comes from a pip target (the session's ``megatron_core_release`` fixture) put first on
PYTHONPATH in a subprocess, so the installed 0.16.1 is shadowed; 0.16.1 runs as installed. A probe
must build and step on every release a rule that names it claims, and on any other release fail
with a ProbeError that says why, which ``verify`` reports as exit 2 (cannot replay), never 1.
End to end, ``unsafe-doctor verify`` proves a scenario-1 fix (the MoE layer-wise tracker) and a
scenario-2 fix (the router's expert_bias) on 0.12.1 and on 0.16.1.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.knowledge.rules import PROBE_NAMES

pytestmark = pytest.mark.slow  # CI runs it: python -m pytest -m slow

ROOT = Path(__file__).resolve().parents[2]
REPLAY = ROOT / "tests" / "fixtures" / "replay"
TRACKER_0_12_LOG = ROOT / "tests" / "corpus" / "logs" / "megatron-0.12-layer-wise-tracker.log"
INSTALLED = "0.16.1"  # the test extra's megatron-core: run as installed, no pip target

# What each probe builds on a release where it must build: where the tracker lives, and the router's
# process-group argument (none up to 0.12, then ModelCommProcessGroups, then ProcessGroupCollection).
BUILT = {
    "0.7.0": ("megatron.core.parallel_state", None),  # the aux-losses tracker, the FAQ's
    "0.8.0": ("megatron.core.parallel_state", None),
    "0.11.0": ("megatron.core.parallel_state", "no process groups"),
    "0.12.1": ("megatron.core.parallel_state", "no process groups"),
    "0.13.0": ("megatron.core.transformer.moe.moe_utils", "ModelCommProcessGroups of no groups"),
    INSTALLED: ("megatron.core.transformer.moe.moe_utils", "ProcessGroupCollection of no groups"),
}
# Why a probe cannot build on a release no rule naming it claims.
NOT_BUILT = {
    ("0.7.0", "megatron-layer-wise-tracker"): "megatron-core 0.7.0 has no _MOE_LAYER_WISE_LOGGING_TRACKER in",
    **{
        (version, "megatron-aux-losses-tracker"): f"megatron-core {version} has no _MOE_AUX_LOSSES_LOGGING_TRACKER in"
        for version in ("0.8.0", "0.11.0", "0.12.1", "0.13.0", "0.16.1")
    },
    (
        "0.7.0",
        "megatron-router-expert-bias",
    ): "megatron-core 0.7.0's TransformerConfig has no moe_router_enable_expert_bias: its TopKRouter has no expert_bias",
    (
        "0.8.0",
        "megatron-router-expert-bias",
    ): "megatron-core 0.8.0's TransformerConfig has no moe_router_enable_expert_bias: its TopKRouter has no expert_bias",
}
RELEASES = ("0.7.0", "0.8.0", "0.11.0", "0.12.1", "0.13.0", INSTALLED)


def environment(pythonpath: list[Path]) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(path) for path in [*pythonpath, ROOT]),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }


@pytest.fixture
def release_path(megatron_core_release):
    """What goes before the repository on PYTHONPATH to run a release: its pip target, or nothing for 0.16.1."""
    return lambda version: [] if version == INSTALLED else [megatron_core_release(version)]


@functools.cache
def claimed_by_a_rule(probe: str, version: str) -> bool:
    return any(
        rule.probe == probe and rule.versions is not None and Version(version) in rule.versions for rule in load_knowledge().rules
    )


def test_every_probe_is_claimed_by_a_rule_on_a_release_tested_here():
    for probe in PROBE_NAMES:
        claimed = [version for version in RELEASES if claimed_by_a_rule(probe, version)]
        assert claimed, f"no release tested here is claimed by a rule naming {probe}"
        assert all(version in BUILT for version in claimed)


@pytest.mark.parametrize("version", RELEASES)
def test_probes_build_on_every_release_their_rules_claim_and_say_why_not_elsewhere(version, release_path):
    result = subprocess.run(
        [sys.executable, str(REPLAY / "probe_release.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment(release_path(version)),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["release"] == version
    if version != INSTALLED:
        assert report["imported_from"].startswith(str(release_path(version)[0]))
    tracker_holder, router_groups = BUILT.get(version, (None, None))
    for probe, outcome in report["probes"].items():
        if claimed_by_a_rule(probe, version):
            assert "error" not in outcome, outcome
            assert outcome["tensors"] >= 1
            assert f"megatron-core {version}'s" in outcome["how"]
            if probe == "megatron-layer-wise-tracker":
                assert f"into {tracker_holder}._MOE_LAYER_WISE_LOGGING_TRACKER" in outcome["how"]
            elif probe == "megatron-aux-losses-tracker":
                assert f"into {tracker_holder}._MOE_AUX_LOSSES_LOGGING_TRACKER" in outcome["how"]
            else:
                assert f"expert bias on, {router_groups})" in outcome["how"]
        else:
            assert outcome["error"].startswith(NOT_BUILT[version, probe])


# --- unsafe-doctor verify, end to end ------------------------------------------------------------------


def unsafe_doctor(*arguments: str, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", *arguments],
        capture_output=True,
        text=True,
        timeout=180,
        env=environment(pythonpath),
        cwd=ROOT,
    )


@pytest.fixture
def in_tree(tmp_path) -> Path:
    """A copy of the in-tree MindSpeed-LLM sample adaptor's source root: fix writes into it."""
    shutil.copytree(ROOT / "samples" / "adaptors" / "in_tree", tmp_path / "in_tree")
    return tmp_path / "in_tree"


@pytest.fixture(scope="session")
def stale_expert_bias_log(megatron_core_release, tmp_path_factory, request):
    """A release's log of TopKRouter.routing reading a stale expert_bias: 0.16.1's from the shared
    fixture (asked for only then: it imports megatron-core here), another's printed by
    stale_expert_bias.py with that release first on PYTHONPATH."""

    def log(version: str) -> Path:
        if version == INSTALLED:
            return request.getfixturevalue("router_expert_bias_log")
        result = subprocess.run(
            [sys.executable, str(REPLAY / "stale_expert_bias.py")],
            capture_output=True,
            text=True,
            timeout=120,
            env=environment([megatron_core_release(version)]),
            cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        path = tmp_path_factory.mktemp("logs") / f"megatron-{version}-expert-bias.log"
        path.write_text(result.stdout)
        return path

    return log


# (the log, the rule the fix comes from, the adaptor file that gets it) per release and scenario
CASES = {
    ("0.7.0", 1): (
        ROOT / "tests" / "corpus" / "logs" / "megatron-0.7-aux-losses-tracker.log",
        "megatron.moe-aux-losses-tracker",
        "tft_rollback.py",
    ),
    ("0.12.1", 1): (TRACKER_0_12_LOG, "megatron.moe-layer-wise-tracker", "tft_rollback.py"),
    (INSTALLED, 1): (
        ROOT / "samples" / "logs" / "megatron_moe_tracker.log",
        "megatron.moe-layer-wise-tracker-moe-utils",
        "tft_rollback.py",
    ),
    ("0.12.1", 2): (None, "megatron.router-expert-bias", "tft_optimizer_data_repair.py"),
    # 0.13's TopKRouter adds to local_tokens_per_expert right after reading expert_bias: the companion is fixed too
    ("0.13.0", 2): (None, "megatron.router-expert-bias", "tft_optimizer_data_repair.py"),
    (INSTALLED, 2): (None, "megatron.router-expert-bias", "tft_optimizer_data_repair.py"),
}


@pytest.mark.parametrize(("version", "scenario"), list(CASES), ids=[f"{v}-scenario-{s}" for v, s in CASES])
def test_verify_proves_the_fix_on_the_release(version, scenario, release_path, in_tree, stale_expert_bias_log):
    """Scenario 1: the MoE layer-wise tracker (parallel_state in 0.12.1, moe_utils in 0.16.1); scenario 2:
    TopKRouter's expert_bias. fix writes the rule's block; verify reproduces the error in the release's
    own files without it and comes back clean with it (exit 0)."""
    log, rule, adaptor_name = CASES[version, scenario]
    log = log or stale_expert_bias_log(version)
    adaptor = in_tree / "mindspeed_llm" / "core" / "high_availability" / adaptor_name
    if rule == "megatron.moe-aux-losses-tracker":  # the sample already rebinds it (fix would say so): take that out
        adaptor.write_text(adaptor.read_text().replace("mpu._MOE_AUX_LOSSES_LOGGING_TRACKER = {}", "pass"))
    common = [str(log), "--source-root", str(in_tree), "--adaptor", str(adaptor)]
    fixed = unsafe_doctor("fix", *common, "--yes", pythonpath=release_path(version))
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert f"# unsafe-doctor: begin {rule}\n" in adaptor.read_text()
    if scenario == 2:  # MindSpeed-LLM 26 does not rebuild the model: the router's other buffer is reset with it
        rollback = adaptor.with_name("tft_rollback.py").read_text()
        assert "# unsafe-doctor: begin megatron.router-local-tokens-per-expert\n" in rollback
    verified = unsafe_doctor("verify", *common, "--ranks", "2", "--format", "json", pythonpath=release_path(version))
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-2000:]
    [verdict] = json.loads(verified.stdout)["verdicts"]
    assert (verdict["rule"], verdict["scenario"], verdict["outcome"]) == (rule, scenario, "proven")
    release_files = str(release_path(version)[0] if release_path(version) else Path(sys.prefix))
    assert verdict["unpatched"].startswith("reproduced `There is unsafe data in the input tensor.` on rank 1 at " + release_files)
    clean = "recovery clean, tensor bit-identical to replica rank 0" if scenario == 2 else "recovery clean, no unsafe tensor left"
    assert verdict["patched"].startswith(clean)


def test_a_release_the_rule_does_not_claim_exits_2_with_the_reason(in_tree):
    """The 0.12.1 corpus log where 0.16.1 is installed: the log's rule (the tracker in parallel_state)
    holds for 0.8-0.12, whose state this machine cannot build. That is exit 2, the reason shown."""
    adaptor = in_tree / "mindspeed_llm" / "core" / "high_availability" / "tft_rollback.py"
    verified = unsafe_doctor(
        "verify",
        str(TRACKER_0_12_LOG),
        "--source-root",
        str(in_tree),
        "--adaptor",
        str(adaptor),
        "--ranks",
        "2",
        "--format",
        "json",
        pythonpath=[],
    )
    assert verified.returncode == 2, verified.stdout[-3000:] + verified.stderr[-2000:]
    [verdict] = json.loads(verified.stdout)["verdicts"]
    assert (verdict["rule"], verdict["outcome"]) == ("megatron.moe-layer-wise-tracker", "not-modelled")
    assert verdict["unpatched"].startswith(
        f"megatron-core {INSTALLED} is installed here, but rule "
        "megatron.moe-layer-wise-tracker holds for megatron-core <0.13,>=0.8"
    )
