"""Knowledge files: schema validation with line numbers, overriding, and rule matching."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from unsafe_doctor.classify import FixPlan
from unsafe_doctor.context import groundwork
from unsafe_doctor.diagnosis import diagnose
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge import is_safe_dotted, load_knowledge, rule_matches, validate_files

GOOD_RULE = """\
rules:
  - id: acme.loss-log
    title: Acme loss log
    match:
      variable: _LOSS_LOG
      module: acme.state
    scenario: 1
    phase: rollback
    fix:
      imports: ["from $parent import $alias"]
      code: |
        $alias.$variable.clear()
    reason: A per-iteration loss log, emptied after every step.
"""


def write(tmp_path: Path, text: str, name: str = "rules.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_valid_file_has_no_problems(tmp_path):
    assert validate_files([write(tmp_path, GOOD_RULE)]) == []


def test_invalid_yaml_names_its_line(tmp_path):
    path = write(tmp_path, "rules:\n  - id: x\n    title: [unclosed\n")
    [problem] = validate_files([path])
    assert problem.startswith(f"{path}:4: invalid YAML") or problem.startswith(f"{path}:3: invalid YAML")


def test_a_missing_field_points_at_the_rule(tmp_path):
    path = write(tmp_path, GOOD_RULE.replace("    scenario: 1\n", ""))
    problems = validate_files([path])
    assert any(p.startswith(f"{path}:2: rules.0:") and "'scenario' is a required property" in p for p in problems), problems


def test_a_wrong_value_points_at_its_own_line(tmp_path):
    path = write(tmp_path, GOOD_RULE.replace("scenario: 1", "scenario: 3"))
    problems = validate_files([path])
    assert any(p.startswith(f"{path}:7: rules.0.scenario:") for p in problems), problems


def test_scenario_two_must_be_fixed_in_repair_with_send_and_recv(tmp_path):
    path = write(tmp_path, GOOD_RULE.replace("scenario: 1", "scenario: 2"))
    problems = validate_files([path])
    assert problems and all(str(path) in p for p in problems)
    assert any("'repair' was expected" in p or "'send' is a required property" in p for p in problems), problems


def test_bad_regex_specifier_and_slot_are_reported(tmp_path):
    text = GOOD_RULE.replace("variable: _LOSS_LOG", "variable_regex: '_LOSS_(['")
    text = text.replace("    scenario: 1\n", "    framework: {package: acme, versions: 'not a version'}\n    scenario: 1\n")
    text = text.replace("$alias.$variable.clear()", "$alias.$variable.clear($evil)")
    problems = validate_files([write(tmp_path, text)])
    assert any("variable_regex" in p for p in problems), problems
    assert any("not a PEP 440 specifier" in p for p in problems), problems
    assert any("unknown template slot(s) evil" in p for p in problems), problems


def test_duplicate_ids_in_one_file(tmp_path):
    body = GOOD_RULE.split("rules:\n", 1)[1]
    problems = validate_files([write(tmp_path, "rules:\n" + body + body)])
    assert any("duplicate id 'acme.loss-log'" in p for p in problems), problems


def test_load_refuses_a_bad_user_file_with_its_line(tmp_path):
    path = write(tmp_path, GOOD_RULE.replace("scenario: 1", "scenario: nine"))
    with pytest.raises(UsageError, match=rf"^{path}:7: rules.0.scenario"):
        load_knowledge([path])


def test_a_user_rule_replaces_a_shipped_one_with_the_same_id(tmp_path):
    shipped = load_knowledge()
    if not shipped.rules:
        pytest.skip("no shipped rules")
    target = shipped.rules[0]
    text = GOOD_RULE.replace("acme.loss-log", target.id).replace("Acme loss log", "Overridden")
    merged = load_knowledge([write(tmp_path, text)])
    assert merged.rule(target.id).title == "Overridden"
    assert len(merged.rules) == len(shipped.rules)


def test_rule_matching_by_name_module_and_frame(tmp_path):
    [rule] = load_knowledge([write(tmp_path, GOOD_RULE)]).rules[-1:]
    assert rule_matches(rule, "_LOSS_LOG", "acme.state", None, "/x/acme/train.py", "step")
    assert not rule_matches(rule, "_LOSS_LOG", "other.state", None, None, None)
    assert not rule_matches(rule, "_LOSS", "acme.state", None, None, None)
    assert not rule_matches(rule, None, None, None, "/x/acme/train.py", "step")  # names no frame


def test_a_frame_rule_supplies_the_variable_a_line_does_not_name(tmp_path):
    text = GOOD_RULE.replace("      module: acme.state\n", "      file: '*/acme/log.py'\n      function: record\n")
    [rule] = load_knowledge([write(tmp_path, text)]).rules[-1:]
    assert rule_matches(rule, None, None, None, "/opt/acme/log.py", "record")
    assert not rule_matches(rule, None, None, None, "/opt/acme/log.py", "other")


LOSS_LOG_BLOCKS = """\
      - variable: _LOSS_LOG
        file: '*/acme/log.py'
        function: record
        loss_scaling: grad-scaler
      - variable_regex: '_LOSS_.*'
        module: acme.state
"""


def test_a_match_list_matches_by_any_block_and_its_first_names_the_variable(tmp_path):
    text = GOOD_RULE.replace("      variable: _LOSS_LOG\n      module: acme.state\n", LOSS_LOG_BLOCKS)
    [rule] = load_knowledge([write(tmp_path, text)]).rules[-1:]
    assert rule.match.variable == "_LOSS_LOG" and len(rule.matches) == 2
    assert rule_matches(rule, "_LOSS_SUM", "acme.state", None, "/x/acme/train.py", "step", "none")  # second block
    assert not rule_matches(rule, "_LOSS_SUM", "other.state", None, "/x/acme/train.py", "step")


@pytest.mark.parametrize(("loss_scaling", "matches"), [("grad-scaler", True), (None, True), ("none", False)])
def test_a_block_with_a_loss_scaling_fits_that_run_or_one_that_does_not_tell(tmp_path, loss_scaling, matches):
    text = GOOD_RULE.replace("      variable: _LOSS_LOG\n      module: acme.state\n", LOSS_LOG_BLOCKS)
    [rule] = load_knowledge([write(tmp_path, text)]).rules[-1:]
    assert rule_matches(rule, None, None, None, "/opt/acme/log.py", "record", loss_scaling) is matches


@pytest.mark.parametrize(
    ("replacement", "where"),
    [
        ("      variable: _LOSS_LOG\n      loss_scaling: fp8\n", "rules.0.match.loss_scaling: 'fp8' is not one of"),
        ("      []\n", "rules.0.match: [] should be non-empty"),
        ("      - {module: acme.state}\n", "rules.0.match.0:"),
    ],
)
def test_a_bad_loss_scaling_or_match_list_is_reported(tmp_path, replacement, where):
    text = GOOD_RULE.replace("      variable: _LOSS_LOG\n      module: acme.state\n", replacement)
    problems = validate_files([write(tmp_path, text)])
    assert any(where in problem for problem in problems), problems


# The culprit of a real fp16 run (tests/corpus/logs/megatron-grad-scaler.log): the loss scale is
# read first in scale_loss(), through get_loss_scale(), whose result the line does not name.
SCALE_LOSS_ERROR = """\
[rank3]: Traceback (most recent call last):
[rank3]:   File "/job/tests/corpus/cases.py", line 346, in train_step
[rank3]:     self.megatron_optimizer.scale_loss(loss).backward()
[rank3]:   File "/usr/local/lib/python3.11/site-packages/megatron/core/optimizer/optimizer.py", line 248, in scale_loss
[rank3]:     return self.get_loss_scale() * loss
[rank3]: RuntimeError: There is unsafe data in the input tensor.
"""
ITERATION = (
    "[rank3]: [2026-11-30 05:10:42] iteration      120/    1000 | lm loss: 4.028615E+00 | loss scale: {} | "
    "number of skipped iterations:   0 |\n"
)
FP16_ARGUMENT = "  fp16 ............................................ {}\n"


@pytest.mark.parametrize(
    ("before", "loss_scaling", "rule", "other"),
    [
        (ITERATION.format("1.0"), "none", "megatron.optimizer-scale-one", "megatron.grad-scaler"),
        (ITERATION.format("65536.0"), "grad-scaler", "megatron.grad-scaler", "megatron.optimizer-scale-one"),
        (FP16_ARGUMENT.format(True), "grad-scaler", "megatron.grad-scaler", "megatron.optimizer-scale-one"),
        (FP16_ARGUMENT.format(False), "none", "megatron.optimizer-scale-one", "megatron.grad-scaler"),
        ("", None, "megatron.optimizer-scale-one", "megatron.grad-scaler"),  # unknown: read as bf16
    ],
)
def test_the_loss_scaling_the_log_shows_chooses_the_rule_for_scale_loss(tmp_path, before, loss_scaling, rule, other):
    log = tmp_path / "train.log"
    log.write_text(before + SCALE_LOSS_ERROR)
    diagnosis = diagnose([str(log)], groundwork())
    [item] = diagnosis.findings
    result = item.classification
    expected = load_knowledge().rule(rule)
    assert diagnosis.loss_scaling == loss_scaling
    assert (result.rule, result.scenario, result.confidence) == (rule, expected.scenario, "high")
    assert isinstance(result.fix, FixPlan) and result.fix.phase == expected.phase
    [note] = [note for note in result.notes if other in note]
    assert ("neither a loss scale nor the fp16 argument" in note) is (loss_scaling is None)


def test_only_scale_loss_stands_for_the_grad_scaler_among_the_optimizers_frames():
    rule = load_knowledge().rule("megatron.grad-scaler")
    optimizer_py = "/site/megatron/core/optimizer/optimizer.py"
    module = "megatron.core.optimizer.optimizer"
    assert rule_matches(rule, None, module, None, optimizer_py, "scale_loss", "grad-scaler")
    assert not rule_matches(rule, None, module, None, optimizer_py, "step_with_ready_grads", "grad-scaler")
    # the scaler's own tensors match whatever the log shows
    grad_scaler_py = "/site/megatron/core/optimizer/grad_scaler.py"
    assert rule_matches(rule, "backoff_factor", "megatron.core.optimizer.grad_scaler", "DynamicGradScaler", grad_scaler_py, "update", "none")


@pytest.mark.parametrize(
    ("name", "safe"),
    [
        ("megatron.core.parallel_state", True),
        ("_MOE_AUX_LOSSES_LOGGING_TRACKER", True),
        ("os.system('rm -rf /')", False),
        ("x; import os", False),
        ("__import__", False),
        ("a.__class__", False),
        ("class", False),
        ("a..b", False),
        ("", False),
        (None, False),
    ],
)
def test_only_plain_dotted_names_reach_generated_code(name, safe):
    assert is_safe_dotted(name) is safe


def test_every_shipped_knowledge_file_meets_the_schema():
    """load_knowledge skips the schema for shipped files, so this test is what holds them to it."""
    from unsafe_doctor.knowledge import shipped_knowledge_dir

    assert validate_files([shipped_knowledge_dir()]) == []


CORPUS = Path(__file__).parent / "corpus"


def test_a_log_from_another_release_than_the_installed_one_lowers_a_version_bound_rule_to_medium():
    """A megatron-core 0.12.1 run read on a machine with 0.16.1 installed: the culprit's line is
    elsewhere in the installed file, so the version read from the installation may not be the job's."""
    log = str(CORPUS / "logs" / "megatron-0.12-layer-wise-tracker.log")
    [guessed] = diagnose([log], groundwork()).findings
    assert guessed.finding.source_differs
    assert guessed.classification.confidence == "medium"
    assert any("give --source-root with the job's tree to be sure" in note for note in guessed.classification.notes)
    [told] = diagnose([log], groundwork(source_roots=[CORPUS / "trees" / "megatron-core-0.12.1"])).findings
    assert (told.classification.rule, told.classification.confidence) == ("megatron.moe-layer-wise-tracker", "high")


def test_a_log_from_the_installed_release_keeps_high_confidence():
    [item] = diagnose([str(Path(__file__).parents[1] / "samples" / "logs" / "megatron_moe_tracker.log")], groundwork()).findings
    assert not item.finding.source_differs and item.classification.confidence == "high"
