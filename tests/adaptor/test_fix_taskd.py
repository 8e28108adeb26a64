"""The taskd elastic-training callbacks of mind-cluster (../shared/real/MANIFEST.md: commit and
paths): the adaptor profile `taskd-elastic` is chosen for them, the rank roles are read from the
named tuple of repair arguments each side takes under its own name, and the fixes are written,
compile, stay single on a second run, revert byte for byte and are proven by `verify`."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import run_cli

from unsafe_doctor.knowledge.context import groundwork

ROOT = Path(__file__).resolve().parents[2]
ELASTIC = Path("taskd", "python", "adaptor", "elastic_training")
CORPUS = ROOT / "tests" / "corpus" / "logs"
EXPERT_BIAS = CORPUS / "megatron-router-expert-bias.log"  # scenario 2
LAYER_WISE_TRACKER = CORPUS / "megatron-0.12-layer-wise-tracker.log"  # scenario 1


@pytest.fixture
def callbacks(tmp_path: Path, real: Path) -> Path:
    """A copy of the callbacks folder; fix writes there."""
    tree = tmp_path / "mind-cluster"
    shutil.copytree(real / "mind-cluster-7.2rc1", tree)
    return tree / ELASTIC


def unsafe_doctor(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    """`unsafe-doctor ARGUMENTS` in this process (fix, sentinel install: neither runs the user's code)."""
    return run_cli(*map(str, arguments), cwd=ROOT)


def verified(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    return run_cli("verify", *map(str, arguments), cwd=ROOT)


def test_the_taskd_profile_is_chosen_for_the_callbacks(callbacks):
    environment = groundwork((), ()).detect(adaptor=callbacks / "repair_callback.py").environment
    assert environment.profile.id == "taskd-elastic"


def test_scenario_2_reads_each_sides_ranks_from_its_own_named_tuple(callbacks):
    repair = callbacks / "repair_callback.py"
    original = repair.read_bytes()
    result = unsafe_doctor("fix", EXPERT_BIAS, "--adaptor", repair, "--yes", "--format", "json")
    assert result.returncode == 0, result.stderr
    written = repair.read_text()
    compile(written, str(repair), "exec")
    send = written[written.index("def send_rank_repair(") : written.index("def save_and_send_ckpt(")]
    recv = written[written.index("def recv_rank_repair(") : written.index("def build_model_and_optimizer(")]
    pairs = "for {1} in dict.fromkeys(zip({0}.src_ranks, {0}.dest_ranks)):"  # each side names the rank it does not read _x
    assert pairs.format("send_rank_repair_args", "_src_rank, dest_rank") in send
    assert pairs.format("recv_rank_repair_args", "src_rank, _dest_rank") in recv
    # the functions' own `group = get_repair_group()`, their torch: nothing imported again
    assert "torch.distributed.send(module.expert_bias, dst=dest_rank, group=group)" in send
    assert "torch.distributed.recv(recv_tensor, src=src_rank, group=group)" in recv
    assert "import torch\n" not in send + recv and "get_repair_group" not in send.split("unsafe-doctor: begin")[1]

    again = unsafe_doctor("fix", EXPERT_BIAS, "--adaptor", repair, "--yes", "--format", "json")
    assert again.returncode == 0 and json.loads(again.stdout)["written"] == []
    assert repair.read_text() == written

    reverted = unsafe_doctor("fix", "--revert", "--adaptor", repair, "--yes")
    assert reverted.returncode == 0, reverted.stderr
    assert repair.read_bytes() == original


def test_scenario_1_goes_into_the_parameterless_feature_rollback(callbacks):
    rollback = callbacks / "rollback_callback.py"
    result = unsafe_doctor("fix", LAYER_WISE_TRACKER, "--adaptor", rollback, "--yes")
    assert result.returncode == 0, result.stderr
    written = rollback.read_text()
    compile(written, str(rollback), "exec")
    feature_rollback = written[written.index("def feature_rollback():") : written.index("def build_data_iterator(")]
    assert "# unsafe-doctor: begin megatron.moe-layer-wise-tracker" in feature_rollback


def test_verify_block_proves_the_scenario_2_fix_with_the_named_tuples_stood_in(callbacks):
    pytest.importorskip("megatron.core.transformer.moe.router")
    repair = callbacks / "repair_callback.py"
    assert unsafe_doctor("fix", EXPERT_BIAS, "--adaptor", repair, "--yes").returncode == 0
    result = verified(EXPERT_BIAS, "--adaptor", repair, "--format", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    # taskd's own repair pickles the optimizer onto the NPU: its blocks run alone, in their functions
    assert [verdict["outcome"] for verdict in report["verdicts"]] == ["block-proven"]
    assert "the fix blocks alone in recv_rank_repair(), send_rank_repair() (their own code cannot run here: " in report["proved"]


def test_with_heal_and_no_fix_the_callbacks_as_they_stand_survive_the_router_fault(callbacks):
    """taskd's callbacks as they stand die on expert_bias as the log did; with `sentinel install --mode
    heal` (no fix written) the repair's heal, run alone in its functions since their own code cannot
    run here, copies expert_bias from the replica bit for bit, and the first step runs."""
    pytest.importorskip("megatron.core.transformer.moe.router")
    repair = callbacks / "repair_callback.py"
    arguments = (EXPERT_BIAS, "--adaptor", repair, "--as-is", "--format", "json")
    before = json.loads(verified(*arguments).stdout)
    assert [verdict["outcome"] for verdict in before["verdicts"]] == ["dies"]
    assert unsafe_doctor("sentinel", "install", "--adaptor", repair, "--mode", "heal", "--yes").returncode == 0
    result = verified(*arguments)
    assert result.returncode == 0, result.stdout + result.stderr
    [verdict] = json.loads(result.stdout)["verdicts"]
    assert verdict["outcome"] == "survives"
    assert verdict["patched"].endswith(f"tensor bit-identical to replica rank {json.loads(result.stdout)['replica_rank']}")
