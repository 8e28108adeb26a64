"""--log-only: the diagnosis rests on the log's text alone, whatever is installed here, and says so."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import run_cli

from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.report.diagnosis import diagnosis_json

sys.path.insert(0, str(Path(__file__).parents[1] / "corpus"))
from hidden import run_without_megatron  # noqa: E402  (tests/corpus is no package)

ROOT = Path(__file__).parents[2]
SAMPLES = ROOT / "samples" / "logs"
CORPUS = ROOT / "tests" / "corpus" / "logs"
LOGS = sorted(SAMPLES.glob("*.log")) + [
    CORPUS / name
    for name in (
        "megatron-0.7-aux-losses-tracker.log",
        "megatron-0.12-layer-wise-tracker.log",
        "megatron-global-memory-buffer.log",
        "megatron-router-expert-bias.log",
        "prefix-cri-router-expert-bias.log",
        "user-runstats-binary-op.log",
    )
]
UNSAFE = "RuntimeError: There is unsafe data in the input tensor."


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)


def essentials(report: dict) -> list[tuple]:
    """What a finding says, less the notes (their wording names the option)."""
    return [
        (item["culprit"], item["tensor"], item["source_from"], item["scenario"], item["rule"], item["confidence"])
        for item in report["findings"]
    ]


def log_only(log: Path) -> dict:
    return diagnosis_json(diagnose([str(log)], groundwork(log_only=True)))


def test_the_installed_megatron_core_is_not_read_when_the_index_holds_the_log_release():
    """The index comes before a local installation: with megatron-core 0.16.1 installed here, a log
    of 0.16.1 is still read from the index (the comparison below then means the same everywhere)."""
    report = diagnosis_json(diagnose([str(SAMPLES / "megatron_moe_tracker.log")], groundwork()))
    assert [item["source_from"] for item in report["findings"]] == ["index"]


def report_script(tmp_path: Path, report: str) -> Path:
    """A script that prints, as JSON, the `report` expression over its arguments (the logs)."""
    script = tmp_path / "report.py"
    script.write_text(
        "import json, sys\n"
        "from unsafe_doctor.knowledge.context import groundwork\n"
        "from unsafe_doctor.diagnose.pipeline import diagnose\n"
        "from unsafe_doctor.report.diagnosis import diagnosis_json\n"
        f"print(json.dumps({report}))\n"
    )
    return script


def test_log_only_gives_what_a_python_without_megatron_gives(tmp_path):
    script = report_script(tmp_path, "[diagnosis_json(diagnose([log], groundwork())) for log in sys.argv[1:]]")
    result = run_without_megatron(script, *map(str, LOGS), scratch=tmp_path)
    assert result.returncode == 0, result.stderr
    bare = json.loads(result.stdout)
    for log, expected in zip(LOGS, bare, strict=True):
        assert all(item["from"] != "installed" for item in expected["summary"]["frameworks"].values()), log.name
        assert essentials(log_only(log)) == essentials(expected), log.name
        assert log_only(log)["summary"]["frameworks"] == expected["summary"]["frameworks"], log.name


def test_a_log_only_finding_is_read_from_the_index_of_the_release_the_frames_fit():
    report = log_only(SAMPLES / "megatron_moe_tracker.log")
    [finding] = report["findings"]
    assert (finding["source_from"], finding["source_confidence"]) == ("index", "high")
    assert finding["source_release"] == "megatron-core 0.16.0–0.16.1, from 4 frames"
    assert finding["tensor"]["expression"] == "tracker[name]"
    assert finding["tensor"]["variable"] == "_MOE_LAYER_WISE_LOGGING_TRACKER"
    assert (finding["scenario"], finding["rule"]) == (1, "megatron.moe-layer-wise-tracker-moe-utils")
    assert report["summary"]["frameworks"] == {
        "megatron-core": {"version": "0.16.1", "from": "the log's frames (megatron-core 0.16.0–0.16.1, from 4 frames)"}
    }


def test_text_report_labels_a_log_only_tensor_as_a_guess():
    """Frames of the user's own code: no index holds them, so the tensor is a guess from the line."""
    result = run("diagnose", str(CORPUS / "user-runstats-binary-op.log"), "--log-only")
    assert result.returncode == 1, result.stderr
    assert "the log's text alone: the tensor is a guess" in " ".join(result.stdout.split())


@pytest.mark.parametrize("command", ["diagnose", "fix"])
def test_log_only_with_a_source_root_is_refused(command):
    result = run(command, str(SAMPLES / "faq_modellink.log"), "--log-only", "--source-root", str(ROOT / "samples" / "framework"))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("unsafe-doctor: ") and "--log-only" in line and "--source-root" in line


CLIP_SOURCE = """\
CLIP_FACTOR = 2.0


def scale(y):
    x = y * CLIP_FACTOR
    return x
"""


def clip_log(tmp_path: Path) -> Path:
    """A traceback through `x = y * CLIP_FACTOR` in /job/clipper/clip.py, as torchrun prints it."""
    package = tmp_path / "clipper"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "clip.py").write_text(CLIP_SOURCE)
    log = tmp_path / "train.log"
    log.write_text(
        textwrap.dedent(
            f"""\
            [rank0]: Traceback (most recent call last):
            [rank0]:   File "/job/clipper/clip.py", line 5, in scale
            [rank0]:     x = y * CLIP_FACTOR
            [rank0]: {UNSAFE}
            """
        )
    )
    return log


@pytest.mark.parametrize("with_source", [True, False], ids=["source-root", "log-only"])
def test_a_constant_operand_is_never_named(tmp_path, with_source):
    log = clip_log(tmp_path)
    options = ["--source-root", str(tmp_path)] if with_source else ["--log-only"]
    result = run("diagnose", str(log), "--format", "json", *options)
    assert result.returncode == 1, result.stderr
    [finding] = json.loads(result.stdout)["findings"]
    assert "CLIP_FACTOR" not in json.dumps(finding["tensor"])
    assert finding["source_from"] == ("job" if with_source else "log")


# --- a class-held global, named with its class from the index alone --------------------------------

SITE_312 = "/usr/local/lib/python3.12/site-packages/megatron/core/transformer/"
MTP = ("MTPLossLoggingHelper", "tracker", "megatron.core.transformer.multi_token_prediction", "megatron.mtp-loss-tracker")
METRICS = ("MoEMetricsTracker", "_metrics", "megatron.core.transformer.moe.moe_logging", "megatron.moe-metrics-tracker")
# (release, file, line, function, the line as the real wheel prints it): methods that read the class's
# tensors through `self._metrics[...]`, or through a local the method bound to the class attribute
MTP_FILE, METRICS_FILE = "multi_token_prediction.py", "moe/moe_logging.py"
CLASS_HELD = [
    ("0.19.2", MTP_FILE, 380, "save_metrics_to_tracker", 'tracker["loss_values"][layer_number] += loss.detach()', MTP),
    ("0.19.2", MTP_FILE, 391, "clean_metrics_in_tracker", 'tracker["loss_values"].zero_()', MTP),
    ("0.19.2", MTP_FILE, 449, "track_mtp_metrics", 'tracker["cumulative_correct_values"] += mtp_corrects', MTP),
    ("0.18.2", MTP_FILE, 367, "save_loss_to_tracker", 'tracker["values"][layer_number] += loss.detach()', MTP),
    ("0.18.2", METRICS_FILE, 125, "record", "entry.values[layer_number - 1] += value.detach()", METRICS),
    ("0.18.2", METRICS_FILE, 275, "_sync_metrics", "torch.distributed.all_reduce(v, group=entry.reduce_group)", METRICS),
    ("0.18.2", METRICS_FILE, 326, "_aggregate", "values = self._metrics[name].values.float() * loss_scale", METRICS),
    pytest.param(
        "0.18.2",
        METRICS_FILE,
        217,
        "clear",
        "entry.values.zero_()",
        METRICS,
        marks=pytest.mark.xfail(
            strict=True,
            reason="`for entry in self._metrics.values()`: a loop target is not followed to its iterable "
            "(syntax.OPAQUE), and the index's skeleton keeps it as `entry = None`",
        ),
    ),
]


@pytest.mark.parametrize(("release", "path", "line", "function", "printed", "expected"), CLASS_HELD)
def test_log_only_names_a_class_held_global_with_its_class(tmp_path, release, path, line, *, function, printed, expected):
    """The frame prints neither the class nor its module; the release's skeleton in the index knows
    the class the method is in. Read where megatron-core is not installed."""
    log = tmp_path / "train.log"
    log.write_text(
        f'[rank0]: Traceback (most recent call last):\n[rank0]:   File "{SITE_312}{path}", line {line}, in '
        f"{function}\n[rank0]:     {printed}\n[rank0]: {UNSAFE}\n"
    )
    script = report_script(tmp_path, "diagnosis_json(diagnose(sys.argv[1:], groundwork(log_only=True)))")
    result = run_without_megatron(script, str(log), scratch=tmp_path)
    assert result.returncode == 0, result.stderr
    [finding] = json.loads(result.stdout)["findings"]
    assert finding["source_release"].startswith(f"megatron-core {release[:4]}"), finding["source_release"]
    tensor = finding["tensor"]
    assert (tensor["owner"], tensor["variable"], tensor["module"], finding["rule"]) == expected
