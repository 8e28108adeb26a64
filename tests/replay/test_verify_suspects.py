"""`verify --suspect N`: a suspect's fix proven for that suspect.

An error MindIO (v7.3 and later) logged without a traceback has no finding to replay, only suspects.
The log here is the corpus's real-format MindSpeed-LLM 26 log of a MoE job (the arguments dump, the
in-tree adaptor's lines, MindIO v26's catch line); the adaptor a copy of the in-tree sample; the
replay real megatron-core on forked gloo ranks, through the CLI as a user types it.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import refused, run_cli

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.replay.plan import AdaptorCode, Block, ReplayPlan, Target
from unsafe_doctor.replay.results import RankResult, RunResult, StepOutcome
from unsafe_doctor.replay.verify import judge_replay
from unsafe_doctor.report.verification import unfixed_globals, verification_json

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "tests" / "corpus" / "logs"
ROUTER_LOG = LOGS / "untraced-v26-mindspeed-llm-26-router-expert-bias.log"  # suspects: expert_bias, local tokens
TRACKER_LOG = LOGS / "untraced-v26-taskd-elastic-layer-wise-tracker.log"  # suspect 1: the tracker, module not named
FLASH_LOG = LOGS / "untraced-v26-mindspeed-llm-26-flash-attention-mask.log"  # suspect 1: no module the log names
REPAIR = Path("mindspeed_llm", "core", "high_availability", "tft_optimizer_data_repair.py")
ROUTER = "megatron.core.transformer.moe.router"


@pytest.fixture
def adaptor(tmp_path) -> Path:
    shutil.copytree(ROOT / "samples" / "adaptors" / "in_tree", tmp_path / "in_tree")
    return tmp_path / "in_tree" / REPAIR


def unsafe_doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env={"COLUMNS": "200"}, cwd=ROOT)


def test_plain_verify_of_a_log_without_a_traceback_says_to_choose_a_suspect(adaptor):
    line = refused(unsafe_doctor("verify", str(ROUTER_LOG), "--adaptor", str(adaptor)))
    assert "no unsafe-data finding" not in line
    assert line == (
        "unsafe-doctor: nothing to verify: the log's unsafe-data error has no traceback: choose which of "
        "its 2 suspects to replay with --suspect N (diagnose lists them)"
    )


@pytest.mark.parametrize(
    ("log", "number", "message"),
    [
        (ROUTER_LOG, "4", "--suspect 4: the log's shortlist has suspects 1 to 2"),  # fix's own words
        (
            TRACKER_LOG,
            "1",
            "--suspect 1: the replay cannot build _MOE_LAYER_WISE_LOGGING_TRACKER: rule "
            "megatron.moe-layer-wise-tracker names it without the one module that holds it",
        ),
        (
            FLASH_LOG,
            "1",
            "--suspect 1: no fix can be shown: the fix must import the module that holds the global, and "
            "the log does not say which module that is (the rule knows it only by the pattern "
            "mindspeed.*); a traceback names it, as the sentinel does at the next fault: diagnose of "
            "that log writes the fix",
        ),
        (
            ROOT / "samples" / "logs" / "megatron_moe_tracker.log",
            "1",
            "--suspect: the log has no error without a traceback, so no shortlist of suspects",
        ),
    ],
)
def test_a_suspect_out_of_range_unbuildable_or_without_a_shortlist_is_refused_in_one_line(adaptor, log, number, message):
    line = refused(unsafe_doctor("verify", str(log), "--adaptor", str(adaptor), "--suspect", number))
    assert line == f"unsafe-doctor: {message}"
    if number == "4" or "no shortlist" in message:  # the same option and resolution as fix's: the same refusal
        assert refused(unsafe_doctor("fix", str(log), "--adaptor", str(adaptor), "--suspect", number)) == line


def test_diagnose_fix_and_verify_give_one_reason_why_a_suspect_has_no_fix(adaptor):
    """The reason is made once, where the classification finds the module unnamed: each command shows it."""
    line = refused(unsafe_doctor("verify", str(FLASH_LOG), "--adaptor", str(adaptor), "--suspect", "1"))
    reason = line.removeprefix("unsafe-doctor: --suspect 1: ")
    assert reason.startswith("no fix can be shown: the fix must import the module that holds the global")
    assert "the pattern mindspeed.*" in reason and "the sentinel" in reason
    fixed = unsafe_doctor("fix", str(FLASH_LOG), "--adaptor", str(adaptor), "--suspect", "1")
    assert fixed.returncode == 1, fixed.stderr
    assert f"unsafe-doctor: suspect 1: {reason}" in fixed.stderr.splitlines()  # the suspect's number, not "finding 1"
    diagnosed = unsafe_doctor("diagnose", str(FLASH_LOG), "--adaptor", str(adaptor))
    assert f"fix: {reason}" in " ".join(diagnosed.stdout.split())


def test_fix_gives_a_suspect_chosen_twice_once_in_the_command_it_names_as_verify_does(adaptor):
    result = unsafe_doctor("fix", str(ROUTER_LOG), "--adaptor", str(adaptor), "--suspect", "1", "--suspect", "1", "--dry-run")
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "to write it: unsafe-doctor fix " in line]
    assert line.endswith(" --suspect 1 --yes") and line.count("--suspect") == 1


def test_a_suspects_fix_goes_red_then_green_and_is_proven_for_that_suspect_only(adaptor):
    options = [str(ROUTER_LOG), "--adaptor", str(adaptor), "--suspect", "1"]
    red = unsafe_doctor("verify", *options)
    assert red.returncode == 1, red.stderr
    text = " ".join(red.stdout.split())
    assert f"NO-FIX · suspect 1 · {ROUTER}.expert_bias · scenario 2" in text
    assert "reproduced `There is unsafe data in the input tensor.` on rank 1" in text
    assert (
        "proof: ran the adaptor's own recv_rank_repair(), send_rank_repair(), feature_rollback() (it holds no fix "
        "block: nothing was patched)"
        in text
        and "patched adaptor" not in text
    )
    assert (
        f"Suspect 1: the replay made {ROUTER}.expert_bias the global the recovery left unsafe (marked as a UCE on it "
        "would be). Not shown: that suspect 1 is the global this log's fault left unsafe"
    ) in text
    # the sentinel names TopKRouter.expert_bias too: the suspect, by its class; the router's other buffer is not
    assert (
        "Still unsafe after the patched rollback, and no finding of the log: "
        f"{ROUTER}.TopKRouter.local_tokens_per_expert; the first step"
    ) in text
    [command] = [line for line in red.stdout.splitlines() if line.startswith("unsafe-doctor fix ")]  # to write the fix
    assert command.endswith(" --suspect 1 --yes")
    written = unsafe_doctor(*shlex.split(command)[1:])
    assert written.returncode == 0, written.stderr
    green = unsafe_doctor("verify", *options)
    assert green.returncode == 0, green.stdout + green.stderr
    text = " ".join(green.stdout.split())
    assert f"PROVEN · suspect 1 · {ROUTER}.expert_bias · scenario 2" in text
    assert "recovery clean, tensor bit-identical to replica rank 3" in text
    assert (
        f"Proven for suspect 1 only: the replay made {ROUTER}.expert_bias the global the recovery left unsafe "
        "(marked as a UCE on it would be); its fix brings the first step after recovery back clean. Not shown: that "
        "suspect 1 is the global this log's fault left unsafe (the log has no traceback): `unsafe-doctor sentinel "
        "install` names that one at the next fault."
    ) in text
    assert "Proven: the fixes of this log's globals" not in text  # the log names no global


# --- the verdict and the report of a suspect, from results as ranks write them (no process group) -----------


SUSPECT = Target(
    "megatron.router-expert-bias", GlobalName(ROUTER, None, "expert_bias"), 2, "megatron.router-expert-bias", suspect=1
)
HELD = f"{ROUTER}.TopKRouter.expert_bias"  # how the sentinel and a dying step name it: by the class that holds it
FUNCTIONS = {"rollback": "feature_rollback", "send": "send_rank_repair", "recv": "recv_rank_repair"}
UNSAFE = "There is unsafe data in the input tensor."


def judged(patched: RunResult):
    block = Block(SUSPECT.key, "recv", "recv_rank_repair", "/job/repair.py", 40, "pass\n", (), None)
    code = AdaptorCode("/job/repair.py", "repair", "", "", tuple(FUNCTIONS.values()))
    plan = ReplayPlan((SUSPECT,), (block,), (code,), FUNCTIONS, {}, (), "adaptor", 2, 1, 0, ())
    clean = RunResult(resume={SUSPECT.key: StepOutcome()})
    red = RunResult(resume={SUSPECT.key: StepOutcome(UNSAFE, "/mc/moe_utils.py:719", HELD)}, sentinel=(HELD,))
    return judge_replay(plan, (), [RankResult(0, "emulated", clean, clean), RankResult(1, "emulated", red, patched)], "gloo", 1.0)


def test_the_json_says_what_a_suspects_proof_shows_and_what_it_does_not():
    verification = judged(RunResult(resume={SUSPECT.key: StepOutcome()}, equal={SUSPECT.key: True}, sentinel=()))
    [verdict] = verification_json(verification)["verdicts"]
    assert verdict["outcome"] == "proven"
    assert verdict["unpatched"] == f"reproduced `{UNSAFE}` on rank 1 at /mc/moe_utils.py:719"  # no "reading" another
    assert verdict["suspect"] == {
        "number": 1,
        "proves": f"the replay made {ROUTER}.expert_bias the global the recovery left unsafe (marked as a UCE on it "
        "would be); its fix brings the first step after recovery back clean",
        "does_not_prove": "that suspect 1 is the global this log's fault left unsafe (the log has no traceback): "
        "`unsafe-doctor sentinel install` names that one at the next fault",
    }
    assert json.loads(json.dumps(verification_json(verification))) == verification_json(verification)


def test_the_global_a_suspects_step_dies_on_is_the_suspect_when_named_by_its_class():
    """The rule names expert_bias in its module; the sentinel and the step name it through TopKRouter:
    the same global, never "another global the log does not name"."""
    died = RunResult(resume={SUSPECT.key: StepOutcome(UNSAFE, "/mc/moe_utils.py:719", HELD)}, sentinel=(HELD,))
    verification = judged(died)
    [verdict] = verification.verdicts
    assert verdict.outcome == "failed"
    assert (
        verdict.patched == f"rank 1: the first step after recovery still fails reading {ROUTER}.expert_bias at "
        "/mc/moe_utils.py:719"
    )
    assert unfixed_globals(verification) == ()
    assert SUSPECT.names(HELD) and not SUSPECT.names(f"{ROUTER}.TopKRouter.local_tokens_per_expert")
    assert not SUSPECT.names(f"{ROUTER}.a.TopKRouter.expert_bias")  # one class, not a module below
