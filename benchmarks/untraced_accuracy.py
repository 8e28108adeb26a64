"""Issue 37's score of the suspects on the logs with no traceback, per half of the fixed split.

    python benchmarks/untraced_accuracy.py              # develop, the half to tune on (the default)
    python benchmarks/untraced_accuracy.py held_back    # the half to report, once, when tuning is done

Each `untraced-*` log of tests/corpus/labels.yaml is diagnosed as a user with a bare install would:
`unsafe-doctor diagnose --log-only --format json LOG`, in a child Python that cannot see megatron-core
(tests/corpus/hidden.py), no `--source-root`. A log scores when:

- its label names a framework culprit (a rule id): the culprit is among the first three suspects (a
  finding located by a traceback that names the culprit's rule counts too);
- its culprit is the user's own global: no suspect, and no finding, is a framework rule at "high";
- the error MindIO caught is not the unsafe-data error (`error: other`): no suspect, no rule named.

The halves are tests/corpus/untraced_split.yaml's: tune on `develop`, whose logs are listed one by
one; `held_back` is only counted (its logs are not shown), to report. This script reports and
always exits 0.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import yaml
from classification_accuracy import hidden, scoring  # the corpus modules, loaded as that benchmark loads them

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"
HALVES = ("develop", "held_back")


def diagnose_bare(log: Path, scratch: Path, options: tuple[str, ...] = ("--log-only",)) -> dict:
    """The JSON report of `unsafe-doctor diagnose OPTIONS --format json LOG` where megatron-core is hidden."""
    result = hidden.run_without_megatron(
        ROOT / "unsafe_doctor" / "__main__.py", "diagnose", *options, "--format", "json", str(log), scratch=scratch
    )
    if not result.stdout.strip():
        raise SystemExit(f"{log.name}: no report (exit {result.returncode}): {result.stderr.strip()[-500:]}")
    return json.loads(result.stdout)


def kind(label: dict) -> str:
    if label.get("error") == "other":
        return "no unsafe error"
    return "framework culprit" if label["culprit"] else "user global"


def score(label: dict, report: dict) -> tuple[bool, str]:
    """(whether the log scores, what the diagnosis answered, shortly)."""
    suspects = [suspect for finding in report["findings"] for suspect in finding.get("suspects") or []]
    located = [finding for finding in report["findings"] if finding.get("rule")]
    shown = ", ".join(f"{s['rule']} ({s['confidence']})" for s in suspects[:3]) or "no suspect"
    if located:
        shown = ", ".join(f"{f['rule']} (located, {f['confidence']})" for f in located) + "; " + shown
    if kind(label) == "framework culprit":
        first_three = [suspect["rule"] for suspect in suspects[:3]]
        return label["culprit"] in first_three or any(f["rule"] == label["culprit"] for f in located), shown
    if kind(label) == "user global":
        return not any(item.get("confidence") == "high" for item in [*suspects, *located]), shown
    return not suspects and not located, shown


def main(halves: list[str]) -> int:
    split = yaml.safe_load((CORPUS / "untraced_split.yaml").read_text())["logs"]
    entries = {Path(entry.log).name: entry for entry in scoring.load_entries() if entry.untraced}
    for half in halves:
        names = sorted(name for name, side in split.items() if side == half)
        print(f"\n=== {half}: {len(names)} logs ===")
        right, by_kind = 0, Counter()
        with tempfile.TemporaryDirectory() as scratch:
            for name in names:
                label = entries[name].untraced
                report = diagnose_bare(entries[name].path(entries[name].log), Path(scratch))
                ok, shown = score(label, report)
                adaptor = report["summary"].get("adaptor") or {}
                read = adaptor.get("profile") if adaptor.get("profile_from") == "log" else None
                right += ok
                by_kind[(kind(label), ok)] += 1
                if half == "held_back":  # counted, never shown: it is not opened while tuning
                    continue
                expected = label["culprit"] or kind(label)
                print(
                    f"{'ok' if ok else 'MISS':4}  {name:<66} {expected:<40} generation {read or '-'}"
                    f"{'' if read == label['generation'] else ' (label: ' + str(label['generation']) + ')'}"
                    f"\n      suspects: {shown}"
                )
        print(f"\n{half}: {right}/{len(names)} ({right / len(names):.0%})", end="")
        print(
            "".join(
                f"; {name} {by_kind[(name, True)]}/{by_kind[(name, True)] + by_kind[(name, False)]}"
                for name in ("framework culprit", "user global", "no unsafe error")
            )
        )
    return 0


def run_halves(score_halves) -> None:
    """Score the halves named on the command line, exit 2 on an unknown one; none named is `develop` alone,
    so that no casual run opens the held-back half."""
    chosen = sys.argv[1:] or ["develop"]
    unknown = sorted(set(chosen) - set(HALVES))
    if unknown:
        print(f"unknown half {unknown}: choose from {list(HALVES)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(score_halves(chosen))


if __name__ == "__main__":
    run_halves(main)
