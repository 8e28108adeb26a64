"""The corpus labels (labels.yaml) and how a diagnosis is scored against them.

Shared by tests/commands/test_corpus.py (every label must hold) and benchmarks/classification_accuracy.py
(the confusion table). A finding is compared on the fields its label gives: `variable` (the global
the finding names: the resolved tensor's variable, else the one its rule names from the culprit
frame), `ranks`, `scenario` (1, 2 or null), `rule` (null for a heuristic verdict or none) and,
when given, `confidence`.

The `held_back` half of releases_split.yaml is left out (`load_entries`), so that no test and no
benchmark but the one that reports it ever diagnoses those logs.
"""

from __future__ import annotations

import importlib.util
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from unsafe_doctor.diagnose.pipeline import DiagnosedFinding, Diagnosis, diagnose
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.knowledge.rules import KnowledgeBase

HERE = Path(__file__).resolve().parent
LABELS = HERE / "labels.yaml"
RELEASES_SPLIT = HERE / "releases_split.yaml"
ENTRY_KEYS = {
    "log",
    "origin",
    "source_roots",
    "rules",
    "findings",
    "last_error",
    "known_failure",
    "untraced",
    "release",
    "log_only_failure",
}
FINDING_KEYS = {"variable", "ranks", "scenario", "rule", "confidence"}
REQUIRED_FINDING_KEYS = {"variable", "ranks", "scenario", "rule"}
UNTRACED_KEYS = {"ranks", "mindio", "generation", "culprit", "determined"}
OPTIONAL_UNTRACED_KEYS = {"error", "benchmark"}
MINDIO_FORMS = {"first-public", "v7.3", "v26"}


@dataclass(frozen=True)
class Entry:
    log: str  # relative to this folder
    origin: str
    source_roots: tuple[str, ...]
    rules: tuple[str, ...]
    findings: tuple[dict, ...]
    last_error: str | None  # exception type the log ends with, when it has no finding
    known_failure: str | None  # why the tool, not the label, is wrong
    untraced: dict | None = None  # a log of MindIO's catch line without a traceback: its answer (labels.yaml)
    release: str | None = None  # the megatron-core release the run imported, unpacked outside the checkout
    log_only_failure: str | None = None  # why the tool misses the label from the log alone (it holds with the sources)

    def path(self, relative: str) -> Path:
        return (HERE / relative).resolve()


def releases_split() -> dict[str, str]:
    """releases_split.yaml: each `release-*` log's side, `develop` or `held_back`."""
    return yaml.safe_load(RELEASES_SPLIT.read_text())["logs"]


def load_entries(*, held_back: bool = False) -> list[Entry]:
    """Every labelled log; the held-back half of releases_split.yaml only when `held_back` (the
    benchmark that reports it, and the check that every log is labelled)."""
    data = yaml.safe_load(LABELS.read_text())
    hidden = set() if held_back else {name for name, side in releases_split().items() if side == "held_back"}
    entries = []
    for item in data["logs"]:
        if Path(item["log"]).name in hidden:
            continue
        if set(item) - ENTRY_KEYS:
            raise ValueError(f"{item.get('log')}: unknown keys {sorted(set(item) - ENTRY_KEYS)}")
        for finding in item.get("findings", []):
            if set(finding) - FINDING_KEYS or REQUIRED_FINDING_KEYS - set(finding):
                raise ValueError(f"{item['log']}: a finding needs {sorted(REQUIRED_FINDING_KEYS)}, may add confidence")
        untraced = item.get("untraced")
        if untraced is not None and (
            not UNTRACED_KEYS <= set(untraced) <= UNTRACED_KEYS | OPTIONAL_UNTRACED_KEYS
            or untraced["mindio"] not in MINDIO_FORMS
            or untraced.get("error", "other") != "other"
        ):
            raise ValueError(
                f"{item['log']}: untraced needs {sorted(UNTRACED_KEYS)}, may add "
                f"{sorted(OPTIONAL_UNTRACED_KEYS)}; mindio one of {sorted(MINDIO_FORMS)}; error: other"
            )
        entries.append(
            Entry(
                log=item["log"],
                origin=item["origin"],
                source_roots=tuple(item.get("source_roots", [])),
                rules=tuple(item.get("rules", [])),
                findings=tuple(item.get("findings", [])),
                last_error=item.get("last_error"),
                known_failure=item.get("known_failure"),
                untraced=untraced,
                release=item.get("release"),
                log_only_failure=item.get("log_only_failure"),
            )
        )
    return entries


def release_root(entry: Entry) -> Path | None:
    """The unpacked megatron-core release of a `release` entry, where tests/knowledge/test_rules_releases.py
    keeps them (tests/fixtures/rules/release.py: downloaded once when missing); None when it cannot
    be had, or the entry names none."""
    if entry.release is None:
        return None
    spec = importlib.util.spec_from_file_location("corpus_release", HERE.parent / "fixtures" / "rules" / "release.py")
    release = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(release)
    return release.release_root(entry.release)


@dataclass(frozen=True)
class Outcome:
    entry: Entry
    findings: tuple[dict, ...]  # every reported finding, with every field
    last_error: str | None
    seconds: float
    untraced_ranks: tuple[int, ...] = ()  # ranks reported with MindIO's catch line and no traceback
    mindio: str | None = None  # the catch line's form the diagnosis read
    generation: str | None = None  # the adaptor profile it chose, when the log's lines chose it
    suspects: tuple[str, ...] = ()  # the shortlist's rule ids, most likely first

    def culprit_rank(self) -> int | None:
        """Where the labelled culprit stands in the shortlist (1 = first), None when it is not there."""
        culprit = (self.entry.untraced or {}).get("culprit")
        return self.suspects.index(culprit) + 1 if culprit in self.suspects else None

    def expected(self) -> list[dict]:
        return sorted(self.entry.findings, key=_order)

    def got(self) -> list[dict]:
        """The reported findings, each on the fields of the label with its variable (all when none)."""
        fields = {label["variable"]: set(label) for label in self.entry.findings}
        kept = [fields.get(finding["variable"], FINDING_KEYS) for finding in self.findings]
        return sorted(
            (
                {key: value for key, value in finding.items() if key in keys}
                for finding, keys in zip(self.findings, kept, strict=True)
            ),
            key=_order,
        )

    def holds(self) -> bool:
        return self.got() == self.expected() and self.last_error == self.entry.last_error


def _order(finding: dict) -> tuple:
    return (str(finding["variable"]), finding["ranks"])


def run(entry: Entry, *, log_only: bool = False) -> Outcome:
    """Diagnose the entry's log as the CLI would, timed; `log_only`: as `--log-only` would, without
    the entry's source roots (its `--rules` still apply: they are the user's knowledge, not source)."""
    rule_paths = [entry.path(path) for path in entry.rules]
    roots = [] if log_only else [entry.path(root) for root in entry.source_roots]
    if entry.release and not log_only:
        root = release_root(entry)
        if root is None:
            raise LookupError(f"{entry.log}: megatron-core {entry.release} cannot be had here")
        roots.append(root)
    started = time.perf_counter()
    setup = groundwork(rule_paths, roots, log_only=log_only)
    diagnosis = diagnose([str(entry.path(entry.log))], setup)
    seconds = time.perf_counter() - started
    findings = tuple(_fields(finding, setup.knowledge) for finding in diagnosis.findings)
    environment = diagnosis.context.environment
    generation = environment.profile.id if environment.profile_from == "log" else None
    untraced = diagnosis.untraced
    suspects = tuple(suspect.rule.id for suspect in untraced.shortlist.suspects) if untraced else ()
    return Outcome(
        entry, findings, _last_error(diagnosis), seconds, diagnosis.untraced_ranks, diagnosis.mindio, generation, suspects
    )


def _fields(diagnosed: DiagnosedFinding, knowledge: KnowledgeBase) -> dict:
    classification, tensor = diagnosed.classification, diagnosed.finding.tensor
    variable = tensor.name.variable if tensor else None
    if variable is None and classification.rule is not None:
        variable = knowledge.rule(classification.rule).match.variable
    return {
        "variable": variable,
        "ranks": list(diagnosed.finding.ranks),
        "scenario": classification.scenario,
        "rule": classification.rule,
        "confidence": classification.confidence,
    }


def _last_error(diagnosis: Diagnosis) -> str | None:
    return diagnosis.last_error.exception_type if diagnosis.last_error else None


# --- the confusion table ------------------------------------------------------------------------------

EXPECTED_CLASSES = ("1", "2", "none")
PREDICTED_CLASSES = ("1", "2", "unclassified", "no finding")


def pairs(outcome: Outcome) -> list[tuple[str, str, dict | None, dict | None]]:
    """(expected class, predicted class, label, finding) for every label and every reported finding.

    Labels and findings pair on the variable, then the rest in order; an unpaired finding is
    expected "none"; a log with no label and no finding counts once as ("none", "no finding").
    """
    labels, findings = list(outcome.entry.findings), list(outcome.findings)
    paired = []
    for label in list(labels):
        match = next((finding for finding in findings if finding["variable"] == label["variable"]), None)
        if match is not None:
            labels.remove(label)
            findings.remove(match)
            paired.append((label, match))
    paired.extend(zip(labels, findings, strict=False))  # the longer one's rest is paired with None below
    paired.extend((label, None) for label in labels[len(findings) :])
    paired.extend((None, finding) for finding in findings[len(labels) :])
    if not paired:
        return [("none", "no finding", None, None)]
    return [
        ("none" if label is None else _class(label["scenario"]), _predicted(finding), label, finding) for label, finding in paired
    ]


def _class(scenario: int | None) -> str:
    return "none" if scenario is None else str(scenario)


def _predicted(finding: dict | None) -> str:
    if finding is None:
        return "no finding"
    return "unclassified" if finding["scenario"] is None else str(finding["scenario"])


def confusion(outcomes: list[Outcome]) -> Counter:
    return Counter((expected, predicted) for outcome in outcomes for expected, predicted, _, _ in pairs(outcome))


def rule_accuracy(outcomes: list[Outcome]) -> tuple[int, int]:
    """(labels whose finding names the labelled rule, or none when the label says none; labels)."""
    right = total = 0
    for outcome in outcomes:
        for _, _, label, finding in pairs(outcome):
            if label is not None:
                total += 1
                right += finding is not None and finding["rule"] == label["rule"]
    return right, total


# --- log-only mode ------------------------------------------------------------------------------------


def load_knowledge_base() -> KnowledgeBase:
    """The shipped rules (no --rules): which labels a shipped rule covers."""
    return load_knowledge([])


def needs_source(entry: Entry, label: dict, shipped: set[str]) -> str | None:
    """Why a label may be missed from the log alone (listed, not required), or None: every label a
    shipped rule covers must hold. What needs the job's own code: a verdict of the source heuristics
    (no rule), a user's rule about the user's module, and code that no release holds (the
    stand-ins at MindSpeed's paths are not MindSpeed's lines, so the index cannot stand in)."""
    if label["rule"] is None:
        return "no rule: the source heuristics read the user's code"
    if label["rule"] not in shipped:
        return "a user's rule about the user's own module"
    if any("standins" in root for root in entry.source_roots):
        return "stand-in code at MindSpeed's paths, which no release holds"
    return None


def log_only_pairs(outcome: Outcome) -> list[tuple[dict, dict | None, bool]]:
    """(label, the reported finding for it, whether it holds) for each label of a log-only outcome;
    a finding holds on the label's fields but confidence (a log-only verdict may be less sure)."""
    found = []
    for label in outcome.entry.findings:
        finding = next((item for item in outcome.findings if item["variable"] == label["variable"]), None)
        fields = [key for key in label if key != "confidence"]
        holds = finding is not None and all(finding[key] == label[key] for key in fields)
        found.append((label, finding, holds))
    return found


def outcome_json(outcome: Outcome) -> dict:
    return {
        "log": outcome.entry.log,
        "findings": list(outcome.findings),
        "last_error": outcome.last_error,
        "seconds": outcome.seconds,
        "untraced_ranks": list(outcome.untraced_ranks),
        "mindio": outcome.mindio,
        "generation": outcome.generation,
        "suspects": list(outcome.suspects),
    }


def outcome_from_json(entry: Entry, data: dict) -> Outcome:
    return Outcome(
        entry,
        tuple(data["findings"]),
        data["last_error"],
        data["seconds"],
        tuple(data["untraced_ranks"]),
        data["mindio"],
        data["generation"],
        tuple(data["suspects"]),
    )


if __name__ == "__main__":  # the log-only scores as JSON: run in a Python without megatron-core (hidden.py)
    import json
    import sys

    print(json.dumps([outcome_json(run(entry, log_only=True)) for entry in load_entries()]))
    sys.exit(0)
