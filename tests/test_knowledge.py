"""Knowledge files: schema validation with line numbers, overriding, and rule matching."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

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
