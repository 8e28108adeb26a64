"""Coverage of every indexed release: each global the audit reports in a pinned release is claimed by a
shipped rule for that release, or reviewed (knowledge_base/reviewed_globals.yaml).

knowledge_base/index/globals.json is what scripts/derive_globals.py derives by running the audit over
every release of knowledge_base/index/sources.yaml; these tests read it and the shipped knowledge only,
except the last, which re-derives two releases from their wheels where they can be had.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import script_module

from unsafe_doctor.knowledge import loading
from unsafe_doctor.knowledge.loading import load_knowledge, validate_files

ROOT = Path(__file__).resolve().parents[2]
KNOWLEDGE = load_knowledge()


SCRIPT = script_module("derive_globals")
SHIPPED = json.loads(SCRIPT.GLOBALS_FILE.read_text(encoding="utf-8"))


def test_every_global_of_every_release_is_claimed_by_a_rule_or_reviewed():
    assert SCRIPT.problems(SHIPPED, KNOWLEDGE, SCRIPT.reviewed()) == []


def test_the_reviewed_file_is_valid_knowledge_that_no_diagnose_reads():
    assert validate_files([SCRIPT.REVIEWED]) == []
    assert SCRIPT.reviewed()
    snapshot = json.loads((loading.shipped_knowledge_dir() / loading.SNAPSHOT_FILE).read_text(encoding="utf-8"))
    assert snapshot["files"] and SCRIPT.REVIEWED.name not in {Path(entry["file"]).name for entry in snapshot["files"]}
    # nor the YAML that an install without a readable snapshot falls back to
    assert loading.shipped_files() and SCRIPT.REVIEWED.name not in {path.name for path in loading.shipped_files()}


def test_no_known_hole_is_left():
    """Each global once listed under `needs_rule` has its rule now."""
    assert [f"{entry['module']}.{entry['name']}" for entry in SCRIPT.reviewed() if entry.get("needs_rule")] == []


def test_a_new_releases_unreviewed_global_fails():
    document = copy.deepcopy(SHIPPED)
    document["releases"]["megatron-core"].append({"release": "0.20.0", "source": "pypi:test", "digest": "0" * 64})
    document["globals"].append(
        {
            "framework": "megatron-core",
            "module": "megatron.core.transformer.moe.router",
            "class": "TopKRouter",
            "name": "new_counts",
            "releases": ["0.20.0"],
            "kind": "buffer",
            "defined": "megatron/core/transformer/moe/router.py:10",
            "sites": ["megatron/core/transformer/moe/router.py:TopKRouter.routing"],
        }
    )
    problems = SCRIPT.problems(document, KNOWLEDGE, SCRIPT.reviewed())
    assert problems == [
        "megatron-core 0.20.0: megatron.core.transformer.moe.router.TopKRouter.new_counts (buffer, "
        "megatron/core/transformer/moe/router.py:10): no rule claims it and no review names it"
    ]


def test_a_new_release_of_a_global_reviewed_for_named_releases_fails():
    reviews = SCRIPT.reviewed()
    named = next(entry for entry in reviews if entry["releases"] != "all")
    document = copy.deepcopy(SHIPPED)
    held = next(
        found
        for found in document["globals"]
        if (found["framework"], found["module"], found["class"], found["name"])
        == (named["framework"], named["module"], named.get("class"), named["name"])
    )
    held["releases"].append("9.9.9")
    document["releases"][named["framework"]].append({"release": "9.9.9", "source": "test", "digest": "0"})
    [problem] = SCRIPT.problems(document, KNOWLEDGE, reviews)
    assert problem.startswith(f"{named['framework']} 9.9.9: ") and "no rule claims it and no review names it" in problem


def test_a_review_of_a_global_a_rule_claims_is_stale():
    reviews = [
        *SCRIPT.reviewed(),
        {
            "framework": "megatron-core",
            "module": "megatron.core.transformer.moe.router",
            "class": "TopKRouter",
            "name": "expert_bias",
            "releases": "all",
            "why": "none",
        },
    ]
    problems = SCRIPT.problems(SHIPPED, KNOWLEDGE, reviews)
    assert problems and all(
        "TopKRouter.expert_bias is reviewed, but megatron.router-expert-bias covers it" in problem for problem in problems
    )
    assert len(problems) == len(next(found["releases"] for found in SHIPPED["globals"] if found["name"] == "expert_bias"))


def test_a_rule_claims_only_the_releases_of_its_range():
    """megatron.default-causal-mask-cache claims megatron-core < 0.16: the same global in a 0.16 release
    would be a hole."""
    document = copy.deepcopy(SHIPPED)
    mask = next(found for found in document["globals"] if found["name"] == "get_default_causal_mask")
    assert SCRIPT.problems({**document, "globals": [mask]}, KNOWLEDGE, []) == []
    mask["releases"].append("0.16.1")
    [problem] = SCRIPT.problems({**document, "globals": [mask]}, KNOWLEDGE, [])
    assert problem.startswith("megatron-core 0.16.1: megatron.core.transformer.utils.get_default_causal_mask ")


def test_the_shipped_file_is_current_for_two_real_releases(tmp_path):
    """The audit run again over megatron-core 0.16.1 and 0.19.2 finds what the shipped file lists for
    them: a change to the audit or to the pinned list shows here until the file is derived again."""
    cache = Path(os.environ.get("UNSAFE_DOCTOR_WHEELS", tmp_path))
    command = [
        sys.executable,
        str(ROOT / "scripts" / "derive_globals.py"),
        "--cache",
        str(cache),
        "--only",
        "megatron-core=0.16.1",
        "--only",
        "megatron-core=0.19.2",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    if done.returncode != 0 and ("pip" in done.stderr or "download" in done.stderr):
        pytest.skip("the megatron-core 0.16.1 and 0.19.2 wheels cannot be had here")
    assert done.returncode == 0, done.stderr
    derived = json.loads(done.stdout)
    releases = {"0.16.1", "0.19.2"}
    assert derived["releases"]["megatron-core"] == [
        release for release in SHIPPED["releases"]["megatron-core"] if release["release"] in releases
    ]
    shipped = [
        {**found, "releases": [release for release in found["releases"] if release in releases]}
        for found in SHIPPED["globals"]
        if found["framework"] == "megatron-core" and releases & {*found["releases"]}
    ]
    newest = [found for found in shipped if "0.19.2" in found["releases"]]  # kind, definition and sites are 0.19.2's
    assert [(found["module"], found["class"], found["name"], found["releases"]) for found in derived["globals"]] == [
        (found["module"], found["class"], found["name"], found["releases"]) for found in shipped
    ]
    assert [found for found in derived["globals"] if "0.19.2" in found["releases"]] == newest
