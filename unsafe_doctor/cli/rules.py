"""`unsafe-doctor rules list|show|validate`: the knowledge base as people and tools read it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from unsafe_doctor.cli.conventions import printing
from unsafe_doctor.cli.options import Format, FormatOption, RulesOption
from unsafe_doctor.cli.streams import print_json, print_rich
from unsafe_doctor.errors import UsageError

app = typer.Typer(help="List, show and validate knowledge-base rules.", no_args_is_help=True, suggest_commands=False)


@app.command("list")
@printing
def list_rules(rules: RulesOption = None, output_format: FormatOption = Format.text) -> int:
    """Every rule: id, scenario, framework versions, title."""
    from unsafe_doctor.knowledge.loading import load_knowledge
    from unsafe_doctor.report import rules as report

    knowledge = load_knowledge(rules or ())
    if output_format is Format.json:
        print_json(
            {
                "rules": [report.rule_json(rule) for rule in knowledge.rules],
                "templates": [report.template_json(template) for template in knowledge.templates],
            }
        )
    else:
        print_rich(report.rules_table(knowledge))
    return 0


@app.command("show")
@printing
def show_rule(
    rule_id: Annotated[str, typer.Argument(help="The rule's id, as `rules list` shows it.")],
    rules: RulesOption = None,
    output_format: FormatOption = Format.text,
) -> int:
    """One rule or template in full: what it matches, why, and the fix it writes."""
    from unsafe_doctor.knowledge.loading import load_knowledge
    from unsafe_doctor.knowledge.rules import Rule
    from unsafe_doctor.report import rules as report

    knowledge = load_knowledge(rules or ())
    rule = knowledge.rule(rule_id) or knowledge.template(rule_id)
    if rule is None:
        import difflib

        known = [rule.id for rule in knowledge.rules] + [template.id for template in knowledge.templates]
        close = difflib.get_close_matches(rule_id, known, n=1, cutoff=0.7)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise UsageError(f"no rule '{rule_id}' ({hint}see `unsafe-doctor rules list`)")
    if output_format is Format.json:
        print_json(report.rule_json(rule) if isinstance(rule, Rule) else report.template_json(rule))
    else:
        print_rich(report.rule_panel(rule, knowledge))
    return 0


@app.command("validate")
def validate_rules(
    files: Annotated[list[Path], typer.Argument(help="Rule files or folders to check.", exists=True)],
) -> int:
    """Check rule files against the schema; every problem as file:line: what is wrong."""
    from unsafe_doctor.knowledge.loading import validate_files

    problems = validate_files(files)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 2
    print(f"{len(files)} path{'s' if len(files) != 1 else ''}: valid")
    return 0
