"""How well `unsafe-doctor diagnose` classifies the labelled corpus (tests/corpus/labels.yaml).

    python benchmarks/classification_accuracy.py

Diagnoses every log with the options its label gives and prints, in a few seconds:
  - each log: the expected and reported findings (variable, scenario, rule) and the wall time;
  - the confusion table of expected scenario (1, 2, none) against the reported one (1, 2,
    unclassified, or no finding at all);
  - rule-id accuracy (the labelled rule, or none for a heuristic verdict) and the known failures.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_scoring():
    spec = importlib.util.spec_from_file_location("corpus_scoring", ROOT / "tests" / "corpus" / "scoring.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def describe(finding: dict | None) -> str:
    if finding is None:
        return "-"
    scenario = "unclassified" if finding["scenario"] is None else f"scenario {finding['scenario']}"
    return f"{finding['variable']}: {scenario}, {finding['rule'] or 'no rule'}"


def main() -> int:
    scoring = _load_scoring()
    outcomes = [scoring.run(entry) for entry in scoring.load_entries()]
    width = max(len(outcome.entry.log) for outcome in outcomes)
    print(f"{'log':<{width}}  {'ms':>5}  ok  expected -> reported")
    for outcome in outcomes:
        mark = "ok" if outcome.holds() else ("xf" if outcome.entry.known_failure else "NO")
        for index, (_, _, label, finding) in enumerate(scoring.pairs(outcome)):
            name, ms = (outcome.entry.log, f"{outcome.seconds * 1000:5.0f}") if index == 0 else ("", "")
            print(f"{name:<{width}}  {ms:>5}  {mark if index == 0 else '':2}  {describe(label)} -> {describe(finding)}")

    table = scoring.confusion(outcomes)
    print("\nexpected \\ reported " + "".join(f"{column:>14}" for column in scoring.PREDICTED_CLASSES))
    for row in scoring.EXPECTED_CLASSES:
        print(f"scenario {row:<11}" + "".join(f"{table[(row, column)]:>14}" for column in scoring.PREDICTED_CLASSES))
    right, total = scoring.rule_accuracy(outcomes)
    held = sum(outcome.holds() for outcome in outcomes)
    seconds = sum(outcome.seconds for outcome in outcomes)
    print(f"\nrule id: {right}/{total} labelled findings ({right / total:.0%})")
    print(f"logs whose every label holds: {held}/{len(outcomes)}; diagnose wall time {seconds:.2f} s in all")
    for outcome in outcomes:
        if outcome.entry.known_failure:
            print(f"known failure  {outcome.entry.log}: {outcome.entry.known_failure}")
    unexpected = [outcome for outcome in outcomes if outcome.holds() == bool(outcome.entry.known_failure)]
    for outcome in unexpected:
        state = "holds although marked known_failure" if outcome.holds() else "fails"
        print(f"UNEXPECTED     {outcome.entry.log}: {state}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
