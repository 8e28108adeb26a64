"""The sentinel's log lines: written and read back by one module, and read by `diagnose` from any log
(files, folders, .gz, stdin, rank prefixes) as findings that `fix` writes in one diff."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from unsafe_doctor.log import inputs, reading
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.sentinel_lines import (
    FAILED,
    FAILED_LINE,
    JSON_START,
    MARKER,
    Failure,
    Summary,
    UnsafeGlobal,
    format_line,
    parse_failure,
    parse_line,
)

ROOT = Path(__file__).parents[2]
FRAMEWORK = ROOT / "samples" / "framework"
TOYTRAIN_LOGS = ROOT / "samples" / "logs" / "toytrain_ema"
TOYTRAIN_ADAPTOR = FRAMEWORK / "toytrain" / "recovery.py"
BUFFER_PATH = "megatron.core.parallel_state._GLOBAL_MEMORY_BUFFER.buffer[('mpu', torch.bfloat16)]"


def run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return run_cli(*args, stdin=stdin, encoding=None)


def records(rank: int, *, healed: bool = False) -> list[UnsafeGlobal | Summary]:
    """What the sentinel logs on one rank after toytrain's and megatron-core's unpatched recovery. The
    scenarios and rules are the record's own claims (the expert_bias one deliberately wrong)."""
    return [
        UnsafeGlobal(
            rank,
            "emulated",
            GlobalName("megatron.core.parallel_state", None, "_GLOBAL_MEMORY_BUFFER"),
            2,
            (BUFFER_PATH,),
            1,
            "megatron.global-memory-buffer",
            "feature_rollback",
        ),
        UnsafeGlobal(
            rank,
            "emulated",
            GlobalName("megatron.core.transformer.moe.router", "TopKRouter", "expert_bias"),
            4,
            ("model[0].decoder.layers[1].mlp.router.expert_bias",),
            1,
            "made.up-rule",
            "feature_rollback",
        ),
        UnsafeGlobal(
            rank,
            "emulated",
            GlobalName("toytrain.state", None, "LOSS_LOG"),
            1,
            ("toytrain.state.LOSS_LOG['lm loss']",),
            None,
            None,
            None,
            healed=healed,
        ),
        UnsafeGlobal(
            rank,
            "emulated",
            GlobalName("toytrain.state", None, "_EMA_GRAD_NORM"),
            1,
            ("toytrain.state._EMA_GRAD_NORM",),
            None,
            None,
            None,
        ),
        UnsafeGlobal(
            rank,
            "emulated",
            GlobalName("megatron.core.transformer.utils", None, "get_default_causal_mask"),
            1,
            ("megatron.core.transformer.utils.get_default_causal_mask(…)[0]",),
            None,
            None,
            None,
            cached=True,
        ),
        Summary(rank, "emulated", "report", 1234, 9, 5, 0.25, None),
    ]


def prefixed(rank: int, lines: list[str]) -> str:
    return "".join(f"[rank{rank}]: {line}\n" for line in lines)


def sentinel_logs(folder: Path) -> Path:
    """Rank 1 as a logger writes it (timestamp, logger name), rank 3 with torchrun's prefix inside a .gz."""
    folder.mkdir(parents=True, exist_ok=True)
    rank1 = "".join(
        f"2026-12-01 10:00:0{n},123 INFO unsafe_doctor.sentinel: {format_line(record)}\n" for n, record in enumerate(records(1))
    )
    (folder / "rank_1.log").write_text(" iteration 19 | lm loss: 1.2E+00 |\n" + rank1 + " iteration 20 |\n")
    rank3 = prefixed(3, [format_line(record) for record in records(3, healed=True)])
    (folder / "rank_3.log.gz").write_bytes(gzip.compress(rank3.encode()))
    return folder


def diagnosed(*args: str, stdin: bytes | None = None) -> tuple[dict, int]:
    result = run("diagnose", *args, "--format", "json", stdin=stdin)
    assert b"Traceback" not in result.stderr, result.stderr.decode()
    return json.loads(result.stdout), result.returncode


def by_variable(report: dict) -> dict[str, dict]:
    return {finding["tensor"]["variable"]: finding for finding in report["findings"]}


# --- the format -----------------------------------------------------------------------------------

names = st.one_of(st.none(), st.text(max_size=40))
ranks = st.one_of(st.none(), st.integers(min_value=0, max_value=1 << 20))
unsafe_globals = st.builds(
    UnsafeGlobal,
    ranks,
    st.text(max_size=12),
    st.builds(GlobalName, names, names, st.text(max_size=40)),
    st.integers(0, 1 << 40),
    st.lists(st.text(max_size=60), max_size=4).map(tuple),
    st.sampled_from([1, 2, None]),
    names,
    names,
    st.booleans(),
    names,
    st.booleans(),
)
summaries = st.builds(
    Summary,
    ranks,
    st.text(max_size=12),
    st.sampled_from(["report", "raise", "heal"]),
    st.integers(0, 1 << 40),
    st.integers(0, 1 << 40),
    st.integers(0, 1 << 20),
    st.floats(min_value=0, max_value=1e6, allow_nan=False),
    st.one_of(st.none(), st.text(max_size=40)),
    st.integers(0, 1 << 20),
    st.lists(st.text(max_size=60), max_size=4).map(tuple),
)
every_record = st.one_of(unsafe_globals, summaries)
prefixes = st.sampled_from(["", "[rank3]: ", "2026-12-01T10:00:00.123456789Z stderr F ", "pod-7 [default3]: ", "x" * 300])


@settings(max_examples=200, deadline=None)
@given(every_record, prefixes)
def test_a_record_read_back_is_the_record_written_whatever_its_names_and_the_line_s_prefix(record, prefix):
    """Quotes, newlines, brackets, non-ASCII and the tag itself in names and paths: the JSON carries them."""
    assert parse_line(prefix + format_line(record)) == record


@settings(max_examples=200, deadline=None)
@given(every_record, st.data())
def test_a_line_cut_anywhere_in_its_json_reads_as_nothing(record, data):
    line = format_line(record)
    start = line.index(JSON_START)
    cut = data.draw(st.integers(min_value=start, max_value=len(line) - 1))
    assert parse_line(line[:cut]) is None


@pytest.mark.parametrize(
    "damaged",
    [
        JSON_START + ', "event": ["unsafe"]}',  # an event that is no string
        JSON_START + ', "event": {"a": 1}}',
        JSON_START + ', "event": "unsafe", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",  # deeper than json recurses
        JSON_START + ', "event": "summary"}',  # fields missing
        JSON_START + ', "event": "unsafe", "rank": "3", "backend": "npu", "module": null, "owner": null, "variable": "X",'
        ' "tensors": 1, "paths": [], "scenario": 1, "rule": null, "fix_function": null}',  # a rank as text
        JSON_START + ', "event": "nothing"}',
        "[unsafe-doctor sentinel] no json here",
    ],
)
def test_a_damaged_or_hostile_record_reads_as_nothing(damaged):
    assert parse_line("[rank3]: " + damaged) is None


def test_a_summary_written_before_the_walk_counted_what_it_could_not_read_reads_as_nothing_unread():
    line = format_line(Summary(3, "npu", "report", 10, 0, 0, 0.1, None))
    older = line.replace(', "not_walked": 0, "not_walked_first": []', "")
    assert older != line and parse_line(older) == Summary(3, "npu", "report", 10, 0, 0, 0.1, None, 0, ())


# --- finding the lines in a log --------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [7, 23, 64, 4096])
def test_every_record_line_is_kept_once_wherever_the_reads_cut_it(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(reading, "CHUNK", chunk)
    lines = [format_line(record) for record in records(1)]
    text = "".join(f"noise {n}\n{line}\n" for n, line in enumerate(lines)) + lines[0]  # the last one without a newline
    log = tmp_path / "train.log"
    log.write_text(text)
    scan = inputs.scan([str(log)], (), record_markers=(MARKER,))
    assert [excerpt.text.rstrip("\n") for excerpt in scan.records] == [*lines, lines[0]]
    assert all(text.encode()[excerpt.start :].startswith(excerpt.text.encode()) for excerpt in scan.records)


def test_record_lines_past_the_budget_or_too_long_are_counted_not_kept(tmp_path, monkeypatch):
    line = format_line(records(1)[0])
    monkeypatch.setattr(reading, "RECORD_BUDGET", 2 * (len(line) + 1))
    log = tmp_path / "train.log"
    log.write_text(f"{line}\n{line}\n{line}\n[unsafe-doctor sentinel] {'x' * (reading.RECORD_LINE_MAX + 10)}\n")
    scan = inputs.scan([str(log)], (), record_markers=(MARKER,))
    assert len(scan.records) == 2
    assert scan.records_not_kept == 2


# --- diagnose --------------------------------------------------------------------------------------


def test_diagnose_reports_every_global_the_sentinel_named_with_the_ranks_and_no_traceback(tmp_path):
    report, code = diagnosed(str(sentinel_logs(tmp_path / "logs")), "--source-root", str(FRAMEWORK))
    assert code == 1
    found = by_variable(report)
    assert set(found) == {"_GLOBAL_MEMORY_BUFFER", "expert_bias", "LOSS_LOG", "_EMA_GRAD_NORM", "get_default_causal_mask"}
    for finding in found.values():
        assert finding["ranks"] == [1, 3]
        assert finding["found_by"] == ["sentinel"]
        assert finding["source_from"] == "sentinel"
        assert (finding["culprit"], finding["frames"], finding["message"]) == (None, [], None)
        assert finding["sentinel"]["ranks"] == [1, 3]
        assert finding["sentinel"]["backends"] == ["emulated"]
    buffer = found["_GLOBAL_MEMORY_BUFFER"]
    assert (buffer["scenario"], buffer["rule"]) == (1, "megatron.global-memory-buffer")
    assert buffer["sentinel"]["paths"] == [BUFFER_PATH]
    assert buffer["sentinel"]["tensors"] == 2
    # the knowledge base decides, not the record's claim (scenario 1, "made.up-rule")
    bias = found["expert_bias"]
    assert (bias["scenario"], bias["rule"], bias["tensor"]["owner"]) == (2, "megatron.router-expert-bias", "TopKRouter")
    assert bias["fix"]["function"] == "recv_rank_repair"
    # toytrain's globals are classified by the source heuristics over --source-root
    assert (found["LOSS_LOG"]["scenario"], found["_EMA_GRAD_NORM"]["scenario"]) == (1, 2)
    cache = found["get_default_causal_mask"]
    assert (cache["scenario"], cache["rule"]) == (1, "megatron.default-causal-mask-cache")  # a rule that names a frame
    assert cache["sentinel"]["paths"] == ["megatron.core.transformer.utils.get_default_causal_mask(…)[0]"]
    assert "cache_clear()" in cache["fix"]["code"]
    assert [(check["rank"], check["backend"], check["stopped_early"]) for check in report["sentinel"]] == [
        (1, "emulated", None),
        (3, "emulated", None),
    ]


@pytest.mark.parametrize(
    ("module", "owner", "variable", "rule"),
    [
        ("megatron.core.transformer.moe.moe_logging", "MoEMetricsTracker", "_metrics", "megatron.moe-metrics-tracker"),
        ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer", "_scale_one", "megatron.optimizer-scale-one"),
        ("megatron.core.transformer.utils", None, "get_default_causal_mask", "megatron.default-causal-mask-cache"),
    ],
)
def test_a_rule_that_knows_a_global_by_the_frame_reading_it_names_the_global_the_sentinel_logged(
    tmp_path, module, owner, variable, rule
):
    """Such rules match a traceback's frame; the sentinel knows the global itself, and takes the frame as given."""
    log = tmp_path / "train.log"
    record = UnsafeGlobal(0, "emulated", GlobalName(module, owner, variable), 1, (), None, None, None)
    log.write_text(prefixed(0, [format_line(record)]))
    report, code = diagnosed(str(log))
    assert code == 1
    [finding] = report["findings"]
    assert (finding["rule"], finding["culprit"]) == (rule, None)


def test_a_healed_global_is_still_a_finding_with_a_note(tmp_path):
    report, _ = diagnosed(str(sentinel_logs(tmp_path / "logs")), "--source-root", str(FRAMEWORK))
    loss_log = by_variable(report)["LOSS_LOG"]
    assert loss_log["sentinel"]["healed_ranks"] == [3]
    assert loss_log["sentinel"]["healed"] is False  # rank 1 did not heal it
    assert any("healed it in process on rank 3 only" in note for note in loss_log["notes"])
    assert loss_log["fix"] is not None


def test_the_sentinel_lines_on_stdin_give_the_same_findings(tmp_path):
    folder = sentinel_logs(tmp_path / "logs")
    piped = (folder / "rank_1.log").read_bytes() + gzip.decompress((folder / "rank_3.log.gz").read_bytes())
    from_files, _ = diagnosed(str(folder), "--source-root", str(FRAMEWORK))
    from_stdin, code = diagnosed("--source-root", str(FRAMEWORK), stdin=piped)
    assert code == 1
    assert [finding["tensor"] for finding in from_stdin["findings"]] == [finding["tensor"] for finding in from_files["findings"]]
    assert [finding["ranks"] for finding in from_stdin["findings"]] == [[1, 3]] * 5


def test_the_text_report_says_which_backend_checked_each_rank_and_whether_its_walk_stopped(tmp_path):
    log = tmp_path / "train.log"
    lines = [
        format_line(UnsafeGlobal(0, "npu", GlobalName("toytrain.state", None, "LOSS_LOG"), 1, (), None, None, None)),
        format_line(Summary(0, "npu", "raise", 500, 1, 1, 0.1, None)),
        format_line(Summary(1, "emulated", "report", 400, 0, 0, 1.5, "time budget (1.0 s)")),
        format_line(Summary(2, "emulated", "report", 300, 0, 0, 0.2, None, 3, ("pkg.state.ARGS (its __dict__ is a property)",))),
    ]
    log.write_text("".join(f"[rank{rank}]: {line}\n" for rank, line in zip((0, 0, 1, 2), lines, strict=True)))
    result = run("diagnose", str(log), "--no-input", "--source-root", str(FRAMEWORK))
    out = " ".join(result.stdout.decode().split())
    assert result.returncode == 1
    assert "rank 0: 500 tensors checked (checked by torch_npu on the NPU), mode raise" in out
    assert "rank 1: 400 tensors checked (emulated backend, no NPU check), mode report, clean; stopped early: time budget" in out
    assert (
        "rank 2: 300 tensors checked (emulated backend, no NPU check), mode report, clean; could not walk up to 3 "
        "objects, the first pkg.state.ARGS (its __dict__ is a property)"
    ) in out


def test_an_emulated_check_is_never_called_an_npu_check(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(prefixed(3, [format_line(record) for record in records(3)]))
    out = run("diagnose", str(log), "--no-input").stdout.decode()
    assert "emulated backend, no NPU check" in out
    assert "on the NPU" not in out


def test_a_traceback_and_the_sentinel_naming_one_global_are_one_finding(tmp_path):
    """toytrain's log: rank 1 died on _EMA_GRAD_NORM; the sentinel had named it, and LOSS_LOG, on ranks 1 and 3."""
    folder = tmp_path / "toytrain_ema"
    shutil.copytree(TOYTRAIN_LOGS, folder)
    toytrain = [record for record in records(3) if isinstance(record, UnsafeGlobal) and record.name.module == "toytrain.state"]
    (folder / "sentinel_rank3.log").write_text(prefixed(3, [format_line(record) for record in toytrain]))
    report, code = diagnosed(str(folder), "--source-root", str(FRAMEWORK))
    assert code == 1
    found = by_variable(report)
    assert set(found) == {"_EMA_GRAD_NORM", "LOSS_LOG"}
    ema = found["_EMA_GRAD_NORM"]
    assert ema["found_by"] == ["traceback", "sentinel"]
    assert ema["ranks"] == [1, 3]  # rank 1's traceback, rank 3's sentinel line
    assert ema["culprit"]["function"] == "clip_gradients"
    assert ema["frames"]
    assert ema["message"] == "There is unsafe data in the input tensor."
    assert found["LOSS_LOG"]["found_by"] == ["sentinel"]


def test_fix_writes_every_finding_of_the_sentinel_in_one_diff(tmp_path):
    adaptor = tmp_path / "recovery.py"
    shutil.copy(TOYTRAIN_ADAPTOR, adaptor)
    original = adaptor.read_bytes()
    toytrain = [
        record
        for rank in (1, 3)
        for record in records(rank)
        if isinstance(record, UnsafeGlobal) and record.name.module == "toytrain.state"
    ]
    log = tmp_path / "train.log.gz"
    log.write_bytes(gzip.compress("".join(f"[rank{r.rank}]: {format_line(r)}\n" for r in toytrain).encode()))
    result = run("fix", str(log), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--dry-run", "--no-input")
    diff = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()
    assert diff.count("--- a/") == 1  # one file, one diff
    assert diff.count("+    # unsafe-doctor: begin ") == 3  # LOSS_LOG in rollback; _EMA_GRAD_NORM sent and received
    assert "begin generic.reinitialise:toytrain.state.LOSS_LOG" in diff
    assert diff.count("begin generic.replica-copy:toytrain.state._EMA_GRAD_NORM") == 2
    assert adaptor.read_bytes() == original
    unasked = run("fix", str(log), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--no-input")
    assert unasked.returncode == 1  # not confirmed: nothing written
    assert adaptor.read_bytes() == original


HOSTILE = [
    UnsafeGlobal(1, "emulated", GlobalName("os", None, "system('x')"), 1, (), 1, None, None),
    UnsafeGlobal(1, "emulated", GlobalName("os.system('x')", None, "X"), 1, (), 1, None, None),
    UnsafeGlobal(1, "emulated", GlobalName("toytrain.state", "__class__", "X"), 1, (), 1, None, None),
    UnsafeGlobal(1, "emulated", GlobalName("p\u0430rallel_state", None, "X"), 1, (), 1, None, None),  # a Cyrillic a
    UnsafeGlobal(1, "emulated", GlobalName("toytrain.state", None, "LOSS_LOG"), 10**30, (), 1, None, None),
    UnsafeGlobal(1, "emulated", GlobalName("toytrain.state", None, "LOSS_LOG"), -1, (), 1, None, None),
    UnsafeGlobal(1 << 40, "emulated", GlobalName("toytrain.state", None, "LOSS_LOG"), 1, (), 1, None, None),
    UnsafeGlobal(1, "npu; rm -rf /", GlobalName("toytrain.state", None, "LOSS_LOG"), 1, (), 1, None, None),
    UnsafeGlobal(1, "emulated", GlobalName("toytrain.state", None, "LOSS_LOG"), 1, (), 1, None, None, healed="yes"),  # type: ignore[arg-type]
    UnsafeGlobal(1, "emulated", GlobalName("toytrain.state", None, "LOSS_LOG"), "2", (), 1, None, None),  # type: ignore[arg-type]
    UnsafeGlobal(1, "emulated", GlobalName("toytrain.state", None, "f"), 1, (), 1, None, None, cached="yes"),  # type: ignore[arg-type]
    Summary(1, "emulated", "fix-it", 1, 0, 0, 0.1, None),  # type: ignore[arg-type]
    Summary(1, "emulated", "report", 1, 0, 0, float("nan"), None),
    Summary(1, "emulated", "report", 1, 0, 0, 0.1, ["stopped"]),  # type: ignore[arg-type]
    Summary(1, "emulated", "report", 1, 0, 0, 0.1, None, -1),
    Summary(1, "emulated", "report", 1, 0, 0, 0.1, None, 1, ("pkg.X", 3)),  # type: ignore[arg-type]
]


def test_a_hostile_record_is_ignored_without_a_traceback(tmp_path):
    log = tmp_path / "train.log"
    good = UnsafeGlobal(1, "emulated", GlobalName("toytrain.state", None, "_EMA_GRAD_NORM"), 1, (), None, None, None)
    damaged = JSON_START + ', "event": ["unsafe"]}'
    log.write_text(prefixed(1, [*map(format_line, HOSTILE), "[unsafe-doctor sentinel] " + damaged, format_line(good)]))
    report, code = diagnosed(str(log), "--source-root", str(FRAMEWORK))
    assert code == 1
    assert [finding["tensor"]["variable"] for finding in report["findings"]] == ["_EMA_GRAD_NORM"]
    assert report["sentinel"] == []
    assert report["summary"]["sentinel_lines_ignored"] == len(HOSTILE) + 1
    text = run("diagnose", str(log), "--no-input", "--source-root", str(FRAMEWORK))
    assert b"Traceback" not in text.stderr
    assert f"{len(HOSTILE) + 1} sentinel lines not read" in " ".join(text.stdout.decode().split())


def test_a_log_of_clean_checks_is_no_finding(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(prefixed(0, [format_line(Summary(0, "emulated", "report", 300, 0, 0, 0.2, None))]))
    report, code = diagnosed(str(log))
    assert code == 0
    assert report["findings"] == []
    assert report["sentinel"][0]["tensors_checked"] == 300


def test_a_global_the_step_writes_before_reading_is_no_finding(tmp_path):
    """The sentinel logged it as harmless (knowledge_base/step_written.yaml): nothing to fix."""
    log = tmp_path / "train.log"
    name = GlobalName("megatron.core.transformer.moe.moe_utils", "MoEAuxLossAutoScaler", "main_loss_backward_scale")
    scale = UnsafeGlobal(1, "emulated", name, 1, (), None, None, None, written_by_step="megatron.moe-aux-loss-scale")
    log.write_text(prefixed(1, [format_line(scale), format_line(records(1)[3])]))
    result = run("diagnose", str(log), "--format", "json", "--no-input")
    report = json.loads(result.stdout)
    assert [finding["tensor"]["variable"] for finding in report["findings"]] == ["_EMA_GRAD_NORM"]


def test_the_real_sentinel_sample_log_gives_both_globals_with_no_traceback():
    """A 4-rank torchrun job (samples/make_logs.py toytrain_sentinel): raise mode stopped the recovery."""
    log = Path(__file__).resolve().parents[2] / "samples" / "logs" / "toytrain_sentinel.log"
    framework = log.parent.parent / "framework"
    result = run("diagnose", str(log), "--source-root", str(framework), "--format", "json", "--no-input")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    found = {finding["tensor"]["variable"]: finding for finding in report["findings"]}
    assert {name: (finding["scenario"], finding["ranks"], finding["found_by"]) for name, finding in found.items()} == {
        "LOSS_LOG": (1, [1], ["sentinel"]),
        "_EMA_GRAD_NORM": (2, [1], ["sentinel"]),
    }
    assert sorted((check["rank"], check["unsafe_globals"]) for check in report["sentinel"]) == [(0, 0), (1, 2), (2, 0), (3, 0)]


def test_a_check_of_no_tensor_is_never_called_clean_in_its_line_or_the_report(tmp_path):
    """A line once read "clean; 0 tensors checked", claiming a safety nothing was checked for."""
    none = Summary(1, "none", "report", 0, 0, 0, 0.0, "nothing checked: no unsafe backend here (no NPU; no emulation active)")
    empty, clean = Summary(2, "emulated", "report", 0, 0, 0, 0.0, None), Summary(3, "emulated", "report", 14, 0, 0, 0.03, None)
    assert format_line(none).startswith("[unsafe-doctor sentinel] rank 1: no tensors checked in 0.00 s (none backend, ")
    assert format_line(empty).startswith("[unsafe-doctor sentinel] rank 2: no tensors checked in 0.00 s (emulated backend, ")
    assert format_line(clean).startswith("[unsafe-doctor sentinel] rank 3: clean; 14 tensors checked in 0.03 s ")
    older = format_line(none).replace("no tensors checked", "clean; 0 tensors checked")  # as older lines read
    assert parse_line(older) == parse_line(format_line(none)) == none  # the JSON is the contract: both read the same

    log = tmp_path / "train.log"
    log.write_text(prefixed(1, [older]) + prefixed(2, [format_line(empty)]) + prefixed(3, [format_line(clean)]))
    out = " ".join(run("diagnose", str(log), "--no-input").stdout.decode().split())
    assert "rank 1: 0 tensors checked (none backend), mode report, safety unknown; stopped early: nothing checked" in out
    assert (
        "ranks 2-3: 0–14 tensors checked (emulated backend, no NPU check), mode report, clean on the ranks that "
        "checked any; walk complete"
    ) in out
    assert ", clean;" not in out


def test_the_blocks_line_where_the_sentinel_could_not_run_is_reported_per_rank(tmp_path):
    """The adaptor's block logs one line, with no JSON, where it cannot run the sentinel;
    diagnose once skipped it, so a rank nothing checked read as a rank with no sentinel line at all. The
    rank is the line's own (the block's `RANK`), else its prefix's, as a block written before the
    rank gave it."""
    missing, older = ModuleNotFoundError("No module named 'unsafe_doctor'"), TypeError("check() got an unexpected keyword")
    lines = [
        FAILED_LINE % ("2", missing),
        f"[rank4]: WARNING:unsafe_doctor.sentinel:{FAILED_LINE % ('?', missing)}",
        f"[rank5]: [unsafe-doctor sentinel] {FAILED}{missing!r}",  # a block written before the rank
        FAILED_LINE % ("2", missing),  # the next recovery's: the same failure
        f"[rank6]: {FAILED_LINE % ('7', older)}",  # the line's own rank wins
    ]
    missing, older = repr(missing), repr(older)
    assert [parse_failure(line) for line in lines] == [
        Failure(2, missing),
        Failure(None, missing),
        Failure(None, missing),
        Failure(2, missing),
        Failure(7, older),
    ]
    log = tmp_path / "train.log"
    log.write_text("".join(line + "\n" for line in lines))
    report, code = diagnosed(str(log))
    assert code == 0 and report["findings"] == [] and report["summary"]["sentinel_lines_ignored"] == 0
    assert report["sentinel_failures"] == [
        {"rank": 2, "error": missing},
        {"rank": 4, "error": missing},
        {"rank": 5, "error": missing},
        {"rank": 7, "error": older},
    ]
    out = " ".join(run("diagnose", str(log), "--no-input").stdout.decode().split())
    assert f"Sentinel checks: the sentinel could not run on ranks 2, 4-5: {missing} the sentinel could not run on rank 7: " in out
