"""The conventions every command keeps, end to end: the shared options table of
docs/configuration.md against each command's --help, parsing (-h, -V, misspelt commands), -o/-q/-v/--exit-zero,
pyproject.toml settings and UNSAFE_DOCTOR_* variables, --format github, shell completion,
the pre-commit hook and the licence."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import refused, run_cli

from unsafe_doctor.report.github import escape_data, escape_property

ROOT = Path(__file__).resolve().parents[2]
FAQ_LOG = ROOT / "samples" / "logs" / "faq_modellink.log"
EMA_LOG = ROOT / "samples" / "logs" / "toytrain_ema"
FRAMEWORK = ROOT / "samples" / "framework"

COMMANDS = {  # the shared options table's column -> the words after `unsafe-doctor`
    "diagnose": ["diagnose"],
    "fix": ["fix"],
    "verify": ["verify"],
    "audit": ["audit"],
    "rules list": ["rules", "list"],
    "rules show": ["rules", "show"],
    "rules validate": ["rules", "validate"],
    "sentinel install": ["sentinel", "install"],
}


def run(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """`unsafe-doctor ARGS` in this process (this tree's package), at 250 columns, with no UNSAFE_DOCTOR_*
    variable but those of `env` (not even the test's cache folder: -v lists them all)."""
    unset = ("UNSAFE_DOCTOR_", "_UNSAFE_DOCTOR")
    return run_cli(*args, stdin=stdin.encode(), cwd=cwd, env={"COLUMNS": "250", **(env or {})}, unset=unset)


def shared_options_table() -> tuple[list[str], list[tuple[set[str], list[str]]]]:
    """docs/configuration.md's table of the options several commands share: its command columns,
    then per row the option's names and each cell."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text[text.index("<!-- options: shared -->") :]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    header = next(line for line in section.splitlines() if line.startswith("| option |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")][1:]
    table = []
    for row in rows[: rows.index(next(r for r in rows if r.startswith("| `-h, --help`"))) + 1]:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        names = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", cells[0].split("`")[1]))
        table.append((names, cells[1:]))
    return columns, table


def help_options(words: list[str]) -> tuple[set[str], str]:
    """The option names in a command's --help (its Options panel), and the whole text."""
    result = run(*words, "--help")
    assert result.returncode == 0, result.stderr
    names = set()
    for line in result.stdout.splitlines():
        match = re.match(r"│\s+(--[\w-]+)(?:\s+(-\w))?\s", line)
        if match:
            names.update(name for name in match.groups() if name)
    return names, result.stdout


def test_every_commands_help_matches_the_shared_options_table():
    columns, table = shared_options_table()
    assert columns == list(COMMANDS)
    for column, words in COMMANDS.items():
        offered, text = help_options(words)
        for names, cells in table:
            cell = cells[columns.index(column)]
            if cell:
                assert names <= offered, (column, names)
            else:
                assert not names & offered, (column, names)
            if "--format" in names and cell:  # the formats the table names are exactly the parser's choices
                assert f"[{cell.replace(', ', '|')}]" in text, (column, cell)


@pytest.mark.parametrize(
    "args",
    [["fix", "--format", "sarif", "x.log"], ["verify", "-f", "github", "x.log"], ["rules", "list", "--format", "sarif"]],
)
def test_a_format_a_command_does_not_write_is_refused_by_the_parser(args):
    result = run(*args)
    refused(result, "Invalid value for '--format' / '-f'")
    assert result.stdout == ""


def test_a_misspelt_command_is_named_not_taken_for_a_missing_log(tmp_path):
    refused(run("diagnoze", "x.log", cwd=tmp_path), "unknown command 'diagnoze'; did you mean 'diagnose'?")
    (tmp_path / "fixe").write_text("iteration 1 | lm loss: 2.0\n")  # a file of that name is a log after all
    assert run("fixe", cwd=tmp_path).returncode == 0
    refused(run("fix.log", cwd=tmp_path), "fix.log: no such file or directory")  # a file name, not a command


def test_dash_h_is_help_and_dash_upper_v_the_version():
    assert "Usage: unsafe-doctor [OPTIONS] COMMAND" in run("-h").stdout
    assert "Usage: unsafe-doctor rules show" in run("rules", "show", "-h").stdout
    version = run("-V")
    assert version.returncode == 0 and re.fullmatch(r"unsafe-doctor \d+\.\d+\.\d+\S*\n", version.stdout)


def test_the_top_level_help_says_a_log_alone_or_piped_is_diagnosed_and_ends_with_examples():
    """`unsafe-doctor --help` once had no examples, nor a word of `unsafe-doctor LOG` or a pipe."""
    result = run("--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "unsafe-doctor LOG, or a log piped in, runs diagnose" in text
    examples = text.split("Examples:", 1)[1]
    assert "unsafe-doctor train.log" in examples and "kubectl logs job/llm | unsafe-doctor" in examples


def test_rules_without_a_subcommand_prints_its_help_and_exits_0():
    result = run("rules")
    assert result.returncode == 0 and "validate" in result.stdout and result.stderr == ""


def test_a_misspelt_subcommand_is_suggested_once():
    result = run("rules", "lis")
    refused(result, "No such command 'lis'.")
    assert result.stderr.count("Did you mean 'list'?") == 1


def test_positional_arguments_show_their_help():
    assert "Log files or folders" in run("diagnose", "--help").stdout
    assert "Framework source folders or files to scan" in run("audit", "--help").stdout
    assert "The rule's id" in run("rules", "show", "--help").stdout
    assert "Rule files or folders to check" in run("rules", "validate", "--help").stdout


def test_output_writes_the_report_to_the_file_and_keeps_it_when_refused(tmp_path):
    report = tmp_path / "report.json"
    written = run(str(FAQ_LOG), "--format", "json", "-o", str(report))
    assert written.returncode == 1 and written.stdout == ""
    printed = run(str(FAQ_LOG), "--format", "json")
    assert json.loads(report.read_text())["findings"] == json.loads(printed.stdout)["findings"]
    before = report.read_bytes()
    refused = run(str(tmp_path / "missing.log"), "--format", "json", "-o", str(report))
    assert refused.returncode == 2 and report.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["report.json"]  # no temporary left beside it
    listing = tmp_path / "rules.json"
    listed = run("rules", "list", "-f", "json", "-o", str(listing))
    assert listed.returncode == 0 and listed.stdout == "" and json.loads(listing.read_text())["rules"]


def test_output_into_a_missing_folder_is_a_one_line_error(tmp_path):
    refused(run(str(FAQ_LOG), "-o", str(tmp_path / "no" / "such" / "r.txt")), "cannot write")


def test_quiet_leaves_only_the_report_and_verbose_names_the_settings(tmp_path):
    adaptor = tmp_path / "recovery.py"
    shutil.copy(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    args = ["fix", str(EMA_LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--dry-run"]
    spoken = run(*args)
    assert spoken.stderr.startswith("unsafe-doctor: ") and "unsafe-doctor: begin" in spoken.stdout
    quiet = run(*args, "-q")
    assert quiet.stderr == "" and quiet.stdout == spoken.stdout and quiet.returncode == spoken.returncode
    verbose = run(*args, "-v", env={"UNSAFE_DOCTOR_FORMAT": "text"})
    assert verbose.stderr.splitlines()[:2] == [
        "unsafe-doctor: no [tool.unsafe-doctor] table found",
        "unsafe-doctor: UNSAFE_DOCTOR_FORMAT=text",
    ]
    refused(run(*args, "-q", "-v"), "--quiet and --verbose contradict each other")
    refused(run(str(tmp_path / "missing.log"), "-q"), "no such file or directory")  # refusals still speak


def test_exit_zero_hides_findings_not_usage_errors(tmp_path):
    assert run(str(FAQ_LOG)).returncode == 1
    assert run(str(FAQ_LOG), "--exit-zero").returncode == 0
    assert run(str(tmp_path / "missing.log"), "--exit-zero").returncode == 2
    assert run("audit", str(FRAMEWORK / "toytrain"), "--exit-zero").returncode == 0


RULE = """\
rules:
  - id: acme.{name}
    title: {name}
    match: {{variable: _{name}}}
    scenario: 1
    phase: rollback
    fix: {{code: "pass"}}
    reason: a scratch buffer
"""


def rule_ids(result: subprocess.CompletedProcess[str]) -> set[str]:
    assert result.returncode == 0, result.stderr
    return {rule["id"] for rule in json.loads(result.stdout)["rules"] if rule["id"].startswith("acme.")}


def test_settings_come_from_the_nearest_pyproject_then_variables_then_the_command_line(tmp_path):
    for name in ("frompyproject", "fromvariable", "fromcommandline"):
        (tmp_path / f"{name}.yaml").write_text(RULE.format(name=name))
    (tmp_path / "pyproject.toml").write_text('[tool.unsafe-doctor]\nrules = ["frompyproject.yaml"]\n')
    inside = tmp_path / "src" / "deeper"
    inside.mkdir(parents=True)
    (tmp_path / "src" / "pyproject.toml").write_text("[project]\nname = 'without-the-table'\n")  # passed over
    assert rule_ids(run("rules", "list", "-f", "json", cwd=inside)) == {"acme.frompyproject"}
    variable = {"UNSAFE_DOCTOR_RULES": str(tmp_path / "fromvariable.yaml")}
    assert rule_ids(run("rules", "list", "-f", "json", cwd=inside, env=variable)) == {"acme.fromvariable"}
    given = run("rules", "list", "-f", "json", "--rules", str(tmp_path / "fromcommandline.yaml"), cwd=inside, env=variable)
    assert rule_ids(given) == {"acme.fromcommandline"}


def test_format_from_the_environment_and_the_command_line_over_it():
    assert "findings" in json.loads(run(str(FAQ_LOG), env={"UNSAFE_DOCTOR_FORMAT": "json"}).stdout)
    assert run(str(FAQ_LOG), "-f", "text", env={"UNSAFE_DOCTOR_FORMAT": "json"}).stdout.lstrip()[:1] != "{"
    refused(
        run("fix", "x.log", env={"UNSAFE_DOCTOR_FORMAT": "sarif"}),
        "Invalid value for '--format' / '-f': 'sarif' is not one of 'text', 'json'. (from UNSAFE_DOCTOR_FORMAT) (see --help)",
    )


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        ("colour = 'red'\n", "[tool.unsafe-doctor] has no key 'colour'"),
        ("rules = 3\n", "rules must be a string or a list of strings"),
        ("functions = 'rollback=x'\n", "functions must be a table of ROLE = NAME"),
        ("rules = [\n", "pyproject.toml: "),
    ],
)
def test_a_bad_settings_table_is_a_one_line_error(tmp_path, table, fragment):
    (tmp_path / "pyproject.toml").write_text("[tool.unsafe-doctor]\n" + table)
    result = run("rules", "list", cwd=tmp_path)
    refused(result, fragment)


def test_audit_scans_the_configured_source_roots_and_the_pre_commit_hook_runs_it(tmp_path):
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    [hook] = hooks
    assert (hook["id"], hook["entry"], hook["language"], hook["pass_filenames"]) == (
        "unsafe-doctor-audit",
        "unsafe-doctor audit",
        "python",
        False,
    )
    shutil.copytree(FRAMEWORK, tmp_path / "framework")
    (tmp_path / "pyproject.toml").write_text('[tool.unsafe-doctor]\nsource-roots = ["framework/toytrain"]\n')
    configured = run(*hook["entry"].split()[1:], "--format", "json", cwd=tmp_path)
    named = run("audit", str(tmp_path / "framework" / "toytrain"), "--format", "json", cwd=tmp_path)
    assert configured.returncode == named.returncode == 1
    assert json.loads(configured.stdout)["holders"] == json.loads(named.stdout)["holders"]
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'job'\n")  # as the snippet in docs/configuration.md finds it
    bare = run(*hook["entry"].split()[1:], "--format", "json", cwd=tmp_path / "framework" / "toytrain")
    assert bare.returncode == 1 and "auditing the current folder" in bare.stderr
    assert [holder["name"] for holder in json.loads(bare.stdout)["holders"]] == [
        holder["name"] for holder in json.loads(named.stdout)["holders"]
    ]


def test_format_github_writes_one_workflow_command_per_finding():
    result = run(str(FAQ_LOG), "--format", "github")
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "::error file=/data/gitee_0925/ModelLink/megatron/core/transformer/moe/moe_utils.py,line=172,"
        "title=Global tensor left unsafe by process-level online recovery::"
        "_MOE_AUX_LOSSES_LOGGING_TRACKER is read while still marked unsafe (ranks 3)"
    ]
    audit = run("audit", "samples/framework/toytrain", "--format", "github")
    lines = audit.stdout.splitlines()
    assert audit.returncode == 1 and lines and all(line.startswith("::error file=samples/framework/toytrain/") for line in lines)


def test_a_log_mapped_to_local_source_is_annotated_on_the_local_repo_relative_file():
    """With --source-root the text report read samples/framework/toytrain/train.py, but
    github and sarif once still gave the cluster's /home/user/job/... path, which no pull request has."""
    mapped = run(str(EMA_LOG), "--source-root", str(FRAMEWORK), "--format", "github")
    assert mapped.stdout.startswith("::error file=samples/framework/toytrain/train.py,line=62,"), mapped.stdout
    sarif = json.loads(run(str(EMA_LOG), "--source-root", str(FRAMEWORK), "--format", "sarif").stdout)
    [result] = sarif["runs"][0]["results"]
    assert result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "samples/framework/toytrain/train.py"
    unmapped = run(str(EMA_LOG), "--format", "github")
    assert unmapped.stdout.startswith("::error file=/home/user/job/toytrain/train.py,line=62,")


def test_github_escaping_follows_the_actions_toolkit():
    assert escape_data("50% done\r\nnext: a, b") == "50%25 done%0D%0Anext: a, b"
    assert escape_property("C:\\x,y%\n") == "C%3A\\x%2Cy%25%0A"


def test_shell_completion_completes_commands_and_prints_its_script():
    completing = {"_UNSAFE_DOCTOR_COMPLETE": "complete_bash", "COMP_WORDS": "unsafe-doctor di", "COMP_CWORD": "1"}
    assert run(env=completing).stdout.split() == ["diagnose"]
    # typer reads the shell from the process's ancestors (an argument after the flag is not read):
    # run from bash, which stays the parent (`; exit`), as a user's terminal is, whoever started pytest.
    command = f"{shlex.quote(sys.executable)} -m unsafe_doctor --show-completion; exit $?"
    script = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert script.returncode == 0 and "_UNSAFE_DOCTOR_COMPLETE=complete_bash" in script.stdout, script.stderr
    assert "--install-completion" in run("--help").stdout


def test_the_licence_file_is_the_apache_2_text_pyproject_names():
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 202


def test_adaptor_and_functions_from_pyproject_reach_fix_and_the_command_line_wins(tmp_path):
    shutil.copytree(FRAMEWORK, tmp_path / "framework")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.unsafe-doctor]\nsource-roots = ["framework"]\nadaptor = "framework/toytrain/recovery.py"\n'
        'functions = {send = "no_such_send"}\n'
    )
    configured = run("fix", str(EMA_LOG), "--dry-run", cwd=tmp_path)
    assert f"no send function no_such_send() in {tmp_path / 'framework' / 'toytrain' / 'recovery.py'}" in configured.stderr
    given = run("fix", str(EMA_LOG), "--dry-run", "--function", "send=send_rank_repair", cwd=tmp_path)
    assert given.returncode == 0 and "+    # unsafe-doctor: begin" in given.stdout


def test_several_source_roots_in_one_variable_are_separated_by_the_path_separator(tmp_path):
    result = run(str(FAQ_LOG), env={"UNSAFE_DOCTOR_SOURCE_ROOT": f"{FRAMEWORK}{os.pathsep}{tmp_path / 'gone'}"})
    refused(result, f"Directory '{tmp_path / 'gone'}' does not exist. (from UNSAFE_DOCTOR_SOURCE_ROOT)")
