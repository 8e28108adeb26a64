"""Fixes written in the adaptor's own generation, proven by running the patched adaptor.

Each test writes an adaptor in a generation's shape (a legacy ``mindio_ttp`` adaptor that binds its
repair group from the wheel; a job whose state lives in its entry script), fixes it with the real
fixer and replays fault, repair, rollback and the first step on real gloo process groups. The
mutation set breaks the written blocks the ways a hand edit or a wrong generation does; each must
come out FAILED where the block as written is PROVEN.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import run_cli

from unsafe_doctor.adaptor.overrides import function_overrides
from unsafe_doctor.adaptor.plan import plan_fix
from unsafe_doctor.adaptor.write import apply
from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.context import groundwork

ROOT = Path(__file__).resolve().parents[2]
EMA_LOG = ROOT / "samples" / "logs" / "toytrain_ema"
LEGACY = '''\
"""A legacy MindIO adaptor: rollback and repair in one file, the repair group from the wheel."""
import torch
from megatron.training import get_args

from mindio_ttp.adaptor.tft_replica_group import build_repair_group, get_repair_group

OPTIMIZER = 2  # train_args: (forward_step_func, model, optimizer, scheduler)


def feature_rollback():
    args = get_args()


def send_rank_repair(src_ranks, dest_ranks, optim_idxs, step, rank_list, train_args):
    build_repair_group(rank_list)
    group = get_repair_group()
    for dest_rank, optim_idx in zip(dest_ranks, optim_idxs):
        train_args[OPTIMIZER].send_optim_param_state(dest_rank, group, optim_idx)


def recv_rank_repair(src_ranks, dest_ranks, optim_idxs, step, need_rebuild, rank_list, train_args):
    build_repair_group(rank_list)
    group = get_repair_group()
    for src_rank, optim_idx in zip(src_ranks, optim_idxs):
        train_args[OPTIMIZER].recv_and_load_optim_param_state(src_rank, group, step, optim_idx)
'''
ENTRY = '''\
"""A user's training entry script that keeps its loss EMA as a global, as pretrain_gpt.py keeps state."""
import sys
import traceback

import torch

_LOSS_EMA = None


def init_state(device):
    global _LOSS_EMA
    _LOSS_EMA = torch.zeros(4, device=device)


def train_step(loss):
    global _LOSS_EMA
    _LOSS_EMA = 0.9 * _LOSS_EMA + 0.1 * loss
    return _LOSS_EMA


def main():
    from unsafe_doctor.npu.backend import EmulatedBackend

    init_state("cpu")
    train_step(torch.ones(4))
    backend = EmulatedBackend(1)
    with backend.activate():
        backend.mark_unsafe(_LOSS_EMA)  # what the fault left in the EMA's memory
        backend.set_check(enabled=True)
        train_step(torch.ones(4))


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as error:
        from torch_npu_standin import hide_emulator_frames

        hide_emulator_frames(error)
        traceback.print_exception(error)
        sys.exit(1)
'''
CUSTOM = "rollback=reset_step_state,send=send_to_repaired_rank,recv=receive_from_replica"


def fixed(log: Path, adaptor: Path, roots: list[Path], functions: str | None = None):
    """The fix as `unsafe-doctor fix --yes` writes it; the plan, for what it says."""
    diagnosis = diagnose([str(log)], groundwork(source_roots=roots), adaptor=adaptor)
    plan = plan_fix(diagnosis.findings, diagnosis.context, function_overrides([functions] if functions else []))
    assert apply(plan)
    return plan


def replay(log: Path, adaptor: Path, roots: list[Path], functions: str | None = None, **options) -> SimpleNamespace:
    """`unsafe-doctor verify --format json`, run as the command line runs it."""
    arguments: list[str | Path] = ["verify", log, "--adaptor", adaptor, "--format", "json"]
    arguments += [item for root in roots for item in ("--source-root", root)]
    arguments += ["--function", functions] if functions else []
    arguments += [item for name, value in options.items() for item in (f"--{name}", str(value)) if item]  # "": a flag
    result = run_cli(*map(str, arguments), env={"COLUMNS": "200", "NO_COLOR": "1"}, cwd=ROOT)
    assert result.stdout, result.stderr
    document = json.loads(result.stdout)
    verdicts = [
        SimpleNamespace(label=item["global"], outcome=item["outcome"], patched=item["patched"], problems=tuple(item["problems"]))
        for item in document["verdicts"]
    ]
    return SimpleNamespace(verdicts=verdicts, proved=document["proved"])


@pytest.fixture
def legacy(tmp_path) -> tuple[Path, list[Path]]:
    """toytrain (the global's framework) and a legacy adaptor inside a mindio_ttp package, fixed."""
    shutil.copytree(ROOT / "samples" / "framework" / "toytrain", tmp_path / "framework" / "toytrain")
    package = tmp_path / "legacy" / "mindio_ttp" / "adaptor"
    package.mkdir(parents=True)
    for folder in (package, package.parent):
        (folder / "__init__.py").write_text("")
    adaptor = package / "modellink_adaptor.py"
    adaptor.write_text(LEGACY)
    return adaptor, [tmp_path / "framework", tmp_path / "legacy"]


def test_a_legacy_adaptor_is_fixed_with_its_own_group_and_the_patched_adaptor_runs_to_proven(legacy):
    """A file that imports get_repair_group from mindio_ttp and binds `group = get_repair_group()`:
    the fix once imported MindSpeed-LLM's getter there (ModuleNotFoundError in the job). Now the legacy
    profile is chosen by that import and the block uses `group`."""
    adaptor, roots = legacy
    plan = fixed(EMA_LOG, adaptor, roots)
    assert plan.profile == "mindio-ttp-legacy"
    assert plan.profile_why == "the adaptor imports get_repair_group from mindio_ttp.adaptor.tft_replica_group"
    written = adaptor.read_text()
    assert "mindspeed_llm" not in written and "import torch\n" not in written.split('"""', 2)[2].split("def ", 1)[1]
    assert written.count("group=group)") == 2  # the send and the receive, on the function's own group
    result = replay(EMA_LOG, adaptor, roots)
    [verdict] = result.verdicts
    assert verdict.outcome == "proven", verdict.problems
    assert result.proved.startswith(
        "ran the patched adaptor's own recv_rank_repair(), send_rank_repair(), "
        "feature_rollback(); stand-ins for what the adaptor imports and this machine lacks: "
        "megatron.training, mindio_ttp.adaptor.tft_replica_group; "
    )


def _in_blocks(old: str, new: str, sides: str = "send recv") -> Callable[[str], str]:
    """A mutation: `old` replaced by `new` inside the send block, the receive block, or both."""

    def mutate(text: str) -> str:
        send_at, recv_at = text.index("def send_rank_repair"), text.index("def recv_rank_repair")
        send, recv = text[send_at:recv_at], text[recv_at:]
        assert old in (send if "send" in sides else recv)
        if "send" in sides:
            send = send.replace(old, new)
        if "recv" in sides:
            recv = recv.replace(old, new)
        return text[:send_at] + send + recv

    return mutate


WRONG_IMPORT = "from mindspeed_llm.core.high_availability.tft_replica_group import get_repair_group as getter\n    "
MUTATIONS = {
    # another generation's getter: MindSpeed-LLM is not in a legacy job
    "wrong-import": (
        lambda text: _in_blocks("group=group)", "group=getter())")(
            _in_blocks("from toytrain import state\n    ", "from toytrain import state\n    " + WRONG_IMPORT)(text)
        ),
        "raised ModuleNotFoundError: No module named 'mindspeed_llm'",
    ),
    # the gloo group for device tensors: gloo carries host tensors only
    "gloo-group": (_in_blocks("group=group)", "group=get_repair_group(True))"), "a device tensor sent on the gloo repair group"),
    # every (source, destination, optimizer index) triple sends: one receive per pair takes one of them
    "no-pair-dedupe": (
        _in_blocks("dict.fromkeys(zip(src_ranks, dest_ranks))", "zip(src_ranks, dest_ranks)", "send"),
        "rank 3 sends 2 tensor(s) to rank 1, which receives 1",
    ),
    # a broadcast on the repair group: its other ranks never join
    "broadcast": (
        lambda text: _in_blocks(
            "torch.distributed.recv(recv_tensor, src=src_rank, group=group)",
            "torch.distributed.broadcast(recv_tensor, src=src_rank, group=group)",
            "recv",
        )(
            _in_blocks(
                "torch.distributed.send(global_tensor, dst=dest_rank, group=group)",
                "torch.distributed.broadcast(global_tensor, src=src_rank, group=group)",
                "send",
            )(text)
        ),
        "raised RuntimeError: broadcast on the repair group",
    ),
    # source and destination swapped in the receive: it waits on itself
    "swapped-src-dest": (
        _in_blocks("src=src_rank, group=group)", "src=dest_rank, group=group)", "recv"),
        "recv_rank_repair() raised",
    ),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_mutation_of_the_written_block_fails(legacy, mutation):
    adaptor, roots = legacy
    fixed(EMA_LOG, adaptor, roots)
    mutate, problem = MUTATIONS[mutation]
    adaptor.write_text(mutate(adaptor.read_text()))
    [verdict] = replay(EMA_LOG, adaptor, roots, timeout=10).verdicts
    assert verdict.outcome == "failed"
    assert any(problem in line for line in verdict.problems), verdict.problems


@pytest.fixture
def entry_job(tmp_path) -> tuple[Path, Path, list[Path]]:
    """A job whose state is its entry script's, run as the job runs it (`python pretrain_user_state.py`,
    under the emulated unsafe backend); its traceback, as a rank's log; the custom sample adaptor."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "pretrain_user_state.py").write_text(ENTRY)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "samples" / "workers")])}
    run = subprocess.run(
        [sys.executable, "pretrain_user_state.py"], cwd=job, capture_output=True, text=True, env=environment, timeout=120
    )
    assert run.returncode == 1 and "There is unsafe data in the input tensor." in run.stderr, run.stderr
    log = tmp_path / "rank1.log"
    log.write_text("".join(f"[rank1]: {line}\n" for line in run.stderr.splitlines()))
    shutil.copy(ROOT / "samples" / "adaptors" / "custom" / "my_recovery.py", job / "my_recovery.py")
    return log, job / "my_recovery.py", [job]


def test_a_global_of_the_entry_script_is_fixed_in_main_not_in_a_second_copy(entry_job):
    """The log's outermost frame is `pretrain_user_state.py … in <module>`, so the job holds the
    global in __main__; `import pretrain_user_state` would load a fresh second copy. The fix reaches
    it through __main__ and is proven; the second-copy mutation fails."""
    log, adaptor, roots = entry_job
    assert "in <module>" in log.read_text().splitlines()[1]
    fixed(log, adaptor, roots, CUSTOM)
    written = adaptor.read_text()
    assert "import __main__" in written and "import pretrain_user_state" not in written
    [verdict] = replay(log, adaptor, roots, CUSTOM).verdicts
    assert verdict.label == "pretrain_user_state._LOSS_EMA"
    assert verdict.outcome == "proven", verdict.problems
    second_copy = written.replace("import __main__", "import pretrain_user_state").replace("__main__", "pretrain_user_state")
    adaptor.write_text(second_copy)
    [verdict] = replay(log, adaptor, roots, CUSTOM).verdicts
    assert verdict.outcome == "failed"
    assert any("still unsafe" in problem or "still fails" in problem for problem in verdict.problems), verdict.problems


def test_the_real_mindspeed_llm_adaptor_gets_the_router_fix_with_its_companion_and_the_blocks_hold(
    tmp_path, real, router_expert_bias_log
):
    """MindSpeed-LLM master's own adaptor files (26.x: the model is not rebuilt): the fix writes the
    expert_bias copy into both repair functions and the local_tokens_per_expert reset into the
    rollback. Their own repair serialises the optimizer to the NPU, which cannot run here: the blocks
    run alone in their functions (BLOCK-PROVEN, saying why); without the companion the step dies."""
    root = tmp_path / "llm"
    shutil.copytree(real / "mindspeed-llm-master", root)
    for path in root.rglob("*.py"):
        path.chmod(0o644)
    adaptor = root / "mindspeed_llm" / "core" / "high_availability" / "tft_optimizer_data_repair.py"
    plan = fixed(router_expert_bias_log, adaptor, [root])
    assert plan.profile == "mindspeed-llm-26"
    rollback = adaptor.with_name("tft_rollback.py").read_text()
    assert "# unsafe-doctor: begin megatron.router-local-tokens-per-expert" in rollback
    result = replay(router_expert_bias_log, adaptor, [root])
    [verdict] = result.verdicts
    assert verdict.outcome == "block-proven", verdict.problems
    assert "the fix blocks alone in recv_rank_repair(), send_rank_repair() (their own code cannot run here: " in result.proved
    companion = rollback[
        rollback.index("    # unsafe-doctor: begin megatron.router-local-tokens-per-expert") : rollback.index(
            "    # unsafe-doctor: end megatron.router-local-tokens-per-expert\n"
        )
    ]
    adaptor.with_name("tft_rollback.py").write_text(
        rollback.replace(companion, "").replace("    # unsafe-doctor: end megatron.router-local-tokens-per-expert\n", "")
    )
    [verdict] = replay(router_expert_bias_log, adaptor, [root]).verdicts
    assert verdict.outcome == "failed"
    assert "dies on megatron.core.transformer.moe.router.TopKRouter.local_tokens_per_expert" in verdict.problems[0]


@pytest.mark.parametrize("ranks", [4, 8])
def test_heal_lets_the_real_mindspeed_llm_26_adaptor_survive_the_router_fault_with_no_fix_written(
    tmp_path, real, router_expert_bias_log, ranks
):
    """MindSpeed-LLM master (26.x, the model not rebuilt) as it stands: it dies on expert_bias as the
    log did; with `sentinel install --mode heal` and no fix, the repair's heal copies expert_bias
    from the replica (scenario 2, a shipped rule) and the rollback's check re-initialises
    local_tokens_per_expert (scenario 1): the first step after recovery runs. Its own repair cannot
    run here, so unsafe-doctor's blocks run alone in its functions, and the proof says so."""
    root = tmp_path / "llm"
    shutil.copytree(real / "mindspeed-llm-master", root)
    for path in root.rglob("*.py"):
        path.chmod(0o644)
    adaptor = root / "mindspeed_llm" / "core" / "high_availability" / "tft_optimizer_data_repair.py"
    [verdict] = replay(router_expert_bias_log, adaptor, [root], ranks=ranks, **{"as-is": ""}).verdicts
    assert verdict.outcome == "dies", verdict
    installed = unsafe_doctor("sentinel", "install", "--adaptor", adaptor, "--source-root", root, "--mode", "heal", "--yes")
    assert installed.returncode == 0, installed.stderr
    result = replay(router_expert_bias_log, adaptor, [root], ranks=ranks, **{"as-is": ""})
    [verdict] = result.verdicts
    assert verdict.outcome == "survives", verdict
    assert verdict.patched.endswith(f"tensor bit-identical to replica rank {(3 % ranks + ranks // 2) % ranks}")
    assert "unsafe-doctor's blocks alone in recv_rank_repair(), send_rank_repair(), rollback_callback()" in result.proved


def unsafe_doctor(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    """`unsafe-doctor ARGUMENTS` in this process (diagnose, fix, sentinel install: none runs the user's code)."""
    return run_cli(*map(str, arguments), env={"COLUMNS": "200", "NO_COLOR": "1"}, cwd=ROOT)


def test_diagnose_shows_exactly_the_blocks_fix_writes_into_the_adaptor_it_knows_as_its_diff(legacy):
    adaptor, roots = legacy
    shown = unsafe_doctor(
        "diagnose", EMA_LOG, "--source-root", roots[0], "--source-root", roots[1], "--adaptor", adaptor, "--no-input"
    ).stdout
    assert (
        unsafe_doctor(
            "fix", EMA_LOG, "--source-root", roots[0], "--source-root", roots[1], "--adaptor", adaptor, "--yes"
        ).returncode
        == 0
    )
    written = adaptor.read_text()
    blocks = [
        written[start : written.index("# unsafe-doctor: end", start)]
        for start in (index for index in range(len(written)) if written.startswith("    # unsafe-doctor: begin", index))
    ]
    assert len(blocks) == 2
    for block in blocks:  # line for line, at the function's indentation: once, in the diff
        assert "".join(f"+{line}\n" for line in block.rstrip().splitlines()) in shown
        assert shown.count(block.splitlines()[1].strip()) == 1


def test_without_an_adaptor_the_printed_block_runs_pasted_at_the_end_of_a_function_that_reads_torch(tmp_path, toytrain_loss_log):
    """The imports go to the top of the file: one inside the function would make `torch` a local of the
    whole function, and the function's own earlier use of it would fail."""
    shutil.copytree(
        ROOT / "samples" / "framework" / "toytrain", tmp_path / "toytrain", ignore=shutil.ignore_patterns("recovery.py")
    )  # no adaptor under the root to write into
    shown = unsafe_doctor("diagnose", toytrain_loss_log, "--source-root", tmp_path, "--no-input").stdout
    lines = shown.splitlines()
    top = lines.index(next(line for line in lines if line.startswith("# at the top of")))
    body = lines.index(next(line for line in lines if line.startswith("# at the end of feature_rollback()")))
    imports = lines[top + 1 : lines.index("", top)]
    block = lines[body + 1 : lines.index("", body)]
    program = "\n".join(
        [
            "import sys",
            f"sys.path.insert(0, {str(tmp_path)!r})",
            "import torch",
            *imports,
            "",
            "def feature_rollback():",
            "    before = torch.zeros(1)",
            *("    " + line for line in block),
            "",
            "from toytrain import state",
            "state.init_state('cpu')",
            "state.record_loss('loss', torch.ones(()))",
            "feature_rollback()",
            "assert state.LOSS_LOG['loss'].item() == 0.0",
            "",
        ]
    )
    checked = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr + program


def test_a_module_the_log_only_names_is_not_imported_by_a_guess(tmp_path):
    """`state._EMA_GRAD_NORM` with no source read: `state` may be `toytrain.state`; no `import state`."""
    rules = tmp_path / "rule.yaml"
    rules.write_text(RESET_BY_RULE)
    shutil.copytree(ROOT / "samples" / "framework" / "toytrain", tmp_path / "toytrain")
    adaptor = tmp_path / "toytrain" / "recovery.py"
    original = adaptor.read_bytes()
    guessed = unsafe_doctor("fix", EMA_LOG, "--adaptor", adaptor, "--rules", rules, "--yes")
    assert (
        "the log reads state._EMA_GRAD_NORM through the name state, which without the job's source is a guess" in guessed.stderr
    )
    assert adaptor.read_bytes() == original
    resolved = unsafe_doctor("fix", EMA_LOG, "--adaptor", adaptor, "--rules", rules, "--source-root", tmp_path, "--yes")
    assert resolved.returncode == 0, resolved.stderr
    assert "    from toytrain import state\n" in adaptor.read_text()


RESET_BY_RULE = """\
rules:
  - id: team.ema
    title: The EMA, reset
    match: {variable: _EMA_GRAD_NORM}
    scenario: 1
    phase: rollback
    fix:
      imports:
        - from $parent import $alias
      code: |
        setattr($holder, "$variable", None)
    reason: Written for the test.
"""
