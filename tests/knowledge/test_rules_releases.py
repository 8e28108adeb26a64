"""The megatron rules held to the real megatron-core releases after the index's 0.16.1.

Each release is its wheel unpacked (tests/fixtures/rules/release.py says how and with which
stand-ins) and run in a child Python, since the test's own Python has 0.16.1 installed. A release
that cannot be had here (no cache, no package index) skips its tests.

- Every megatron rule's global resolves, by importing the release's module, in each release its
  version range claims: a global that moved or was renamed fails until the rule follows it.
- The fixes of the rules whose globals changed shape in 0.18 and 0.19 run on the real code under
  the emulated unsafe-data check: the step fails again without the fix and passes with it.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers import run_cli, warm_python
from packaging.version import Version
from test_rules_shipped import CASES, KNOWLEDGE, UNSAFE_DATA, diagnose, release_root, unguarded

from unsafe_doctor.knowledge.rules import Rule

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "rules"
RELEASES = ("0.17.1", "0.18.2", "0.19.2")
MEGATRON_RULES = [rule for rule in KNOWLEDGE.rules if rule.id.startswith("megatron.")]


def unpacked(version: str) -> Path:
    root = release_root(version)
    if root is None:
        pytest.skip(f"megatron-core {version} cannot be had here")
    return root


# What every script run on a release starts with, once per release (tests/helpers.py's warm Python):
# the release first on sys.path, torch, the emulation, and megatron-core's transformer config, which
# every module a rule names imports (most of the package's import time), imported under the
# emulation as a step would import it.
PRELUDE = """
from pathlib import Path
from release import import_from
import_from(Path({root!r}))
import torch
from generate import aux_loss, emulated_npu
with emulated_npu():
    import megatron.core.transformer.transformer_config
"""


def in_release(root: Path, script: str) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh child of the release's warm Python (and this tree's unsafe_doctor)."""
    env = (("PYTHONPATH", os.pathsep.join([str(REPO), str(FIXTURES)])), ("PYTHONWARNINGS", "ignore"))
    return warm_python(PRELUDE.format(root=str(root)), env).run(script)


# --- each rule's global, in each release it claims -------------------------------------------------


def modules_named(root: Path, rule: Rule) -> list[tuple[str, str, str | None]]:
    """(module, variable, owner) for each of the rule's matches that names a variable, over the
    release's modules its module or file glob selects."""
    files = [path.relative_to(root) for path in (root / "megatron").rglob("*.py")]
    queries = []
    for match in rule.matches:
        if match.variable is None:
            continue
        for relative in files:
            dotted = ".".join(relative.with_suffix("").parts)
            if (match.module is not None and fnmatch.fnmatchcase(dotted, match.module)) or (
                match.file is not None and fnmatch.fnmatchcase(f"/{relative}", match.file)
            ):
                queries.append((dotted, match.variable, match.owner))
    return queries


def claims(rule: Rule, version: str) -> bool:
    return rule.versions is None or Version(version) in rule.versions


@pytest.mark.parametrize("version", RELEASES)
def test_every_megatron_rule_resolves_its_global_in_each_release_it_claims(version):
    root = unpacked(version)
    claimed = [rule for rule in MEGATRON_RULES if claims(rule, version)]
    queries = {rule.id: modules_named(root, rule) for rule in claimed}
    flat = [query for rule_queries in queries.values() for query in rule_queries]
    script = f"import json\nfrom resolve import resolves\nprint(json.dumps([resolves(*query) for query in {flat!r}]))"
    result = in_release(root, script)
    assert result.returncode == 0, result.stderr[-3000:]
    found = dict(zip(map(tuple, flat), json.loads(result.stdout.splitlines()[-1]), strict=True))
    unresolved = [rule_id for rule_id, rule_queries in queries.items() if not any(found[query] for query in rule_queries)]
    assert not unresolved, f"megatron-core {version} has no such global for: {unresolved}"


def test_the_tracker_rules_split_where_the_releases_moved_the_tracker():
    """The old tracker's rule ends at 0.17, the metrics object's starts at 0.18: each claims only
    the releases that have its global (the test above holds them to it)."""
    assert [claims(KNOWLEDGE.rule("megatron.moe-layer-wise-tracker-moe-utils"), v) for v in RELEASES] == [True, False, False]
    assert [claims(KNOWLEDGE.rule("megatron.moe-metrics-tracker"), v) for v in RELEASES] == [False, True, True]


# --- the fixes, run on each release's real code ----------------------------------------------------

# run in a fresh child of the release's warm Python: what the step changes is gone with the child
STEP = """
with emulated_npu() as mark:
{setup}
{fix}
    try:
{retry}
    except RuntimeError as error:
        print("unsafe" if {unsafe!r} in str(error) else f"other: {{error}}")
    else:
        print("passed")
"""


def step(root: Path, setup: str, retry: str, fix: str | None) -> str:
    """The step that failed, in a fresh process of the release: after `setup` marked its tensors
    unsafe, with or without the fix first; 'unsafe', 'passed' or the other error."""
    script = STEP.format(
        setup=textwrap.indent(setup, "    "),
        fix=textwrap.indent(fix or "pass", "    "),
        retry=textwrap.indent(retry, "        "),
        unsafe=UNSAFE_DATA,
    )
    result = in_release(root, script)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()[-1]


@functools.cache
def rendered_fix(case: str) -> str:
    """The fix diagnose renders for the case, without its guards, imports first."""
    _, result = diagnose(CASES[case].log(None), CASES[case].versions, (unpacked("0.19.2"),))
    imports, code = unguarded(CASES[case].rule, result.fix)
    return "\n".join([*imports, code])


RECORD_MOE_METRIC = """
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
get_moe_metrics_tracker().record("load_balancing_loss", aux_loss(), 1, 4)
mark(get_moe_metrics_tracker().metrics["load_balancing_loss"].values)
"""
# 0.19: a step logged (the running sums exist), the next step's tensors all left unsafe
SAVE_MTP_METRICS = """
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
MTPLossLoggingHelper.save_metrics_to_tracker(aux_loss(), torch.tensor(3.0), torch.tensor(4.0), 0, 2)
MTPLossLoggingHelper.track_mtp_metrics(1.0, 1, None)
MTPLossLoggingHelper.clean_metrics_in_tracker()
for value in MTPLossLoggingHelper.tracker.values():
    if isinstance(value, torch.Tensor):
        mark(value)
"""


# packed sequences: a micro-batch added its lengths, the step failed before the iteration's end read them
UPDATE_SEQLEN_STATS = """
from megatron.training import training
training.update_seqlen_stats_from_cu_seqlens(torch.tensor([0, 3, 7], dtype=torch.int32))
mark(training._seqlen_stats_in_iteration)
"""


@pytest.mark.parametrize(
    ("case", "version", "setup", "retry"),
    [
        (
            "0.19 moe metrics tracker",
            "0.18.2",
            RECORD_MOE_METRIC,
            'get_moe_metrics_tracker().record("load_balancing_loss", aux_loss(), 1, 4)\nget_moe_metrics_tracker().clear()',
        ),
        (
            "0.19 moe metrics tracker",
            "0.19.2",
            RECORD_MOE_METRIC,
            'get_moe_metrics_tracker().record("load_balancing_loss", aux_loss(), 1, 4)\nget_moe_metrics_tracker().clear()',
        ),
        (
            "0.19 mtp metrics tracker",
            "0.19.2",
            SAVE_MTP_METRICS,
            "MTPLossLoggingHelper.save_metrics_to_tracker(aux_loss(), torch.tensor(3.0), torch.tensor(4.0), 0, 2)\n"
            "MTPLossLoggingHelper.track_mtp_metrics(1.0, 2, None)\nMTPLossLoggingHelper.clean_metrics_in_tracker()",
        ),
        (
            "0.18 seqlen stats",
            "0.18.2",
            UPDATE_SEQLEN_STATS,
            "training.update_seqlen_stats_from_cu_seqlens(torch.tensor([0, 3, 7], dtype=torch.int32))\n"
            "assert training.consume_seqlen_stats_in_iteration() == (7.0, 25.0)",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) and "\n" not in value else None,
)
def test_fix_lets_the_next_step_past_the_unsafe_memory_in_the_release(case, version, setup, retry):
    root = unpacked(version)
    fix = rendered_fix(case)
    assert step(root, setup, retry, None) == "unsafe"
    assert step(root, setup, retry, fix) == "passed"


def test_log_only_diagnose_names_the_seqlen_stats_from_the_index():
    """A real 0.18.2 traceback through megatron/training/training.py, read with the log alone (the
    index holds megatron/training for 0.17 and newer): the global, its module and the rule."""
    log = FIXTURES / "megatron-core-0.18.2-update-seqlen-stats.log"
    result = run_cli("diagnose", "--log-only", "--format", "json", str(log))
    [finding] = json.loads(result.stdout)["findings"]
    tensor = finding["tensor"]
    assert (tensor["variable"], tensor["module"]) == ("_seqlen_stats_in_iteration", "megatron.training.training")
    assert finding["rule"] == "megatron.seqlen-stats"
    assert finding["source_release"].startswith("megatron-core 0.18.0–0.18.2"), finding["source_release"]
