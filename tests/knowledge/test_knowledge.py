"""Knowledge files: schema validation with line numbers, overriding, and rule matching."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import run_cli

from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge import matching
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.knowledge.loading import load_knowledge, validate_files
from unsafe_doctor.knowledge.matching import rule_matches
from unsafe_doctor.knowledge.render.template import FixPlan
from unsafe_doctor.knowledge.rules import is_safe_dotted
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.source.index import FrameworkIndex
from unsafe_doctor.source.workspace import Origin

ROOT = Path(__file__).resolve().parents[2]
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
    target = shipped.rules[0]
    text = GOOD_RULE.replace("acme.loss-log", target.id).replace("Acme loss log", "Overridden")
    merged = load_knowledge([write(tmp_path, text)])
    assert merged.rule(target.id).title == "Overridden"
    assert len(merged.rules) == len(shipped.rules)


def test_rule_matching_by_name_module_and_frame(tmp_path):
    [rule] = load_knowledge([write(tmp_path, GOOD_RULE)]).rules[-1:]
    assert rule_matches(rule, GlobalName("acme.state", None, "_LOSS_LOG"), "/x/acme/train.py", function="step")
    assert not rule_matches(rule, GlobalName("other.state", None, "_LOSS_LOG"), None, function=None)
    assert not rule_matches(rule, GlobalName("acme.state", None, "_LOSS"), None, function=None)
    assert not rule_matches(rule, GlobalName(None, None, None), "/x/acme/train.py", function="step")  # names no frame


def test_a_frame_rule_supplies_the_variable_a_line_does_not_name(tmp_path):
    text = GOOD_RULE.replace("      module: acme.state\n", "      file: '*/acme/log.py'\n      function: record\n")
    [rule] = load_knowledge([write(tmp_path, text)]).rules[-1:]
    assert rule_matches(rule, GlobalName(None, None, None), "/opt/acme/log.py", function="record")
    assert not rule_matches(rule, GlobalName(None, None, None), "/opt/acme/log.py", function="other")


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
    # the second block
    assert rule_matches(
        rule, GlobalName("acme.state", None, "_LOSS_SUM"), "/x/acme/train.py", function="step", loss_scaling="none"
    )
    assert not rule_matches(rule, GlobalName("other.state", None, "_LOSS_SUM"), "/x/acme/train.py", function="step")


@pytest.mark.parametrize(("loss_scaling", "matches"), [("grad-scaler", True), (None, True), ("none", False)])
def test_a_block_with_a_loss_scaling_fits_that_run_or_one_that_does_not_tell(tmp_path, loss_scaling, matches):
    text = GOOD_RULE.replace("      variable: _LOSS_LOG\n      module: acme.state\n", LOSS_LOG_BLOCKS)
    [rule] = load_knowledge([write(tmp_path, text)]).rules[-1:]
    assert (
        rule_matches(rule, GlobalName(None, None, None), "/opt/acme/log.py", function="record", loss_scaling=loss_scaling)
        is matches
    )


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
    assert rule_matches(rule, GlobalName(module, None, None), optimizer_py, function="scale_loss", loss_scaling="grad-scaler")
    assert not rule_matches(
        rule, GlobalName(module, None, None), optimizer_py, function="step_with_ready_grads", loss_scaling="grad-scaler"
    )
    # the scaler's own tensors match whatever the log shows
    grad_scaler_py = "/site/megatron/core/optimizer/grad_scaler.py"
    assert rule_matches(
        rule,
        GlobalName("megatron.core.optimizer.grad_scaler", "DynamicGradScaler", "backoff_factor"),
        grad_scaler_py,
        function="update",
        loss_scaling="none",
    )


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
    """load_knowledge skips the schema and the alias bound for shipped files, so this test is what holds them to both."""
    from unsafe_doctor.knowledge.loading import shipped_knowledge_dir

    assert validate_files([shipped_knowledge_dir()]) == []


CORPUS = Path(__file__).parents[1] / "corpus"


def test_a_log_from_another_release_than_the_installed_one_is_read_as_its_own_release():
    """A megatron-core 0.12.1 run read on a machine with 0.16.1 installed: the frames fingerprint
    0.12.1-0.12.3 in the index, whose rule is chosen at high confidence, as with the job's tree."""
    log = str(CORPUS / "logs" / "megatron-0.12-layer-wise-tracker.log")
    [indexed] = diagnose([log], groundwork()).findings
    assert indexed.finding.origin is Origin.INDEX
    assert indexed.finding.release == "megatron-core 0.12.1–0.12.3, from 4 frames"
    assert (indexed.classification.rule, indexed.classification.confidence) == ("megatron.moe-layer-wise-tracker", "high")
    [told] = diagnose([log], groundwork(source_roots=[CORPUS / "trees" / "megatron-core-0.12.1"])).findings
    assert (told.classification.rule, told.classification.confidence) == ("megatron.moe-layer-wise-tracker", "high")


def test_an_installed_release_the_frames_disagree_with_is_not_read(tmp_path):
    """With no index for the log's release (here: an empty index), a local installation stands in
    only where its lines are the log's: 0.16.1's moe_utils.py is not 0.12.1's, so the finding rests
    on the log's text and says so, rather than on a file that did not run."""
    log = str(CORPUS / "logs" / "megatron-0.12-layer-wise-tracker.log")
    setup = groundwork()
    setup.workspace.index = FrameworkIndex(tmp_path)  # an empty index folder
    [guessed] = diagnose([log], setup).findings
    assert guessed.finding.source_differs and guessed.finding.origin is Origin.LOG and guessed.finding.source_file is None
    assert guessed.finding.tensor is not None and guessed.finding.tensor.expression == "tracker[name]"


def test_a_log_from_the_installed_release_keeps_high_confidence():
    [item] = diagnose([str(Path(__file__).parents[2] / "samples" / "logs" / "megatron_moe_tracker.log")], groundwork()).findings
    assert not item.finding.source_differs and item.classification.confidence == "high"


# --- templates, probes, switches, roles and ties: knowledge as data --------------------------------

TEMPLATE = """\
templates:
  - id: acme.reset
    title: Acme reset
    scenario: 1
    phase: rollback
    applies_to: [value]
    fix:
      code: |
        $tensor.clear()
    reason: Emptied after every step.
"""

PROFILE = """\
profiles:
  - id: acme-adaptor
    title: Acme adaptor
    files: [acme/recovery.py]
    rollback: rollback
    send: send
    recv: recv
    parameters: {src_ranks: sources, dest_ranks: destinations}
    repair_group: {expression: get_group()}
"""


def test_templates_are_chosen_by_scenario_and_what_the_global_is():
    knowledge = load_knowledge()
    kinds = [(scenario, kind) for scenario in (1, 2) for kind in ("value", "lru-cache")]
    chosen = {(scenario, kind): knowledge.template_for(scenario, kind).id for scenario, kind in kinds}
    assert chosen == {
        (1, "value"): "generic.reinitialise",
        (1, "lru-cache"): "generic.cache-clear",
        (2, "value"): "generic.replica-copy",
        (2, "lru-cache"): "generic.replica-copy",
    }
    assert not {template.id for template in knowledge.templates} & {rule.id for rule in knowledge.rules}


def test_two_templates_for_one_kind_of_global_are_refused(tmp_path):
    second = TEMPLATE.split("templates:\n", 1)[1].replace("acme.reset", "acme.other-reset")
    path = write(tmp_path, TEMPLATE + second)
    [problem] = validate_files([path])
    assert problem == (
        f"{path}:{1 + TEMPLATE.count(chr(10))}: template acme.other-reset: scenario 1 for value is already "
        f"template acme.reset's ({path}:2)"
    )


def test_a_user_template_replaces_a_shipped_one_by_id_and_must_leave_no_kind_without_one(tmp_path):
    replaced = load_knowledge([write(tmp_path, TEMPLATE.replace("acme.reset", "generic.reinitialise"))])
    assert replaced.template_for(1, "value").title == "Acme reset"
    narrowed = TEMPLATE.replace("acme.reset", "generic.replica-copy")
    narrowed = narrowed.replace("scenario: 1\n    phase: rollback", "scenario: 2\n    phase: repair")
    narrowed = narrowed.replace("      code: |\n        $tensor.clear()\n", "      send: pass\n      recv: pass\n")
    with pytest.raises(UsageError, match="no template for lru-cache globals in scenario 2"):
        load_knowledge([write(tmp_path, narrowed, "narrowed.yaml")])


def test_a_template_has_no_match_block(tmp_path):
    path = write(tmp_path, TEMPLATE.replace("    applies_to: [value]\n", "    applies_to: [value]\n    match: {variable: x}\n"))
    assert any("templates.0: Additional properties are not allowed ('match' was unexpected)" in p for p in validate_files([path]))


def test_a_rule_names_its_probe_and_an_unknown_probe_is_reported_with_its_line(tmp_path):
    assert load_knowledge().rule("megatron.router-expert-bias").probe == "megatron-router-expert-bias"
    path = write(tmp_path, GOOD_RULE.replace("    phase: rollback\n", "    phase: rollback\n    probe: acme-loss-log\n"))
    [problem] = validate_files([path])
    assert problem.startswith(f"{path}:2: rule acme.loss-log: unknown probe 'acme-loss-log' (the replay has: ")


def test_a_condition_carries_its_switch_and_renders_the_same_guard(tmp_path):
    conditions = load_knowledge().conditions
    assert (conditions["moe"].switches, conditions["moe"].guard) == (("num_experts",), 'getattr(get_args(), "num_experts", None)')
    assert conditions["moe_expert_bias"].guard == 'getattr(get_args(), "moe_router_enable_expert_bias", False)'
    assert conditions["moe_expert_bias"].imports == ("from megatron.training import get_args",)
    free = write(tmp_path, "conditions:\n  acme_on:\n    guard: acme.enabled()\n    imports: [import acme]\n    description: x\n")
    condition = load_knowledge([free]).conditions["acme_on"]
    assert (condition.guard, condition.imports, condition.switches) == ("acme.enabled()", ("import acme",), ())


def test_a_condition_with_both_a_switch_and_a_guard_is_reported(tmp_path):
    path = write(tmp_path, "conditions:\n  acme_on:\n    switch: acme\n    guard: acme.enabled()\n    description: Acme is on.\n")
    assert validate_files([path]) == [
        f"{path}:3: conditions.acme_on: "
        "a condition gives one of a switch, an any_of list of switches (each with its default) or a guard (and its imports)"
    ]
    both = write(tmp_path, "conditions:\n  acme_on:\n    switch: acme\n    any_of: [a, b]\n    description: x\n", "both.yaml")
    assert validate_files([both]) == [
        f"{both}:3: conditions.acme_on: "
        "a condition gives one of a switch, an any_of list of switches (each with its default) or a guard (and its imports)"
    ]


ANY_OF_RULE = (
    GOOD_RULE.replace(
        "rules:\n",
        """\
conditions:
  acme_packed:
    any_of: [acme_sft, acme_masking]
    description: Acme packs sequences.
  acme_logging:
    switch: acme_log_losses
    description: Acme logs losses.
rules:
""",
    )
    .replace("    phase: rollback\n", "    phase: rollback\n    conditions: [acme_packed, acme_logging]\n")
    .replace("      module: acme.state\n", "")
)  # the traceback below names no module


def test_an_any_of_condition_renders_an_or_of_its_switches_and_holds_when_any_is_on(tmp_path):
    path = write(tmp_path, ANY_OF_RULE)
    assert validate_files([path]) == []
    condition = load_knowledge([path]).conditions["acme_packed"]
    assert condition.switches == ("acme_sft", "acme_masking")
    assert condition.guard == 'getattr(get_args(), "acme_sft", False) or getattr(get_args(), "acme_masking", False)'
    assert condition.on_in({"acme_sft": "False", "acme_masking": "True"}) == ("acme_masking",)
    assert condition.on_in({"acme_sft": "True", "acme_masking": "True"}) == ("acme_sft", "acme_masking")
    assert condition.on_in({"acme_sft": "False", "acme_masking": "False"}) == ()
    assert condition.on_in({"acme_sft": "False"}) == ()  # a switch the dump lacks reads as off


@pytest.mark.parametrize(
    ("sft", "masking", "log_losses", "runs"),
    [
        (False, False, True, False),
        (True, False, True, True),
        (False, True, True, True),
        (True, True, False, False),
    ],
)
def test_an_any_of_guard_beside_another_condition_guards_the_fix_as_an_or_within_an_and(tmp_path, sft, masking, log_losses, runs):
    """`a or b and c` would run the fix whenever a is on: the any-of guard is one operand of the `and`."""
    path = write(tmp_path, ANY_OF_RULE)
    log = tmp_path / "train.log"
    log.write_text(
        '[rank0]: Traceback (most recent call last):\n[rank0]:   File "/opt/acme/train.py", line 3, in step\n'
        "[rank0]:     state._LOSS_LOG.add_(loss)\n[rank0]: RuntimeError: There is unsafe data in the input tensor.\n"
    )
    [item] = diagnose([str(log)], groundwork(rule_paths=[path])).findings
    fix = item.classification.fix
    assert fix.code.splitlines()[0] == (
        'if (getattr(get_args(), "acme_sft", False) or getattr(get_args(), "acme_masking", '
        'False)) and getattr(get_args(), "acme_log_losses", False):'
    )
    arguments = argparse.Namespace(acme_sft=sft, acme_masking=masking, acme_log_losses=log_losses)
    ran = []
    state = argparse.Namespace(_LOSS_LOG=argparse.Namespace(clear=lambda: ran.append(1)))
    exec(fix.code, {"get_args": lambda: arguments, "state": state})
    assert bool(ran) is runs


def test_the_shipped_guards_are_the_switches_the_replay_turns_on():
    knowledge = load_knowledge()
    assert knowledge.switches(knowledge.rule("megatron.router-expert-bias")) == ("moe_router_enable_expert_bias",)
    assert knowledge.switches(knowledge.rule("megatron.rotary-inv-freq")) == ()


def test_a_profile_names_only_known_parameter_roles(tmp_path):
    assert validate_files([write(tmp_path, PROFILE)]) == []
    path = write(tmp_path, PROFILE.replace("dest_ranks: destinations", "dest_ranks: destinations, step_count: step"))
    [problem] = validate_files([path])
    assert problem.startswith(f"{path}:2: profile acme-adaptor: unknown parameter role 'step_count' (roles: src_ranks, ")
    path = write(tmp_path, PROFILE.replace("src_ranks: sources, ", ""), "missing.yaml")
    assert validate_files([path]) == [
        f"{path}:2: profile acme-adaptor: parameters: no parameter for the role src_ranks (or peer)"
    ]


def test_two_rules_that_tie_need_a_priority_and_the_higher_one_wins(tmp_path):
    """Same match, same specificity: file order would decide, so the knowledge must say."""
    body = GOOD_RULE.split("rules:\n", 1)[1].replace("      module: acme.state\n", "")
    second = body.replace("acme.loss-log", "acme.loss-log-v2").replace("Acme loss log", "Acme loss log v2")
    tied = write(tmp_path, "rules:\n" + body + second)
    [problem] = validate_files([tied])
    assert problem.startswith(f"{tied}:{2 + body.count(chr(10))}: rule acme.loss-log-v2: ties with rule acme.loss-log ({tied}:2)")
    assert "same priority (0); give one a higher priority" in problem
    with pytest.raises(UsageError, match="ties with rule acme.loss-log"):
        load_knowledge([tied])
    preferred = second.replace("    phase: rollback\n", "    phase: rollback\n    priority: 1\n")
    ordered = write(tmp_path, "rules:\n" + body + preferred, "ordered.yaml")
    assert validate_files([ordered]) == []
    log = tmp_path / "train.log"
    log.write_text(
        '[rank0]: Traceback (most recent call last):\n[rank0]:   File "/opt/acme/train.py", line 3, in step\n'
        "[rank0]:     state._LOSS_LOG.add_(loss)\n[rank0]: RuntimeError: There is unsafe data in the input tensor.\n"
    )
    [item] = diagnose([str(log)], groundwork(rule_paths=[ordered])).findings
    assert item.classification.rule == "acme.loss-log-v2"


def test_rules_that_cannot_match_one_global_need_no_priority(tmp_path):
    body = GOOD_RULE.split("rules:\n", 1)[1]
    other_module = body.replace("acme.loss-log", "acme.other").replace("module: acme.state", "module: acme.other_state")
    sums, logs = (
        body.replace("acme.loss-log", f"acme.{name}").replace("variable: _LOSS_LOG", f"variable_regex: '_LOSS_({names})'")
        for name, names in (("sums", "SUM|MAX"), ("logs", "MIN|LOG"))
    )
    assert validate_files([write(tmp_path, "rules:\n" + body + other_module + sums + logs)]) == []
    frames = [
        body.replace("acme.loss-log", f"acme.{name}").replace("module: acme.state\n", f"file: '*/{name}.py'\n      function: f\n")
        for name in ("log", "tally")
    ]
    assert validate_files([write(tmp_path, "rules:\n" + "".join(frames), "frames.yaml")]) == []
    same = write(tmp_path, "rules:\n" + frames[0] + frames[0].replace("acme.log", "acme.log-2"), "same.yaml")
    assert "ties with rule acme.log" in validate_files([same])[0]


# --- hostile rule files, bounded --------------------------------------------------------------------


def regex_rule(rule_id: str, regex: str, module: str = "acme.state") -> str:
    body = GOOD_RULE.split("rules:\n", 1)[1]
    return (
        body.replace("acme.loss-log", rule_id)
        .replace("variable: _LOSS_LOG", f"variable_regex: '{regex}'")
        .replace("module: acme.state", f"module: {module}")
    )


def validate_in_a_child(path: Path, memory: int = 1 << 30) -> subprocess.CompletedProcess[str]:
    """`rules validate` in a process held to `memory` bytes of address space."""
    limit = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))"
    code = f"{limit}; import sys; from unsafe_doctor.cli import main; main(['rules', 'validate', {str(path)!r}])"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )


def test_a_tie_between_regexes_of_a_million_names_is_decided_without_listing_them(tmp_path):
    """`(a|b)` 24 times is 16 million names: listed, 58 s and 2.9 GB; now in a 1 GB process, at once."""
    crossing = write(tmp_path, "rules:\n" + regex_rule("acme.first", "(a|b)" * 24) + regex_rule("acme.second", "(b|c)" * 24))
    result = validate_in_a_child(crossing)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "rule acme.second: ties with rule acme.first" in result.stdout + result.stderr
    apart = write(
        tmp_path,
        "rules:\n" + regex_rule("acme.first", "(a|b)" * 24) + regex_rule("acme.second", "(b|c)" * 24, "acme.other"),
        "apart.yaml",
    )
    assert validate_in_a_child(apart).returncode == 0


def test_rules_naming_different_variables_are_never_compared(tmp_path, monkeypatch):
    """2,000 rules compared pair by pair took 24-30 s; blocks of different variables cannot meet."""
    compared = []
    original = matching._may_overlap
    monkeypatch.setattr(matching, "_may_overlap", lambda a, b: compared.append((a, b)) or original(a, b))
    body = GOOD_RULE.split("rules:\n", 1)[1]
    many = "".join(body.replace("acme.loss-log", f"acme.r{index}").replace("_LOSS_LOG", f"_LOG_{index}") for index in range(2000))
    again = body.replace("acme.loss-log", "acme.again").replace("_LOSS_LOG", "_LOG_7")
    [problem] = validate_files([write(tmp_path, "rules:\n" + many + again)])
    assert "rule acme.again: ties with rule acme.r7 (" in problem
    assert len(compared) == 1


@pytest.mark.parametrize(
    ("regex", "problem"),
    [
        ("(?=_LOSS)_LOSS_LOG", "no lookaround"),
        (r"(_LOSS)\1", "no backreference"),
    ],
)
def test_a_regex_that_needs_backtracking_is_refused_with_its_line(tmp_path, regex, problem):
    [line] = validate_files([write(tmp_path, "rules:\n" + regex_rule("acme.look", regex))])
    assert line.startswith(f"{tmp_path / 'rules.yaml'}:2: rule acme.look: variable_regex: ") and problem in line


def test_a_regex_nested_500_deep_is_read_without_recursion(tmp_path):
    deep = write(tmp_path, "rules:\n" + regex_rule("acme.deep", "(" * 500 + "_LOSS_LOG" + ")" * 500))
    result = validate_in_a_child(deep)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


def test_a_backtracking_regex_cannot_hang_an_audit(tmp_path):
    """`(x+x+)+y` against a run of 40 x's is 2^40 steps for a backtracking engine; RE2's are linear."""
    rules = write(tmp_path, "rules:\n" + regex_rule("acme.slow", "(x+x+)+y|KEEP_ME", "'*'"))
    package = tmp_path / "pkg"
    package.mkdir()
    name = "KEEP_ME"
    (package / "m.py").write_text(f"import torch\n\n{'x' * 40} = 1\n{name} = torch.zeros(4)\n")
    result = subprocess.run(  # in a process of its own, so that a hang ends at the timeout as a failure
        [sys.executable, "-m", "unsafe_doctor", "audit", str(package), "--rules", str(rules)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr
    assert name in result.stdout


# --- a value ending in a line feed (Python's `$` matches before one) ----------------------------------


def schema_patterns(node) -> list[str]:
    if isinstance(node, dict):
        return [
            *([node["pattern"]] if isinstance(node.get("pattern"), str) else []),
            *(pattern for value in node.values() for pattern in schema_patterns(value)),
        ]
    return [pattern for value in node for pattern in schema_patterns(value)] if isinstance(node, list) else []


def test_no_schema_pattern_takes_a_value_with_a_line_feed_after_one_it_takes():
    """jsonschema searches with Python's `re`, whose `$` also matches before a final line feed."""
    import json
    import re

    schema = json.loads((ROOT / "unsafe_doctor" / "knowledge" / "knowledge.schema.json").read_text())
    patterns = schema_patterns(schema)
    assert len(patterns) >= 7
    for pattern in patterns:
        taken = next(
            value for value in ("acme.loss-log", "acme", "1.2", "import torch", "_LOSS_LOG") if re.search(pattern, value)
        )
        assert re.search(pattern, taken + "\n") is None, pattern


@pytest.mark.parametrize(
    ("field", "old", "new"),
    [
        ("rules.0.id", "id: acme.loss-log", 'id: "acme.loss-log\\n"'),
        ("rules.0.match.variable", "variable: _LOSS_LOG", 'variable: "_LOSS_LOG\\n"'),
        ("rules.0.fix.imports.0", '"from $parent import $alias"', '"from $parent import $alias\\n"'),
        (
            "rules.0.framework.package",
            "    scenario: 1\n",
            '    framework: {package: "acme\\n", versions: ">=1"}\n    scenario: 1\n',
        ),
        ("rules.0.repair_with.0", "    scenario: 1\n", '    repair_with: ["acme.other\\n"]\n    scenario: 1\n'),
    ],
)
def test_rules_validate_refuses_a_value_that_ends_in_a_line_feed(tmp_path, field, old, new):
    path = write(tmp_path, GOOD_RULE.replace(old, new))
    result = run_cli("rules", "validate", str(path))
    assert result.returncode == 2, result.stderr
    assert f": {field}: " in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_rule_id_ending_in_a_line_feed_is_refused_before_fix_writes_its_block(tmp_path):
    """With the id taken, every `fix --yes` wrote the block again: its marker, read back, never held that id."""
    rules = write(
        tmp_path,
        """\
        rules:
          - id: "team.ema\\n"
            title: A rule whose id ends in a line feed
            match: {variable: _EMA_GRAD_NORM}
            scenario: 1
            phase: rollback
            fix:
              code: |
                _EMA_GRAD_NORM.zero_()
            reason: Reset every step.
        """,
    )
    adaptor = tmp_path / "adaptor.py"
    adaptor.write_text("def feature_rollback():\n    return None\n")
    result = run_cli(
        "fix",
        str(ROOT / "samples" / "logs" / "toytrain_ema"),
        "--source-root",
        str(ROOT / "samples" / "framework"),
        "--adaptor",
        str(adaptor),
        "--rules",
        str(rules),
        "--yes",
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and f"{rules}:2: rules.0.id: " in result.stderr, result.stderr
    assert adaptor.read_text() == "def feature_rollback():\n    return None\n"
