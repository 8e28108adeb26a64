"""The shipped knowledge as JSON (knowledge_base/snapshot.json, derived by scripts/derive_snapshot.py):
what every run reads for the shipped files instead of their YAML, holding exactly what the YAML gives."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import script_module
from helpers import run_cli

from unsafe_doctor.knowledge.loading import SNAPSHOT_FILE, _load_file, shipped_files, shipped_knowledge_dir, snapshot_knowledge

ROOT = Path(__file__).resolve().parents[2]
TRACED_LOG = ROOT / "samples" / "logs" / "megatron_moe_tracker.log"


def test_the_committed_snapshot_is_what_the_script_derives_from_the_yaml():
    committed = (shipped_knowledge_dir() / SNAPSHOT_FILE).read_text(encoding="utf-8")
    stale = "knowledge_base/snapshot.json is stale: run python scripts/derive_snapshot.py"
    assert script_module("derive_snapshot").render() == committed, stale


def test_the_snapshot_builds_the_knowledge_the_yaml_builds_with_every_items_file_and_line():
    from_yaml = [_load_file(path, [], trusted=True) for path in shipped_files()]
    from_snapshot = snapshot_knowledge([])  # raises, rather than falling back to the YAML
    assert from_snapshot == from_yaml
    assert all(rule.origin.startswith(str(shipped_knowledge_dir())) for loaded in from_snapshot for rule in loaded.rules.values())


def _run(cwd: Path, pythonpath: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`unsafe-doctor ARGS` from the package under `pythonpath`, in a Python of its own."""
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(pythonpath)},
    )


@pytest.mark.parametrize("broken", ["missing", "truncated"])
def test_an_install_with_a_broken_snapshot_lists_the_same_rules_from_the_yaml(tmp_path, broken):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "unsafe_doctor", tree / "unsafe_doctor", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "knowledge_base", tree / "knowledge_base", ignore=shutil.ignore_patterns("index"))
    shutil.copytree(ROOT / "knowledge_base" / "index", tree / "knowledge_base" / "index", copy_function=os.symlink)
    snapshot = tree / "knowledge_base" / SNAPSHOT_FILE
    if broken == "missing":
        snapshot.unlink()
    else:
        snapshot.write_text(snapshot.read_text(encoding="utf-8")[:1000], encoding="utf-8")
    result = _run(tmp_path, tree, "rules", "list", "--format", "json")
    expected = run_cli("rules", "list", "--format", "json", cwd=tmp_path)  # this checkout's
    assert result.returncode == expected.returncode == 0, result.stderr[-2000:]
    assert result.stdout.replace(str(tree), str(ROOT)) == expected.stdout


def test_a_yaml_file_edited_since_the_snapshot_is_read_as_yaml(tmp_path):
    """A checkout whose rules were edited without running the script reads the edit, not the snapshot."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "unsafe_doctor", tree / "unsafe_doctor", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "knowledge_base", tree / "knowledge_base", ignore=shutil.ignore_patterns("index"))
    shutil.copytree(ROOT / "knowledge_base" / "index", tree / "knowledge_base" / "index", copy_function=os.symlink)
    rules = tree / "knowledge_base" / "rules" / "megatron.yaml"
    text = rules.read_text(encoding="utf-8")
    title = next(line for line in text.splitlines() if line.strip().startswith("title:"))
    rules.write_text(text.replace(title, title.split("title:")[0] + "title: edited in the checkout", 1), encoding="utf-8")
    listed = _run(tmp_path, tree, "rules", "list", "--format", "json")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "edited in the checkout" in listed.stdout


def test_a_user_rules_file_is_still_schema_checked_with_its_line(tmp_path):
    rules = tmp_path / "mine.yaml"
    rules.write_text("rules:\n  - id: mine.rule\n    title: 3\n", encoding="utf-8")
    result = run_cli("diagnose", "--rules", str(rules), str(TRACED_LOG), cwd=tmp_path)
    assert result.returncode == 2
    assert f"{rules}:2: rules.0: 'match' is a required property" in result.stderr  # the schema's, with its line
