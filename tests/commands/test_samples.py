"""End to end on the bundled samples (real torchrun runs through megatron-core): what a user sees."""

from __future__ import annotations

import gzip
import io
import json
import random
import re
import subprocess
from pathlib import Path

from helpers import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.report.diagnosis import diagnosis_json, diagnosis_sarif

LOGS = Path(__file__).resolve().parents[2] / "samples" / "logs"
FRAMEWORK = LOGS.parent / "framework"
FINDING_KEYS = {
    "ranks", "message", "error_code", "recovery", "culprit", "frames", "tensor",
    "scenario", "rule", "confidence", "reason", "evidence", "fix", "truncated", "notes", "source_from",
    "source_release", "source_confidence", "found_by", "sentinel", "suspects", "alternatives",
}  # fmt: skip


def run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return run_cli(*args, stdin=stdin, encoding=None)


def findings_of(*args: str, stdin: bytes | None = None) -> tuple[int, dict]:
    result = run(*args, "--format", "json", stdin=stdin)
    assert result.returncode in (0, 1), result.stderr.decode()
    return result.returncode, json.loads(result.stdout)


def test_megatron_tracker_on_two_ranks_folds_into_one_finding():
    code, report = findings_of("diagnose", str(LOGS / "megatron_moe_tracker.log"))
    assert code == 1
    [finding] = report["findings"]
    assert set(finding) == FINDING_KEYS
    assert (finding["found_by"], finding["sentinel"]) == (["traceback"], None)  # a log with no sentinel line
    assert finding["ranks"] == [1, 3]
    assert finding["message"] == "There is unsafe data in the input tensor."
    assert finding["error_code"] == "ERR00003"
    assert finding["recovery"] == {
        "seen": True,
        "fault_ranks": [1, 3],
        "step": 120,
        "phase": "after-recovery",
        "faults": [{"rank": 1, "kind": "memory-fault"}, {"rank": 3, "kind": "memory-fault"}],
    }
    culprit = finding["culprit"]
    assert culprit["file"].endswith("megatron/core/transformer/moe/moe_utils.py")
    assert (culprit["line"], culprit["function"]) == (897, "save_to_aux_losses_tracker")
    assert finding["tensor"]["variable"] == "_MOE_LAYER_WISE_LOGGING_TRACKER"
    assert finding["tensor"]["module"] == "megatron.core.transformer.moe.moe_utils"
    assert report["summary"]["ranks_seen"] == [0, 1, 2, 3]
    assert (finding["scenario"], finding["rule"], finding["confidence"]) == (
        1, "megatron.moe-layer-wise-tracker-moe-utils", "high"
    )  # fmt: skip
    assert finding["fix"]["phase"] == "rollback" and finding["fix"]["function"] == "feature_rollback"
    assert "_MOE_LAYER_WISE_LOGGING_TRACKER" in finding["fix"]["code"] and ".zero_()" not in finding["fix"]["code"]


def test_torchrun_log_dir_with_a_gzipped_rank_log():
    """The log names the job's folder (/home/user/job/toytrain/...): --source-root finds toytrain by suffix."""
    code, report = findings_of("diagnose", str(LOGS / "toytrain_ema"), "--source-root", str(FRAMEWORK))
    assert code == 1
    [finding] = report["findings"]
    assert finding["ranks"] == [1]
    assert finding["tensor"] == {
        "expression": "state._EMA_GRAD_NORM",
        "variable": "_EMA_GRAD_NORM",
        "module": "toytrain.state",
        "owner": None,
    }
    assert finding["culprit"]["file"].endswith("toytrain/train.py")
    assert (finding["culprit"]["line"], finding["culprit"]["function"]) == (62, "clip_gradients")
    assert finding["recovery"]["fault_ranks"] == [1] and finding["recovery"]["step"] == 20
    assert any(name["name"].endswith("stderr.log.gz") for name in report["inputs"])


def test_unknown_user_global_is_classified_from_its_source():
    _, report = findings_of("diagnose", str(LOGS / "toytrain_ema"), "--source-root", str(FRAMEWORK))
    [finding] = report["findings"]
    assert (finding["scenario"], finding["rule"], finding["confidence"]) == (2, None, "medium")
    assert any("toytrain/train.py:66: updated from its own previous value" in line for line in finding["evidence"])
    fix = finding["fix"]
    assert (fix["phase"], fix["function"], fix["peer"]["function"]) == ("repair", "recv_rank_repair", "send_rank_repair")
    assert "torch.distributed.recv(" in fix["code"] and ".copy_(" in fix["code"]
    assert "torch.distributed.send(" in fix["peer"]["code"]


def test_error_inside_the_rollback_callback_is_said_so():
    _, report = findings_of("diagnose", str(LOGS / "rollback_failed.log"))
    [finding] = report["findings"]
    assert finding["ranks"] == [2]
    assert finding["recovery"]["phase"] == "rollback"
    assert finding["tensor"]["variable"] == "_MOE_LAYER_WISE_LOGGING_TRACKER"


def test_faq_log_without_rank_prefixes_takes_the_rank_from_torch_npu():
    _, report = findings_of("diagnose", str(LOGS / "faq_modellink.log"))
    [finding] = report["findings"]
    assert finding["ranks"] == [3]
    assert finding["tensor"]["expression"] == "parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER[name]"
    assert finding["tensor"]["variable"] == "_MOE_AUX_LOSSES_LOGGING_TRACKER"
    assert finding["tensor"]["module"] == "megatron.core.parallel_state"
    assert finding["recovery"]["phase"] == "none"
    assert (finding["scenario"], finding["rule"]) == (1, "megatron.moe-aux-losses-tracker")
    # The FAQ's ModelLink tree ran Megatron's 0.6 files: the index says so, whatever is installed here.
    assert (finding["source_from"], finding["source_confidence"]) == ("index", "high")
    assert finding["source_release"] == "megatron-core 0.6.0, from 2 of 5 frames"
    assert finding["notes"] == []


def test_kubectl_pod_prefixes():
    _, report = findings_of(str(LOGS / "kubectl_prefix.log"))
    [finding] = report["findings"]
    assert finding["ranks"] == [1, 3]
    assert finding["tensor"]["variable"] == "_MOE_LAYER_WISE_LOGGING_TRACKER"


def test_a_log_without_the_error_exits_zero_and_names_the_error_it_ended_with():
    code, report = findings_of("diagnose", str(LOGS / "hccl_timeout.log"))
    assert code == 0 and report["findings"] == []
    assert report["summary"]["last_error"]["type"] == "torch.distributed.DistBackendError"
    assert report["summary"]["last_error"]["rank"] == 2
    text = run("diagnose", str(LOGS / "hccl_timeout.log")).stdout.decode()
    assert "No 'There is unsafe data in the input tensor' error" in text
    assert "on rank 2: torch.distributed.DistBackendError" in text


def test_stdin_gives_what_the_file_gives():
    path = LOGS / "megatron_moe_tracker.log"
    _, from_file = findings_of("diagnose", str(path))
    _, from_pipe = findings_of(stdin=path.read_bytes())
    assert from_pipe["findings"] == from_file["findings"]
    _, from_gzip_pipe = findings_of(stdin=gzip.compress(path.read_bytes()))
    assert from_gzip_pipe["findings"] == from_file["findings"]


def test_several_inputs_at_once():
    _, report = findings_of(
        "diagnose", str(LOGS / "faq_modellink.log"), str(LOGS / "toytrain_ema"), "--source-root", str(FRAMEWORK)
    )
    variables = [finding["tensor"]["variable"] for finding in report["findings"]]
    assert variables == ["_MOE_AUX_LOSSES_LOGGING_TRACKER", "_EMA_GRAD_NORM"]


def test_text_report_shows_ranks_culprit_and_tensor():
    result = run("diagnose", str(LOGS / "megatron_moe_tracker.log"))
    text = result.stdout.decode()
    assert result.returncode == 1
    assert "Finding 1 · ranks 1, 3" in text
    assert "_MOE_LAYER_WISE_LOGGING_TRACKER" in text
    assert "moe_utils.py:897" in text
    assert "first iteration after recovery" in text
    assert "\x1b[" not in text  # not a terminal: no colour codes


def test_sarif_locates_the_culprit():
    result = run("diagnose", str(LOGS / "megatron_moe_tracker.log"), "--format", "sarif")
    sarif = json.loads(result.stdout)
    [result_] = sarif["runs"][0]["results"]
    location = result_["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"].endswith("moe_utils.py")
    assert location["region"]["startLine"] == 897


# --- interleaving: ranks write concurrently, so any interleaving must give the same findings -----

_PREFIX = re.compile(r"^\[rank(\d+)\]:")
SAMPLE_LINES = (LOGS / "megatron_moe_tracker.log").read_text().splitlines(keepends=True)


def _per_rank_streams() -> tuple[dict[int, list[str]], list[str]]:
    streams: dict[int, list[str]] = {}
    others = []
    for line in SAMPLE_LINES:
        match = _PREFIX.match(line)
        if match:
            streams.setdefault(int(match.group(1)), []).append(line)
        else:
            others.append(line)
    return streams, others


def _essentials(report: dict) -> list[tuple]:
    return [
        (tuple(f["ranks"]), f["culprit"]["file"], f["culprit"]["line"], f["tensor"]["variable"], f["tensor"]["module"])
        for f in report["findings"]
    ]


EXPECTED = None


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), noise=st.lists(st.sampled_from([
    " iteration      121/    1000 | lm loss: 2.1E+00 |\n",
    "\x1b[32mINFO\x1b[0m saving checkpoint\r\n",
    "[rank0]: [W1130 04:10:00.000 ProcessGroupGloo.cpp:100] Warning: something\n",
    "garbage \xff\xfe line\n",
    "\n",
]), max_size=30))  # fmt: skip
def test_any_interleaving_of_rank_output_gives_the_same_findings(seed, noise):
    global EXPECTED
    if EXPECTED is None:
        EXPECTED = _essentials(diagnosis_json(diagnose([str(LOGS / "megatron_moe_tracker.log")], groundwork())))
    streams, others = _per_rank_streams()
    rng = random.Random(seed)
    # Each writer keeps its own order (ranks, the launcher and MindIO's unprefixed lines, noise).
    queues = [list(lines) for lines in streams.values()] + [others, list(noise)]
    merged = []
    while any(queues):
        queue = rng.choice([q for q in queues if q])
        merged.append(queue.pop(0))
    data = "".join(merged).encode("utf-8", "surrogateescape")
    assert _essentials(diagnosis_json(diagnose([], groundwork(), stdin=io.BytesIO(data)))) == EXPECTED


def test_sarif_points_at_each_piece_of_heuristic_evidence():
    """The heuristics' evidence is (file, line, text): SARIF gives each as a related location."""
    diagnosis = diagnose([str(LOGS / "toytrain_ema")], groundwork(source_roots=[FRAMEWORK]))
    [item] = diagnosis.findings
    assert item.classification.evidence, "toytrain's _EMA_GRAD_NORM is classified by the heuristics"
    [result] = diagnosis_sarif(diagnosis)["runs"][0]["results"]
    related = [
        (
            place["physicalLocation"]["artifactLocation"]["uri"],
            place["physicalLocation"]["region"]["startLine"],
            place["message"]["text"],
        )
        for place in result["relatedLocations"]
    ]
    assert related == [(seen.file, seen.line, seen.text) for seen in item.classification.evidence]
    assert ("toytrain/train.py", 66) in [(uri, line) for uri, line, _ in related]
