"""Errors MindIO logged without a traceback: the arguments dump, the generation, and the ranked suspects.

The logs here are written in the real formats (Megatron-LM's `_print_args` frame, MindSpeed-LLM's
dump title, MindIO's catch lines of v7.3.x and v26, the adaptors' own messages); the corpus in
tests/corpus/ holds the same from real torchrun runs.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
from rich.console import Console
from rich.text import Text
from terminal import at_terminal

from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.log import inputs, reading
from unsafe_doctor.log.arguments import DUMP_MARKERS, read_arguments
from unsafe_doctor.log.lines import split_lines
from unsafe_doctor.report.diagnosis import diagnosis_json
from unsafe_doctor.report.terminal import Hanging

ROOT = Path(__file__).parents[2]
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


def test_moe_job_on_the_in_tree_adaptor_suspects_the_router_buffers_and_not_what_both_generations_reset(tmp_path):
    """The in-tree lines are logged by 2.3 and 26 alike: a tie, and 26 leaves the router's buffers unsafe."""
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    diagnosis, shortlist = shortlist_of(log)
    rules = [suspect.rule.id for suspect in shortlist.suspects]
    assert diagnosis.mindio == "v26" and diagnosis.untraced_ranks == (3,)
    assert shortlist.generation is None
    assert [profile.id for profile in shortlist.generations] == ["mindspeed-llm-2.3", "mindspeed-llm-26"]
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


def test_several_suspects_are_medium_up_to_the_third_and_low_after(tmp_path):
    """Confidence "high" is for a lone survivor (tests/diagnose/test_suspects_model.py); several are never."""
    log = write_log(tmp_path, dump({**MOE, "bf16": "True", "position_embedding_type": "rope"}), IN_TREE_LINES, [CATCH_V26])
    _, shortlist = shortlist_of(log)
    confidences = [suspect.confidence for suspect in shortlist.suspects]
    assert len(confidences) > 3
    assert set(confidences[:3]) == {"medium"} and set(confidences[3:]) == {"low"}


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
    report = diagnosis_json(diagnose([str(log)], groundwork()))
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
    result = helpers.run_cli(*args)
    if "--format" in args and "json" in args:
        json.loads(result.stdout)
    return result


def test_at_a_terminal_the_untraced_report_offers_a_suspects_fix_then_the_sentinel(tmp_path):
    """The report of an error without a traceback once asked nothing at a terminal, where a traced one offers its fix."""
    tree = shutil.copytree(IN_TREE, tmp_path / "tree")
    adaptor = tree / "mindspeed_llm" / "core" / "high_availability" / "tft_optimizer_data_repair.py"
    rollback = adaptor.parent / "tft_rollback.py"
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    answers = [(b"Which suspect's fix to write? [1-", b"1\n"), (b"? [y/N]: ", b"y\n"), (b"at the next fault)? [y/N]: ", b"y\n")]
    code, screen = at_terminal([str(log), "--adaptor", str(adaptor)], answers=answers, columns=400)
    shown = " ".join(screen.split())
    assert f"Apply suspect 1's scenario-2 fix to {adaptor}::recv_rank_repair and {adaptor}::send_rank_repair? [y/N]: y" in shown
    assert f"Install the sentinel into {rollback} (it names the exact tensor at the next fault)? [y/N]: y" in shown
    assert "the training image needs unsafe-doctor==" in shown  # said before the question, as sentinel install says it
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


def test_a_suspect_with_no_fix_to_write_is_not_offered_a_fix_command():
    """The flash-attention mask's rule names its module only by a pattern: its suspect has no fix, so
    the report's closing lines name the sentinel, not a `fix --suspect 1` that would be refused."""
    log = Path(__file__).parents[1] / "corpus" / "logs" / "untraced-v26-mindspeed-llm-26-flash-attention-mask.log"
    result = run_cli(str(log), "--no-input")
    assert "no fix can be shown" in result.stdout
    assert "--suspect" not in result.stderr and "to name the exact tensor at the next fault" in result.stderr


# --- the suspects as the text report shows them ---------------------------------------------------

CORPUS_LOGS = ROOT / "tests" / "corpus" / "logs"
NO_DUMP = CORPUS_LOGS / "untraced-v26-mindspeed-llm-26-mtp-loss-tracker-no-dump.log"  # 16 suspects, every rule shape
ONE_SUSPECT = CORPUS_LOGS / "untraced-v26-mindspeed-llm-26-mtp-loss-tracker.log"


def report_at(columns: int, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI's text report at a fixed terminal width, as a pipe sees it (no colour)."""
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", "diagnose", *args, "--no-input"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env={"COLUMNS": str(columns), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
    )  # fmt: skip


def suspect_entries(stdout: str) -> list[list[str]]:
    """Each suspect's lines: its numbered header, its why, alternatives and fix, with their wrapped lines."""
    lines = stdout.splitlines()
    heading = next(index for index, line in enumerate(lines) if line.startswith("Suspects, most likely first"))
    start = next(index for index in range(heading, len(lines)) if re.match(r"\s+1\. ", lines[index]))
    entries: list[list[str]] = []
    for line in lines[start:]:
        if re.match(r"\s+\d+\. ", line):
            entries.append([line])
        elif entries and line.startswith(" "):
            entries[-1].append(line)
        else:
            break
    return entries


@pytest.mark.parametrize("log, kind", [(ONE_SUSPECT, "suspects only, no traceback"), (NO_DUMP, "suspects only, no traceback")])
def test_the_summary_counts_the_finding_the_json_lists_and_says_it_has_suspects_only(log, kind):
    text, as_json = report_at(100, str(log)), report_at(100, str(log), "--format", "json")
    assert text.returncode == as_json.returncode == 1
    findings = json.loads(as_json.stdout)["findings"]
    assert len(findings) == 1 and findings[0]["suspects"]
    summary = " ".join(text.stdout.split())
    assert f"1 finding ({kind}) on 1 rank ·" in summary
    assert "0 findings" not in summary


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_each_suspect_is_shown_by_name_then_where_it_lives_once_and_never_as_a_regex(columns):
    entries = suspect_entries(report_at(columns, str(NO_DUMP)).stdout)
    headers = [" ".join(" ".join(entry).split("why:")[0].split()) for entry in entries]
    names = [re.sub(r"^\d+\. ", "", header).split("  scenario ")[0].split(" scenario ")[0] for header in headers]
    assert len(entries) == 15  # AG_SHARED_EXPERTS_INPUTS of moe_utils and moe_common: one suspect
    assert len(set(names)) == len(names), names
    shown = " ".join(headers)
    assert "(INPUT|OUTPUT)" not in shown and "AsyncAll2All_INPUT, AsyncAll2All_OUTPUT in *fb_overlap" in shown
    assert "CACHED_(" not in shown
    # a name first, then its module, as a finding's Tensor row: never module-qualified for some and bare for others
    assert "expert_bias in megatron.core.transformer.moe.router" in shown
    assert "megatron.core.transformer.moe.router.expert_bias" not in shown
    assert "inv_freq in megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding" in shown


def test_a_suspect_with_no_fix_says_in_plain_words_why_and_what_names_it():
    entries = suspect_entries(report_at(120, str(NO_DUMP)).stdout)
    fixes = [" ".join(" ".join(entry).split(" fix: ", 1)[1].split()) for entry in entries]
    unfixed = [fix for fix in fixes if not fix.startswith("in ")]
    assert len(unfixed) == 3
    for fix in unfixed:
        assert "plain Python name" not in fix
        assert "the log does not say which module that is" in fix and "a traceback names it, as the sentinel" in fix
    assert any("the pattern mindspeed.*" in fix for fix in unfixed)


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_a_suspects_wrapped_lines_start_under_the_text_they_continue(columns):
    entries = suspect_entries(report_at(columns, str(NO_DUMP)).stdout)
    wrapped = 0
    for entry in entries:
        header_text = re.match(r"\s+\d+\. ", entry[0]).end()
        label_at = None
        for line in entry[1:]:
            assert len(line) <= columns or len(line.split()) == 1  # a name wider than the room stands whole
            label = re.match(r"(\s+)(why|fix|or, by release or module): ", line)
            if label:
                label_at = label.end()
                continue
            indent = len(line) - len(line.lstrip())
            assert indent == (label_at if label_at is not None else header_text), (entry, line)
            wrapped += label_at is not None
    assert wrapped  # some why or fix line did wrap at this width


def test_a_wrapped_line_counts_terminal_cells_and_keeps_a_name_wider_than_the_room_whole():
    """A wide character takes two cells; a dotted name that cannot fit stands whole on its own line."""
    shown = []
    for text in ("日志日志 模块模块 训练训练 适配器适配器 完成完成", "see megatron.core.transformer.moe.router_gate for it"):
        console = Console(width=30, file=io.StringIO(), color_system=None)
        console.print(Hanging("why: ", Text(text)), crop=False)
        shown.append(console.file.getvalue().splitlines())
    assert shown == [
        ["why: 日志日志 模块模块", "     训练训练 适配器适配器", "     完成完成"],
        ["why: see", "     megatron.core.transformer.moe.router_gate", "     for it"],
    ]


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="the stale check reads an installed megatron-core")
def test_the_stale_resets_and_the_suspects_reason_with_the_same_release():
    """With megatron-core 0.16 installed here and a log of the mindspeed-llm-26 generation
    (which runs on core_r0.12.1), the stale section once cited the installed release and the suspects the
    paired one. Both take `Environment.job_releases`; the stale check reads that release's module."""
    rollback = IN_TREE / "mindspeed_llm" / "core" / "high_availability" / "tft_rollback.py"
    result = run_cli("diagnose", str(ONE_SUSPECT), "--adaptor", str(rollback), "--format", "json")
    report = json.loads(result.stdout)
    (stale,) = report["summary"]["stale_resets"]
    (suspect,) = report["findings"][0]["suspects"]
    (said,) = [why for why in suspect["why"] if why.startswith("megatron-core ")]
    release = said.split(" (")[0]
    assert release == "megatron-core 0.12.1"
    assert stale["why"].startswith(f"{release} (the release the mindspeed-llm-26 adaptor runs with) has no ")
    text = report_at(400, str(ONE_SUSPECT), "--adaptor", str(rollback)).stdout
    (summary,) = [line for line in text.splitlines() if line.startswith("1 finding")]
    assert f" · {release} (the release the mindspeed-llm-26 adaptor runs with) · " in summary  # not the installed one


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_a_stale_resets_wrapped_lines_start_under_the_text_they_continue(columns):
    rollback = IN_TREE / "mindspeed_llm" / "core" / "high_availability" / "tft_rollback.py"
    lines = report_at(columns, str(ONE_SUSPECT), "--adaptor", str(rollback)).stdout.splitlines()
    start = lines.index("Stale resets in the adaptor's rollback:")
    section = lines[start + 1 : lines.index("", start)]
    assert len(section) > 2 and all(line.startswith("  ") for line in section), section  # none at column 0
    assert section[0].startswith(f"  {rollback}:") and section[-1].startswith("    ")


def test_a_name_kept_in_two_modules_of_one_release_is_one_suspect(tmp_path):
    """MindSpeed's AG_SHARED_EXPERTS_INPUTS lives in moe_utils and moe_common; the log cannot tell which the step read."""
    log = write_log(tmp_path, dump({**MOE, "moe_permutation_async_comm": "True"}), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log)
    named = [suspect for suspect in shortlist.suspects if suspect.tensor.name.variable == "AG_SHARED_EXPERTS_INPUTS"]
    assert [(suspect.rule.id, suspect.alternatives) for suspect in named] == [
        ("mindspeed.ag-shared-experts-inputs", ("mindspeed.ag-shared-experts-inputs-moe-common",))
    ]
    assert "mindspeed.ag-shared-experts-inputs-moe-common" not in {item.rule for item in shortlist.excluded}


def test_a_tie_of_the_adaptor_lines_names_the_tied_generations_above_the_suspects(tmp_path):
    log = write_log(tmp_path, dump(MOE), IN_TREE_LINES, [CATCH_V26, PTA_ERROR])
    text = " ".join(report_at(100, str(log)).stdout.split())
    assert "Suspects, most likely first (the arguments dump, the mindspeed-llm-2.3 or mindspeed-llm-26 adaptor):" in text


def release_dump(release: str, **settings: str) -> list[str]:
    """Megatron-LM's dump of a release's own arguments (tests/corpus/arguments/, from its parser), defaults
    but `settings`."""
    arguments = json.loads((ROOT / "tests" / "corpus" / "arguments" / f"megatron-lm-core_v{release}.json").read_text())
    return dump({**{name: str(value) for name, value in arguments["arguments"].items()}, **settings})


@pytest.mark.parametrize("release", ["0.18.2", "0.19.0"])
def test_an_untraced_job_whose_dump_has_no_packed_sequence_switch_on_does_not_suspect_the_seqlen_stats(tmp_path, release):
    """Only packed batches (--sft, or 0.19's --dataloader-inter-document-masking) reach
    update_seqlen_stats_from_cu_seqlens: with both off its tensor is never made."""
    log = write_log(tmp_path, release_dump(release), TASKD_LINES, [CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log)
    assert "megatron.seqlen-stats" not in [suspect.rule.id for suspect in shortlist.suspects]
    masking = "False" if release == "0.19.0" else "not in the arguments"  # 0.18 has no such argument
    assert {item.rule: item.why for item in shortlist.excluded}["megatron.seqlen-stats"] == (
        f"sft is False, dataloader_inter_document_masking is {masking}: packed_sequences is off"
    )


@pytest.mark.parametrize(
    ("release", "switch"),
    [
        ("0.18.2", "sft"),
        ("0.19.0", "sft"),
        ("0.19.0", "dataloader_inter_document_masking"),
    ],
)
def test_an_untraced_job_with_either_packed_sequence_switch_on_suspects_the_seqlen_stats_first(tmp_path, release, switch):
    log = write_log(tmp_path, release_dump(release, **{switch: "True"}), TASKD_LINES, [CATCH_V26, PTA_ERROR])
    _, shortlist = shortlist_of(log)
    first = shortlist.suspects[0]
    assert (first.rule.id, first.why[0]) == ("megatron.seqlen-stats", f"{switch} = True")
