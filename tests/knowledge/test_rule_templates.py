"""A `$` in a rule's fix template that starts no slot: `rules validate` refuses it with the
rule and the text, one line, and `$$`, the escape, renders a dollar sign. Each runs the CLI."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
ERROR_LOG = ROOT / "samples" / "logs" / "faq_modellink.log"  # a _MOE_AUX_LOSSES_LOGGING_TRACKER finding


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env={"NO_COLOR": "1"})


def rule_with_code(tmp_path: Path, code: str) -> Path:
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        textwrap.dedent("""\
        rules:
          - id: acme.cost
            title: a rule whose fix prints a price
            match:
              variable: _MOE_AUX_LOSSES_LOGGING_TRACKER
              module: megatron.core.parallel_state
            priority: 5
            scenario: 1
            phase: rollback
            fix:
              code: |
        """)
        + textwrap.indent(code, " " * 8)
        + "    reason: a test\n"
    )
    return rules


@pytest.mark.parametrize(
    "code, shown",
    [
        ('print("cost: $5")\n', 'print("cost: $5")'),
        ("x = 1\ny = $\n", "y = $"),
        ('print("${variable")\n', 'print("${variable")'),
    ],
)
def test_a_dollar_that_starts_no_slot_is_refused_with_the_rule_and_its_text(tmp_path, code, shown):
    rules = rule_with_code(tmp_path, code)
    result = doctor("rules", "validate", str(rules))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == [
        f"{rules}:2: rule acme.cost: a '$' that starts no slot in {shown!r} (write $$ for a dollar sign)"
    ]
    result = doctor("diagnose", str(ERROR_LOG), "--rules", str(rules))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1 and "acme.cost" in result.stderr


def test_a_doubled_dollar_renders_one(tmp_path):
    rules = rule_with_code(tmp_path, 'print("cost: $$5 for $variable")\n')
    assert doctor("rules", "validate", str(rules)).returncode == 0
    result = doctor("diagnose", str(ERROR_LOG), "--rules", str(rules))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert 'print("cost: $5 for _MOE_AUX_LOSSES_LOGGING_TRACKER")' in result.stdout
