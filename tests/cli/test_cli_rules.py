"""`unsafe-doctor rules …` and `--rules` / `--adaptor` on diagnose, end to end."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
FAQ_LOG = ROOT / "samples" / "logs" / "faq_modellink.log"
LEGACY_ADAPTOR = ROOT / "tests" / "fixtures" / "adaptors" / "legacy" / "mindio_ttp" / "adaptor" / "modellink_adaptor.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)


def test_rules_list_names_every_shipped_rule_with_scenario_and_versions():
    result = run("rules", "list", "--format", "json")
    assert result.returncode == 0
    rules = {rule["id"]: rule for rule in json.loads(result.stdout)["rules"]}
    assert rules["megatron.moe-aux-losses-tracker"]["framework"] == {"package": "megatron-core", "versions": "<0.8,>=0.6"}
    assert rules["megatron.router-expert-bias"]["scenario"] == 2
    assert len(rules) >= 25


def test_rules_show_prints_the_reason_and_fix():
    result = run("rules", "show", "megatron.moe-aux-losses-tracker")
    assert result.returncode == 0
    assert "_MOE_AUX_LOSSES_LOGGING_TRACKER" in result.stdout and "rollback" in result.stdout


def test_rules_show_unknown_id_is_a_one_line_error():
    result = run("rules", "show", "no.such-rule")
    assert result.returncode == 2
    assert result.stderr.strip() == "unsafe-doctor: no rule 'no.such-rule' (see `unsafe-doctor rules list`)"


def test_rules_validate_accepts_the_shipped_knowledge_base():
    result = run("rules", "validate", str(ROOT / "knowledge_base"))
    assert result.returncode == 0, result.stderr


def test_rules_validate_reports_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        textwrap.dedent("""\
        rules:
          - id: acme.scratch
            title: scratch
            match: {variable: _SCRATCH}
            scenario: 1
            phase: repair
            fix: {code: "pass"}
            reason: a scratch buffer
        """)
    )
    result = run("rules", "validate", str(bad))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"{bad}:6: rules.0.phase: 'rollback' was expected"]


def test_a_user_rule_file_classifies_a_global_no_shipped_rule_knows(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        textwrap.dedent("""\
        [rank2]: Traceback (most recent call last):
        [rank2]:   File "/opt/acme/trainer/step.py", line 40, in step
        [rank2]:     acme_state._SCRATCH.add_(delta)
        [rank2]: RuntimeError: There is unsafe data in the input tensor.
        """)
    )
    rules = tmp_path / "acme.yaml"
    rules.write_text(
        textwrap.dedent("""\
        rules:
          - id: acme.scratch
            title: Acme scratch buffer
            match: {variable: _SCRATCH}
            scenario: 1
            phase: rollback
            fix:
              imports: ["import torch"]
              code: |
                acme_state._SCRATCH = torch.zeros(acme_state._SCRATCH.shape, dtype=acme_state._SCRATCH.dtype,
                                                  device=acme_state._SCRATCH.device)
            reason: A scratch buffer rewritten before every use.
        """)
    )
    result = run("diagnose", str(log), "--rules", str(rules), "--format", "json")
    [finding] = json.loads(result.stdout)["findings"]
    assert (finding["rule"], finding["scenario"], finding["confidence"]) == ("acme.scratch", 1, "high")
    assert finding["reason"] == "A scratch buffer rewritten before every use."


def test_a_bad_user_rule_file_stops_diagnose_before_reading_the_log(tmp_path):
    rules = tmp_path / "broken.yaml"
    rules.write_text("rules: [\n")
    result = run("diagnose", str(FAQ_LOG), "--rules", str(rules))
    assert result.returncode == 2
    assert result.stderr.startswith(f"unsafe-doctor: {rules}:") and "invalid YAML" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_faq_adaptor_reset_is_reported_stale_on_a_log_from_a_newer_megatron():
    """The FAQ's reset names a global megatron-core 0.16 no longer has; the log's frames say 0.16 ran."""
    log = Path(__file__).parents[2] / "samples" / "logs" / "megatron_moe_tracker.log"
    result = run("diagnose", str(log), "--adaptor", str(LEGACY_ADAPTOR), "--format", "json")
    summary = json.loads(result.stdout)["summary"]
    assert summary["adaptor"]["profile"] == "mindio-ttp-legacy"
    assert summary["frameworks"]["megatron-core"]["version"] == "0.16.1"
    [stale] = [item for item in summary["stale_resets"] if "_MOE_AUX_LOSSES_LOGGING_TRACKER" in item["statement"]]
    assert "has no _MOE_AUX_LOSSES_LOGGING_TRACKER in megatron.core.parallel_state" in stale["why"]


def test_the_faq_adaptor_reset_is_not_stale_on_the_faqs_own_log():
    """The FAQ's log fingerprints megatron-core 0.6, whose parallel_state has the tracker: whatever
    release is installed here, the reset is not stale."""
    result = run("diagnose", str(FAQ_LOG), "--adaptor", str(LEGACY_ADAPTOR), "--format", "json")
    summary = json.loads(result.stdout)["summary"]
    assert summary["frameworks"]["megatron-core"]["version"] == "0.6.0"
    assert not [item for item in summary["stale_resets"] if "_MOE_AUX_LOSSES_LOGGING_TRACKER" in item["statement"]]


def test_rules_show_gives_every_match_block_of_a_rule():
    document = json.loads(run("rules", "show", "megatron.grad-scaler", "--format", "json").stdout)
    assert document["match"]["function"] == "scale_loss" and document["match"]["loss_scaling"] == "grad-scaler"
    assert document["also_match"] == [
        {"variable_regex": "_scale|min_scale|growth_factor|backoff_factor", "module": "megatron.core.optimizer.grad_scaler"}
    ]
    text = run("rules", "show", "megatron.grad-scaler").stdout
    assert "or variable_regex=_scale|min_scale|growth_factor|backoff_factor" in text


def test_the_json_summary_says_what_loss_scaling_the_log_shows():
    logs = Path(__file__).parents[1] / "corpus" / "logs"
    scaled = json.loads(run("diagnose", str(logs / "megatron-grad-scaler.log"), "--format", "json").stdout)
    plain = json.loads(run("diagnose", str(logs / "megatron-optimizer-scale-one.log"), "--format", "json").stdout)
    assert (scaled["summary"]["loss_scaling"], plain["summary"]["loss_scaling"]) == ("grad-scaler", "none")


def test_rules_list_and_show_give_the_generic_templates_apart_from_the_rules():
    document = json.loads(run("rules", "list", "--format", "json").stdout)
    templates = {template["id"]: template for template in document["templates"]}
    assert templates["generic.cache-clear"]["applies_to"] == ["lru-cache"]
    assert not set(templates) & {rule["id"] for rule in document["rules"]}
    shown = json.loads(run("rules", "show", "generic.replica-copy", "--format", "json").stdout)
    assert (shown["scenario"], shown["phase"], shown["applies_to"]) == (2, "repair", ["value", "lru-cache"])
    assert "generic.reinitialise" in run("rules", "list").stdout
    assert "for a value that no rule knows" in run("rules", "show", "generic.reinitialise").stdout


def test_rules_show_gives_a_rules_probe():
    document = json.loads(run("rules", "show", "megatron.router-expert-bias", "--format", "json").stdout)
    assert (document["probe"], document["priority"]) == ("megatron-router-expert-bias", 0)


# --- the text layout at common terminal widths ------------------------------------------------------


def at_width(columns: int, *args: str) -> str:
    result = run_cli(*args, env={"COLUMNS": str(columns)})
    assert result.returncode == 0, result.stderr
    return result.stdout


def shipped_entries() -> list[dict]:
    document = json.loads(run("rules", "list", "--format", "json").stdout)
    return [*document["rules"], *document["templates"]]


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_rules_list_gives_every_id_whole_its_columns_aligned_and_its_title_across_the_width(columns):
    """An id is what `rules show` takes: never cut. A title wraps at the terminal's edge, not inside
    the id's column (at 100 columns titles broke at 60, beside an empty versions column)."""
    lines = at_width(columns, "rules", "list").splitlines()
    header, rows = lines[0], lines[1:]
    assert header.split() == ["rule", "scenario", "versions"] and "…" not in "".join(lines)
    assert all(len(line) <= columns for line in lines)
    starts = [index for index, line in enumerate(rows) if not line.startswith(" ")]
    entries = {entry["id"]: entry for entry in shipped_entries()}
    assert [rows[index].split()[0] for index in starts] == sorted(entries)
    for number, index in enumerate(starts):
        identifier, scenario, *versions = rows[index].split(maxsplit=2)
        entry = entries[identifier]
        assert rows[index].index(scenario, len(identifier)) == header.index("scenario") + len("scenario") // 2 - 1
        assert rows[index].index(versions[0], len(identifier) + 1 + len(scenario)) == header.index("versions")
        assert int(scenario) == entry["scenario"]
        following = rows[index + 1 : starts[number + 1] if number + 1 < len(starts) else len(rows)]
        title = [line.strip() for line in following if line.startswith("  ") and line.strip()]
        assert " ".join(title).endswith(entry["title"]), (identifier, following)
        if len(entry["title"]) <= columns - 2:
            assert title[-1] == entry["title"], (identifier, following)


def test_rules_list_folds_an_id_too_long_for_the_terminal_and_keeps_within_it(tmp_path):
    rules = tmp_path / "long.yaml"
    identifier = "acme." + "-".join(["long"] * 16)
    rules.write_text(
        textwrap.dedent(f"""\
        rules:
          - id: {identifier}
            title: A rule with a long id
            match: {{variable: _LOSS_LOG}}
            scenario: 1
            phase: rollback
            fix: {{code: "_LOSS_LOG.clear()"}}
            reason: Emptied every step.
        """)
    )
    lines = at_width(80, "rules", "list", "--rules", str(rules)).splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in "".join(lines)
    first = next(index for index, line in enumerate(lines) if line.startswith("acme."))
    width = lines[0].index("scenario") - 1
    assert "".join(line[:width].strip() for line in lines[first : first + 2]) == identifier


def test_no_shipped_rule_text_holds_a_word_split_at_a_hyphen():
    """A folded YAML line that ends in a hyphen joins the next with a space: "data- parallel"."""
    split = [
        (entry["id"], field, match.group())
        for entry in shipped_entries()
        for field in ("title", "reason")
        for match in re.finditer(r"\w+- \w+", entry[field])
    ]
    assert split == []


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_rules_show_keeps_a_hyphenated_word_whole(columns):
    shown = at_width(columns, "rules", "show", "megatron.router-expert-bias")
    text = " ".join(line.strip("│ ") for line in shown.splitlines())
    assert "equal across data-parallel replicas" in " ".join(text.split())
    assert "data- parallel" not in text
