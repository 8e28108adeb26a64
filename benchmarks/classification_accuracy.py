"""How well `unsafe-doctor diagnose` classifies the labelled corpus (tests/corpus/labels.yaml), in two modes.

    python benchmarks/classification_accuracy.py

1. **With sources**: each log with the options its label gives (`--source-root`, `--rules`), in
   this Python (where the test extra installed megatron-core).
2. **Log only, no framework importable**: each log with `--log-only` (its `--rules` kept), in a
   child Python that cannot see megatron-core (tests/corpus/hidden.py): what a bare `pip install .`
   on a login node gives. Every label a shipped rule covers must hold; the misses that need the
   job's own code are listed with the reason.

For each mode: every log (expected -> reported, wall time), the confusion table of expected scenario
(1, 2, none) against the reported one (1, 2, unclassified, no finding) and the rule-id accuracy.
3. **Operands, log only**: the logs of tests/fixtures/operands (real release lines, three Python
   renderings; which operand of the culprit line reached a global), each with `--log-only`.

Exit status 1 when a label holds or fails against what labels.yaml and the log-only rule expect.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"corpus_{name}", CORPUS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


scoring = _load("scoring")
hidden = _load("hidden")


def describe(finding: dict | None) -> str:
    if finding is None:
        return "-"
    scenario = "unclassified" if finding["scenario"] is None else f"scenario {finding['scenario']}"
    return f"{finding['variable']}: {scenario}, {finding['rule'] or 'no rule'}"


def table(title: str, outcomes: list) -> None:
    print(f"\n=== {title} ===")
    width = max(len(outcome.entry.log) for outcome in outcomes)
    print(f"{'log':<{width}}  {'ms':>5}  {'ok':2}  expected -> reported")
    for outcome in outcomes:
        mark = "ok" if outcome.holds() else "NO"
        for index, (_, _, label, finding) in enumerate(scoring.pairs(outcome)):
            name, ms = (outcome.entry.log, f"{outcome.seconds * 1000:5.0f}") if index == 0 else ("", "")
            print(f"{name:<{width}}  {ms:>5}  {mark if index == 0 else '':2}  {describe(label)} -> {describe(finding)}")
    counts = scoring.confusion(outcomes)
    print("\nexpected \\ reported " + "".join(f"{column:>14}" for column in scoring.PREDICTED_CLASSES))
    for row in scoring.EXPECTED_CLASSES:
        print(f"scenario {row:<11}" + "".join(f"{counts[(row, column)]:>14}" for column in scoring.PREDICTED_CLASSES))
    right, total = scoring.rule_accuracy(outcomes)
    named = sum(1 for outcome in outcomes for label, finding, _ in scoring.log_only_pairs(outcome) if finding is not None)
    labels = sum(len(outcome.entry.findings) for outcome in outcomes)
    held = sum(outcome.holds() for outcome in outcomes)
    seconds = sum(outcome.seconds for outcome in outcomes)
    print(f"\ntensor named: {named}/{labels} labelled findings ({named / labels:.0%})")
    print(f"rule id: {right}/{total} labelled findings ({right / total:.0%})")
    print(f"logs whose every label holds: {held}/{len(outcomes)}; diagnose wall time {seconds:.2f} s in all")


def shortlist(title: str, outcomes: list, *, log_only: bool = False) -> int:
    """Logs with no traceback: where the labelled culprit stands among the suspects (target: first 3 where
    the log's features determine it, and for every issue-38 release log; no suspect for a user's global).
    Returns the misses that no `known_failure` (or, log only, `log_only_failure`) expects."""
    untraced = [
        outcome
        for outcome in outcomes
        if outcome.entry.untraced and outcome.entry.untraced["ranks"] and not outcome.entry.untraced.get("benchmark")
    ]  # issue 37's measure: benchmarks/untraced_accuracy.py
    print(f"\n=== suspects, {title} ===")
    misses = 0
    for outcome in untraced:
        label = outcome.entry.untraced
        place = outcome.culprit_rank()
        if label["culprit"] is None:
            ok = not outcome.suspects
        else:
            ok = not (label["determined"] or outcome.entry.release) or (place is not None and place <= 3)
        expected = outcome.entry.known_failure or (outcome.entry.log_only_failure if log_only else None)
        misses += not ok and not expected
        where = f"{place} of {len(outcome.suspects)}" if label["culprit"] else f"{len(outcome.suspects)} suspects"
        mark = "ok" if ok else "KNOWN" if expected else "MISS"
        print(f"{mark:5} {Path(outcome.entry.log).name:<62} {label['culprit'] or 'a user global':<44} {where}")
    determined = [o for o in untraced if o.entry.untraced["determined"] and o.entry.untraced["culprit"]]
    top = sum(1 for o in determined if (o.culprit_rank() or 99) <= 3)
    first = sum(1 for o in determined if o.culprit_rank() == 1)
    print(f"culprit among the first 3: {top}/{len(determined)} determined logs (first: {first})")
    return misses


def with_sources(entries: list) -> int:
    outcomes = [scoring.run(entry) for entry in entries]
    table("with sources (--source-root, --rules as labelled; megatron-core installed)", outcomes)
    misses = shortlist("with sources", outcomes)
    # an untraced log's known failure is its culprit's (shortlist), not its findings'
    unexpected = [
        outcome for outcome in outcomes if outcome.holds() == bool(outcome.entry.known_failure and not outcome.entry.untraced)
    ]
    for outcome in outcomes:
        if outcome.entry.known_failure:
            print(f"known failure  {outcome.entry.log}: {outcome.entry.known_failure}")
    for outcome in unexpected:
        print(f"UNEXPECTED     {outcome.entry.log}: {'holds although marked known_failure' if outcome.holds() else 'fails'}")
    return len(unexpected) + misses


def log_only(entries: list) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        result = hidden.run_without_megatron(CORPUS / "scoring.py", scratch=Path(scratch))
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        return 1
    by_log = {entry.log: entry for entry in entries}
    outcomes = [scoring.outcome_from_json(by_log[data["log"]], data) for data in json.loads(result.stdout)]
    table("log only (--log-only, no megatron-core importable)", outcomes)
    failures = shortlist("log only", outcomes, log_only=True)
    shipped = {rule.id for rule in scoring.load_knowledge_base().rules}
    print("\nlog-only misses:")
    for outcome in outcomes:
        for label, finding, holds in scoring.log_only_pairs(outcome):
            if holds:
                continue
            reason = scoring.needs_source(outcome.entry, label, shipped)
            failures += reason is None
            print(
                f"  {'needs the job' + chr(39) + 's code' if reason else 'FAILS'}  {outcome.entry.log}: "
                f"{describe(label)} -> {describe(finding)}{f' ({reason})' if reason else ''}"
            )
    return failures


def operands() -> int:
    """tests/fixtures/operands: which operand of the culprit line was unsafe, each case in three
    Python renderings, from the log alone (`--log-only`; the shipped index stands for the releases)."""
    import subprocess

    import yaml

    folder = ROOT / "tests" / "fixtures" / "operands"
    cases = yaml.safe_load((folder / "cases.yaml").read_text())["cases"]
    print("\n=== operands of the culprit line, log only (tests/fixtures/operands) ===")
    misses = 0
    for case in cases:
        expected = dict(case["expected"], module=None if "user_files" in case else case["expected"]["module"])
        for log in sorted((folder / "logs").glob(f"{case['name']}-py3*.log")):
            run = subprocess.run(
                [sys.executable, "-m", "unsafe_doctor", "diagnose", "--log-only", "--format", "json", str(log)],
                capture_output=True,
                text=True,
            )
            found = json.loads(run.stdout)["findings"] if run.stdout else []
            got = [
                {
                    "variable": f["tensor"]["variable"],
                    "module": f["tensor"]["module"],
                    "scenario": f["scenario"],
                    "rule": f["rule"],
                }
                for f in found
            ]
            ok = got == [expected]
            misses += not ok
            shown = got[0] if got else {}
            print(
                f"{'ok' if ok else 'NO':2}  {log.name:<44} {shown.get('variable')}: scenario {shown.get('scenario')}, "
                f"{shown.get('rule') or 'no rule'}"
            )
    total = sum(len(list((folder / "logs").glob(f"{case['name']}-py3*.log"))) for case in cases)
    print(f"located and classified: {total - misses}/{total}")
    return misses


def main() -> int:
    entries = scoring.load_entries()
    return 1 if with_sources(entries) + log_only(entries) + operands() else 0


if __name__ == "__main__":
    sys.exit(main())
