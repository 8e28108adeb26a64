"""`unsafe-doctor sentinel install`: the sentinel's call written at the end of real adaptors' rollback
functions by the fixer's own code, and taken out again.

The adaptors are the real MindSpeed-LLM and mind-cluster files (../shared/real/, the real fixture), the sample
adaptors (samples/adaptors/) and toytrain's recovery.py, each copied under tmp_path. Each install is
checked for its exact lines, a file that compiles with the call as the function's last statement,
a second run that changes nothing and a revert that gives the original bytes back; then the order
with `fix` both ways, the modes, the command line, and `verify` proving a fix beside the sentinel;
last, the block in training ranks that cannot import unsafe-doctor.
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
from conftest import importable_package
from helpers import run_cli
from terminal import at_terminal

from unsafe_doctor import __version__
from unsafe_doctor.adaptor.overrides import function_overrides, parameter_roles
from unsafe_doctor.adaptor.plan import Plan, plan_fix, plan_revert
from unsafe_doctor.adaptor.sentinel_install import plan_sentinel
from unsafe_doctor.adaptor.write import BACKUP_SUFFIX, apply
from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.log.sentinel_modes import MODES
from unsafe_doctor.npu.backend import EmulatedBackend
from unsafe_doctor.replay.verify import plan_replay, verify
from unsafe_doctor.sentinel import UnsafeStateError
from unsafe_doctor.source.markers import MARKER_BEGIN, SENTINEL_KEY

ROOT = Path(__file__).resolve().parents[2]
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
    Case(
        "mindspeed-llm-master",
        Path("mindspeed-llm-master"),
        f"{HIGH_AVAILABILITY}/tft_rollback.py",
        "rollback_callback",
        train_args=True,
        real=True,
    ),
    Case(
        "taskd-elastic-7.2rc1",
        Path("mind-cluster-7.2rc1"),
        "taskd/python/adaptor/elastic_training/rollback_callback.py",
        "rollback_callback",
        train_args=True,
        real=True,
    ),
    Case("sample-legacy", SAMPLES / "adaptors" / "legacy", "mindio_ttp/adaptor/modellink_adaptor.py", "feature_rollback"),
    Case(
        "sample-in-tree",
        SAMPLES / "adaptors" / "in_tree",
        f"{HIGH_AVAILABILITY}/tft_rollback.py",
        "rollback_callback",
        train_args=True,
    ),
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
    return plan_sentinel(
        environment,
        mode,
        function_overrides([functions] if functions else []),
        parameter_roles([parameters] if parameters else []),
    )


def revert(adaptor: Path, *, sentinel: bool) -> None:
    apply(plan_revert(groundwork().detect(adaptor=adaptor).environment, sentinel=sentinel))


def expected_block(indent: str, arguments: str, what: str = "go on", unit: str = "    ") -> list[str]:
    """The block as a mode writes it: report's and heal's guarded by try/except (heal's letting its
    UnsafeStateError through), raise's bare."""
    calls = [
        "from unsafe_doctor.sentinel import check as _ud_sentinel_check",
        "from unsafe_doctor.sentinel.keeper import keep_tracebacks as _ud_keep_tracebacks",
        "_ud_keep_tracebacks()  # MindIO logs the next unsafe-data error with its traceback",
        f"_ud_sentinel_check({arguments})",
    ]
    if 'mode="raise"' not in arguments:
        stop = [
            'if type(_ud_error).__name__ == "UnsafeStateError":',
            unit + "raise  # tensors heal left unsafe: stop the recovery, as mode heal asks",
        ]
        calls = [
            "try:  # unsafe-doctor missing or broken never fails the rollback: one line says why",
            *(unit + line for line in calls),
            "except Exception as _ud_error:",
            *(unit + line for line in (stop if 'mode="heal"' in arguments else [])),
            unit + "import logging as _ud_logging",
            unit + "import os as _ud_os",
            unit + '_ud_logging.getLogger("unsafe_doctor.sentinel").warning(',
            unit * 2 + '"[unsafe-doctor sentinel] rank %s: failed, the rollback goes on: %r",',
            unit * 2 + '_ud_os.getenv("RANK", "?"), _ud_error)',
        ]
    return [
        f"{indent}# unsafe-doctor: begin {SENTINEL_KEY}",
        f"{indent}# last in the rollback: name every unsafe tensor, then {what}",
        *(indent + line for line in calls),
        f"{indent}# unsafe-doctor: end {SENTINEL_KEY}",
    ]


def sentinel_call(statement: ast.stmt) -> str:
    """The sentinel's call in the block's last statement: itself, or the last of its `try`."""
    if isinstance(statement, ast.Try):
        statement = statement.body[-1]
    assert isinstance(statement, ast.Expr)
    return ast.unparse(statement)


def added_lines(plan: Plan) -> list[str]:
    return [line[1:] for line in plan.diff().splitlines() if line.startswith("+") and not line.startswith("+++")]


def added_blocks(plan: Plan) -> list[list[str]]:
    """The added lines, one list per block, in the diff's order (mode heal: the repair's two first)."""
    blocks: list[list[str]] = []
    for line in added_lines(plan):
        if line.lstrip().startswith(MARKER_BEGIN):
            blocks.append([])
        blocks[-1].append(line)
    return blocks


def last_statement(source: bytes, function: str) -> ast.stmt:
    """The last statement `function` runs: its last, or the one before a trailing return."""
    [node] = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef) and node.name == function]
    body = node.body[:-1] if isinstance(node.body[-1], ast.Return) else node.body
    return body[-1]


def markers(data: bytes) -> list[str]:
    return [
        line.strip().removeprefix("# unsafe-doctor: begin ")
        for line in data.decode().splitlines()
        if line.strip().startswith("# unsafe-doctor: begin ")
    ]


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
    assert sentinel_call(last_statement(after, case.function)) == f"_ud_sentinel_check({passed}mode='report')"
    assert written.backup.read_bytes() == before

    again = sentinel_plan(adaptor, functions=case.functions)
    assert again.edits == ()
    assert again.present == (f"{adaptor}: {SENTINEL_KEY} already in {case.function}()",)

    revert(adaptor, sentinel=True)
    assert adaptor.read_bytes() == before
    nothing = plan_revert(groundwork().detect(adaptor=adaptor).environment, sentinel=True)
    assert nothing.edits == () and f"{adaptor}: no sentinel block" in nothing.notes
    for mode in ("raise", "heal"):  # raise's bare block, and heal's guarded one
        apply(sentinel_plan(adaptor, mode, functions=case.functions))
        assert sentinel_call(last_statement(adaptor.read_bytes(), case.function)) == f"_ud_sentinel_check({passed}mode='{mode}')"
        revert(adaptor, sentinel=True)
        assert adaptor.read_bytes() == before, mode


def test_mindspeed_llms_rollback_callback_passes_its_train_args(tmp_path, real):
    """MindSpeed-LLM calls feature_rollback() in the middle of rollback_callback(step, train_args, ctx),
    before the model's parameters are gathered from the optimizer: at the callback's end the sentinel
    sees the whole recovery, and is passed the models and optimizers."""
    adaptor = copied(real / "mindspeed-llm-master", tmp_path) / HIGH_AVAILABILITY / "tft_rollback.py"
    plan = sentinel_plan(adaptor, functions="rollback=rollback_callback")
    assert added_lines(plan) == expected_block("    ", 'train_args, mode="report"')
    assert not any(NO_TRAIN_ARGS in note for note in plan.notes)
    apply(plan)
    call = sentinel_call(last_statement(adaptor.read_bytes(), "rollback_callback"))
    assert call == "_ud_sentinel_check(train_args, mode='report')"


def test_the_train_args_parameter_is_passed_and_each_mode_written(tmp_path):
    """toytrain's rollback_callback(step, train_args, ctx) holds the models and optimizers."""
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    whats = {"report": "go on", "raise": "stop the recovery", "heal": "re-initialise scenario-1 ones, else stop"}
    assert set(whats) == set(MODES)
    for mode, what in whats.items():
        plan = sentinel_plan(adaptor, mode, functions="rollback=rollback_callback")
        assert added_blocks(plan)[-1] == expected_block("    ", f'train_args, mode="{mode}"', what)
        assert not any(NO_TRAIN_ARGS in note for note in plan.notes)
    with pytest.raises(UsageError, match="sentinel mode 'loud': one of report, raise, heal"):
        sentinel_plan(adaptor, "loud")


HEAL_CALLS = {  # each generation's repair functions, with the group the function keeps and its rank lists
    "mindspeed-llm-master": (
        ("send_rank_repair", "_ud_send_state(group, src_ranks, dest_ranks, train_args)"),
        ("recv_rank_repair", "_ud_receive_state(group, src_ranks, dest_ranks, train_args)"),
    ),
    "taskd-elastic-7.2rc1": (
        (
            "send_rank_repair",
            "_ud_send_state(group, send_rank_repair_args.src_ranks, send_rank_repair_args.dest_ranks, train_args)",
        ),
        (
            "recv_rank_repair",
            "_ud_receive_state(group, recv_rank_repair_args.src_ranks, recv_rank_repair_args.dest_ranks, train_args)",
        ),
    ),
    "sample-legacy": (  # no group of its own: the wheel's getter, imported in the block
        ("send_rank_repair", "_ud_send_state(get_repair_group(), src_ranks, dest_ranks, train_args)"),
        ("recv_rank_repair", "_ud_receive_state(get_repair_group(), src_ranks, dest_ranks, train_args)"),
    ),
    "sample-in-tree": (
        ("send_rank_repair", "_ud_send_state(group, src_ranks, dest_ranks, train_args)"),
        ("recv_rank_repair", "_ud_receive_state(group, src_ranks, dest_ranks, train_args)"),
    ),
    "sample-custom": (
        ("send_to_repaired_rank", "_ud_send_state(group, src_ranks, dest_ranks, train_args)"),
        ("receive_from_replica", "_ud_receive_state(group, src_ranks, dest_ranks, train_args)"),
    ),
    "toytrain": (
        ("send_rank_repair", "_ud_send_state(repair_group, src_ranks, dest_ranks, train_args)"),
        ("recv_rank_repair", "_ud_receive_state(repair_group, src_ranks, dest_ranks, train_args)"),
    ),
}


@pytest.mark.parametrize("case", [case for case in CASES if case.name in HEAL_CALLS], ids=lambda case: case.name)
def test_heal_writes_both_repair_functions_in_their_own_names_and_revert_takes_every_block_out(case, tmp_path, request):
    tree = copied(request.getfixturevalue("real") / case.tree if case.real else case.tree, tmp_path)
    adaptor = tree / case.adaptor
    before = {path: path.read_bytes() for path in tree.rglob("*.py")}
    functions = [case.functions] if case.functions else []
    if case.name == "sample-custom":  # in-house hooks: named, as the command line names them
        functions += ["recv=receive_from_replica", "send=send_to_repaired_rank"]
    environment = groundwork().detect(adaptor=adaptor).environment
    apply(plan_sentinel(environment, "heal", function_overrides(functions), parameter_roles([]), [tmp_path / "rules.yaml"]))
    changed = {path: path.read_bytes() for path in before if path.read_bytes() != before[path]}
    for data in changed.values():
        compile(data, "adaptor", "exec")
    calls = {}
    for data in changed.values():
        for function, _ in HEAL_CALLS[case.name]:
            if f"def {function}(".encode() in data:
                calls[function] = sentinel_call(last_statement(data, function))
    rules = f"rules=[{str(tmp_path / 'rules.yaml')!r}]"
    expected = {function: call for function, call in HEAL_CALLS[case.name]}
    expected = {name: call[:-1] + f", {rules})" if "receive" in call else call for name, call in expected.items()}
    assert calls == expected
    revert(adaptor, sentinel=True)
    assert all(path.read_bytes() == data for path, data in before.items())


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
    assert added_lines(plan) == expected_block("\t", 'state, mode="raise"', "stop the recovery")
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
    assert sentinel_call(last_statement(fix_first.read_bytes(), "feature_rollback")) == "_ud_sentinel_check(mode='report')"

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
    block = "".join(line + "\n" for line in expected_block("    ", 'train_args, mode="report"'))
    assert text.endswith(f"# unsafe-doctor: end {LOSS_LOG_KEY}\n{block}\n    return 0\n")
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
    """`unsafe-doctor sentinel install ARGS`, in this process: it writes the adaptor, never imports it."""
    return run_cli("sentinel", "install", *args, unset=("UNSAFE_DOCTOR_",), cwd=cwd)


def test_cli_dry_run_unasked_yes_again_json_and_revert(tmp_path):
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    before = adaptor.read_bytes()

    dry = run("--adaptor", str(adaptor), "--mode", "raise", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"--- a{adaptor}\n+++ b{adaptor}\n")
    assert '+    _ud_sentinel_check(train_args, mode="raise")\n' in dry.stdout  # at the end of rollback_callback
    assert NO_TRAIN_ARGS not in dry.stderr
    assert "dry run: nothing written" in dry.stderr
    assert sorted(path.name for path in adaptor.parent.iterdir()) == sorted(
        path.name for path in TOYTRAIN.iterdir() if path.name != "__pycache__"
    )
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
        "unsafe-doctor/sentinel-install/v1",
        "report",
        [],
        [],
    )
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
    assert '+        _ud_sentinel_check(ctx, mode="report")\n' in result.stdout
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
    """A docstring quoting the markers once made install say "already installed", and each
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


# --- a training image without unsafe-doctor ---------------------------------------------------------

WORKERS = SAMPLES / "workers"
SENTINEL_LOG = SAMPLES / "logs" / "toytrain_sentinel.log"
FAILED_LINE = "failed, the rollback goes on: "
WITHOUT_THE_SENTINEL = '''\
"""Run a sample worker in a Python that cannot import unsafe_doctor.sentinel, as in a training image
without unsafe-doctor (the worker's emulated torch_npu is unsafe_doctor.npu, so the package itself is
there: its sentinel is what the adaptor's block imports)."""
import runpy
import sys


class NoSentinel:
    def find_spec(self, name, path=None, target=None):
        if name == "unsafe_doctor.sentinel" or name.startswith("unsafe_doctor.sentinel."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoSentinel())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def toytrain_without_the_sentinel(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    """toytrain's 2-rank torchrun job under emulated MindIO and torch_npu, an HBM ECC fault on rank 1 at
    step 21, in ranks whose Python cannot import unsafe_doctor.sentinel. Its adaptor holds the fixes
    of both globals the recovery leaves unsafe (so the first step after it can run) and the sentinel
    in `mode`. The job's console output is its stdout."""
    framework = tmp_path / "framework"
    shutil.copytree(SAMPLES / "framework", framework, ignore=shutil.ignore_patterns("__pycache__"))
    adaptor = framework / "toytrain" / "recovery.py"
    write_fix(SENTINEL_LOG, adaptor, [framework])
    apply(sentinel_plan(adaptor, mode))
    launcher = tmp_path / "without_the_sentinel.py"
    launcher.write_text(WITHOUT_THE_SENTINEL)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(WORKERS), str(framework), str(ROOT)]),
        "SAMPLE_FAULT": "21:1:hbm:forward",
        "SAMPLE_TRAIN_ITERS": "23",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        "2",
        str(launcher),
        str(WORKERS / "train_toy.py"),
        "--case",
        "ema",
    ]
    return subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=environment,
        stdin=subprocess.DEVNULL,
    )


def test_in_report_mode_ranks_without_the_package_log_one_line_the_recovery_completes_and_diagnose_says_so(tmp_path):
    """The block's import once failed the rollback on every rank, and MindIO gave up the recovery;
    then the one line each rank logged instead had no JSON, and diagnose said nothing of it."""
    job = toytrain_without_the_sentinel(tmp_path, "report")
    output = job.stdout
    assert job.returncode == 0, output[-3000:]
    said = sorted(line[line.index("[unsafe-doctor sentinel]") :] for line in output.splitlines() if FAILED_LINE in line)
    error = "ModuleNotFoundError(\"No module named 'unsafe_doctor.sentinel'\")"
    assert said == [f"[unsafe-doctor sentinel] rank {rank}: {FAILED_LINE}{error}" for rank in (0, 1)]  # one line on each rank
    assert "rollback failed" not in output
    assert output.count("rolled back to step 20") == 2
    assert output.index("toytrain step     21 |") > output.rindex("rolled back to step 20")  # the first step after it ran

    log = tmp_path / "job.log"
    log.write_text(output)
    report = diagnosed(log, "json")
    failures = sorted(json.loads(report.stdout)["sentinel_failures"], key=lambda failure: failure["rank"])  # in the log's order
    assert failures == [{"rank": 0, "error": error}, {"rank": 1, "error": error}]
    assert f"\n  the sentinel could not run on ranks 0-1: {error}\n" in diagnosed(log, "text").stdout


def diagnosed(log: Path, fmt: str) -> subprocess.CompletedProcess[str]:
    return run_cli("diagnose", str(log), "--format", fmt, env={"COLUMNS": "200"}, unset=("UNSAFE_DOCTOR_",), cwd=ROOT)


def test_in_raise_mode_ranks_without_the_package_stop_the_recovery(tmp_path):
    """Raise mode was asked to stop the recovery rather than let a step run unchecked: it still does."""
    job = toytrain_without_the_sentinel(tmp_path, "raise")
    output = job.stdout
    assert job.returncode != 0, output[-3000:]
    assert "An error occurred: No module named 'unsafe_doctor.sentinel'" in output
    assert "rank:1 rollback failed, ret: 1" in output
    assert "toytrain step     21 |" not in output and FAILED_LINE not in output


OLD_SENTINEL = "def check(*roots):\n    return None\n"  # an unsafe-doctor in the image older than the block: no mode
OLD_KEEPER = "def keep_tracebacks():\n    return None\n"
IMAGES = {  # what the training image holds, as files of its site-packages: what the block meets there
    "nothing": {},
    "no keeper": {"unsafe_doctor/__init__.py": "", "unsafe_doctor/sentinel/__init__.py": OLD_SENTINEL},
    "an older check": {
        "unsafe_doctor/__init__.py": "",
        "unsafe_doctor/sentinel/__init__.py": OLD_SENTINEL,
        "unsafe_doctor/sentinel/keeper.py": OLD_KEEPER,
    },
}
ERRORS = {
    "nothing": "ModuleNotFoundError(\"No module named 'unsafe_doctor'\")",
    "no keeper": "ModuleNotFoundError(\"No module named 'unsafe_doctor.sentinel.keeper'\")",
    "an older check": "TypeError(\"check() got an unexpected keyword argument 'mode'\")",
}


def rollback_in_an_image(tmp_path: Path, mode: str, image: str) -> subprocess.CompletedProcess[str]:
    """An adaptor with the sentinel in `mode`, its rollback run by a Python without site-packages (-S:
    no unsafe-doctor, whatever this venv holds) beside the files of `image`."""
    adaptor = tmp_path / "recovery.py"
    adaptor.write_text('STATE = {"loss": 1}\n\n\ndef feature_rollback():\n    STATE.clear()\n')
    apply(sentinel_plan(adaptor, mode))
    site = tmp_path / "site-packages"
    for name, text in IMAGES[image].items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    driver = (
        f"import logging, sys; sys.path[:0] = [{str(tmp_path)!r}, {str(site)!r}]; logging.basicConfig(); "
        "import recovery; recovery.feature_rollback(); print('rolled back', recovery.STATE)"
    )
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", driver],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "RANK": "3"},
    )


@pytest.mark.parametrize("mode", ["report", "heal"])
@pytest.mark.parametrize("image", list(IMAGES))
def test_in_report_and_heal_mode_nothing_the_image_lacks_or_holds_fails_the_rollback(tmp_path, image, mode):
    """No package, an older one without the keeper, one whose check takes no mode: the rollback runs
    to its end and one line says on which rank the sentinel did not check, and why."""
    result = rollback_in_an_image(tmp_path, mode, image)
    assert (result.returncode, result.stdout) == (0, "rolled back {}\n"), result.stderr
    assert result.stderr == f"WARNING:unsafe_doctor.sentinel:[unsafe-doctor sentinel] rank 3: {FAILED_LINE}{ERRORS[image]}\n"


def test_raise_mode_raises_where_the_package_is_missing(tmp_path):
    """The one mode that stops the recovery for want of the package: the user asked it to stop
    rather than let a step run unchecked."""
    result = rollback_in_an_image(tmp_path, "raise", "nothing")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.endswith("ModuleNotFoundError: No module named 'unsafe_doctor'\n"), result.stderr
    assert FAILED_LINE not in result.stderr


def test_heal_mode_still_stops_the_recovery_for_what_it_could_not_heal(tmp_path, monkeypatch):
    """The guard lets heal's own verdict through: a global no scenario-1 rule covers is still unsafe
    after heal, so the rollback raises UnsafeStateError, as heal was asked to."""
    with importable_package(
        tmp_path,
        monkeypatch,
        "healjob",
        {
            "recovery.py": """\
            import torch

            EMA = torch.ones(2)


            def feature_rollback():
                pass
            """
        },
    ) as package:
        adaptor = package / "recovery.py"
        apply(sentinel_plan(adaptor, "heal", functions="rollback=feature_rollback"))
        from healjob import recovery

        backend = EmulatedBackend()
        with backend.activate(), pytest.raises(UnsafeStateError, match="healjob.recovery.EMA"):
            backend.mark_unsafe(recovery.EMA)
            recovery.feature_rollback()


def test_the_line_goes_to_the_sentinels_own_logger():
    from unsafe_doctor.adaptor.sentinel_install import LOGGER
    from unsafe_doctor.sentinel import logger

    assert logger.name == LOGGER


def test_each_modes_block_is_short_one_import_a_line_and_binds_only_its_imports_and_error(tmp_path):
    """What the adaptor's maintainer reads: lines within 100 columns, one module per import, and no
    local beyond the names imported and the error caught."""
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    for mode in MODES:
        blocks = added_blocks(sentinel_plan(adaptor, mode, functions="rollback=rollback_callback"))
        logging = {"_ud_error", "_ud_logging", "_ud_os"} if mode != "raise" else set()
        imported = [{"_ud_sentinel_check", "_ud_keep_tracebacks"}]
        if mode == "heal":  # the repair's blocks first: send_rank_repair, then recv_rank_repair
            imported = [{"_ud_send_state"}, {"_ud_receive_state"}, *imported]
        assert len(blocks) == len(imported), mode
        for lines, names in zip(blocks, imported, strict=True):
            assert max(len(line) for line in lines) <= 100, mode
            block = ast.parse(textwrap.dedent("\n".join(lines)))
            assert all(len(node.names) == 1 for node in ast.walk(block) if isinstance(node, ast.Import)), mode
            bound = {node.id for node in ast.walk(block) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
            bound |= {
                alias.asname for node in ast.walk(block) if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names
            }
            bound |= {node.name for node in ast.walk(block) if isinstance(node, ast.ExceptHandler) and node.name}
            assert bound == {*names, *logging}, mode


def test_what_the_image_needs_follows_from_the_mode():
    from unsafe_doctor.report.sentinel import needs_line

    logged, raised = needs_line("report"), needs_line("raise")
    assert needs_line("heal") == logged != raised
    assert all(f"unsafe-doctor=={__version__} " in line for line in (logged, raised))
    assert "the block logs one line and the rollback goes on" in logged and "the rollback raises there" in raised


def test_install_says_what_the_training_image_needs(tmp_path):
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    where = f"the training image needs unsafe-doctor=={__version__} importable in every rank's Python: where it is not, "
    report = run("--adaptor", str(adaptor), "--dry-run")
    assert report.returncode == 0, report.stderr
    assert f"{where}the block logs one line and the rollback goes on without the sentinel\n" in report.stderr
    stopping = run("--adaptor", str(adaptor), "--mode", "raise", "--dry-run")
    assert (
        f"{where}the rollback raises there and MindIO gives up the online recovery, as it does for an unsafe tensor "
        "in this mode\n"
    ) in stopping.stderr

    healing = run("--adaptor", str(adaptor), "--mode", "heal", "--dry-run")
    assert f"{where}the block logs one line and the rollback goes on without the sentinel\n" in healing.stderr
    written = json.loads(run("--adaptor", str(adaptor), "--mode", "heal", "--yes", "--format", "json").stdout)
    assert written["training_image"] == {
        "needs": f"unsafe-doctor=={__version__}",
        "where": "importable in every rank's Python",
        "if_missing": "logged",
    }
    for args in ((), ("--revert",)):  # nothing written: nothing needed
        document = json.loads(run("--adaptor", str(adaptor), "--yes", "--format", "json", *args).stdout)
        assert document["training_image"] is None


@pytest.mark.parametrize("mode", ["report", "heal"])
def test_an_unguarded_block_of_an_earlier_install_is_named_with_the_way_to_guard_it(tmp_path, mode):
    adaptor = copied(TOYTRAIN, tmp_path) / "recovery.py"
    apply(sentinel_plan(adaptor, mode))
    guarded = adaptor.read_text()
    rollback = guarded.index(f"{MARKER_BEGIN}{SENTINEL_KEY}\n")  # older installs wrote no repair blocks: only this one changed
    start, end = guarded.index("    try:  # unsafe-doctor", rollback), guarded.index("    # unsafe-doctor: end", rollback)
    earlier = [line.removeprefix("    ") for line in guarded[start:end].splitlines(keepends=True)[1:5]]
    adaptor.write_text(guarded[:start] + "".join(earlier) + guarded[end:])  # as older installs wrote it
    compile(adaptor.read_text(), str(adaptor), "exec")

    again = sentinel_plan(adaptor)
    assert again.edits == ()
    assert again.notes == (
        f"it is unguarded in mode {mode} (an earlier unsafe-doctor wrote it): a rank that cannot import "
        "unsafe-doctor fails the rollback there; to guard it: sentinel install --revert, then install again",
    )
    revert(adaptor, sentinel=True)
    apply(sentinel_plan(adaptor, mode))
    assert adaptor.read_text() == guarded
    assert sentinel_plan(adaptor).notes == ("to write another mode or move it: sentinel install --revert, then install again",)
