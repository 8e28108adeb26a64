"""Knowledge-base rules as JSON, a table, or one rule in full."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from unsafe_doctor.knowledge.rules import KnowledgeBase, Rule, Template
from unsafe_doctor.report.common import printable, printable_lines
from unsafe_doctor.report.terminal import CodeToCopy, title


def rule_json(rule: Rule) -> dict[str, Any]:
    blocks = [{key: value for key, value in asdict(match).items() if value is not None} for match in rule.matches]
    return {
        "id": rule.id,
        "title": rule.title,
        "match": blocks[0],
        "also_match": blocks[1:],  # further match blocks, any one of which suffices
        "framework": {"package": rule.framework, "versions": str(rule.versions)} if rule.framework else None,
        "scenario": rule.scenario,
        "phase": rule.phase,
        "conditions": list(rule.conditions),
        "fix": {key: value for key, value in asdict(rule.fix).items() if value},
        "reason": rule.reason,
        "references": list(rule.references),
        "origin": rule.origin,
        "probe": rule.probe,
        "priority": rule.priority,
    }


def template_json(template: Template) -> dict[str, Any]:
    return {
        "id": template.id,
        "title": template.title,
        "scenario": template.scenario,
        "phase": template.phase,
        "applies_to": list(template.applies_to),
        "fix": {key: value for key, value in asdict(template.fix).items() if value},
        "reason": template.reason,
        "references": list(template.references),
        "origin": template.origin,
    }


def rules_table(knowledge: KnowledgeBase) -> RulesTable:
    entries: list[Rule | Template] = sorted([*knowledge.rules, *knowledge.templates], key=lambda entry: entry.id)
    return RulesTable(
        tuple(
            (
                printable(entry.id),
                str(entry.scenario),
                printable(f"{entry.framework} {entry.versions}" if isinstance(entry, Rule) and entry.framework else "any"),
                printable(entry.title),
            )
            for entry in entries
        )
    )


@dataclass(frozen=True)
class RulesTable:
    """Each rule's id, scenario and versions on one line, aligned down the list, its title under it
    across the whole width. An id is what `rules show` takes: its column is as wide as the longest,
    and only where the terminal has no room for that are ids folded (never cut)."""

    rows: tuple[tuple[str, str, str, str], ...]  # id, scenario, versions, title

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        versions = max(len(row[2]) for row in (*self.rows, ("", "", "versions", "")))
        room = options.max_width - len("scenario") - 4  # the id's and the versions' columns, two gaps of 2 out
        width = max(min(max(len(row[0]) for row in self.rows), room - min(versions, _VERSIONS_KEPT)), 1)

        def line(rule: Text, scenario: Text, versions: Text) -> Table:
            table = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False)
            table.add_column(width=width, overflow="fold")
            table.add_column(width=len("scenario"), justify="center")
            table.add_column(overflow="fold")
            table.add_row(rule, scenario, versions)
            return table

        yield line(*(Text(label, style="bold") for label in ("rule", "scenario", "versions")))
        for identifier, scenario, framework, described in self.rows:
            yield line(Text(identifier, style="bold"), Text(scenario), Text(framework))
            yield Padding(Text(described, style="dim"), (0, 0, 0, 2), expand=False)  # wrapped lines indented too


_VERSIONS_KEPT = 16  # columns the versions keep beside a long id ("megatron-core" and a range on the next line)


def rule_panel(rule: Rule | Template, knowledge: KnowledgeBase) -> Group:
    """The rule in a box, then its fix code outside it, to be copied whole."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="ellipsis")
    grid.add_row("Title", Text(printable(rule.title)))
    if isinstance(rule, Rule):
        blocks = [", ".join(f"{key}={value}" for key, value in asdict(match).items() if value) for match in rule.matches]
        grid.add_row("Matches", Text(printable_lines("\nor ".join(blocks))))
        grid.add_row("Versions", Text(printable(f"{rule.framework} {rule.versions}" if rule.framework else "any")))
    else:
        kinds = " or ".join("an lru-cached function" if kind == "lru-cache" else "a value" for kind in rule.applies_to)
        grid.add_row("Template", Text(f"for {kinds} that no rule knows, in the scenario heuristics or the user give"))
    grid.add_row("Scenario", Text(f"{rule.scenario}, fixed in the {rule.phase} phase"))
    if isinstance(rule, Rule) and rule.conditions:
        grid.add_row("Only when", Text(printable("; ".join(knowledge.conditions[name].description for name in rule.conditions))))
    grid.add_row("Why", Text(printable(rule.reason)))
    fixes = (("fix", rule.fix.code), ("receive", rule.fix.recv), ("send", rule.fix.send))
    templates = [(label, code) for label, code in fixes if code]
    if templates:
        grid.add_row("Fix", Text(f"below the box: the {' and '.join(label for label, _ in templates)} template"))
    parts: list[Panel | Text | CodeToCopy] = [Panel(grid, title=title(rule.id), title_align="left")]
    for label, code in templates:
        parts += [Text(f"# {label} template:", style="bold"), CodeToCopy("\n".join([*rule.fix.imports, "", code.rstrip()]))]
    # addresses and paths are copied too: whole, on lines of their own
    lines = [*(f"See: {reference}" for reference in rule.references), f"Defined in {rule.origin}"]
    parts.append(CodeToCopy("\n".join(lines), python=False))
    return Group(*parts)
