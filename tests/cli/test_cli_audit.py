"""`unsafe-doctor audit`, end to end: exit codes, text, JSON and SARIF, --fix."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import refused, run_cli
from terminal import at_terminal

from unsafe_doctor.cli.options import CACHE_VARIABLE

ROOT = Path(__file__).resolve().parents[2]
TOYTRAIN = ROOT / "samples" / "framework" / "toytrain"
LEGACY_ADAPTOR = ROOT / "samples" / "adaptors" / "legacy" / "mindio_ttp" / "adaptor" / "modellink_adaptor.py"
MARKER = "# unsafe-doctor: begin "


# What the command reads of the environment, beyond COLUMNS: its settings, and rich's colour switches.
READ = ("UNSAFE_DOCTOR_", "_UNSAFE_DOCTOR", "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "TERM")


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`unsafe-doctor audit ARGS` in this process (this tree's package), at 120 columns, with no setting
    from the environment but the test's own cache folder (conftest), as a child given only COLUMNS would run."""
    return run_cli("audit", *args, cwd=cwd, env={"COLUMNS": "120", CACHE_VARIABLE: os.environ[CACHE_VARIABLE]}, unset=READ)


@pytest.fixture
def framework(tmp_path) -> Path:
    """A copy of toytrain: --fix writes into its recovery.py."""
    shutil.copytree(TOYTRAIN.parent, tmp_path / "framework")
    return tmp_path / "framework"


def test_uncovered_globals_exit_1_with_a_table():
    result = run(str(TOYTRAIN), "--adaptor", str(TOYTRAIN / "recovery.py"))
    assert result.returncode == 1, result.stderr
    for text in (
        "LOSS_LOG",
        "_EMA_GRAD_NORM",
        "in toytrain.state",
        "uncovered",
        "state.py:11",
        "2 globals: 2 uncovered, 0 unsafe, 0 covered",
        "fix: feature_rollback()",
    ):
        assert text in result.stdout


def test_json_shape():
    result = run(str(TOYTRAIN), "--format", "json")
    assert result.returncode == 1
    document = json.loads(result.stdout)
    assert document["schema"] == "unsafe-doctor/audit/v1"
    assert document["adaptor"] == {
        "file": str(TOYTRAIN / "recovery.py"),
        "found": "found under the source roots as the module that defines the rollback and repair functions",
        "profile": "mindspeed-llm-26",
        "profile_from": "adaptor",
    }
    assert document["summary"] == {"holders": 2, "uncovered": 2, "unsafe": 0, "covered": 0, "fixable": 2}
    loss_log = next(holder for holder in document["holders"] if holder["variable"] == "LOSS_LOG")
    assert {key: loss_log[key] for key in ("name", "kind", "module", "owner", "placement", "scenario", "rule", "confidence")} == {
        "name": "toytrain.state.LOSS_LOG",
        "kind": "module-global",
        "module": "toytrain.state",
        "owner": None,
        "placement": "unknown",
        "scenario": 1,
        "rule": None,
        "confidence": "medium",
    }
    assert loss_log["definition"] == {
        "file": str(TOYTRAIN / "state.py"),
        "line": 11,
        "function": None,
        "code": "LOSS_LOG: dict[str, torch.Tensor] = {}",
    }
    assert {(Path(site["file"]).name, site["line"]) for site in loss_log["tensors"]} == {("state.py", 27), ("state.py", 28)}
    assert loss_log["coverage"]["status"] == "uncovered"
    assert loss_log["fix"]["function"] == "feature_rollback"
    assert all(set(site) == {"file", "line", "function", "code"} for site in loss_log["writers"] + loss_log["readers"])


def test_sarif_results_locations_fixes_and_stale_resets():
    result = run(str(TOYTRAIN), "--adaptor", str(LEGACY_ADAPTOR), "--format", "sarif")
    assert result.returncode == 1, result.stderr
    sarif = json.loads(result.stdout)
    assert sarif["version"] == "2.1.0" and sarif["$schema"].endswith("sarif-2.1.0.json")
    [run_] = sarif["runs"]
    rules = {rule["id"] for rule in run_["tool"]["driver"]["rules"]}
    results = run_["results"]
    assert {result_["ruleId"] for result_ in results} <= rules
    uncovered = [result_ for result_ in results if result_["ruleId"] == "uncovered-global-tensor"]
    assert len(uncovered) == 2
    for result_ in uncovered:
        [location] = result_["locations"]
        assert location["physicalLocation"]["artifactLocation"]["uri"] == (TOYTRAIN / "state.py").as_uri()
        assert location["physicalLocation"]["region"]["startLine"] in (11, 14)
        [fix] = result_["fixes"]
        changes = fix["artifactChanges"]
        assert {change["artifactLocation"]["uri"] for change in changes} == {LEGACY_ADAPTOR.as_uri()}
        inserted = [r["insertedContent"]["text"] for change in changes for r in change["replacements"]]
        assert all(text.lstrip().startswith(MARKER) for text in inserted)
        assert all(r["deletedRegion"]["charLength"] == 0 for change in changes for r in change["replacements"])
    scenario_2 = next(r for r in uncovered if "_EMA_GRAD_NORM" in r["message"]["text"])
    assert len(scenario_2["fixes"][0]["artifactChanges"][0]["replacements"]) == 2  # send and receive
    [stale] = [result_ for result_ in results if result_["ruleId"] == "stale-reset"]
    assert "_MOE_AUX_LOSSES_LOGGING_TRACKER" in stale["message"]["text"]
    assert stale["locations"][0]["physicalLocation"]["region"]["startLine"] == 23


def test_sarif_fixes_applied_give_what_fix_writes(framework):
    adaptor = framework / "toytrain" / "recovery.py"
    text = adaptor.read_text()
    sarif = json.loads(run(str(framework / "toytrain"), "--format", "sarif").stdout)
    replacements = [
        replacement
        for result_ in sarif["runs"][0]["results"]
        for change in result_["fixes"][0]["artifactChanges"]
        for replacement in change["replacements"]
    ]
    assert len(replacements) == 3
    for replacement in sorted(replacements, key=lambda r: r["deletedRegion"]["charOffset"], reverse=True):
        offset = replacement["deletedRegion"]["charOffset"]
        text = text[:offset] + replacement["insertedContent"]["text"] + text[offset:]
    assert run(str(framework / "toytrain"), "--fix", "--yes").returncode == 0
    assert adaptor.read_text() == text


def test_fix_dry_run_prints_one_diff_and_writes_nothing(framework):
    adaptor = framework / "toytrain" / "recovery.py"
    before = adaptor.read_bytes()
    result = run("toytrain", "--adaptor", "toytrain/recovery.py", "--fix", "--dry-run", cwd=framework)
    assert result.returncode == 1, result.stderr
    diff = result.stdout[result.stdout.index("--- a/toytrain/recovery.py") :]
    assert diff.count("--- ") == 1 and diff.count(f"+    {MARKER}") == 3
    assert "dry run: nothing written" in result.stderr
    assert adaptor.read_bytes() == before
    assert sorted(path.name for path in adaptor.parent.iterdir()) == sorted(path.name for path in TOYTRAIN.iterdir())


def test_fix_yes_writes_and_the_second_audit_is_clean(framework):
    result = run("toytrain", "--fix", "--yes", cwd=framework)
    assert result.returncode == 0, result.stderr
    assert "wrote toytrain/recovery.py (backup: toytrain/recovery.py.unsafe-doctor.bak)" in result.stderr
    again = run("toytrain", "--format", "json", cwd=framework)
    assert again.returncode == 0, again.stdout
    document = json.loads(again.stdout)
    assert document["summary"] == {"holders": 2, "uncovered": 0, "unsafe": 0, "covered": 2, "fixable": 0}
    assert {holder["variable"]: holder["coverage"]["how"] for holder in document["holders"]} == {
        "LOSS_LOG": "rebuilt",
        "_EMA_GRAD_NORM": "repaired",
    }


def test_clean_tree_exits_0(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("import torch\n\nTABLE = torch.arange(4)\nLIMIT = 3\n")
    result = run(str(tmp_path / "pkg"))
    assert result.returncode == 0, result.stdout
    assert "No global that holds device tensors was found." in result.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["missing-folder"], "missing-folder: no such file or folder"),
        ([str(TOYTRAIN), "--adaptor", "no_such_adaptor.py"], "adaptor no_such_adaptor.py: no such file"),
        ([str(TOYTRAIN), "--dry-run"], "--dry-run goes with --fix"),
        ([str(TOYTRAIN), "--fix", "--format", "json"], "--fix prints a diff"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, fragment):
    refused(run(*args), fragment)


def test_fix_without_an_adaptor_exits_2(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("import torch\n\nBUF = torch.ones(2).cuda()\n")
    refused(run(str(tmp_path / "pkg"), "--fix", "--yes"), "--fix needs the recovery adaptor")


def _docs_sample_section() -> str:
    """docs/audit.md's walk through the sample framework."""
    text = (ROOT / "docs" / "audit.md").read_text()
    start = text.index("\n## On the sample framework")
    return text[start : text.index("\n## ", start + 1)]


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and line[0] in "┏┃┡│├└"]


def test_the_audit_pages_sample_commands_are_true(tmp_path):
    """docs/audit.md's commands on the sample framework, run in a copy of samples/: the tables it
    shows (timings aside), the diff lines it shows, and the exit codes it names (1, then 0, then 0)."""
    section = _docs_sample_section()
    blocks = section.split("```")[1::2]  # fenced blocks, in order: their first line is the language
    commands = [
        line
        for block in blocks
        if block.startswith("bash")
        for line in block.splitlines()[1:]
        if line.startswith(("unsafe-doctor audit samples/", "cp samples/"))
    ]
    tables = [_table_lines(block) for block in blocks if block.startswith("\n┏")]
    [diff] = [block for block in blocks if block.startswith("diff")]
    shutil.copytree(ROOT / "samples", tmp_path / "samples")
    environment = {"COLUMNS": "100", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    outputs = []
    for command in commands:
        result = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120
        )
        outputs.append(result)
    assert [result.returncode for result in outputs] == [1, 0, 0, 0], [result.stderr for result in outputs]
    audits = [
        result
        for command, result in zip(commands, outputs, strict=True)
        if "--fix" not in command and command.startswith("unsafe")
    ]
    assert len(audits) == len(tables) == 2
    for result, table in zip(audits, tables, strict=True):
        assert _table_lines(result.stdout) == table
    fixed = outputs[2].stdout
    assert all(line[1:] in fixed for line in diff.splitlines()[1:] if line.startswith("+"))
    assert "wrote audited_recovery.py (backup: audited_recovery.py.unsafe-doctor.bak)" in outputs[2].stderr


# --- the progress bar -------------------------------------------------------------------------------


def on_a_terminal(*args: str, stdout_to_file: bool = False) -> tuple[int, str]:
    """Run the audit with a pseudo-terminal as stderr, and as stdout unless that goes to a file; what
    the terminal showed."""
    return at_terminal(["audit", *args], stdout_to_file=stdout_to_file, columns=120, cwd=ROOT, quiet_seconds=120)


def test_a_terminal_shows_the_stages_of_the_audit_as_a_bar():
    code, screen = on_a_terminal(str(TOYTRAIN), "--adaptor", str(TOYTRAIN / "recovery.py"))
    assert code == 1
    for stage in ("reading files", "scanning files", "judging globals"):
        assert stage in screen
    assert "2 globals: 2 uncovered" in screen  # the report follows the bar


def test_no_bar_when_stderr_is_no_terminal():
    result = run(str(TOYTRAIN), "--adaptor", str(TOYTRAIN / "recovery.py"))
    assert result.returncode == 1
    assert result.stderr == ""
    assert "reading files" not in result.stdout


def test_no_bar_while_json_goes_to_a_file_even_at_a_terminal():
    code, screen = on_a_terminal(
        str(TOYTRAIN), "--adaptor", str(TOYTRAIN / "recovery.py"), "--format", "json", stdout_to_file=True
    )
    assert code == 1
    assert screen == ""


def test_a_report_with_fixes_ends_with_the_command_that_writes_them(framework):
    result = run("toytrain", cwd=framework)
    assert result.returncode == 1, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last == "to write the fixes: unsafe-doctor audit toytrain --fix"
    words = shlex.split(last.partition(": ")[2])
    assert run(*words[2:], "--yes", cwd=framework).returncode == 0
    assert run("toytrain", cwd=framework).returncode == 0


def test_an_audit_with_no_adaptor_found_says_to_name_one_not_to_rerun_with_fix_alone(framework):
    """No adaptor, no `--fix` suggested: it once suggested `--fix`, which then exits 2 after a second scan."""
    (framework / "toytrain" / "recovery.py").unlink()
    result = run("toytrain", cwd=framework)
    assert result.returncode == 1, result.stderr
    assert "no recovery adaptor found under the paths" in " ".join(result.stdout.split())
    assert "(--fix)" not in result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last == "to write the fixes: unsafe-doctor audit toytrain --adaptor ADAPTOR.py --fix"
