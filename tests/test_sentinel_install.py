"""`unsafe-doctor sentinel install`: the sentinel's call written at the end of real adaptors' rollback
functions by the fixer's own code, and taken out again.

The adaptors are the real MindSpeed-LLM and mind-cluster files (../shared/real/, the real fixture), the sample
adaptors (samples/adaptors/) and toytrain's recovery.py, each copied under tmp_path. Each install is
checked for its exact lines, a file that compiles with the call as the function's last statement,
a second run that changes nothing and a revert that gives the original bytes back; then the order
with `fix` both ways, the modes, the command line, and `verify` proving a fix beside the sentinel.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from terminal import at_terminal

from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.errors import UsageError
from unsafe_doctor.adaptor.fix import BACKUP_SUFFIX, Plan, apply, function_overrides, parameter_roles, plan_fix, plan_revert
from unsafe_doctor.source.markers import SENTINEL_KEY
from unsafe_doctor.adaptor.sentinel_install import plan_sentinel
from unsafe_doctor.log.sentinel_lines import MODES
from unsafe_doctor.replay.verify import plan_replay, verify

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
TOYTRAIN = SAMPLES / "framework" / "toytrain"
HIGH_AVAILABILITY = "mindspeed_llm/core/high_availability"
LOSS_LOG_KEY = "generic.reinitialise:toytrain.state.LOSS_LOG"
NO_TRAIN_ARGS = "has no train_args parameter (--parameter train_args=NAME): the sentinel is not passed the models"


@dataclass(frozen=True)
class Case:
    name: str
    tree: Path  # copied as a whole; relative to ../shared/real where real
    adaptor: str  # inside the copy
    function: str  # where the sentinel goes: the rollback callback where the profile names one, else the rollback function
    functions: str | None = None  # --function
    train_args: bool = False  # the function has the train_args parameter, which the call passes
    real: bool = False  # a real third-party tree, under ../shared/real (the real fixture)


CASES = [
    Case("mindspeed-llm-master", Path("mindspeed-llm-master"), f"{HIGH_AVAILABILITY}/tft_rollback.py", "rollback_callback",
         train_args=True, real=True),
    Case("taskd-elastic-7.2rc1", Path("mind-cluster-7.2rc1"), "taskd/python/adaptor/elastic_training/rollback_callback.py",
         "rollback_callback", train_args=True, real=True),
    Case("sample-legacy", SAMPLES / "adaptors" / "legacy", "mindio_ttp/adaptor/modellink_adaptor.py", "feature_rollback"),
    Case("sample-in-tree", SAMPLES / "adaptors" / "in_tree", f"{HIGH_AVAILABILITY}/tft_rollback.py", "rollback_callback",
         train_args=True),
    Case("sample-custom", SAMPLES / "adaptors" / "custom", "my_recovery.py", "reset_step_state", "rollback=reset_step_state"),
    Case("toytrain", TOYTRAIN, "recovery.py", "rollback_callback", train_args=True),
    Case("toytrain-feature-rollback", TOYTRAIN, "recovery.py", "feature_rollback", "rollback=feature_rollback"),
]


def copied(tree: Path, tmp_path: Path) -> Path:
    copy = tmp_path / tree.name
    shutil.copytree(tree, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def sentinel_plan(adaptor: Path, mode="report", functions: str | None = None, parameters: str | None = None) -> Plan:
    environment = groundwork().detect(adaptor=adaptor).environment
    return plan_sentinel(environment, mode, function_overrides([functions] if functions else []),
                         parameter_roles([parameters] if parameters else []))


def revert(adaptor: Path, *, sentinel: bool) -> None:
    apply(plan_revert(groundwork().detect(adaptor=adaptor).environment, sentinel=sentinel))


def expected_block(indent: str, arguments: str, what: str = "report: log them and go on") -> list[str]:
    return [
        f"{indent}# unsafe-doctor: begin {SENTINEL_KEY}",
        f"{indent}# last in the rollback: name every tensor still unsafe (mode {what})",
        f"{indent}from unsafe_doctor.sentinel import check as _ud_sentinel_check",
        f"{indent}from unsafe_doctor.sentinel.keeper import keep_tracebacks as _ud_keep_tracebacks",
        f"{indent}_ud_keep_tracebacks()  # MindIO logs the next unsafe-data error with its traceback",
        f"{indent}_ud_sentinel_check({arguments})",
        f"{indent}# unsafe-doctor: end {SENTINEL_KEY}",
    ]


def added_lines(plan: Plan) -> list[str]:
    return [line[1:] for line in plan.diff().splitlines() if line.startswith("+") and not line.startswith("+++")]


def last_statement(source: bytes, function: str) -> ast.stmt:
    """The last statement `function` runs: its last, or the one before a trailing return."""
    [node] = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef) and node.name == function]
    body = node.body[:-1] if isinstance(node.body[-1], ast.Return) else node.body
    return body[-1]


def markers(data: bytes) -> list[str]:
    return [line.strip().removeprefix("# unsafe-doctor: begin ") for line in data.decode().splitlines()
            if line.strip().startswith("# unsafe-doctor: begin ")]


# --- real adaptors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_install_then_idempotent_then_revert_on_real_adaptors(case, tmp_path, request):
    tree = request.getfixturevalue("real") / case.tree if case.real else case.tree
    adaptor = copied(tree, tmp_path) / case.adaptor
    before = adaptor.read_bytes()

    plan = sentinel_plan(adaptor, functions=case.functions)
    [edit] = plan.edits
    assert edit.path == adaptor
    passed = "train_args, " if case.train_args else ""
    assert added_lines(plan) == expected_block("    ", passed + 'mode="report"')
    said = any(case.function + "() " + NO_TRAIN_ARGS in note for note in plan.notes)
    assert said != case.train_args, plan.notes
    [written] = apply(plan)
    after = adaptor.read_bytes()
    compile(after, str(adaptor), "exec")
    call = last_statement(after, case.function)
    assert isinstance(call, ast.Expr) and ast.unparse(call) == f"_ud_sentinel_check({passed}mode='report')"
    assert written.backup.read_bytes() == before

    again = sentinel_plan(adaptor, functions=case.functions)
    assert again.edits == ()
    assert again.present == (f"{adaptor}: {SENTINEL_KEY} already in {case.function}()",)

    revert(adaptor, sentinel=True)
    assert adaptor.read_bytes() == before
    nothing = plan_revert(groundwork().detect(adaptor=adaptor).environment, sentinel=True)
    assert nothing.edits == () and f"{adaptor}: no sentinel block" in nothing.notes


def test_mindspeed_llms_rollback_callback_passes_its_train_args(tmp_path, real):
    """MindSpeed-LLM calls feature_rollback() in the middle of rollback_callback(step, train_args, ctx),
    before the model's parameters are gathered from the optimizer: at the callback's end the sentinel
    sees the whole recovery, and is passed the models and optimizers."""
    adaptor = copied(real / "mindspeed-llm-master", tmp_path) / HIGH_AVAILABILITY / "tft_rollback.py"
    plan = sentinel_plan(adaptor, functions="rollback=rollback_callback")
    assert added_lines(plan) == expected_block("    ", 'train_args, mode="report"')
    assert not any(NO_TRAIN_ARGS in note for note in plan.notes)
    apply(plan)
    call = last_statement(adaptor.read_bytes(), "rollback_callback")
    assert ast.unparse(call) == "_ud_sentinel_check(train_args, mode='report')"


def test_the_train_args_parameter_is_passed_and_each_mode_written(tmp_path):
    """toytrain's rollback_callback(step, train_args, ctx) holds the models and optimizers."""
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    whats = {"report": "report: log them and go on", "raise": "raise: stop the recovery, naming them all",
             "heal": "heal: re-initialise those a scenario-1 rule covers, then check again"}
    assert set(whats) == set(MODES)
    for mode, what in whats.items():
        plan = sentinel_plan(adaptor, mode, functions="rollback=rollback_callback")
        assert added_lines(plan) == expected_block("    ", f'train_args, mode="{mode}"', what)
        assert not any(NO_TRAIN_ARGS in note for note in plan.notes)
    with pytest.raises(UsageError, match="sentinel mode 'loud': one of report, raise, heal"):
        sentinel_plan(adaptor, "loud")


def test_one_sentinel_per_adaptor_whichever_function_is_asked(tmp_path):
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    apply(sentinel_plan(adaptor))
    elsewhere = sentinel_plan(adaptor, "raise", functions="rollback=feature_rollback")
    assert elsewhere.edits == ()
    assert elsewhere.present == (f"{adaptor}: {SENTINEL_KEY} already in rollback_callback()",)
    assert elsewhere.notes == ("to write another mode or move it: sentinel install --revert, then install again",)


def test_a_train_args_parameter_by_another_name_is_passed(tmp_path):
    adaptor = tmp_path / "recovery.py"
    adaptor.write_text("def feature_rollback(state, ctx):\n\tstate.reset()\n\treturn 0\n")
    plan = sentinel_plan(adaptor, "raise", parameters="train_args=state")
    assert added_lines(plan) == expected_block("\t", 'state, mode="raise"', "raise: stop the recovery, naming them all")
    apply(plan)
    ending = f'\t_ud_sentinel_check(state, mode="raise")\n\t# unsafe-doctor: end {SENTINEL_KEY}\n\treturn 0\n'
    assert adaptor.read_text().endswith(ending)


# --- with fix, in both orders -----------------------------------------------------------------------


def write_fix(log: Path, adaptor: Path, roots: list[Path], functions: str | None = None) -> None:
    diagnosis = diagnose([str(log)], groundwork(source_roots=roots), adaptor=adaptor)
    apply(plan_fix(diagnosis.findings, diagnosis.context, function_overrides([functions] if functions else [])))


def test_the_sentinel_stays_last_whichever_comes_first_and_each_revert_takes_its_own(tmp_path, toytrain_loss_log):
    fix_first = copied(TOYTRAIN, tmp_path / "fix-first") / "recovery.py"
    sentinel_first = copied(TOYTRAIN, tmp_path / "sentinel-first") / "recovery.py"
    before = fix_first.read_bytes()
    roots = [fix_first.parent.parent]

    write_fix(toytrain_loss_log, fix_first, roots)
    apply(sentinel_plan(fix_first, functions="rollback=feature_rollback"))  # the fix's function: same place
    apply(sentinel_plan(sentinel_first, functions="rollback=feature_rollback"))
    write_fix(toytrain_loss_log, sentinel_first, [sentinel_first.parent.parent])

    assert markers(fix_first.read_bytes()) == [LOSS_LOG_KEY, SENTINEL_KEY]
    assert fix_first.read_bytes() == sentinel_first.read_bytes()  # one file, whichever came first
    assert ast.unparse(last_statement(fix_first.read_bytes(), "feature_rollback")) == "_ud_sentinel_check(mode='report')"

    revert(fix_first, sentinel=False)  # fix --revert: the fixes only
    assert markers(fix_first.read_bytes()) == [SENTINEL_KEY]
    assert plan_revert(groundwork().detect(adaptor=fix_first).environment).notes == (f"{fix_first}: no unsafe-doctor fix blocks",)
    revert(fix_first, sentinel=True)
    assert fix_first.read_bytes() == before
    revert(sentinel_first, sentinel=True)  # sentinel install --revert: the sentinel only
    assert markers(sentinel_first.read_bytes()) == [LOSS_LOG_KEY]
    revert(sentinel_first, sentinel=False)
    assert sentinel_first.read_bytes() == before


def test_before_a_trailing_return_a_fix_still_goes_before_the_sentinel(tmp_path, toytrain_loss_log):
    adaptor = tmp_path / "recovery.py"
    original = textwrap.dedent("""\
        def reset(train_args):
            if train_args is None:
                return 1
            train_args.clear()

            return 0
        """)
    adaptor.write_text(original)
    plan = sentinel_plan(adaptor, functions="rollback=reset")
    assert f"{adaptor}: reset() returns before its end (line 3): the block runs only on paths that reach the end" in plan.notes
    apply(plan)
    write_fix(toytrain_loss_log, adaptor, [TOYTRAIN.parent], functions="rollback=reset")
    text = adaptor.read_text()
    assert markers(text.encode()) == [LOSS_LOG_KEY, SENTINEL_KEY]
    assert text.endswith(f"# unsafe-doctor: end {LOSS_LOG_KEY}\n    # unsafe-doctor: begin {SENTINEL_KEY}\n"
                         "    # last in the rollback: name every tensor still unsafe (mode report: log them and go on)\n"
                         "    from unsafe_doctor.sentinel import check as _ud_sentinel_check\n"
                         "    from unsafe_doctor.sentinel.keeper import keep_tracebacks as _ud_keep_tracebacks\n"
                         "    _ud_keep_tracebacks()  # MindIO logs the next unsafe-data error with its traceback\n"
                         '    _ud_sentinel_check(train_args, mode="report")\n'
                         f"    # unsafe-doctor: end {SENTINEL_KEY}\n\n    return 0\n")
    compile(text, str(adaptor), "exec")
    revert(adaptor, sentinel=True)
    revert(adaptor, sentinel=False)
    assert adaptor.read_text() == original


# --- verify skips the sentinel ----------------------------------------------------------------------


def test_verify_proves_a_fix_in_an_adaptor_that_also_holds_the_sentinel(tmp_path, toytrain_loss_log):
    """The sentinel's block is no fix: block mode does not run it, adaptor mode imports the file
    without it (unsafe_doctor.sentinel is never imported by the replay)."""
    root = copied(TOYTRAIN, tmp_path).parent
    adaptor = root / "toytrain" / "recovery.py"
    write_fix(toytrain_loss_log, adaptor, [root])
    apply(sentinel_plan(adaptor))
    diagnosis = diagnose([str(toytrain_loss_log)], groundwork(source_roots=[root]), adaptor=adaptor)
    plan, skipped = plan_replay(diagnosis, diagnosis.context.knowledge, ranks=2)
    assert [block.key for block in plan.blocks] == [LOSS_LOG_KEY]
    [code] = plan.files
    assert SENTINEL_KEY not in code.patched and LOSS_LOG_KEY in code.patched
    result = verify(plan, skipped)
    assert result is not None
    [verdict] = result.verdicts
    assert verdict.outcome == "proven", verdict.problems


# --- the command line -------------------------------------------------------------------------------


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("UNSAFE_DOCTOR_")}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "unsafe_doctor", "sentinel", "install", *args], capture_output=True,
                          text=True, cwd=cwd, env=environment, timeout=120, stdin=subprocess.DEVNULL)


def test_cli_dry_run_unasked_yes_again_json_and_revert(tmp_path):
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    before = adaptor.read_bytes()

    dry = run("--adaptor", str(adaptor), "--mode", "raise", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"--- a{adaptor}\n+++ b{adaptor}\n")
    assert '+    _ud_sentinel_check(train_args, mode="raise")\n' in dry.stdout  # at the end of rollback_callback
    assert NO_TRAIN_ARGS not in dry.stderr
    assert "dry run: nothing written" in dry.stderr
    assert sorted(path.name for path in adaptor.parent.iterdir()) == sorted(path.name for path in TOYTRAIN.iterdir()
                                                                             if path.name != "__pycache__")
    assert adaptor.read_bytes() == before

    unasked = run("--adaptor", str(adaptor), "--mode", "raise")
    assert (unasked.returncode, unasked.stdout) == (1, dry.stdout)
    assert (f"to apply: unsafe-doctor sentinel install --adaptor {adaptor} --mode raise --yes") in unasked.stderr
    assert adaptor.read_bytes() == before

    applied = run("--adaptor", str(adaptor), "--mode", "raise", "--yes", "-q")
    assert (applied.returncode, applied.stdout, applied.stderr) == (0, dry.stdout, "")
    assert markers(adaptor.read_bytes()) == [SENTINEL_KEY]

    again = run("--adaptor", str(adaptor), "--yes", "--format", "json")
    assert again.returncode == 0, again.stderr
    document = json.loads(again.stdout)
    assert (document["schema"], document["mode"], document["files"], document["written"]) == (
        "unsafe-doctor/sentinel-install/v1", "report", [], [])
    assert document["present"] == [f"{adaptor}: {SENTINEL_KEY} already in rollback_callback()"]

    installed = adaptor.read_bytes()
    reverted = run("--adaptor", str(adaptor), "--revert", "--yes")
    assert reverted.returncode == 0, reverted.stderr
    assert f"wrote {adaptor} (backup: {adaptor}{BACKUP_SUFFIX})" in reverted.stderr
    assert adaptor.read_bytes() == before
    assert (adaptor.parent / f"recovery.py{BACKUP_SUFFIX}").read_bytes() == installed  # the file before the last write


def test_cli_refusals_are_one_line_and_exit_2(tmp_path):
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    for args, fragment in (
        (("--adaptor", str(tmp_path / "missing.py")), "Invalid value for '--adaptor'"),
        (("--adaptor", str(adaptor), "--mode", "loud"), "Invalid value for '--mode'"),
        (("--adaptor", str(adaptor), "--function", "rollback=absent"), "no rollback function absent()"),
    ):
        result = run(*args)
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and fragment in result.stderr, result.stderr
        assert result.stdout == ""
    assert adaptor.read_bytes() == (TOYTRAIN / "recovery.py").read_bytes()


def test_cli_asks_at_a_terminal(tmp_path):
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    before = adaptor.read_bytes()
    code, screen = at_terminal(["sentinel", "install", "--adaptor", str(adaptor)], answers=[(b"? [y/N]: ", b"n\n")])
    assert code == 1 and "_ud_sentinel_check(train_args, mode=" in screen
    assert adaptor.read_bytes() == before
    code, screen = at_terminal(["sentinel", "install", "--adaptor", str(adaptor)], answers=[(b"? [y/N]: ", b"y\n")])
    assert code == 0 and f"(backup: {adaptor}{BACKUP_SUFFIX})" in screen
    assert markers(adaptor.read_bytes()) == [SENTINEL_KEY]


def test_cli_takes_the_adaptor_function_and_parameter_from_pyproject(tmp_path):
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    (tmp_path / "pyproject.toml").write_text(
        '[tool.unsafe-doctor]\nadaptor = "toytrain/recovery.py"\nfunctions = {rollback = "rollback_callback"}\n'
        'parameters = {train_args = "ctx"}\n'
    )
    result = run("--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert '+    _ud_sentinel_check(ctx, mode="report")\n' in result.stdout
    assert adaptor.read_bytes() == (TOYTRAIN / "recovery.py").read_bytes()


QUOTED_BLOCKS = f'''

HOW_TO = """What unsafe-doctor writes looks like this:
    # unsafe-doctor: begin {SENTINEL_KEY}
    _ud_sentinel_check(train_args)
    # unsafe-doctor: end {SENTINEL_KEY}
    # unsafe-doctor: begin generic.reinitialise:toytrain.state.LOSS_LOG
    # unsafe-doctor: end generic.reinitialise:toytrain.state.LOSS_LOG
"""
'''


def test_markers_quoted_in_a_string_are_no_block_to_install_over_or_revert(tmp_path, toytrain_loss_log):
    """Issue 26: a docstring quoting the markers made install say "already installed", and each
    revert deleted those lines from the user's string."""
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    adaptor.write_text(adaptor.read_text() + QUOTED_BLOCKS)

    apply(sentinel_plan(adaptor))
    write_fix(toytrain_loss_log, adaptor, [tmp_path])
    installed = adaptor.read_bytes()
    assert markers(installed).count(SENTINEL_KEY) == 2  # the quoted one and the block written
    assert markers(installed).count(LOSS_LOG_KEY) == 2

    revert(adaptor, sentinel=True)
    revert(adaptor, sentinel=False)
    assert adaptor.read_text() == (TOYTRAIN / "recovery.py").read_text() + QUOTED_BLOCKS  # the string whole
