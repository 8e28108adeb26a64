"""`unsafe-doctor fix`: fixes written into real adaptor files, checked byte for byte.

Golden cases take a sample adaptor (samples/adaptors/, toytrain's recovery.py) and a log, plan and
apply the fix in a copy under tmp_path, and compare every changed file with
tests/fixtures/fix/<case>/. Each case is also applied a second time (nothing changes) and reverted
(the original bytes come back). The logs are the committed samples, or tracebacks produced here by
running the real code under the emulated torch_npu check (tests/fixtures/rules/generate.py).

The patched code is run, not only compiled: the scenario-1 block against megatron-core 0.16.1's
real MoE tracker made unsafe, and the scenario-2 send and receive blocks between two gloo ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import load_rules_generator
from helpers import load_module, run_cli, run_ranks
from terminal import at_terminal

from unsafe_doctor.adaptor.overrides import function_overrides
from unsafe_doctor.adaptor.plan import Plan, plan_fix, plan_revert
from unsafe_doctor.adaptor.splice import FileEdit
from unsafe_doctor.adaptor.write import BACKUP_SUFFIX, apply
from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.context import groundwork

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples"
LOGS = SAMPLES / "logs"
FRAMEWORK = SAMPLES / "framework"
GOLDEN = Path(__file__).parents[1] / "fixtures" / "fix"
CUSTOM_FUNCTIONS = "rollback=reset_step_state,send=send_to_repaired_rank,recv=receive_from_replica"


GENERATOR = load_rules_generator()


# --- logs produced here from real code ------------------------------------------------------------


@pytest.fixture(scope="module")
def produced_logs(router_expert_bias_log, toytrain_loss_log) -> dict[str, Path]:
    return {"router_expert_bias": router_expert_bias_log, "toytrain_loss_log": toytrain_loss_log}


def log_path(name: str, produced: dict[str, Path]) -> Path:
    return produced[name] if name in produced else LOGS / name


# --- planning, the way the CLI does it ------------------------------------------------------------


def plan_for(logs, adaptor: Path, *, source_roots=(), functions: str | None = None, rules=()) -> Plan:
    diagnosis = diagnose([str(log) for log in logs], groundwork(rules, source_roots), adaptor=adaptor)
    overrides = function_overrides([functions] if functions else [])
    return plan_fix(diagnosis.findings, diagnosis.context, overrides)


def revert_plan(adaptor: Path) -> Plan:
    return plan_revert(groundwork().detect(adaptor=adaptor).environment)


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@dataclass(frozen=True)
class Case:
    name: str
    sample: Path  # a folder copied as a whole
    adaptor: str  # the file given as --adaptor, inside the copy
    logs: tuple[str, ...]
    changed: tuple[str, ...]  # files the fix edits, inside the copy
    source_roots: tuple[Path, ...] = ()
    functions: str | None = None
    keys: tuple[str, ...] = field(default=())  # marker keys expected, in order of the file


ADAPTORS = SAMPLES / "adaptors"
LEGACY_FILE = "mindio_ttp/adaptor/modellink_adaptor.py"
IN_TREE = "mindspeed_llm/core/high_availability"

CASES = [
    # The legacy adaptor resets the FAQ's tracker already (tests/adaptor/test_existing_reset.py); the
    # layer-wise tracker of a megatron-core 0.16 log is what it misses.
    Case(
        "legacy-layer-wise-tracker",
        ADAPTORS / "legacy",
        LEGACY_FILE,
        ("megatron_moe_tracker.log",),
        (LEGACY_FILE,),
        keys=("megatron.moe-layer-wise-tracker-moe-utils",),
    ),
    Case(
        "legacy-router-expert-bias",
        ADAPTORS / "legacy",
        LEGACY_FILE,
        ("router_expert_bias",),
        (LEGACY_FILE,),
        keys=("megatron.router-expert-bias", "megatron.router-expert-bias"),
    ),
    Case(
        "in-tree-layer-wise-tracker",
        ADAPTORS / "in_tree",
        f"{IN_TREE}/tft_rollback.py",
        ("megatron_moe_tracker.log",),
        (f"{IN_TREE}/tft_rollback.py",),
        keys=("megatron.moe-layer-wise-tracker-moe-utils",),
    ),
    # MindSpeed-LLM 26.x does not rebuild the model: the router's local_tokens_per_expert is reset with it
    Case(
        "in-tree-router-expert-bias",
        ADAPTORS / "in_tree",
        f"{IN_TREE}/tft_rollback.py",
        ("router_expert_bias",),
        (f"{IN_TREE}/tft_optimizer_data_repair.py", f"{IN_TREE}/tft_rollback.py"),
        keys=("megatron.router-expert-bias", "megatron.router-expert-bias", "megatron.router-local-tokens-per-expert"),
    ),
    Case(
        "custom-ema-grad-norm",
        ADAPTORS / "custom",
        "my_recovery.py",
        ("toytrain_ema",),
        ("my_recovery.py",),
        source_roots=(FRAMEWORK,),
        functions=CUSTOM_FUNCTIONS,
        keys=("generic.replica-copy:toytrain.state._EMA_GRAD_NORM",) * 2,
    ),
    Case(
        "custom-loss-log",
        ADAPTORS / "custom",
        "my_recovery.py",
        ("toytrain_loss_log",),
        ("my_recovery.py",),
        source_roots=(FRAMEWORK,),
        functions=CUSTOM_FUNCTIONS,
        keys=("generic.reinitialise:toytrain.state.LOSS_LOG",),
    ),
    Case(
        "toytrain-ema-grad-norm",
        FRAMEWORK / "toytrain",
        "recovery.py",
        ("toytrain_ema",),
        ("recovery.py",),
        source_roots=(FRAMEWORK,),
        keys=("generic.replica-copy:toytrain.state._EMA_GRAD_NORM",) * 2,
    ),
]


def copy_sample(case: Case, tmp_path: Path) -> Path:
    copy = tmp_path / "adaptor"
    shutil.copytree(case.sample, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def markers(data: bytes) -> list[str]:
    return [
        line.strip().removeprefix("# unsafe-doctor: begin ")
        for line in data.decode().splitlines()
        if line.strip().startswith("# unsafe-doctor: begin ")
    ]


def spliced(edit: FileEdit) -> str:
    """The original with each recorded insertion put before its line: what a SARIF consumer rebuilds."""
    lines = [line.decode(edit.encoding) for line in edit.original.splitlines(keepends=True)]
    for insertion in reversed(edit.insertions):
        lines.insert(insertion.line, insertion.text)
    return "".join(lines)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_golden_fix_then_idempotent_then_revert(case, tmp_path, produced_logs):
    copy = copy_sample(case, tmp_path)
    original = tree_bytes(copy)
    adaptor = copy / case.adaptor
    logs = [log_path(name, produced_logs) for name in case.logs]
    plan = plan_for(logs, adaptor, source_roots=case.source_roots, functions=case.functions)
    assert [edit.path.resolve() for edit in plan.edits] == [(copy / name).resolve() for name in case.changed]
    written = apply(plan)

    after = tree_bytes(copy)
    for name in case.changed:
        golden = GOLDEN / case.name / Path(name).name
        assert after[name] == golden.read_bytes(), f"{copy / name} differs from {golden}"
        compile(after[name], name, "exec")
        assert (copy / (name + BACKUP_SUFFIX)).read_bytes() == original[name]
    assert [key for name in case.changed for key in markers(after[name])] == list(case.keys)
    untouched = {name for name in original if name not in case.changed}
    assert {name: after[name] for name in untouched} == {name: original[name] for name in untouched}
    assert len(written) == len(case.changed)

    again = plan_for(logs, adaptor, source_roots=case.source_roots, functions=case.functions)
    assert again.edits == () and again.diff() == ""
    assert len(again.present) == len(case.keys)

    apply(revert_plan(adaptor))
    for name in case.changed:
        assert (copy / name).read_bytes() == original[name]


# --- where a block goes -------------------------------------------------------------------------


def custom_adaptor(tmp_path: Path, source: str, name: str = "adaptor.py") -> Path:
    path = tmp_path / name
    path.write_bytes(textwrap.dedent(source).encode())
    return path


EMA = (LOGS / "toytrain_ema",)
LOSS = ("toytrain_loss_log",)


def test_docstring_only_decorated_function_gets_the_block_after_its_docstring(tmp_path, produced_logs):
    adaptor = custom_adaptor(
        tmp_path,
        '''\
        import functools


        def traced(function):
            @functools.wraps(function)
            def wrapper(*args):
                return function(*args)
            return wrapper


        @traced
        @functools.lru_cache(maxsize=None)
        def feature_rollback():
            """Nothing to reset yet."""
        ''',
    )
    plan = plan_for([produced_logs["toytrain_loss_log"]], adaptor, source_roots=(FRAMEWORK,))
    lines = plan.edits[0].updated.decode().splitlines()
    docstring = lines.index('    """Nothing to reset yet."""')
    assert lines[docstring + 1] == "    # unsafe-doctor: begin generic.reinitialise:toytrain.state.LOSS_LOG"
    assert lines[-1] == "    # unsafe-doctor: end generic.reinitialise:toytrain.state.LOSS_LOG"


def test_block_goes_before_a_trailing_return_and_its_comment(tmp_path, produced_logs):
    adaptor = custom_adaptor(
        tmp_path,
        """\
        def feature_rollback():
            status = 0

            # report success
            return status


        def after():
            pass
        """,
    )
    plan = plan_for([produced_logs["toytrain_loss_log"]], adaptor, source_roots=(FRAMEWORK,))
    text = plan.edits[0].updated.decode()
    assert "    status = 0\n    # unsafe-doctor: begin" in text
    block_end = "# unsafe-doctor: end generic.reinitialise:toytrain.state.LOSS_LOG\n"
    assert block_end + "\n    # report success\n    return status\n" in text
    assert plan.notes == ()


def test_a_comment_closing_the_block_before_the_return_stays_with_that_block(tmp_path, produced_logs):
    """A comment as deep as the `else:` body ends that body; the lines after it, the return's own
    comment among them, still come after the fix."""
    adaptor = custom_adaptor(
        tmp_path,
        """\
        def feature_rollback(args=None):
            if args:
                args.reset()
            else:
                pass
                # nothing to reset without args

            # report success
            return args
        """,
    )
    plan = plan_for([produced_logs["toytrain_loss_log"]], adaptor, source_roots=(FRAMEWORK,))
    text = plan.edits[0].updated.decode()
    assert "        # nothing to reset without args\n    # unsafe-doctor: begin" in text
    assert "# unsafe-doctor: end generic.reinitialise:toytrain.state.LOSS_LOG\n\n    # report success\n    return args\n" in text


def test_a_second_fix_into_a_function_goes_after_the_first_block(tmp_path, produced_logs):
    """A later run's block goes after the end marker of a block already at the function's end, not
    inside it (where the markers would nest and the file could no longer be reverted)."""
    copy = copy_sample(next(case for case in CASES if case.name == "in-tree-layer-wise-tracker"), tmp_path)
    adaptor = copy / f"{IN_TREE}/tft_rollback.py"
    before = adaptor.read_bytes()
    apply(plan_for([LOGS / "megatron_moe_tracker.log"], adaptor, source_roots=(copy,)))
    apply(plan_for([produced_logs["toytrain_loss_log"]], adaptor, source_roots=(FRAMEWORK,)))
    text = adaptor.read_text()
    assert markers(text.encode()) == ["megatron.moe-layer-wise-tracker-moe-utils", "generic.reinitialise:toytrain.state.LOSS_LOG"]
    assert "    # unsafe-doctor: end megatron.moe-layer-wise-tracker-moe-utils\n    # unsafe-doctor: begin generic." in text
    apply(revert_plan(adaptor))
    assert adaptor.read_bytes() == before


def test_early_returns_are_reported(tmp_path, produced_logs):
    adaptor = custom_adaptor(
        tmp_path,
        """\
        def feature_rollback(args=None):
            if args is None:
                return
            for _ in range(2):
                def inner():
                    return 1  # not the rollback's own return
            args.reset()
        """,
    )
    plan = plan_for([produced_logs["toytrain_loss_log"]], adaptor, source_roots=(FRAMEWORK,))
    assert plan.notes == (
        f"{adaptor}: feature_rollback() returns before its end (line 3): the block runs only on paths that reach the end",
    )
    assert (
        plan.edits[0].updated.decode().rstrip("\n").endswith("# unsafe-doctor: end generic.reinitialise:toytrain.state.LOSS_LOG")
    )


def test_crlf_and_tab_indentation_are_kept(tmp_path):
    source = (
        "def send_rank_repair(src_ranks, dest_ranks, optim_idxs, rank_list, train_args):\r\n"
        "\tgroup = dist.new_group(rank_list)\r\n"
        "\tif group is None:\r\n"
        "\t\traise RuntimeError('no group')\r\n"
        "\r\n"
        "def recv_rank_repair(src_ranks, dest_ranks, optim_idxs, rank_list, train_args):\r\n"
        "\tgroup = dist.new_group(rank_list)\r\n"
        "\treturn 0\r\n"
    )
    adaptor = tmp_path / "adaptor.py"
    adaptor.write_bytes(source.encode())
    plan = plan_for(EMA, adaptor, source_roots=(FRAMEWORK,))
    (edit,) = plan.edits
    assert b"\n" not in edit.updated.replace(b"\r\n", b"")  # every line ends in CRLF
    original_lines = set(edit.original.split(b"\r\n"))
    block = [line for line in edit.updated.split(b"\r\n") if line not in original_lines]
    assert markers(edit.updated.replace(b"\r\n", b"\n")) == ["generic.replica-copy:toytrain.state._EMA_GRAD_NORM"] * 2
    assert all(line.startswith(b"\t") and b"    " not in line[: len(line) - len(line.lstrip())] for line in block)
    assert b"\r\n\t\tglobal_tensor = state._EMA_GRAD_NORM\r\n" in edit.updated  # the pair loop, then the template's level
    assert [insertion.line for insertion in edit.insertions] == [4, 7]  # before the blank line; before `return 0`
    assert spliced(edit) == edit.updated.decode()
    compile(edit.updated, "adaptor.py", "exec")
    apply(plan)
    apply(revert_plan(adaptor))
    assert adaptor.read_bytes() == source.encode()


@pytest.mark.parametrize(
    "head, tail",
    [
        (b"# -*- coding: latin-1 -*-\n# Gr\xfc\xdfe aus K\xf6ln\n", b"\n"),
        (b"\xef\xbb\xbf# caf\xc3\xa9, with a BOM\n", b"\n"),
        (b"# no line ending at the very end\n", b""),
    ],
    ids=["latin-1", "utf-8-bom", "no-final-newline"],
)
def test_encodings_and_file_ends_round_trip(tmp_path, produced_logs, head, tail):
    adaptor = tmp_path / "adaptor.py"
    original = head + b'def feature_rollback():\n    """Reset."""\n    pass' + tail
    adaptor.write_bytes(original)
    plan = plan_for([produced_logs["toytrain_loss_log"]], adaptor, source_roots=(FRAMEWORK,))
    (edit,) = plan.edits
    assert edit.updated.startswith(head)
    assert edit.updated.endswith(b"# unsafe-doctor: end generic.reinitialise:toytrain.state.LOSS_LOG" + tail)
    assert spliced(edit) == edit.updated.decode(edit.encoding)
    compile(edit.updated, "adaptor.py", "exec")
    apply(plan)
    apply(revert_plan(adaptor))
    assert adaptor.read_bytes() == original


def test_two_space_indented_method(tmp_path, produced_logs):
    adaptor = custom_adaptor(
        tmp_path,
        """\
        class Recovery:
          def feature_rollback(self):
            if True:
              pass
        """,
    )
    plan = plan_for([produced_logs["toytrain_loss_log"]], adaptor, source_roots=(FRAMEWORK,))
    lines = plan.edits[0].updated.decode().splitlines()
    assert "    from toytrain import state" in lines  # at the method body's level
    assert "      global_tensor = global_tensors[key]" in lines  # the file's two-space unit inside the block
    assert "      if isinstance(global_tensor, torch.Tensor):" in lines


# --- several findings ---------------------------------------------------------------------------


def test_several_findings_make_one_diff_per_file_and_pair_in_order(tmp_path, produced_logs):
    copy = tmp_path / "legacy"
    shutil.copytree(ADAPTORS / "legacy", copy)
    adaptor = copy / LEGACY_FILE
    logs = [LOGS / "megatron_moe_tracker.log", produced_logs["router_expert_bias"], LOGS / "toytrain_ema"]
    plan = plan_for(logs, adaptor, source_roots=(FRAMEWORK,))
    (edit,) = plan.edits
    assert edit.diff().count("\n--- ") + edit.diff().startswith("--- ") == 1
    text = edit.updated.decode()
    send = text[text.index("def send_rank_repair") : text.index("def recv_rank_repair")]
    recv = text[text.index("def recv_rank_repair") :]
    scenario_2 = ["megatron.router-expert-bias", "generic.replica-copy:toytrain.state._EMA_GRAD_NORM"]
    assert markers(send.encode()) == scenario_2 and markers(recv.encode()) == scenario_2
    assert markers(text[: text.index("def send_rank_repair")].encode()) == ["megatron.moe-layer-wise-tracker-moe-utils"]
    assert len(edit.changes) == 5
    assert len(edit.insertions) == 5 and spliced(edit) == text


# --- profiles -------------------------------------------------------------------------------------


def test_profile_with_scalar_ranks_passes_them_in(tmp_path, produced_logs):
    rules = tmp_path / "profile.yaml"
    rules.write_text(
        textwrap.dedent("""\
        profiles:
          - id: team-pairwise
            title: A team adaptor called once per (source, destination) pair
            files: [team/recovery.py]
            rollback: rollback
            send: send_state
            recv: recv_state
            parameters: {src_ranks: source, dest_ranks: target, train_args: job.train_args}
            ranks_are_lists: false
            repair_group: {expression: job.group}
        """)
    )
    adaptor = custom_adaptor(
        tmp_path,
        """\
        def send_state(source, target, job):
            pass


        def recv_state(source, target, job):
            pass
        """,
    )
    plan = plan_for([produced_logs["router_expert_bias"]], adaptor, rules=(rules,))
    text = plan.edits[0].updated.decode()
    assert "        for chunk in job.train_args[1]:\n" in text  # the role's parameter, in the function's names
    assert "torch.distributed.send(module.expert_bias, dst=target, group=job.group)" in text
    assert "torch.distributed.recv(recv_tensor, src=source, group=job.group)" in text
    assert "dict.fromkeys(zip(" not in text  # called once per pair: no lists to walk
    compile(text, "adaptor.py", "exec")


def test_list_ranks_visit_each_pair_once_in_first_seen_order(tmp_path, produced_logs):
    adaptor = tmp_path / "adaptor"
    shutil.copytree(ADAPTORS / "custom", adaptor)
    plan = plan_for(EMA, adaptor / "my_recovery.py", source_roots=(FRAMEWORK,), functions=CUSTOM_FUNCTIONS)
    namespace = {}
    exec("def pairs(src_ranks, dest_ranks):\n    return list(dict.fromkeys(zip(src_ranks, dest_ranks)))", namespace)
    written = plan.edits[0].updated.decode()
    assert "for _src_rank, dest_rank in dict.fromkeys(zip(src_ranks, dest_ranks)):" in written  # the send side
    assert "for src_rank, _dest_rank in dict.fromkeys(zip(src_ranks, dest_ranks)):" in written  # the receive side
    assert namespace["pairs"]([4, 4, 5, 4], [1, 1, 2, 1]) == [(4, 1), (5, 2)]


# --- refusals -------------------------------------------------------------------------------------


def refused(fragment: str):
    return pytest.raises(UsageError, match=fragment)


def test_no_such_function_lists_what_is_there(tmp_path):
    adaptor = custom_adaptor(tmp_path, "def rollback_all():\n    pass\n\n\ndef helper():\n    pass\n")
    with refused(
        r"no recv function recv_rank_repair\(\) .* \(functions there: helper, rollback_all\); "
        r"name it with --function recv=NAME"
    ):
        plan_for(EMA, adaptor, source_roots=(FRAMEWORK,))


def test_several_functions_of_the_name_are_refused(tmp_path, produced_logs):
    adaptor = custom_adaptor(
        tmp_path,
        """\
        def feature_rollback():
            pass


        class Legacy:
            def feature_rollback(self):
                pass
        """,
    )
    with refused(rf"several functions named feature_rollback\(\) \({adaptor}:1, {adaptor}:6\)"):
        plan_for([produced_logs["toytrain_loss_log"]], adaptor, source_roots=(FRAMEWORK,))


def test_function_without_the_profile_parameters_is_refused(tmp_path):
    adaptor = custom_adaptor(
        tmp_path,
        """\
        def send_rank_repair(src_ranks, rank_list, train_args):
            pass


        def recv_rank_repair(src_ranks, dest_ranks, rank_list, train_args):
            pass
        """,
    )
    with refused(r"send_rank_repair\(\) has no parameter for dest_ranks, .* it has rank_list, src_ranks, train_args"):
        plan_for(EMA, adaptor, source_roots=(FRAMEWORK,))


def test_one_line_function_is_refused(tmp_path, produced_logs):
    adaptor = custom_adaptor(tmp_path, "def feature_rollback(): pass\n")
    with refused(r"has its body on the `def` line"):
        plan_for([produced_logs["toytrain_loss_log"]], adaptor, source_roots=(FRAMEWORK,))


def test_result_that_does_not_compile_is_refused(tmp_path):
    rules = tmp_path / "bad_rule.yaml"
    rules.write_text(
        textwrap.dedent("""\
        rules:
          - id: team.ema
            title: A rule whose code is not valid inside a function
            match: {variable: _EMA_GRAD_NORM}
            scenario: 1
            phase: rollback
            fix:
              code: |
                nonlocal never_bound
            reason: Written to fail.
        """)
    )
    adaptor = custom_adaptor(tmp_path, "def feature_rollback():\n    pass\n")
    with refused(
        r"adaptor.py: the edited file would not compile "
        r"\(no binding for nonlocal 'never_bound' found, line 5\): nothing written"
    ):
        plan_for(EMA, adaptor, source_roots=(FRAMEWORK,), rules=(rules,))
    assert adaptor.read_bytes() == b"def feature_rollback():\n    pass\n"


def test_bad_function_overrides_are_refused():
    with refused(r"write role=name"):
        function_overrides(["my_rollback"])
    with refused(r"'import os' is not a Python function name"):
        function_overrides(["rollback=import os"])
    with refused(r"two functions for send"):
        function_overrides(["send=a", "send=b"])
    assert function_overrides(["rollback=a, send=b", "recv=c"]) == {"rollback": "a", "send": "b", "recv": "c"}


# --- writing --------------------------------------------------------------------------------------


def toytrain_copy(tmp_path: Path) -> Path:
    adaptor = tmp_path / "recovery.py"
    shutil.copyfile(FRAMEWORK / "toytrain" / "recovery.py", adaptor)
    return adaptor


def test_read_only_file_is_refused_and_untouched(tmp_path):
    adaptor = toytrain_copy(tmp_path)
    before = adaptor.read_bytes()
    plan = plan_for(EMA, adaptor, source_roots=(FRAMEWORK,))
    adaptor.chmod(0o444)
    with refused(r"recovery.py is read-only: nothing written"):
        apply(plan)
    assert adaptor.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["recovery.py"]


def test_file_changed_between_plan_and_apply_is_refused(tmp_path):
    adaptor = toytrain_copy(tmp_path)
    plan = plan_for(EMA, adaptor, source_roots=(FRAMEWORK,))
    edited = adaptor.read_bytes() + b"\n# edited while the diff was shown\n"
    adaptor.write_bytes(edited)
    with refused(r"recovery.py changed since it was read: nothing written"):
        apply(plan)
    assert adaptor.read_bytes() == edited
    assert sorted(path.name for path in tmp_path.iterdir()) == ["recovery.py"]


def test_mode_is_kept_and_the_backup_holds_the_original(tmp_path):
    adaptor = toytrain_copy(tmp_path)
    adaptor.chmod(0o640)
    before = adaptor.read_bytes()
    (written,) = apply(plan_for(EMA, adaptor, source_roots=(FRAMEWORK,)))
    assert stat.S_IMODE(adaptor.stat().st_mode) == 0o640
    assert written.backup == adaptor.with_name("recovery.py" + BACKUP_SUFFIX)
    assert written.backup.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["recovery.py", "recovery.py" + BACKUP_SUFFIX]


def test_revert_without_blocks_changes_nothing(tmp_path):
    adaptor = toytrain_copy(tmp_path)
    plan = revert_plan(adaptor)
    assert plan.edits == () and plan.notes == (f"{adaptor}: no unsafe-doctor fix blocks",)


def test_revert_refuses_a_block_without_its_end(tmp_path):
    adaptor = custom_adaptor(tmp_path, "def f():\n    # unsafe-doctor: begin team.x\n    pass\n")
    with refused(r"adaptor.py:2: block team.x has no end marker"):
        revert_plan(adaptor)


# --- untrusted logs -------------------------------------------------------------------------------

INJECTED_SOURCE_LINE = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/srv/job/mindspeed_llm/training/utils.py", line 88, in get_batch
[rank1]:     _MTP_BATCH_LIST[0] + __import__("os").system("touch PWNED"); exec("import shutil; shutil.rmtree('/')")
[rank1]: RuntimeError: There is unsafe data in the input tensor.
[rank1]: [ERROR] 2025-01-01-00:00:00 (PID:1, Device:1, RankID:1) ERR00003 PTA invalid value
"""

INJECTED_MODULE = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/srv/job/mindspeed_llm/__builtins__/training/utils.py", line 88, in get_batch
[rank1]:     position_ids = _MTP_POSITION_ID[0]
[rank1]: RuntimeError: There is unsafe data in the input tensor.
[rank1]: [ERROR] 2025-01-01-00:00:00 (PID:1, Device:1, RankID:1) ERR00003 PTA invalid value
"""


def test_code_in_a_logged_source_line_never_reaches_the_file(tmp_path):
    log = tmp_path / "crafted.log"
    log.write_text(INJECTED_SOURCE_LINE)
    adaptor = custom_adaptor(tmp_path, "def feature_rollback():\n    pass\n")
    (edit,) = plan_for([log], adaptor).edits
    inserted = edit.updated.decode()
    assert "    import mindspeed_llm.training.utils\n" in inserted  # the whole dotted name: the submodule is loaded
    assert 'setattr(mindspeed_llm.training.utils, "_MTP_BATCH_LIST", None)' in inserted
    for payload in ("__import__", "system", "PWNED", "exec", "shutil", "rmtree"):
        assert payload not in inserted


def test_a_logged_name_that_is_not_a_plain_name_is_refused(tmp_path):
    log = tmp_path / "crafted.log"
    log.write_text(INJECTED_MODULE)
    adaptor = custom_adaptor(tmp_path, "def feature_rollback():\n    pass\n")
    with refused(r"the log gives module 'mindspeed_llm.__builtins__.training.utils' where a Python name belongs"):
        plan_for([log], adaptor)


# --- the patched code runs ------------------------------------------------------------------------


class MegatronTrainingArguments:
    """`megatron.training` is not in the megatron-core wheel: the rollback guard asks it for the
    parsed arguments, so the test supplies a module with MoE on."""

    num_experts = 4


def test_patched_rollback_makes_the_real_megatron_tracker_safe_again(tmp_path, monkeypatch):
    import types

    from megatron.core.transformer.moe import moe_utils

    copy = tmp_path / "legacy"
    shutil.copytree(ADAPTORS / "legacy", copy)
    adaptor = copy / LEGACY_FILE
    apply(plan_for([LOGS / "megatron_moe_tracker.log"], adaptor))
    training = types.ModuleType("megatron.training")
    training.get_args = MegatronTrainingArguments
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.syspath_prepend(str(copy))
    patched = load_module("patched_modellink_adaptor", adaptor)
    original = load_module("original_modellink_adaptor", ADAPTORS / "legacy" / LEGACY_FILE)

    def fault_then_rollback(adaptor_module) -> None:
        moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER.clear()
        with GENERATOR.emulated_npu() as mark:
            moe_utils.save_to_aux_losses_tracker("load_balancing_loss", GENERATOR.aux_loss(), 1, 4)
            mark(moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER["load_balancing_loss"]["values"])
            adaptor_module.feature_rollback()
            moe_utils.save_to_aux_losses_tracker("load_balancing_loss", GENERATOR.aux_loss(), 1, 4)

    try:
        with pytest.raises(RuntimeError, match="There is unsafe data in the input tensor"):
            fault_then_rollback(original)
        fault_then_rollback(patched)
        values = moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER["load_balancing_loss"]["values"]
        assert values.tolist() == [0.25, 0.0, 0.0, 0.0]  # the first step after recovery, counted once
    finally:
        moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER.clear()


REPAIR_WORKER = """\
import os, sys
import torch
import torch.distributed as dist
sys.path[:0] = [{workers!r}, {framework!r}, {repository!r}]
import torch_npu_standin
from toytrain import state
from toytrain.train import build_model
import importlib.util

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

rank = int(os.environ["RANK"])
npu = torch_npu_standin.activate()
dist.init_process_group("gloo")
torch.manual_seed(0)
model = build_model()
train_args = (model, torch.optim.Adam(model.parameters()), None, None)
# The replica's running norm is 0.75; the faulty rank's memory was hit.
lists = ([0, 0], [1, 1], [0, 1], [0, 1])  # one pair, repeated for two optimizer indices

def repair(adaptor):
    state.init_state("cpu")
    if rank == 0:
        state._EMA_GRAD_NORM.copy_(torch.tensor(0.75))
        adaptor.send_rank_repair(*lists, train_args)
        return "replica"
    npu.mark_unsafe(state._EMA_GRAD_NORM)
    npu.set_check(enabled=True)
    adaptor.recv_rank_repair(*lists, train_args)
    try:
        return str((state._EMA_GRAD_NORM * 2).item())
    except RuntimeError as error:
        return str(error).splitlines()[0]

print(rank, repair(load("original", {original!r})), repair(load("patched", {patched!r})), flush=True)
dist.destroy_process_group()
"""


def test_patched_send_and_receive_repair_the_tensor_between_two_ranks(tmp_path):
    adaptor = toytrain_copy(tmp_path)
    apply(plan_for(EMA, adaptor, source_roots=(FRAMEWORK,)))
    worker = tmp_path / "worker.py"
    worker.write_text(
        REPAIR_WORKER.format(
            workers=str(SAMPLES / "workers"),
            framework=str(FRAMEWORK),
            repository=str(ROOT),
            original=str(FRAMEWORK / "toytrain" / "recovery.py"),
            patched=str(adaptor),
        )
    )
    ranks = run_ranks(worker, 2, dict(os.environ), timeout=120)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    outputs = [(out, err) for _, out, err in ranks]
    assert outputs[0][0].strip() == "0 replica replica"
    assert outputs[1][0].strip() == "1 There is unsafe data in the input tensor. 1.5"


# --- the command line -----------------------------------------------------------------------------


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`unsafe-doctor fix ARGS`, in this process: it writes the adaptor, never imports it."""
    return run_cli("fix", *args, cwd=cwd)


def test_cli_dry_run_yes_again_and_revert(tmp_path):
    adaptor = toytrain_copy(tmp_path)
    before = adaptor.read_bytes()
    common = [str(LOGS / "toytrain_ema"), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)]

    dry = run(*common, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"--- a{adaptor}\n+++ b{adaptor}\n")  # outside the working folder: from /
    assert "unsafe-doctor: dry run: nothing written" in dry.stderr
    assert adaptor.read_bytes() == before

    unasked = run(*common)
    assert unasked.returncode == 1
    assert unasked.stdout == dry.stdout
    assert (
        f"not applied: nothing is asked without a terminal or with --no-input; "
        f"to apply: unsafe-doctor fix {' '.join(common)} --yes"
    ) in unasked.stderr
    assert adaptor.read_bytes() == before

    applied = run(*common, "--yes")
    assert applied.returncode == 0, applied.stderr
    assert f"wrote {adaptor} (backup: {adaptor}{BACKUP_SUFFIX})" in applied.stderr
    assert markers(adaptor.read_bytes()) == ["generic.replica-copy:toytrain.state._EMA_GRAD_NORM"] * 2

    again = run(*common, "--yes")
    assert (again.returncode, again.stdout) == (0, "")
    assert "nothing to do: the adaptor already holds every fix" in again.stderr

    reverted = run("--revert", "--adaptor", str(adaptor), "--yes")
    assert reverted.returncode == 0, reverted.stderr
    assert reverted.stdout.count("\n-    # unsafe-doctor: begin ") == 2
    assert adaptor.read_bytes() == before


def test_cli_json(tmp_path):
    adaptor = toytrain_copy(tmp_path)
    result = run(
        str(LOGS / "toytrain_ema"), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--format", "json", "--yes"
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["schema"] == "unsafe-doctor/fix/v1"
    assert [item["path"] for item in document["files"]] == [str(adaptor)]
    assert document["files"][0]["diff"].startswith(f"--- a{adaptor}")
    assert document["written"] == [{"path": str(adaptor), "backup": f"{adaptor}{BACKUP_SUFFIX}", "links": 1}]


def test_cli_refusals_are_one_line_and_exit_2(tmp_path):
    adaptor = toytrain_copy(tmp_path)
    for args, fragment in (
        ((str(LOGS / "toytrain_ema"), "--adaptor", str(adaptor), "--function", "send"), "write role=name"),
        (("--revert", str(LOGS / "toytrain_ema"), "--adaptor", str(adaptor)), "--revert takes no logs"),
        (
            (str(LOGS / "toytrain_ema"), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--function", "recv=absent"),
            "no recv function absent()",
        ),
    ):
        result = run(*args)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert result.stderr.count("\n") == 1 and fragment in result.stderr
    assert adaptor.read_bytes() == (FRAMEWORK / "toytrain" / "recovery.py").read_bytes()


def test_cli_no_fix_for_an_unclassified_finding_exits_1(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        textwrap.dedent("""\
        [rank1]: Traceback (most recent call last):
        [rank1]:   File "/srv/job/train.py", line 62, in clip_gradients
        [rank1]:     max_norm = CLIP_FACTOR * state._EMA_GRAD_NORM
        [rank1]: RuntimeError: There is unsafe data in the input tensor.
        """)
    )
    adaptor = toytrain_copy(tmp_path)
    result = run(str(log), "--adaptor", str(adaptor), "--no-input")  # no source to read: unclassified
    assert (result.returncode, result.stdout) == (1, "")
    assert "finding 1: unclassified: scenario 1 or 2 is not known, so there is no fix to write" in result.stderr


def test_cli_asks_at_a_terminal(tmp_path):
    """The prompt path for real: stdin and stdout are a pseudo-terminal; no writes nothing, yes writes."""
    adaptor = toytrain_copy(tmp_path)
    args = ["fix", str(LOGS / "toytrain_ema"), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)]
    for answer, code, written in ((b"n\n", 1, False), (b"y\n", 0, True)):
        exit_code, screen = at_terminal(args, answers=[(b"? [y/N]: ", answer)])
        assert exit_code == code, screen
        assert (BACKUP_SUFFIX in screen) is written
        assert bool(markers(adaptor.read_bytes())) is written


def test_the_question_names_the_file_asks_again_and_ctrl_c_says_nothing_was_written(tmp_path):
    """`Apply? [y/N]` once named no file, took any other answer for a no, and Ctrl-C left the
    shell's prompt on the question's line, saying nothing."""
    adaptor = toytrain_copy(tmp_path)
    args = ["fix", str(LOGS / "toytrain_ema"), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor)]
    code, screen = at_terminal(args, answers=[(b"? [y/N]: ", b"maybe\n"), (b"? [y/N]: ", b"\x03")])
    assert code == 130, screen
    assert f"Write this into {adaptor}? [y/N]: " in screen
    assert screen.count("? [y/N]: ") == 2  # asked again
    assert "\r\nunsafe-doctor: stopped at the question: what it asked about was not written" in screen, screen
    assert not markers(adaptor.read_bytes()) and not adaptor.with_name(adaptor.name + BACKUP_SUFFIX).exists()


def test_a_local_the_function_keeps_is_renamed_in_the_block_a_lambdas_parameter_too(tmp_path):
    rules = tmp_path / "lambda_rule.yaml"
    rules.write_text(
        textwrap.dedent("""\
        rules:
          - id: team.ema
            title: A rule whose code assigns a name the function reads after it
            match: {variable: _EMA_GRAD_NORM}
            scenario: 1
            phase: rollback
            fix:
              code: |
                seed = 1  # a comment kept
                _EMA_GRAD_NORM.fill_((lambda seed: seed)(seed))
            reason: The block's seed is not the function's.
        """)
    )
    adaptor = custom_adaptor(tmp_path, "def feature_rollback():\n    seed = 0\n    return seed\n")
    plan = plan_for(EMA, adaptor, source_roots=(FRAMEWORK,), rules=(rules,))
    text = plan.edits[0].updated.decode()
    assert "    seed_ = 1  # a comment kept\n    _EMA_GRAD_NORM.fill_((lambda seed_: seed_)(seed_))\n" in text
    assert text.endswith("    return seed\n")


def test_a_name_a_closure_made_before_the_block_reads_is_not_clobbered_by_the_block(tmp_path):
    """`report` reads `seed` when called, after the block ran: the block's own `seed` gets another name."""
    rules = tmp_path / "seed_rule.yaml"
    rules.write_text(
        textwrap.dedent("""\
        rules:
          - id: team.ema
            title: A rule whose code assigns a name a closure of the function reads
            match: {variable: _EMA_GRAD_NORM}
            scenario: 1
            phase: rollback
            fix:
              code: |
                seed = 1
                _EMA_GRAD_NORM.fill_(seed)
            reason: The block's seed is not the function's.
        """)
    )
    adaptor = custom_adaptor(tmp_path, "def feature_rollback():\n    seed = 0\n    report = lambda: seed\n    return report\n")
    text = plan_for(EMA, adaptor, source_roots=(FRAMEWORK,), rules=(rules,)).edits[0].updated.decode()
    assert "    seed_ = 1\n    _EMA_GRAD_NORM.fill_(seed_)\n" in text


def test_a_line_separator_inside_a_string_of_the_rule_does_not_shift_the_names_after_it(tmp_path):
    """U+2028 in a string literal is no line to Python (nor to `ast`'s positions): the renames after it land."""
    rules = tmp_path / "separator_rule.yaml"
    rules.write_text(
        textwrap.dedent("""\
        rules:
          - id: team.ema
            title: A rule whose code holds a line separator in a string
            match: {variable: _EMA_GRAD_NORM}
            scenario: 1
            phase: rollback
            fix:
              code: "seed = len('a\\Lb')\\n_EMA_GRAD_NORM.fill_(seed)\\n"
            reason: The block's seed is not the function's.
        """)
    )
    adaptor = custom_adaptor(tmp_path, "def feature_rollback():\n    seed = 0\n    return seed\n")
    text = plan_for(EMA, adaptor, source_roots=(FRAMEWORK,), rules=(rules,)).edits[0].updated.decode()
    assert "    seed_ = len('a\u2028b')\n    _EMA_GRAD_NORM.fill_(seed_)\n" in text


def test_a_rules_aliased_from_import_of_a_variable_is_written_as_a_from_import_and_the_block_runs(tmp_path):
    """`from M import NAME as A` of a module-level variable stays a from-import in the block: written
    as `import M.NAME as A`, it raised ModuleNotFoundError in the rollback at the next fault."""
    (tmp_path / "acme_settings.py").write_text("RESET_VALUE = 42\n")
    rules = tmp_path / "aliased_rule.yaml"
    rules.write_text(
        textwrap.dedent("""\
        rules:
          - id: team.ema
            title: A rule that imports a module-level variable under another name
            match: {variable: _EMA_GRAD_NORM}
            scenario: 1
            phase: rollback
            fix:
              imports: ["from acme_settings import RESET_VALUE as reset_value"]
              code: |
                SEEN.append(reset_value)
            reason: The reset value is the team's setting.
        """)
    )
    adaptor = custom_adaptor(tmp_path, "SEEN = []\n\n\ndef feature_rollback():\n    return SEEN\n")

    rollback = _fixed_then_rolled_back(tmp_path, rules, adaptor)

    assert "    from acme_settings import RESET_VALUE as reset_value\n    SEEN.append(reset_value)\n" in adaptor.read_text()
    assert (rollback.returncode, rollback.stdout) == (0, "[42]\n"), rollback.stderr


def test_a_rules_dotted_import_of_a_name_the_function_binds_is_read_through_its_alias_and_the_block_runs(tmp_path):
    """`import pkgx.sub` where the function binds `pkgx` is written `import pkgx.sub as pkgx_`, which binds
    the module pkgx.sub: the reads of `pkgx.sub.VALUE` become `pkgx_.VALUE` (as `pkgx_.sub.VALUE` they
    raised AttributeError at the next fault)."""
    (tmp_path / "pkgx").mkdir()
    (tmp_path / "pkgx" / "__init__.py").write_text("")
    (tmp_path / "pkgx" / "sub.py").write_text("VALUE = 42\n")
    rules = tmp_path / "dotted_rule.yaml"
    rules.write_text(
        textwrap.dedent("""\
        rules:
          - id: team.ema
            title: A rule that reads a submodule's variable through its dotted import
            match: {variable: _EMA_GRAD_NORM}
            scenario: 1
            phase: rollback
            fix:
              imports: ["import pkgx.sub"]
              code: |
                SEEN.append(pkgx.sub.VALUE)
            reason: The reset value is the team's setting.
        """)
    )
    adaptor = custom_adaptor(tmp_path, "SEEN = []\n\n\ndef feature_rollback():\n    pkgx = 'local'\n    return SEEN, pkgx\n")

    rollback = _fixed_then_rolled_back(tmp_path, rules, adaptor)

    assert "    import pkgx.sub as pkgx_\n    SEEN.append(pkgx_.VALUE)\n" in adaptor.read_text()
    assert (rollback.returncode, rollback.stdout) == (0, "([42], 'local')\n"), rollback.stderr


def _fixed_then_rolled_back(tmp_path: Path, rules: Path, adaptor: Path) -> subprocess.CompletedProcess[str]:
    """`fix --yes` with the team's rule into the adaptor, then its feature_rollback() called in a fresh Python."""
    result = run(
        str(LOGS / "toytrain_ema"), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--rules", str(rules), "--yes"
    )
    assert result.returncode == 0, result.stderr
    return subprocess.run(
        [sys.executable, "-c", "import adaptor; print(adaptor.feature_rollback())"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
