"""Replay results cross process boundaries as JSON, and `verify` judges from their typed fields.

No process group here: the results are written by hand the way ranks write them, so each verdict
rule is checked alone. tests/replay/test_verify.py replays the same situations on real ranks.
"""

from __future__ import annotations

from dataclasses import replace

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.replay.launch import ReplayStopped
from unsafe_doctor.replay.plan import AdaptorCode, Block, ReplayPlan, Target
from unsafe_doctor.replay.results import FixFailure, Milestone, RankResult, RunResult, StepOutcome
from unsafe_doctor.replay.verify import _stopped, judge_replay

TARGET = Target("generic.replica-copy:toytrain.state._EMA", GlobalName("toytrain.state", None, "_EMA"), 2, "generic.replica-copy")
FUNCTIONS = {"rollback": "feature_rollback", "send": "send_rank_repair", "recv": "recv_rank_repair"}
UNSAFE = "There is unsafe data in the input tensor."
TIMEOUT = FixFailure(
    "recv", "recv_rank_repair", "RuntimeError: [/gloo/pair.cc:534] Timed out waiting 3000ms", "/job/recovery.py:40", "timeout"
)


def plan(ranks: int = 2) -> ReplayPlan:
    block = Block(TARGET.key, "recv", "recv_rank_repair", "/job/recovery.py", 40, "pass\n", (), None)
    code = AdaptorCode("/job/recovery.py", "recovery", "", "", tuple(FUNCTIONS.values()))
    return ReplayPlan((TARGET,), (block,), (code,), FUNCTIONS, {}, (), "adaptor", ranks, 1, 0, (), timeout=3.0)


def run(**fields) -> RunResult:
    defaults = dict(
        built={TARGET.key: "built"},
        resume={TARGET.key: StepOutcome()},
        equal={TARGET.key: True},
        seconds={"build": 0.5, "repair": 0.25},
    )
    return RunResult(**{**defaults, **fields})


def red(**fields) -> RunResult:
    return run(resume={TARGET.key: StepOutcome(UNSAFE, "/job/train.py:62")}, **fields)


def test_a_rank_result_survives_json_with_every_field_typed():
    failure = FixFailure("rollback", "feature_rollback", f"RuntimeError: {UNSAFE}", None, "unsafe-data")
    result = RankResult(
        1,
        "emulated",
        red(alone={"recv_rank_repair": "why"}),
        run(fix_failures=(failure,), unsafe_left={TARGET.key: 2}, unmatched=("a mismatch",)),
        ("a note",),
    )
    again = RankResult.from_json(result.to_json())
    assert again == result
    assert isinstance(again.patched.fix_failures[0], FixFailure)
    assert isinstance(again.unpatched.resume[TARGET.key], StepOutcome)


def test_milestones_survive_json_and_read_as_the_progress_lines_reports_quote():
    entered = Milestone("patched", "repair", "recv_rank_repair")
    failed = Milestone("patched", "repair", "recv_rank_repair", TIMEOUT)
    assert [Milestone.from_json(m.to_json()) for m in (entered, failed)] == [entered, failed]
    assert str(entered) == "patched repair recv_rank_repair()"
    assert str(Milestone("unpatched", "build")) == "unpatched build"
    assert str(failed) == "patched recv recv_rank_repair() raised RuntimeError: [/gloo/pair.cc:534] Timed out waiting 3000ms"


def test_a_clean_patched_run_is_proven_and_phase_times_are_the_slowest_ranks():
    results = [RankResult(0, "emulated", run(), run(seconds={"build": 2.0})), RankResult(1, "emulated", red(), run())]
    verification = judge_replay(plan(), (), results, "gloo", 1.0)
    [verdict] = verification.verdicts
    assert (verdict.outcome, verdict.patched) == ("proven", "recovery clean, tensor bit-identical to replica rank 0")
    assert verdict.unpatched == f"reproduced `{UNSAFE}` on rank 1 at /job/train.py:62"
    assert verification.phase_seconds["patched build"] == 2.0


def test_a_function_whose_own_code_could_not_run_makes_the_verdict_block_proven_with_why():
    alone = {"recv_rank_repair": "AttributeError: 'NoneType' object has no attribute 'to' at /job/recovery.py:38"}
    results = [RankResult(0, "emulated", run(), run()), RankResult(1, "emulated", red(alone=alone), run(alone=alone))]
    verification = judge_replay(plan(), (), results, "gloo", 1.0)
    [verdict] = verification.verdicts
    assert (verdict.outcome, verification.exit_code) == ("block-proven", 0)
    assert verification.proved == (
        "ran the patched adaptor's own send_rank_repair(), feature_rollback() and the fix blocks alone in "
        "recv_rank_repair() (their own code cannot run here: AttributeError: 'NoneType' object has no attribute 'to' "
        "at /job/recovery.py:38); no stand-ins; emulated backend (CPU, gloo)"
    )


def test_the_proof_of_an_adaptor_with_no_fix_block_does_not_call_it_patched():
    """NO-FIX's proof line once said "the patched adaptor's own" where nothing was patched."""
    unfixed = replace(plan(), blocks=())
    results = [RankResult(0, "emulated", run(), run()), RankResult(1, "emulated", red(), red())]
    verification = judge_replay(unfixed, (), results, "gloo", 1.0)
    assert verification.verdicts[0].outcome == "no-fix"
    assert verification.proved == (
        "ran the adaptor's own recv_rank_repair(), send_rank_repair(), feature_rollback() "
        "(it holds no fix block: nothing was patched); no stand-ins; emulated backend (CPU, gloo)"
    )


def test_transfers_whose_sides_differ_fail_the_fix():
    unmatched = (
        "rank 0 sends 2 tensor(s) to rank 1, which receives 1: one transfer per (source, destination) pair "
        "on both sides (dict.fromkeys(zip(src_ranks, dest_ranks)))",
    )
    results = [RankResult(0, "emulated", run(), run()), RankResult(1, "emulated", red(), run(unmatched=unmatched))]
    [verdict] = judge_replay(plan(), (), results, "gloo", 1.0).verdicts
    assert (verdict.outcome, verdict.problems) == ("failed", unmatched)


def test_a_timed_out_transfer_names_the_side_that_waited():
    results = [RankResult(0, "emulated", run(), run()), RankResult(1, "emulated", red(), run(fix_failures=(TIMEOUT,)))]
    [verdict] = judge_replay(plan(), (), results, "gloo", 1.0).verdicts
    assert verdict.outcome == "failed"
    assert verdict.patched.startswith("a repair transfer waited 3 s in vain: recv_rank_repair() on rank 1 waits for a tensor")


def test_a_receive_function_that_sends_to_itself_is_reported_as_swapped():
    swapped = FixFailure("recv", "recv_rank_repair", "ValueError: Invalid destination rank", None, "send-to-self")
    results = [RankResult(0, "emulated", run(), run()), RankResult(1, "emulated", red(), run(fix_failures=(swapped,)))]
    [verdict] = judge_replay(plan(), (), results, "gloo", 1.0).verdicts
    assert "the receive function recv_rank_repair() sends: send and receive are swapped" in verdict.problems


def test_an_error_text_alone_is_not_a_timeout():
    """The kind decides, not words in the message: a failure of kind "other" that mentions a timeout."""
    other = FixFailure("recv", "recv_rank_repair", "RuntimeError: the user timed out", None, "other")
    results = [RankResult(0, "emulated", run(), run()), RankResult(1, "emulated", red(), run(fix_failures=(other,)))]
    [verdict] = judge_replay(plan(), (), results, "gloo", 1.0).verdicts
    assert not any("waited" in problem for problem in verdict.problems)


def test_a_stopped_replay_says_where_each_rank_was_and_which_side_waited():
    histories = {
        0: (
            Milestone("patched", "build"),
            Milestone("patched", "repair", "send_rank_repair"),
            Milestone("patched", "rollback", "feature_rollback"),
        ),
        1: (Milestone("patched", "build"), Milestone("patched", "repair", "recv_rank_repair")),
    }
    stopped = ReplayStopped("timeout", 9.0, histories, "")
    [verdict] = _stopped(plan(), (), stopped, "emulated", 9.0).verdicts
    assert verdict.patched == (
        "the replay stopped at the 3 s timeout (rank 0: patched rollback feature_rollback(); "
        "rank 1: patched repair recv_rank_repair()); likely cause: recv_rank_repair() on rank 1 waits for a tensor "
        "that send_rank_repair() on rank 0 never sends (a receive without its send, or send and receive swapped)"
    )
    assert stopped.place(5) == "not started"
