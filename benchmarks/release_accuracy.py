"""Issue 38's measure on our own megatron-core 0.17-0.19 logs (tests/corpus/logs/release-*.log), per
half of tests/corpus/releases_split.yaml, two ways:

    python benchmarks/release_accuracy.py              # develop, the half to tune on (the default)
    python benchmarks/release_accuracy.py held_back    # the half to report, once, when tuning is done

1. **log only**: `unsafe-doctor diagnose --log-only --format json LOG` in a Python that cannot see
   megatron-core (tests/corpus/hidden.py), no `--source-root`: a bare install with the log alone;
2. **with the source**: the same Python and `--source-root` the release the run imported (the
   label's `release`, unpacked outside the checkout where tests/fixtures/rules/release.py keeps it).

A log is **located** when a finding names the culprit global (the finding's variable, else the one
its rule names, is the label's or one the culprit's rule matches), or, with no traceback, when the
culprit rule is among the first three suspects (issue 37's score, `untraced_accuracy.score`). It is
**classified** when a finding has the label's rule and scenario, or, with no traceback, when the
first suspect is the culprit rule. `develop` is listed log by log; `held_back` is only counted (its
logs and answers are not shown), to report. This script reports and always exits 0.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from untraced_accuracy import diagnose_bare, run_halves, scoring
from untraced_accuracy import score as untraced_score

MODES = ("log only", "with source")


def named_variable(finding: dict, knowledge) -> str | None:
    """The global a reported finding names: its tensor's variable, else its rule's (scoring._fields)."""
    variable = (finding.get("tensor") or {}).get("variable")
    rule = knowledge.rule(finding["rule"]) if finding.get("rule") else None
    return rule.match.variable if variable is None and rule is not None else variable


def judge(entry, report: dict, knowledge) -> tuple[bool, bool, str]:
    """(located, classified, what the diagnosis answered, shortly)."""
    findings = report["findings"]
    suspects = [suspect["rule"] for finding in findings for suspect in finding.get("suspects") or []]
    shown = (
        "; ".join(f"{named_variable(f, knowledge)}: scenario {f['scenario']}, {f['rule'] or 'no rule'}" for f in findings)
        or "no finding"
    )
    if entry.untraced:
        located = untraced_score(entry.untraced, report)[0]
        return located, suspects[:1] == [entry.untraced["culprit"]], f"{shown}; suspects {', '.join(suspects[:3]) or '-'}"
    label = entry.findings[0]
    rule = knowledge.rule(label["rule"])
    names = {label["variable"], *(match.variable for match in (rule.matches if rule else ()))}
    located = any(named_variable(finding, knowledge) in names for finding in findings)
    classified = any((finding["rule"], finding["scenario"]) == (label["rule"], label["scenario"]) for finding in findings)
    return located, classified, shown


def main(halves: list[str]) -> int:
    split = scoring.releases_split()
    entries = {Path(entry.log).name: entry for entry in scoring.load_entries(held_back=True) if entry.release}
    knowledge = scoring.load_knowledge_base()
    for half in halves:
        names = sorted(name for name, side in split.items() if side == half)
        print(f"\n=== {half}: {len(names)} logs ===")
        totals = {mode: [0, 0, 0] for mode in MODES}  # located, classified, both
        with tempfile.TemporaryDirectory() as scratch:
            for name in names:
                entry = entries[name]
                root = scoring.release_root(entry)
                if root is None:
                    raise SystemExit(f"megatron-core {entry.release} cannot be had: see tests/fixtures/rules/release.py")
                options = {"log only": ("--log-only",), "with source": (f"--source-root={root}",)}
                lines = []
                for mode in MODES:
                    report = diagnose_bare(entry.path(entry.log), Path(scratch), options[mode])
                    located, classified, shown = judge(entry, report, knowledge)
                    for index, ok in enumerate((located, classified, located and classified)):
                        totals[mode][index] += ok
                    lines.append(
                        f"      {mode:<11} {'located' if located else 'NOT located':<11} "
                        f"{'classified' if classified else 'NOT classified':<14} {shown}"
                    )
                if half == "held_back":  # counted, never shown: it is not opened while tuning
                    continue
                answer = entry.untraced["culprit"] if entry.untraced else entry.findings[0]["rule"]
                print(f"{name:<52} {answer}\n" + "\n".join(lines))
        for mode in MODES:
            located, classified, both = totals[mode]
            print(
                f"{half}, {mode}: fully right {both}/{len(names)}, located {located}/{len(names)}, "
                f"classified {classified}/{len(names)}"
            )
    return 0


if __name__ == "__main__":
    run_halves(main)
