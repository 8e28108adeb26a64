"""The suspects' model (docs/diagnose.md#how-suspects-are-ranked), step by step, on logs in the real formats.

Step 1 weighs every adaptor generation the job may have run; step 2 reads from the log what the
fault marked unsafe; step 3 ranks by the device memory a global holds after a UCE that marked only
the blocks it hit, by the step's first read otherwise, and keeps the run's own globals in the first
three; step 4 says "high" only of a lone survivor of a fault that marked every tensor.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import helpers
import pytest
from test_suspects import CATCH_V26, DENSE, IN_TREE_LINES, MOE, PTA_ERROR, dump, lines_of, shortlist_of, write_log

from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.log.recovery import read_fault, read_recovery

LOGS = Path(__file__).parents[1] / "corpus" / "logs"
# MindSpeed-LLM's clean callback (its logger, through Python logging) and MindIO's decorator.
CLEAN = "2026-12-02 16:50:42,269 - mindspeed_llm.core.high_availability.tft_stop_clean - INFO - "
DECORATOR = "2026-07-30 10:00:00.000001 warn 4242 [12345][PYH ttp_decorator.py:938] "
PERSISTENT_UCE = CLEAN + "rank 3 check uce memory result: 3"
TEMPORARY_UCE = CLEAN + "rank 3 check uce memory result: 2"
HBM_ECC = DECORATOR + (
    "rank:3 catch HBM MULTI BIT ECC can repair exception, error_code:， ex instance:NPU function "
    "error: HBM MULTI BIT ECC ERROR.time is 1796230240952318"
)
UCE_ONLY = DECORATOR + "rank:3 catch UCE ERROR exception, ex instance:UCE ERROR, "
LINK = DECORATOR + "rank:3 catch UB LINK ERROR exception, error_code:， ex instance:UB LINK ERROR"
RETRY = DECORATOR + "rank:3 catch HCCL OP RETRY FAILED exception, error_code:， ex instance:x"
REMOTE = DECORATOR + "rank:3 catch SUSPECT REMOTE ERROR exception, error_code:， ex instance:x"
OTHER_RANK_TEMPORARY = CLEAN + "rank 2 check uce memory result: 2"
PRECISION = DECORATOR + "rank:3 catch PRECISION ERROR exception, error_code:， ex instance:x"
# torch_npu 26.1's `torch_npu.recovery` logger (its field layout inferred from the API: docs/diagnose.md says so)
RESTART_ALL = (
    "2026-07-30 10:00:01,000 - torch_npu.recovery - INFO - restart device start, device_id=3, "
    "rebuild_all_resources=True, disable_tensor_unsafe_check=False"
)
RESTART_UNCHECKED = RESTART_ALL.replace("disable_tensor_unsafe_check=False", "disable_tensor_unsafe_check=True")
RESTART_KEEP = RESTART_ALL.replace("rebuild_all_resources=True", "rebuild_all_resources=False")
# MindSpeed-LLM 2.3's receive summary: 26's has no `build repair group:` time (knowledge_base/adaptor_messages.json)
LLM_23 = (
    "[repair] rank 3 recv total time consumed:0.120s, build repair group:0.001s, rebuild:0.000s, recv ckpt:0.099s, "
    "load ckpt:0.010s, recv optim:0.009s, recv log args:0.001s."
)
# A MindSpeed-LLM MoE run with flash attention and rotary embeddings, in the sizes of a real model
BIG_MOE = {
    **MOE,
    "use_flash_attn": "True",
    "position_embedding_type": "rope",
    "bf16": "True",
    "seq_length": "4096",
    "kv_channels": "128",
    "num_layers": "4",
    "rotary_percent": "1.0",
    "micro_batch_size": "1",
    "hidden_size": "4096",
}


def fault_of(*lines: str):
    return read_fault(read_recovery(lines_of("\n".join(lines))))


@pytest.mark.parametrize(
    "lines, marking, evidence, rank",
    [
        ([UCE_ONLY, PERSISTENT_UCE], "partial", "check uce memory result: 3", 3),
        ([HBM_ECC], "partial", "HBM MULTI BIT ECC", 3),
        ([UCE_ONLY, TEMPORARY_UCE], "none-marked", "check uce memory result: 2", 3),
        ([LINK], "none-marked", "UB LINK ERROR", 3),
        ([RETRY], "none-marked", "HCCL OP RETRY FAILED", 3),
        ([PRECISION], "none-marked", "PRECISION ERROR", 3),
        ([REMOTE], "none-marked", "SUSPECT REMOTE ERROR", 3),
        ([UCE_ONLY, OTHER_RANK_TEMPORARY], "unknown", "UCE ERROR", 3),  # rank 2's check says nothing of rank 3's UCE
        ([PERSISTENT_UCE, RESTART_ALL], "all-marked", RESTART_ALL.split(" - INFO - ")[1], None),  # the line names a device
        ([LINK, PERSISTENT_UCE], "partial", "check uce memory result: 3", 3),  # the fault that marks wins
        ([UCE_ONLY], "unknown", "UCE ERROR", 3),  # which memory it hit is not in the log
        ([UCE_ONLY, LINK], "unknown", "UCE ERROR", 3),  # a UCE not checked may have hit persistent memory
        ([RESTART_UNCHECKED], "unknown", None, None),  # rebuilt, but the check was turned off: nothing marked by it
        ([RESTART_KEEP], "unknown", None, None),
        ([], "unknown", None, None),
    ],
)
def test_the_log_tells_what_the_fault_marked_unsafe(lines, marking, evidence, rank):
    fault = fault_of(*lines)
    assert (fault.marking, fault.evidence, fault.rank) == (marking, evidence, rank)


def test_a_reset_rules_a_global_out_only_when_every_generation_the_job_may_have_run_does_it(tmp_path):
    """No adaptor line: every generation is possible. All of them rebuild the memory buffer; 26 keeps the router's bias."""
    log = write_log(tmp_path, dump(MOE), [HBM_ECC, CATCH_V26, PTA_ERROR])
    diagnosis, shortlist = shortlist_of(log)
    assert diagnosis.context.environment.generation is None
    assert len(shortlist.generations) == 4
    excluded = {item.rule: item.why for item in shortlist.excluded}
    assert excluded["megatron.global-memory-buffer"].startswith(
        "the mindio-ttp-legacy or mindspeed-llm-2.3 or mindspeed-llm-26 or taskd-elastic adaptor's rollback and repair"
    )
    bias = next(suspect for suspect in shortlist.suspects if suspect.rule.id == "megatron.router-expert-bias")
    assert (
        "adaptor generation not shown by the log: not reset by the mindspeed-llm-26 adaptor, which the job may have "
        "run (generations considered: mindio-ttp-legacy, mindspeed-llm-2.3, mindspeed-llm-26, taskd-elastic)"
    ) in bias.why


def test_a_tie_in_the_logs_evidence_weighs_every_tied_generation_and_its_releases(tmp_path):
    """The in-tree adaptor's lines fit 2.3 and 26 alike: 26 keeps the router's buffers."""
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [PERSISTENT_UCE, CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log)
    assert [profile.id for profile in shortlist.generations] == ["mindspeed-llm-2.3", "mindspeed-llm-26"]
    bias = next(suspect for suspect in shortlist.suspects if suspect.rule.id == "megatron.router-expert-bias")
    assert (
        "not reset by the mindspeed-llm-26 adaptor, which the job may have run (generations considered: "
        "mindspeed-llm-2.3, mindspeed-llm-26)" in bias.why
    )
    tracker = next(suspect for suspect in shortlist.suspects if "layer-wise-tracker" in suspect.rule.id)
    assert "not reset by any generation the job may have run (mindspeed-llm-2.3, mindspeed-llm-26)" in tracker.why
    assert "megatron-core 0.12.1 (the release the mindspeed-llm-26 adaptor runs with)" in bias.why  # 2.3's too


def test_tied_generations_that_run_with_other_releases_bring_them_all():
    """A tie between the legacy wheel (core 0.6 to 0.12.1) and 2.3 (0.12.1): the releases of both count."""
    from packaging.version import Version

    from unsafe_doctor.knowledge.loading import load_knowledge
    from unsafe_doctor.knowledge.versions import Environment

    profiles = {profile.id: profile for profile in load_knowledge().profiles}
    tied = (profiles["mindio-ttp-legacy"], profiles["mindspeed-llm-2.3"])
    environment = Environment(
        {"megatron-core": Version("0.16.1")}, {"megatron-core": "installed"}, (), tied[1], None, "log", possible=tied
    )
    releases, origin = environment.job_releases()["megatron-core"]
    assert releases == tuple(map(Version, ("0.6.0", "0.7.0", "0.8.0", "0.12.1")))
    assert origin == "the releases the mindio-ttp-legacy or mindspeed-llm-2.3 adaptors run with"


def test_after_a_partial_uce_the_largest_global_leads_and_the_runs_own_stay_in_the_first_three(tmp_path):
    log = write_log(tmp_path, dump(BIG_MOE, "MindSpeed-LLM Arguments"), IN_TREE_LINES, [PERSISTENT_UCE, CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log)
    rules = [suspect.rule.id for suspect in shortlist.suspects]
    assert rules[:3] == ["mindspeed.global-attn-mask", "megatron.router-expert-bias", "megatron.router-local-tokens-per-expert"]
    # the generic globals come back after them, larger first
    generic = ["megatron.rotary-emb-cache", "megatron.rotary-inv-freq", "megatron.optimizer-scale-one"]
    assert sorted(generic, key=rules.index) == generic
    mask = shortlist.suspects[0]
    assert "holds about 4.0 MiB of device memory (2048 * 2048)" in mask.why  # MindSpeed compresses it to 2048 x 2048
    assert {suspect.confidence for suspect in shortlist.suspects[:3]} == {"medium"}


def test_after_a_restart_that_marks_every_tensor_the_first_read_alone_decides(tmp_path):
    log = write_log(tmp_path, dump(BIG_MOE), IN_TREE_LINES, [PERSISTENT_UCE, RESTART_ALL, CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log)
    assert shortlist.fault.marking == "all-marked"
    rules = [suspect.rule.id for suspect in shortlist.suspects]
    assert rules[:3] == ["megatron.rotary-emb-cache", "megatron.router-expert-bias", "megatron.router-local-tokens-per-expert"]
    assert rules.index("megatron.rotary-inv-freq") < rules.index("mindspeed.global-attn-mask")  # embedding before attention
    assert not any("device memory" in why for suspect in shortlist.suspects for why in suspect.why)


def test_a_size_the_dump_does_not_give_is_said_not_guessed(tmp_path):
    values = {name: value for name, value in BIG_MOE.items() if name != "seq_length"}
    log = write_log(tmp_path, dump(values), IN_TREE_LINES, [PERSISTENT_UCE, CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log)
    cache = next(suspect for suspect in shortlist.suspects if suspect.rule.id == "megatron.rotary-emb-cache")
    assert (
        "device memory it holds not known (seq_length * kv_channels * rotary_percent * 4 not in the dump): ranked "
        "after those whose size is known"
    ) in cache.why
    rules = [suspect.rule.id for suspect in shortlist.suspects]
    assert rules.index("megatron.rotary-inv-freq") < rules.index("megatron.rotary-emb-cache")


def test_an_error_after_a_fault_that_marks_nothing_points_elsewhere(tmp_path):
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [LINK, CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log)
    assert shortlist.fault.marking == "none-marked"
    assert shortlist.suspects and {suspect.confidence for suspect in shortlist.suspects} == {"low"}
    text = run_cli("diagnose", str(log), "--no-input")
    assert (
        "The fault before the error marks no memory unsafe (rank 3: UB LINK ERROR): the unsafe data points elsewhere "
        "(an earlier fault, or not this recovery), so no suspect is what this fault left."
    ) in text.stdout
    report = json.loads(run_cli("diagnose", str(log), "--format", "json").stdout)
    [finding] = report["findings"]
    assert any("points elsewhere" in note for note in finding["notes"])


def test_a_fault_whose_memory_check_the_log_lacks_is_said_and_ranks_by_first_read(tmp_path):
    log = write_log(tmp_path, dump(BIG_MOE), IN_TREE_LINES, [UCE_ONLY, CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log)
    assert shortlist.fault.marking == "unknown"
    assert shortlist.suspects[0].rule.id == "megatron.rotary-emb-cache"  # embedding: read first
    result = run_cli("diagnose", str(log), "--no-input")
    assert (
        "The log does not show what the fault (rank 3: UCE ERROR) marked unsafe (no memory check result, no restart "
        "line): the suspects are ranked by where the step first reads them."
    ) in result.stdout


def test_only_a_lone_survivor_of_a_fault_that_marked_every_tensor_is_high(tmp_path):
    mtp = {**DENSE, "mtp_num_layers": "1", "sequence_parallel": "False", "create_attention_mask_in_dataloader": "True"}
    everything = write_log(tmp_path, dump(mtp), [LLM_23, PERSISTENT_UCE, RESTART_ALL, CATCH_V26, PTA_ERROR], name="restart.log")
    _, shortlist = shortlist_of(everything)
    assert [(suspect.rule.id, suspect.confidence) for suspect in shortlist.suspects] == [("megatron.mtp-loss-tracker", "high")]
    some_blocks = write_log(tmp_path, dump(mtp), [LLM_23, PERSISTENT_UCE, CATCH_V26, PTA_ERROR], name="uce.log")
    _, shortlist = shortlist_of(some_blocks)
    assert [(suspect.rule.id, suspect.confidence) for suspect in shortlist.suspects] == [("megatron.mtp-loss-tracker", "medium")]


def test_a_lone_survivor_that_most_runs_of_the_stack_have_is_never_high(tmp_path):
    """Every MindSpeed-LLM run with flash attention has the mask: a run whose state is in its own code has it too."""
    dense_flash = {**DENSE, "use_flash_attn": "True", "seq_length": "4096"}
    everything = write_log(tmp_path, dump(dense_flash), [LLM_23, PERSISTENT_UCE, RESTART_ALL, CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(everything)
    assert [(suspect.rule.id, suspect.confidence) for suspect in shortlist.suspects] == [("mindspeed.global-attn-mask", "medium")]


@pytest.mark.parametrize(
    "name", ["untraced-v26-mindspeed-llm-2.3-packer-flash-attn.log", "untraced-v26-mindspeed-llm-2.3-flash-attention-mask.log"]
)
def test_the_flash_attention_mask_never_leads_at_high_after_a_partial_uce(name):
    """Every MindSpeed-LLM run builds the mask: a UCE that hit some blocks cannot prove it was the mask's,
    and the first of these runs keeps its state in its own code (tests/corpus/labels.yaml)."""
    diagnosis = diagnose([str(LOGS / name)], groundwork(log_only=True))
    assert diagnosis.untraced is not None
    shortlist = diagnosis.untraced.shortlist
    assert shortlist.fault.marking == "partial"
    assert [(suspect.rule.id, suspect.confidence) for suspect in shortlist.suspects] == [("mindspeed.global-attn-mask", "medium")]


def test_several_suspects_say_what_tells_them_apart(tmp_path):
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [PERSISTENT_UCE, CATCH_V26, PTA_ERROR])
    result = run_cli("diagnose", str(log), "--no-input")
    assert (
        "suspects survive and the log cannot tell them apart: the sentinel names the one at the next fault "
        "(unsafe-doctor sentinel install)." in result.stdout
    )


def test_a_rule_size_that_is_not_arithmetic_is_refused_in_one_line(tmp_path):
    rules = tmp_path / "acme.yaml"
    rules.write_text(
        textwrap.dedent("""\
        rules:
          - id: acme.mask
            title: Acme mask
            match: {variable: _MASK, module: acme.masks}
            scenario: 1
            phase: rollback
            first_read: attention
            device_bytes: "__import__('os').getpid()"
            fix:
              code: |
                acme.masks._MASK = None
            reason: Built again on first use.
        """)
    )
    log = write_log(tmp_path, dump(MOE), [CATCH_V26, PTA_ERROR])
    result = run_cli("diagnose", str(log), "--rules", str(rules))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"unsafe-doctor: {rules}:2: rule acme.mask: device_bytes \"__import__('os').getpid()\": only + - * /, numbers "
        "and argument names are allowed, not Call"
    ]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI, lines as wide as the longest sentence (the report wraps at the terminal's width)."""
    return helpers.run_cli(*args, env={"COLUMNS": "400"})
