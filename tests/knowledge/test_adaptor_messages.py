"""The adaptor generation a log shows, read from the messages each generation's real adaptor logs
(knowledge_base/adaptor_messages.json, derived by scripts/derive_messages.py)."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import load_module, run_cli

from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.knowledge.generations import MESSAGES_FILE, NEEDLE_CHARS, WORD, needles, read_generation, shipped_messages
from unsafe_doctor.knowledge.loading import load_knowledge, shipped_knowledge_dir
from unsafe_doctor.log import inputs, recovery
from unsafe_doctor.log.lines import mindio_file, split_lines

ROOT = Path(__file__).resolve().parents[2]
MIRRORS = ROOT.parent / ".mirror"  # bare clones of the public repositories, where this machine has them
REPOS = {"mindspeed_llm": MIRRORS / "Ascend+MindSpeed-LLM" / "repo", "mind_cluster": MIRRORS / "Ascend+mind-cluster" / "repo"}
CORPUS = ROOT / "tests" / "corpus"
IN_TREE = "mindspeed_llm.core.high_availability"


@functools.cache
def _script():
    """scripts/derive_messages.py, loaded as a module (scripts/ is no package)."""
    return load_module("derive_messages", ROOT / "scripts" / "derive_messages.py", register=True)


def _in_tree(stem: str, message: str, rank: int = 1) -> str:
    """A line of the in-tree adaptor, as Python logging writes it under the job's format."""
    return f"[rank{rank}]:2026-12-06 07:29:38,114 - {IN_TREE}.{stem} - INFO - {message}\n"


def _log(tmp_path: Path, *lines: str) -> Path:
    """A v26 MindIO log of rank 1's untraced unsafe-data error, the adaptor's lines before it."""
    caught = (
        "[rank1]:2026-12-06 07:29:40.110641 warn 21118 [71360][PYH ttp_decorator.py:938] rank:1 catch OTHER "
        "exception, error_code:， ex instance:There is unsafe data in the input tensor.\n"
    )
    path = tmp_path / "train.log"
    path.write_text("".join(lines) + caught)
    return path


SHARED = (  # what 2.3 and 26 both log, text for text
    _in_tree("tft_stop_clean", "[clean] rank:1, type:retry, cost:0.000s, ret:0"),
    _in_tree("tft_rollback", "rank:1 successfully gather and rollback at iteration 120"),
)


def _diagnosed(path: Path):
    return diagnose([str(path)], groundwork((), (), log_only=True))


# --- the script, on real files ---------------------------------------------------------------------


def test_the_script_reads_each_logging_call_of_a_real_in_tree_adaptor_file_with_its_holes(real):
    path = real / "mindspeed-llm-master" / "mindspeed_llm" / "core" / "high_availability" / "tft_optimizer_data_repair.py"
    found = _script().messages_in(path.read_text(), f"{IN_TREE}.tft_optimizer_data_repair")
    texts = {message.text: message for message in found}
    received = (
        "[repair] rank {} recv total time consumed:{}s, rebuild:{}s, recv ckpt:{}s, load ckpt:{}s, "
        "recv optim:{}s, recv log args:{}s."
    )
    assert texts[received].logger == f"{IN_TREE}.tft_optimizer_data_repair"  # getLogger(__name__)
    assert texts["[repair] rank {} repair total time consumed:{}s"].line > 0
    assert any(message.logger is None for message in found)  # its print_rank_0 calls, read as prints


def test_the_script_reads_taskds_messages_as_mindio_logger_lines(real):
    path = real / "mind-cluster-7.2rc1" / "taskd" / "python" / "adaptor" / "elastic_training" / "rollback_callback.py"
    found = _script().messages_in(path.read_text(), "taskd.python.adaptor.elastic_training.rollback_callback")
    assert {message.text: message.logger for message in found}["rollback strategy params: {}, step: {}"] == "mindio"


def test_a_message_with_too_little_literal_text_tells_no_generation():
    script = _script()
    assert not script.is_specific("params: {}")
    assert not script.is_specific("{}")
    assert script.is_specific("rank:{} start to build dataset")


@pytest.mark.skipif(
    not all((repo / "HEAD").is_file() for repo in REPOS.values()),
    reason=f"the MindSpeed-LLM and mind-cluster git mirrors are not on this machine ({MIRRORS})",
)
def test_the_shipped_messages_are_what_the_script_derives_from_the_real_releases():
    shipped = json.loads((shipped_knowledge_dir() / MESSAGES_FILE).read_text(encoding="utf-8"))
    assert _script().derive(REPOS) == shipped


def test_every_generation_of_the_messages_is_a_shipped_adaptor_profile():
    profiles = {profile.id for profile in load_knowledge().profiles}
    named = {generation for message in shipped_messages() for generation in message.generations}
    assert named == profiles


def test_the_recorded_legacy_lines_say_where_each_is_known_from():
    recorded = [message for message in shipped_messages() if message.where.startswith("recorded: ")]
    assert recorded and all(message.generations == ("mindio-ttp-legacy",) for message in recorded)
    assert all("domain notes" in message.where for message in recorded)


# --- reading a log -----------------------------------------------------------------------------------


def test_a_line_only_26_logs_decides_26_over_2_3(tmp_path):
    """26's receive summary has no `build repair group:` time; 2.3's has (MindSpeed-LLM d67469ec)."""
    received = (
        "[repair] rank 1 recv total time consumed:0.049s, rebuild:0.000s, recv ckpt:0.048s, load ckpt:0.000s, "
        "recv optim:0.000s, recv log args:0.000s."
    )
    diagnosis = _diagnosed(_log(tmp_path, *SHARED, _in_tree("tft_optimizer_data_repair", received)))
    assert diagnosis.generation is not None
    assert (diagnosis.generation.decision, diagnosis.generation.generations) == ("decided", ("mindspeed-llm-26",))
    assert [profile.id for profile in diagnosis.context.environment.possible] == ["mindspeed-llm-26"]


def test_2_3s_longer_line_is_2_3s_though_26s_shorter_message_fits_it_too(tmp_path):
    received = (
        "[repair] rank 1 recv total time consumed:0.049s, build repair group:0.001s, rebuild:0.000s, recv "
        "ckpt:0.048s, load ckpt:0.000s, recv optim:0.000s, recv log args:0.000s."
    )
    diagnosis = _diagnosed(_log(tmp_path, *SHARED, _in_tree("tft_optimizer_data_repair", received)))
    assert diagnosis.generation is not None and diagnosis.generation.generations == ("mindspeed-llm-2.3",)


def test_a_26_only_line_no_recovery_marker_holds_is_kept_by_the_scan_and_decides(tmp_path):
    diagnosis = _diagnosed(_log(tmp_path, *SHARED, _in_tree("tft_arf_group_repair", "Tensor and data parallel group is None")))
    assert diagnosis.generation is not None and diagnosis.generation.generations == ("mindspeed-llm-26",)


def test_lines_2_3_and_26_both_log_tie_and_leave_both_possible(tmp_path):
    diagnosis = _diagnosed(_log(tmp_path, *SHARED))
    assert diagnosis.generation is not None
    assert (diagnosis.generation.decision, diagnosis.generation.generations) == ("tie", ("mindspeed-llm-2.3", "mindspeed-llm-26"))
    assert [profile.id for profile in diagnosis.context.environment.possible] == ["mindspeed-llm-2.3", "mindspeed-llm-26"]


def test_a_log_without_an_adaptor_line_shows_no_generation_and_leaves_all_possible(tmp_path):
    diagnosis = _diagnosed(_log(tmp_path, "[rank1]:iteration 120 | lm loss: 2.5 | loss scale: 1.0\n"))
    assert diagnosis.generation is not None and (diagnosis.generation.decision, diagnosis.generation.generations) == ("none", ())
    possible = diagnosis.context.environment.possible
    assert {profile.id for profile in possible} == {profile.id for profile in load_knowledge().profiles}


def test_the_in_tree_texts_through_mindios_logger_are_the_legacy_wheels(tmp_path):
    """The legacy wheel logs the texts 2.3 later carried in-tree, but through MindIO's logger: its lines name the file."""
    lines = (
        "[rank1]:2026-12-02 16:47:07.504934 info 17864 [34912][PYH tft_stop_clean.py:58] "
        "[clean] rank:1, type:retry, cost:0.000s, ret:0\n"
    )
    diagnosis = _diagnosed(_log(tmp_path, lines))
    assert diagnosis.generation is not None and diagnosis.generation.generations == ("mindio-ttp-legacy",)


def _in_tree_profiles():
    return [profile for profile in load_knowledge().profiles if profile.id in ("mindspeed-llm-2.3", "mindspeed-llm-26")]


def test_a_line_naming_another_module_is_not_that_modules_message():
    written = f"2026-12-06 07:29:38,114 - {IN_TREE}.tft_rollback - INFO - [clean] rank:1, type:retry, cost:0.000s, ret:0"
    read = read_generation(
        shipped_messages(), split_lines(written, source="x.log", base_offset=0, rank_hint=None), (), _in_tree_profiles()
    )
    assert read.decision == "none"


def test_the_counts_cannot_be_changed_after_the_reading():
    read = read_generation(
        shipped_messages(), split_lines(SHARED[0], source="x.log", base_offset=0, rank_hint=None), (), _in_tree_profiles()
    )
    assert dict(read.counts) == {"mindspeed-llm-2.3": 1, "mindspeed-llm-26": 1}
    with pytest.raises(TypeError):
        read.counts["mindspeed-llm-26"] = 5  # type: ignore[index]


def test_a_line_keeps_what_its_writer_wrote():
    [line] = split_lines(SHARED[0], source="x.log", base_offset=0, rank_hint=None)
    assert (line.text, line.written) == ("[clean] rank:1, type:retry, cost:0.000s, ret:0", SHARED[0].rstrip("\n"))


# --- MindIO's logger names the file ---------------------------------------------------------------------


def test_mindios_older_python_format_names_the_module_as_the_file():
    """mind-cluster's faultdiag sample ttp_log.log.1 (domain notes §4): `[time][tid][LEVEL][module:line]`."""
    assert mindio_file("[2024-12-24 11:56:59,095][10][ERROR][ttp_mindx_api:56] remove broken link") == "ttp_mindx_api.py"
    assert mindio_file("2026-12-02 16:47:07.504934 info 17864 [34912][PYH tft_stop_clean.py:58] x") == "tft_stop_clean.py"
    assert mindio_file("2026-12-06 07:29:38,114 - mindspeed_llm.x - INFO - [clean] rank:1") is None


def test_a_legacy_line_in_mindios_older_python_format_is_the_legacy_wheels(tmp_path):
    """Read as a line naming no logger, it tied 2.3 with 26, which log the same text through Python logging."""
    line = "[2024-12-24 11:56:59,095][10][INFO][tft_rollback:52] rank:1 successfully gather and rollback at iteration 120\n"
    diagnosis = _diagnosed(_log(tmp_path, line))
    assert diagnosis.generation is not None
    assert (diagnosis.generation.decision, diagnosis.generation.generations) == ("decided", ("mindio-ttp-legacy",))


def test_a_legacy_line_from_the_faqs_modellink_adaptor_file_is_the_legacy_wheels(tmp_path):
    """The FAQ names mindio_ttp/adaptor/modellink_adaptor.py as the older wheel's adaptor file."""
    line = (
        "[rank1]:2024-12-02 16:47:07.504934 info 17864 [34912][PYH modellink_adaptor.py:210] "
        "[clean] rank:1, type:retry, cost:0.000s, ret:0\n"
    )
    diagnosis = _diagnosed(_log(tmp_path, line))
    assert diagnosis.generation is not None and diagnosis.generation.generations == ("mindio-ttp-legacy",)
    [(first, _)] = diagnosis.generation.shown(["mindio-ttp-legacy"])
    assert "modellink_adaptor.py (the one adaptor file of older wheels the FAQ names)" in first.message.where


def test_each_recorded_legacy_line_holds_for_the_wheels_known_files_each_with_where_it_is_known_from():
    recorded = json.loads((shipped_knowledge_dir() / MESSAGES_FILE).read_text(encoding="utf-8"))["recorded"]
    for item in recorded:
        assert "modellink_adaptor.py" in item["files"] and len(item["files"]) == 2
        assert all(known_from for known_from in item["files"].values())
    assert {file for item in recorded for file in item["files"]} >= {"tft_rollback.py", "tft_optimizer_data_repair.py"}


# --- traceback frames in a profile's files ----------------------------------------------------------------------


def test_a_traced_logs_frame_in_an_adaptors_file_tells_its_generation(tmp_path):
    path = tmp_path / "train.log"
    path.write_text(
        "Traceback (most recent call last):\n"
        '  File "/usr/local/lib/python3.8/site-packages/mindio_ttp/adaptor/modellink_adaptor.py", line 120, in feature_rollback\n'
        "    train_step()\n"
        '  File "/work/megatron/core/transformer/moe/moe_utils.py", line 172, in save_to_aux_losses_tracker\n'
        "    tracker[name][layer_number - 1] += loss.detach()\n"
        "RuntimeError: There is unsafe data in the input tensor.\n"
    )
    diagnosis = _diagnosed(path)
    assert diagnosis.generation is not None
    assert (diagnosis.generation.decision, diagnosis.generation.generations) == ("decided", ("mindio-ttp-legacy",))
    [(first, count)] = diagnosis.generation.shown(["mindio-ttp-legacy"])
    assert first.line == (
        'File "/usr/local/lib/python3.8/site-packages/mindio_ttp/adaptor/modellink_adaptor.py", line 120, in feature_rollback'
    )
    assert (first.source, count) == (str(path), 1)
    assert first.message.where == "the profile's files (mindio-ttp-legacy): mindio_ttp/adaptor/*.py"


# --- the scan's needles ---------------------------------------------------------------------------------------


def test_each_needle_the_scan_keeps_lines_by_has_two_words_and_enough_characters():
    found = needles(shipped_messages())
    assert found and b" not supported" not in found and b"not supported" not in found
    assert all(len(needle.strip()) >= NEEDLE_CHARS and len(WORD.findall(needle.decode())) >= 2 for needle in found)


def test_a_message_whose_needle_is_too_generic_still_matches_in_a_line_other_markers_keep():
    line = _in_tree("elastic_training_repair", "rank:1 repair type retry not supported")
    read = read_generation(
        shipped_messages(), split_lines(line, source="x.log", base_offset=0, rank_hint=None), (), _in_tree_profiles()
    )
    assert [item.message.text for item in read.evidence] == ["rank:{} repair type {} not supported"]


def test_a_log_of_many_generic_lines_keeps_no_more_lines_than_the_recovery_markers_do(tmp_path):
    """torch_npu prints `... not supported ...` on every line of some logs: none of them is an adaptor's. They
    stand over a MiB before the error, outside the window the scan keeps around it."""
    generic = (f"[W compiler_depend.ts:{n}] Warning: The operator 'aten::x' is not supported now.\n" for n in range(3000))
    path = _log(tmp_path, *generic, "iteration 1 | lm loss: 2.5 | padding\n" * 40_000)

    def kept(markers):
        scan = inputs.scan([str(path)], markers)
        return sum(excerpt.text.count("\n") for excerpt in (*scan.context, *scan.windows))

    assert kept((*recovery.MARKERS, *needles(shipped_messages()))) == kept(recovery.MARKERS)


# --- a user's profile --------------------------------------------------------------------------------------


def test_the_shipped_profiles_list_no_log_evidence_their_messages_are_derived():
    assert all(profile.log_evidence == () for profile in load_knowledge().profiles)


def test_a_users_profile_with_log_evidence_loads_and_its_text_tells_the_generation(tmp_path):
    rules = tmp_path / "acme.yaml"
    rules.write_text(
        "profiles:\n"
        "  - id: acme-adaptor\n"
        "    title: Acme adaptor\n"
        "    files: [acme/recovery.py]\n"
        "    rollback: rollback\n"
        "    send: send\n"
        "    recv: recv\n"
        "    parameters: {src_ranks: sources, dest_ranks: destinations}\n"
        "    repair_group: {expression: get_group()}\n"
        "    log_evidence: ['acme rollback {done} for rank']\n"
    )
    path = _log(tmp_path, "[rank1]:2026-12-06 07:29:38,114 - acme.recovery - INFO - acme rollback {done} for rank 1\n")
    diagnosis = diagnose([str(path)], groundwork((rules,), (), log_only=True))
    assert diagnosis.generation is not None
    assert (diagnosis.generation.decision, diagnosis.generation.generations) == ("decided", ("acme-adaptor",))
    [(first, _)] = diagnosis.generation.shown(["acme-adaptor"])
    assert first.message.where == f"the profile's log_evidence in {rules}"


def test_each_matched_line_says_where_its_message_comes_from(tmp_path):
    diagnosis = _diagnosed(_log(tmp_path, *SHARED))
    assert diagnosis.generation is not None
    shown = diagnosis.generation.shown(["mindspeed-llm-26"])
    assert [first.message.text for first, _ in shown] == [
        "[clean] rank:{}, type:{}, cost:{}s, ret:{}",
        "rank:{} successfully gather and rollback at iteration {}",
    ]
    first, count = shown[0]
    assert (first.source, first.offset, count) == (str(tmp_path / "train.log"), 0, 1)
    assert first.message.where.startswith("Ascend/MindSpeed-LLM v2.3.0 mindspeed_llm/core/high_availability/tft_stop_clean.py:")


def _develop_untraced() -> list[tuple[str, str]]:
    """(log, labelled generation) of the develop half's untraced logs that hold the error (untraced_split.yaml)."""
    split = yaml.safe_load((CORPUS / "untraced_split.yaml").read_text())["logs"]
    entries = yaml.safe_load((CORPUS / "labels.yaml").read_text())["logs"]
    return [
        (Path(entry["log"]).name, entry["untraced"]["generation"])
        for entry in entries
        if split.get(Path(entry["log"]).name) == "develop" and entry["untraced"].get("error") != "other"
    ]


@pytest.mark.parametrize(("log", "generation"), _develop_untraced())
def test_the_develop_corpus_logs_show_their_generation(log, generation):
    diagnosis = _diagnosed(CORPUS / "logs" / log)
    assert diagnosis.generation is not None
    assert (diagnosis.generation.decision, diagnosis.generation.generations) == ("decided", (generation,))


# --- shown ---------------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=ROOT)


def test_diagnose_verbose_shows_the_decision_and_each_matched_message_once(tmp_path):
    result = _cli("diagnose", "--log-only", "--no-input", "--verbose", str(_log(tmp_path, *SHARED)))
    text = " ".join(result.stdout.split())
    assert "Adaptor generation: the log's adaptor lines tie between mindspeed-llm-2.3, mindspeed-llm-26" in text
    assert "(messages matched: mindspeed-llm-2.3 2, mindspeed-llm-26 2)" in text
    assert f"{tmp_path / 'train.log'}:0" in text
    assert text.count("message: [clean] rank:{}, type:{}, cost:{}s, ret:{} (Ascend/MindSpeed-LLM v2.3.0") == 1
    assert "logged by mindspeed-llm-2.3, mindspeed-llm-26)" in text


def test_diagnose_without_verbose_keeps_its_report(tmp_path):
    result = _cli("diagnose", "--log-only", "--no-input", str(_log(tmp_path, *SHARED)))
    assert "Adaptor generation:" not in result.stdout


def test_the_json_report_holds_the_decision_and_the_evidence(tmp_path):
    result = _cli("diagnose", "--log-only", "--format", "json", str(_log(tmp_path, *SHARED)))
    generation = json.loads(result.stdout)["summary"]["generation"]
    assert (generation["decision"], generation["read"], generation["possible"]) == (
        "tie",
        ["mindspeed-llm-2.3", "mindspeed-llm-26"],
        ["mindspeed-llm-2.3", "mindspeed-llm-26"],
    )
    first = generation["evidence"][0]
    assert first["message"] == "[clean] rank:{}, type:{}, cost:{}s, ret:{}"
    assert first["generations"] == ["mindspeed-llm-2.3", "mindspeed-llm-26"]
    assert (first["source"], first["offset"], first["lines"]) == (str(tmp_path / "train.log"), 0, 1)
    assert first["line"] == SHARED[0].rstrip("\n")
