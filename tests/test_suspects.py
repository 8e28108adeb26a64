"""Errors MindIO logged without a traceback: the arguments dump, the generation, and the ranked suspects.

The logs here are written in the real formats (Megatron-LM's `_print_args` frame, MindSpeed-LLM's
dump title, MindIO's catch lines of v7.3.x and v26, the adaptors' own messages); the corpus in
tests/corpus/ holds the same from real torchrun runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from terminal import at_terminal

from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.log import inputs, reading
from unsafe_doctor.log.arguments import DUMP_MARKERS, read_arguments
from unsafe_doctor.log.lines import split_lines
from unsafe_doctor.report.diagnosis import to_json

ROOT = Path(__file__).parents[1]
IN_TREE = ROOT / "samples" / "adaptors" / "in_tree"
CATCH_V73 = "rank:3 catch OTHER exception, ex instance:There is unsafe data in the input tensor."
CATCH_V26 = "rank:3 catch OTHER exception, error_code:， ex instance:There is unsafe data in the input tensor."
PTA_ERROR = "[ERROR] 2026-02-03-10:11:12 (PID:991527, Device:3, RankID:3) ERR00003 PTA invalid value"
IN_TREE_LINES = [  # MindSpeed-LLM's in-tree adaptor (2.3 and 26), through Python logging
    "[repair] rank 3, repair type:2, src ranks:[11], dst ranks:[3], rank list:[3, 11], optim idxs:[0], step:1200",
    "[rollback] rank 3 rollback total time consumed:1.250s, feature rollback:0.010s",
]
TASKD_LINES = [  # mind-cluster taskd's elastic callbacks, through MindIO's logger
    "2025-09-08 11:34:00.400331 info 1900637 [77840][PYH repair_callback.py:43] repair strategy params: {}, step: 1200",
    "2025-09-08 11:34:01.400331 info 1900637 [77840][PYH rollback_callback.py:23] rollback strategy params: {}, step: 1200",
]
MOE = {
    "num_experts": "8",
    "moe_router_enable_expert_bias": "True",
    "mtp_num_layers": "None",
    "sequence_parallel": "True",
    "position_embedding_type": "learned_absolute",
    "bf16": "False",
    "fp16": "False",
    "use_flash_attn": "False",
}
DENSE = {**MOE, "num_experts": "None", "moe_router_enable_expert_bias": "False"}


def dump(values: dict[str, str], title: str = "arguments") -> list[str]:
    """Megatron-LM's `_print_args` frame: name, dots to column 48, value; sorted; rank 0 only."""
    lines = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in values.items()]
    return [
        f"------------------------ {title} ------------------------",
        *sorted(lines, key=str.lower),
        f"-------------------- end of {title} ---------------------",
    ]


def lines_of(text: str, source: str = "train.log", start: int = 0):
    return split_lines(text, source=source, base_offset=start, rank_hint=None)


def write_log(tmp_path: Path, *parts: list[str], name: str = "train.log") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(line for part in parts for line in part) + "\n")
    return path


def shortlist_of(log: Path, **options):
    diagnosis = diagnose([str(log)], groundwork(**options))
    assert diagnosis.untraced is not None
    return diagnosis, diagnosis.untraced.shortlist


def test_megatron_arguments_dump_is_read_with_rank_prefixes_and_other_ranks_between():
    prefixed = [f"[rank0]: {line}" for line in dump(MOE)]
    text = "\n".join([*prefixed[:3], "[rank1]: iteration 5 | loss 2.0", *prefixed[3:]])
    arguments = read_arguments(lines_of(text))
    assert arguments is not None and arguments.title == "arguments"
    assert arguments.values == MOE


def test_mindspeed_llm_dump_is_read_by_its_title():
    arguments = read_arguments(lines_of("\n".join(dump(DENSE, "MindSpeed-LLM Arguments"))))
    assert arguments is not None and arguments.title == "MindSpeed-LLM Arguments" and arguments.get("num_experts") == "None"


def test_a_dump_cut_before_its_end_line_is_not_read():
    assert read_arguments(lines_of("\n".join(dump(MOE)[:-1]))) is None


def test_the_dump_is_kept_however_far_from_the_error_it_stands(tmp_path):
    """The dump comes at start-up, the error hours later: past the span searched for recovery lines."""
    filler = ["iteration 1 | lm loss: 2.0 | loss scale: 1.0 |" + " " * 60] * ((reading.CONTEXT_SPAN // 100) + 1000)
    log = write_log(tmp_path, dump(MOE), filler, [CATCH_V26, PTA_ERROR])
    scan = inputs.scan([str(log)], (), dump_markers=DUMP_MARKERS)
    arguments = read_arguments(line for excerpt in scan.dumps for line in lines_of(excerpt.text, excerpt.source, excerpt.start))
    assert arguments is not None and arguments.values == MOE


def test_moe_job_on_the_26_adaptor_suspects_the_router_buffers_and_not_what_the_adaptor_resets(tmp_path):
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    diagnosis, shortlist = shortlist_of(log)
    rules = [suspect.rule.id for suspect in shortlist.suspects]
    assert diagnosis.mindio == "v26" and diagnosis.untraced_ranks == (3,)
    assert shortlist.generation is not None and shortlist.generation.id == "mindspeed-llm-26"
    assert rules[:2] == ["megatron.router-expert-bias", "megatron.router-local-tokens-per-expert"]
    excluded = {item.rule: item.why for item in shortlist.excluded}
    assert "already reset" in excluded["megatron.global-memory-buffer"]  # sequence parallel is on, but 26 rebuilds it
    assert "position_embedding_type" in excluded["megatron.rotary-inv-freq"]  # learned positions: no rotary buffer
    assert shortlist.suspects[0].why[:2] == ("moe_router_enable_expert_bias = True", "num_experts = 8")


def test_a_generation_that_rebuilds_the_model_never_suspects_its_buffers(tmp_path):
    log = write_log(tmp_path, dump(MOE), TASKD_LINES, [CATCH_V73, PTA_ERROR])
    diagnosis, shortlist = shortlist_of(log)
    rules = {suspect.rule.id for suspect in shortlist.suspects}
    assert diagnosis.context.environment.profile.id == "taskd-elastic"
    assert diagnosis.context.environment.profile_from == "log"
    assert not rules & {"megatron.router-expert-bias", "megatron.router-local-tokens-per-expert"}
    assert any("layer-wise-tracker" in rule for rule in rules)  # module-level trackers survive every generation


def test_dense_job_names_no_framework_suspect_and_says_what_finds_the_tensor(tmp_path):
    log = write_log(tmp_path, dump(DENSE), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log)
    assert shortlist.suspects == ()
    result = run_cli("diagnose", str(log), "--no-input")
    assert "No framework global fits" in result.stdout
    assert "sentinel install" in result.stderr


def test_without_a_dump_every_possible_global_is_a_low_confidence_suspect(tmp_path):
    log = write_log(tmp_path, IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log)
    assert shortlist.arguments is None
    assert len(shortlist.suspects) > 3 and {suspect.confidence for suspect in shortlist.suspects} == {"low"}
    assert all(any("no arguments dump" in why for why in suspect.why) for suspect in shortlist.suspects)


def test_release_unknown_makes_one_suspect_of_a_global_renamed_across_releases(tmp_path):
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log, log_only=True)  # no installed metadata: the release is unknown
    trackers = [suspect for suspect in shortlist.suspects if "tracker" in suspect.rule.id]
    assert len(trackers) == 1
    assert "megatron.moe-layer-wise-tracker" in {trackers[0].rule.id, *trackers[0].alternatives}
    assert trackers[0].confidence != "high"


def test_first_suspect_alone_may_be_high_and_those_after_the_third_are_low(tmp_path):
    log = write_log(tmp_path, dump({**MOE, "bf16": "True", "position_embedding_type": "rope"}), IN_TREE_LINES, [CATCH_V26])
    _, shortlist = shortlist_of(log)
    confidences = [suspect.confidence for suspect in shortlist.suspects]
    assert confidences[0] == "high" and "high" not in confidences[1:]
    assert set(confidences[3:]) == {"low"}


@pytest.mark.parametrize("catch, release", [(CATCH_V73, "v7.3.0 to v7.3.2"), (CATCH_V26, "v26.0.0 or later")])
def test_untraced_release_is_named_and_no_search_for_a_traceback_is_advised(tmp_path, catch, release):
    log = write_log(tmp_path, dump(MOE), [catch, PTA_ERROR])
    result = run_cli("diagnose", str(log), "--no-input")
    text = " ".join(result.stdout.split())
    assert release in text and "no log of this run holds its traceback" in text
    assert "stderr or per-rank log" not in text
    assert result.returncode == 1


def test_json_gives_the_untraced_ranks_one_finding_with_its_suspects(tmp_path):
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    report = to_json(diagnose([str(log)], groundwork()))
    (finding,) = report["findings"]
    assert finding["found_by"] == ["mindio-catch"] and finding["tensor"] is None and finding["ranks"] == [3]
    first = finding["suspects"][0]
    assert set(first) == {"variable", "module", "owner", "rule", "scenario", "why", "confidence", "alternatives", "fix"}
    assert (first["variable"], first["rule"], first["scenario"]) == ("expert_bias", "megatron.router-expert-bias", 2)
    assert report["summary"]["mindio"] == {"form": "v26", "release": "mind-cluster v26.0.0 or later", "logs_traceback": False}
    assert report["summary"]["arguments_dump"] == "arguments"
    assert report["summary"]["adaptor"]["profile_from"] == "log"


def test_fix_writes_only_the_chosen_suspect(tmp_path):
    tree = shutil.copytree(IN_TREE, tmp_path / "tree")
    adaptor = tree / "mindspeed_llm" / "core" / "high_availability" / "tft_optimizer_data_repair.py"
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    before = adaptor.read_text()
    nothing = run_cli("fix", str(log), "--adaptor", str(adaptor), "--yes")
    assert adaptor.read_text() == before and "--suspect N" in nothing.stderr
    chosen = run_cli("fix", str(log), "--adaptor", str(adaptor), "--suspect", "1", "--yes")
    assert chosen.returncode == 0, chosen.stderr
    written = adaptor.read_text()
    assert "# unsafe-doctor: begin megatron.router-expert-bias" in written
    assert "local_tokens_per_expert" not in written


def test_a_suspect_number_outside_the_shortlist_is_refused_in_one_line(tmp_path):
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    result = run_cli("fix", str(log), "--adaptor", str(tmp_path / "missing.py"), "--suspect", "99")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_suspect_on_a_log_with_no_untraced_error_is_refused(tmp_path):
    log = ROOT / "samples" / "logs" / "megatron_moe_tracker.log"
    result = run_cli("fix", str(log), "--suspect", "1", "--dry-run")
    assert result.returncode == 2 and "no shortlist" in result.stderr


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "unsafe_doctor", *args], capture_output=True, text=True, timeout=300)
    if "--format" in args and "json" in args:
        json.loads(result.stdout)
    return result


def test_at_a_terminal_the_untraced_report_offers_a_suspects_fix_then_the_sentinel(tmp_path):
    """Issue 36: the report of an error without a traceback asked nothing at a terminal, where a traced one offers its fix."""
    tree = shutil.copytree(IN_TREE, tmp_path / "tree")
    adaptor = tree / "mindspeed_llm" / "core" / "high_availability" / "tft_optimizer_data_repair.py"
    rollback = adaptor.parent / "tft_rollback.py"
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    answers = [(b"Which suspect's fix to write? [1-", b"1\n"), (b"? [y/N]: ", b"y\n"),
               (b"at the next fault)? [y/N]: ", b"y\n")]
    code, screen = at_terminal([str(log), "--adaptor", str(adaptor)], answers=answers, columns=400)
    shown = " ".join(screen.split())
    assert f"Apply suspect 1's scenario-2 fix to {adaptor}::recv_rank_repair and {adaptor}::send_rank_repair? [y/N]: y" in shown
    assert f"Install the sentinel into {rollback} (it names the exact tensor at the next fault)? [y/N]: y" in shown
    assert "# unsafe-doctor: begin megatron.router-expert-bias" in adaptor.read_text()
    assert "# unsafe-doctor: begin unsafe_doctor.sentinel" in rollback.read_text()
    assert code == 1  # a suspect's fix is a guess until a fault proves it


def test_without_a_terminal_the_untraced_report_writes_nothing_and_says_the_commands(tmp_path):
    tree = shutil.copytree(IN_TREE, tmp_path / "tree")
    adaptor = tree / "mindspeed_llm" / "core" / "high_availability" / "tft_optimizer_data_repair.py"
    before = {path: path.read_bytes() for path in adaptor.parent.glob("*.py")}
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    result = run_cli(str(log), "--adaptor", str(adaptor), "--yes")  # --yes picks no suspect: the person does
    assert result.returncode == 1
    assert f"to write suspect 1's fix: unsafe-doctor fix {log} --adaptor {adaptor} --suspect 1" in result.stderr
    install = f"unsafe-doctor sentinel install --adaptor {adaptor} --yes"
    assert f"to name the exact tensor at the next fault: {install}" in result.stderr
    assert {path: path.read_bytes() for path in adaptor.parent.glob("*.py")} == before
