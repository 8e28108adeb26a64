"""The shipped framework index and release fingerprinting, against the real releases.

The index was built by scripts/build_index.py from the megatron-core wheels on the package index and
the tags of github.com/Ascend/MindSpeed and github.com/Ascend/MindSpeed-LLM; the test extra installs
megatron-core 0.16.1, whose real files are the reference here.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
import zipfile
from pathlib import Path

import pytest
from helpers import run_cli

from unsafe_doctor.diagnose.locate import locate
from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.log.tracebacks import Frame, Traceback
from unsafe_doctor.npu.messages import UNSAFE_DATA
from unsafe_doctor.source.fingerprint import fingerprint
from unsafe_doctor.source.index import FrameworkIndex, index_folder
from unsafe_doctor.source.skeleton import line_hashes, skeleton
from unsafe_doctor.source.workspace import Origin, Workspace

SITE = Path(sysconfig.get_paths()["purelib"])
MEGATRON = SITE / "megatron" / "core"
REMOTE = "/cluster/env/lib/python3.10/site-packages/"
SAMPLES = Path(__file__).parents[2] / "samples" / "logs"
CORPUS = Path(__file__).parents[1] / "corpus" / "logs"


def traceback_of(frame: Frame) -> Traceback:
    return Traceback(0, "train.log", 0, (frame,), "RuntimeError", UNSAFE_DATA, None, None, None, False, None, None)


def spans(tree: ast.Module) -> list[tuple[str, int, int | None]]:
    return sorted(
        (node.name, node.lineno, node.end_lineno)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    )


# --- skeletons -------------------------------------------------------------------------------------


def test_every_megatron_file_skeleton_parses_with_the_same_spans_and_no_text():
    files = sorted(MEGATRON.rglob("*.py"))
    assert len(files) > 300
    for path in files:
        text = path.read_text(encoding="utf-8")
        reduced = skeleton(text)
        assert reduced is not None, path
        assert spans(ast.parse(reduced)) == spans(ast.parse(text)), path
        strings = [node.value for node in ast.walk(ast.parse(reduced)) if isinstance(node, ast.Constant)]
        assert all(value in ("", b"") or not isinstance(value, (str, bytes)) for value in strings), path


def test_a_call_over_several_lines_keeps_its_arguments_and_still_spans_lines():
    text = "def route(self):\n    probs = topk(\n        logits,\n        expert_bias=self.expert_bias,\n    )\n"
    tree = ast.parse(skeleton(text) or "")
    [assign] = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)]
    assert ast.unparse(assign) == "probs = topk(logits, expert_bias=self.expert_bias)"
    assert (assign.lineno, assign.end_lineno) == (2, 3)


# --- the shipped data ------------------------------------------------------------------------------


MEGATRON_RELEASES = [
    "0.5.0",
    "0.6.0",
    "0.7.0",
    "0.8.0",
    "0.9.0",
    "0.10.0",
    "0.11.0",
    "0.12.0",
    "0.12.1",
    "0.12.2",
    "0.12.3",
    "0.13.0",
    "0.13.1",
    "0.14.0",
    "0.15.0",
    "0.15.1",
    "0.15.2",
    "0.15.3",
    "0.16.0",
    "0.16.1",
    "0.17.0",
    "0.17.1",
    "0.18.0",
    "0.18.2",
    "0.19.0",
    "0.19.2",
]


def test_the_index_holds_every_megatron_core_release_with_its_provenance():
    framework = FrameworkIndex().framework_of(REMOTE + "megatron/core/parallel_state.py")
    assert framework is not None
    releases = framework[0].releases
    assert [release.name for release in releases] == MEGATRON_RELEASES
    for release in releases:
        assert release.source.startswith(f"pypi:megatron_core-{release.name}-") and release.source.endswith(".whl")
        assert len(release.digest) == 64


@pytest.mark.parametrize("name", ["mindspeed", "mindspeed-llm"])
def test_the_mindspeed_indexes_record_a_commit_per_release(name):
    with zipfile.ZipFile(index_folder() / f"{name}.zip") as archive:
        meta = json.loads(archive.read("releases.json"))
    assert len(meta["releases"]) >= 10
    for release in meta["releases"]:
        assert release["source"] == f"git:{name}@{release['digest']}" and len(release["digest"]) == 40


def test_the_index_is_compact():
    sizes = {path.name: path.stat().st_size for path in index_folder().glob("*.zip")}
    assert set(sizes) == {"megatron-core.zip", "mindspeed.zip", "mindspeed-llm.zip"}
    assert sum(sizes.values()) < 7 * 1024 * 1024, sizes


def test_the_installed_release_files_are_the_indexed_ones_byte_for_byte():
    """Each installed 0.16.1 file's sha256 and line hashes are the index's for 0.16.1."""
    framework, _ = FrameworkIndex().framework_of(REMOTE + "megatron/core/parallel_state.py") or (None, None)
    assert framework is not None
    newest = [release.name for release in framework.releases].index("0.16.1")
    for path in sorted(MEGATRON.rglob("*.py")):
        relative = path.relative_to(SITE).as_posix()
        version = framework.version_in(relative, newest)
        assert version is not None, relative
        content = path.read_bytes()
        assert version.sha256 == hashlib.sha256(content).hexdigest(), relative
        assert version.hashes == line_hashes(content.decode("utf-8")), relative


# --- fingerprinting --------------------------------------------------------------------------------


def frames_of(relative: str, count: int) -> list[Frame]:
    """Frames at the first `count` statements of functions of an installed 0.16.1 file."""
    text = (SITE / relative).read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef):
            for statement in node.body:
                if isinstance(statement, (ast.Assign, ast.Expr, ast.Return)) and not isinstance(statement.value, ast.Constant):
                    found.append(Frame(REMOTE + relative, statement.lineno, node.name, lines[statement.lineno - 1].strip()))
                    break
    return found[:count]


def test_frames_of_the_installed_release_fingerprint_it():
    frames = frames_of("megatron/core/transformer/moe/router.py", 6) + frames_of("megatron/core/parallel_state.py", 6)
    match = fingerprint(frames, FrameworkIndex())["megatron-core"]
    assert match.framework.releases[match.chosen].name == "0.16.1"
    assert match.agreeing == match.frames == 12
    assert match.describe().startswith("megatron-core ") and match.describe().endswith(", from 12 frames")


def test_a_frame_no_release_holds_narrows_nothing():
    frames = [Frame(REMOTE + "megatron/core/parallel_state.py", 5, "f", "patched_by_the_user(x)")]
    assert fingerprint(frames, FrameworkIndex()) == {}


def test_an_older_checkouts_training_frames_say_nothing_of_the_release():
    """megatron/training/ is in the wheels of 0.17 on only; a Megatron-LM checkout's frames there, without
    their lines or with a line no release holds there, neither vote nor count."""
    core = frames_of("megatron/core/transformer/moe/router.py", 6)
    alone = fingerprint(core, FrameworkIndex())["megatron-core"]
    unprinted = [Frame(REMOTE + "megatron/training/training.py", line, "train", None) for line in (700, 1200, 2100)]
    patched = [Frame(REMOTE + "megatron/training/training.py", 640, "pretrain", "iteration, flops_so_far = train(")]
    match = fingerprint(core + unprinted + patched, FrameworkIndex())["megatron-core"]
    assert (match.candidates, match.agreeing, match.frames) == (alone.candidates, alone.agreeing, alone.frames)


def test_the_faq_log_fingerprints_megatron_core_0_6():
    """The FAQ's ModelLink job ran a Megatron checkout: two of its five megatron/core frames are 0.6.0's lines."""
    report = diagnose([str(SAMPLES / "faq_modellink.log")], groundwork(log_only=True))
    match = report.context.workspace.releases["megatron-core"]
    assert match.describe() == "megatron-core 0.6.0, from 2 of 5 frames"


# Frames of a router's z-loss reaching the 0.18 metrics tracker, at each release's own lines (read in the
# real wheels): router.forward -> routing -> apply_z_loss -> moe_logging's MoEMetricsTracker.record.
ROUTING = "probs, routing_map = self.routing(logits, padding_mask=padding_mask)"
Z_LOSS = "logits = self.apply_z_loss(logits, padding_mask=padding_mask)"
MOE_METRICS_FRAMES = {
    "0.19": [
        ("transformer/moe/router.py", 866, "forward", ROUTING),
        ("transformer/moe/router.py", 763, "routing", Z_LOSS),
        ("transformer/moe/router.py", 697, "apply_z_loss", "get_moe_metrics_tracker().record("),
        ("transformer/moe/moe_logging.py", 125, "record", "entry.values[layer_number - 1] += value.detach()"),
    ],
    "0.18": [
        ("transformer/moe/router.py", 706, "forward", ROUTING),
        ("transformer/moe/router.py", 608, "routing", Z_LOSS),
        ("transformer/moe/router.py", 546, "apply_z_loss", "get_moe_metrics_tracker().record("),
        ("transformer/moe/moe_logging.py", 125, "record", "entry.values[layer_number - 1] += value.detach()"),
    ],
}


def metrics_tracker_log(frames: list[tuple[str, int, str, str]]) -> str:
    """A rank's torchrun traceback through those frames, as Python 3.12 prints it."""
    site = "/usr/local/lib/python3.12/site-packages/megatron/core/"
    lines = [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/home/user/job/pretrain_gpt.py", line 211, in forward_step',
        "[rank0]:     output_tensor = model(tokens, position_ids, attention_mask, labels=labels)",
    ]
    for path, line, function, source in frames:
        lines += [f'[rank0]:   File "{site}{path}", line {line}, in {function}', f"[rank0]:     {source}"]
    return "\n".join([*lines, f"[rank0]: RuntimeError: {UNSAFE_DATA}.", ""])


@pytest.mark.parametrize(("series", "named"), [("0.19", "0.19.0–0.19.2"), ("0.18", "0.18.0–0.18.2")])
def test_frames_of_a_newer_release_name_it_in_the_summary_and_the_finding(tmp_path, series, named):
    """0.17 to 0.19 are indexed: the log's frames name their release, and the summary says what the finding says."""
    log = tmp_path / "train.log"
    log.write_text(metrics_tracker_log(MOE_METRICS_FRAMES[series]))
    done = run_cli("diagnose", str(log), "--log-only", "--format", "json")
    report = json.loads(done.stdout)
    described = f"megatron-core {named}, from 4 frames"
    assert report["summary"]["frameworks"]["megatron-core"]["from"] == f"the log's frames ({described})"
    assert report["findings"] and {finding["source_release"] for finding in report["findings"]} == {described}


def test_a_log_of_user_code_opens_no_index():
    """The index is read lazily: frames outside the frameworks' package folders open no zip."""
    setup = groundwork(log_only=True)
    [finding] = diagnose([str(CORPUS / "user-runstats-binary-op.log")], setup).findings
    assert finding.finding.origin is Origin.LOG
    assert setup.workspace.index.frameworks and all("_archive" not in vars(item) for item in setup.workspace.index.frameworks)


# --- the index stands in for the release's files -------------------------------------------------


@pytest.mark.parametrize(
    "relative",
    [
        "megatron/core/transformer/moe/moe_utils.py",
        "megatron/core/transformer/moe/router.py",
        "megatron/core/parallel_state.py",
        "megatron/core/optimizer/optimizer.py",
        "megatron/core/models/common/embeddings/rotary_pos_embedding.py",
    ],
)
def test_the_index_names_the_same_global_as_the_real_file_for_every_statement(relative):
    """Every one-line statement of every function, as a log frame: located with the real file (a
    source root) and from the index alone, the global (variable, module, class, cached) is the same."""
    text = (SITE / relative).read_text(encoding="utf-8")
    lines = text.splitlines()
    frames = [
        Frame(REMOTE + relative, statement.lineno, function.name, lines[statement.lineno - 1].strip())
        for function in ast.walk(ast.parse(text))
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for statement in ast.walk(function)
        if isinstance(statement, (ast.Assign, ast.AugAssign, ast.Expr, ast.Return))
        and statement.lineno == statement.end_lineno
        and not isinstance(getattr(statement, "value", None), ast.Constant)
    ]
    assert len(frames) > 40
    tracebacks = [traceback_of(frame) for frame in frames]
    with_source = locate(tracebacks, Workspace([SITE]))
    indexed = locate(tracebacks, Workspace([]))  # sys.path as for the other: other packages (yaml) resolve alike
    assert {finding.origin for finding in with_source} == {Origin.JOB}
    assert {finding.origin for finding in indexed} == {Origin.INDEX}

    def named(findings):
        return {
            (finding.culprit.line if finding.culprit else None): (
                (finding.tensor.name.variable, finding.tensor.name.module, finding.tensor.name.owner, finding.tensor.cached)
                if finding.tensor
                else None
            )
            for finding in findings
        }

    assert named(indexed) == named(with_source)
