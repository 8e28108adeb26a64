"""`verify --as-is`: the fault replayed on the adaptor as it stands, the sentinel's blocks included.
toytrain under its own rules (samples/framework/toytrain_rules.yaml: the EMA scenario 2, the loss
log scenario 1), with no fix written: the recovery dies as the log did without heal, and survives
with it, the EMA copied bit for bit from the replica in the repair and the loss log emptied in the
rollback."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORK = ROOT / "samples" / "framework"
RULES = FRAMEWORK / "toytrain_rules.yaml"
LOG = ROOT / "samples" / "logs" / "toytrain_sentinel.log"  # names both globals


def unsafe_doctor(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*map(str, arguments), cwd=ROOT)


def toytrain(tmp_path: Path, *, heal: bool) -> Path:
    framework = shutil.copytree(FRAMEWORK, tmp_path / "framework", ignore=shutil.ignore_patterns("__pycache__"))
    adaptor = framework / "toytrain" / "recovery.py"
    if heal:
        done = unsafe_doctor("sentinel", "install", "--adaptor", adaptor, "--mode", "heal", "--rules", RULES, "--yes")
        assert done.returncode == 0, done.stderr
    return adaptor


def as_is(adaptor: Path, ranks: int) -> tuple[int, dict]:
    framework = adaptor.parents[1]
    done = unsafe_doctor(
        "verify", LOG, "--source-root", framework, "--adaptor", adaptor, "--rules", RULES, "--as-is",
        "--probe", "toytrain_probe:train_one_step", "--ranks", str(ranks), "--format", "json",
    )  # fmt: skip
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize("ranks", [4, 8])
def test_with_heal_installed_and_no_fix_the_first_step_after_recovery_runs(tmp_path, ranks):
    code, report = as_is(toytrain(tmp_path, heal=True), ranks)
    assert code == 0, report
    verdicts = {verdict["global"]: verdict for verdict in report["verdicts"]}
    assert {name: verdict["outcome"] for name, verdict in verdicts.items()} == {
        "toytrain.state.LOSS_LOG": "survives",
        "toytrain.state._EMA_GRAD_NORM": "survives",
    }
    replica = report["replica_rank"]
    assert verdicts["toytrain.state._EMA_GRAD_NORM"]["patched"] == (
        f"the first step after recovery ran, tensor bit-identical to replica rank {replica}"
    )
    assert "reproduced `There is unsafe data in the input tensor.`" in verdicts["toytrain.state._EMA_GRAD_NORM"]["unpatched"]
    assert report["as_is"] and report["sentinel"]["patched"] == []  # nothing left unsafe after the rollback
    assert "the sentinel's blocks included" in report["proved"]


def test_without_heal_the_adaptor_as_it_stands_dies_as_the_log_did(tmp_path):
    code, report = as_is(toytrain(tmp_path, heal=False), 4)
    assert code == 1
    outcomes = {verdict["global"]: verdict["outcome"] for verdict in report["verdicts"]}
    assert outcomes == {"toytrain.state.LOSS_LOG": "dies", "toytrain.state._EMA_GRAD_NORM": "dies"}
    assert set(report["sentinel"]["patched"]) == {"toytrain.state.LOSS_LOG", "toytrain.state._EMA_GRAD_NORM"}
