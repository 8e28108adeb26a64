"""judge_by_source(): scenario 1 / 2 evidence read from source, on fixture trees, the toy trainer and megatron-core."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unsafe_doctor.diagnose.locate import locate
from unsafe_doctor.knowledge.heuristics import HeuristicVerdict, judge_by_source
from unsafe_doctor.knowledge.heuristics.gather import MAX_FILES
from unsafe_doctor.knowledge.subject import Subject, TensorRef
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.tracebacks import Frame, Traceback
from unsafe_doctor.source.workspace import Workspace

FIXTURES = Path(__file__).parents[1] / "fixtures" / "heuristics"
TOYTRAIN = Path(__file__).parents[2] / "samples" / "framework"


def _megatron_core() -> Path:
    """megatron-core (a test dependency) found on disk: importing it would import torch."""
    for entry in sys.path:
        if (Path(entry or ".") / "megatron" / "core" / "parallel_state.py").is_file():
            return Path(entry or ".") / "megatron" / "core"
    raise AssertionError("megatron-core is not installed: pip install -e '.[test]'")


CORE = _megatron_core()
MOE = CORE / "transformer" / "moe"
FINALIZE = CORE / "distributed" / "finalize_model_grads.py"


def line_of(path: Path, source: str, after: str | None = None) -> int:
    """Line number of `source` (stripped) in a file, the first one after the line `after` when given."""
    lines = path.read_text().splitlines()
    start = line_of(path, after) if after else 0
    for number, text in enumerate(lines[start:], start + 1):
        if text.strip() == source:
            return number
    raise AssertionError(f"{source!r} not in {path}")


def unsafe(*frames: Frame) -> Traceback:
    return Traceback(
        rank=0,
        source="train.log",
        offset=0,
        frames=frames,
        exception_type="RuntimeError",
        message="There is unsafe data in the input tensor.",
        error_code="ERR00003",
        npu_rank=None,
        device=None,
        truncated=False,
        caused_by=None,
        chain_kind=None,
    )


def located(path: Path, function: str, source: str, roots: tuple[Path, ...] = ()) -> Subject:
    """The subject locate() finds for a traceback whose innermost frame is `source` in `path`."""
    frame = Frame(str(path), line_of(path, source), function, source)
    [finding] = locate([unsafe(frame)], Workspace(roots))
    return finding.subject


def evidence_at(verdict: HeuristicVerdict) -> list[tuple[Path, int, str]]:
    """Evidence as (resolved file, line, what): paths outside a source root are shown as found."""
    return [(Path(evidence.file).resolve(), evidence.line, evidence.text) for evidence in verdict.evidence]


def shown(verdict: HeuristicVerdict) -> tuple[str, ...]:
    """Evidence as the report prints it: "file:line: what"."""
    return tuple(map(str, verdict.evidence))


# --- fixture trees: one small package per pattern ---------------------------------------------------

ACCUMULATOR = FIXTURES / "accumulator"
LOGDICT = FIXTURES / "logdict"
EMA = FIXTURES / "ema"
BUFFER = FIXTURES / "buffer"
MIXED = FIXTURES / "mixed"
NOTHING = FIXTURES / "nothing"


LOG_LINE = 'writer.add_scalar("loss", state._LOSS_SUM[0].item(), iteration)'


def test_accumulator_zeroed_every_step_is_scenario_1():
    state, train = ACCUMULATOR / "accfw" / "state.py", ACCUMULATOR / "accfw" / "train.py"
    subject = located(state, "add_loss", "_LOSS_SUM[index] += loss.detach()", (ACCUMULATOR,))
    assert subject.tensor == TensorRef("_LOSS_SUM[index]", GlobalName("accfw.state", None, "_LOSS_SUM"))
    verdict = judge_by_source(subject, Workspace((ACCUMULATOR,)))
    assert (verdict.scenario, verdict.confidence) == (1, "medium")
    assert shown(verdict) == (
        f"accfw/state.py:{line_of(state, '_LOSS_SUM.zero_()')}: reset in reset_loss_sum(): `_LOSS_SUM.zero_()`",
        f"accfw/train.py:{line_of(train, 'reset_loss_sum()')}: train() calls reset_loss_sum() every iteration",
        f"accfw/state.py:{line_of(state, '_LOSS_SUM[index] += loss.detach()')}: accumulated from detached values "
        "in add_loss(): `_LOSS_SUM[index] += loss.detach()`",
        f"accfw/train.py:{line_of(train, LOG_LINE)}: read for logging in train(): `{LOG_LINE}`",
    )
    assert verdict.reason == (
        "_LOSS_SUM looks independent of the training iterations: it is reset by reset_loss_sum(), that reset runs "
        "every iteration, it accumulates values within a step, it is read for logging."
    )


def test_logging_dict_cleared_by_the_logging_step_is_scenario_1():
    metrics = LOGDICT / "logfw" / "metrics.py"
    culprit = "_STEP_METRICS[name] = _STEP_METRICS.get(name, 0) + value.detach()"
    verdict = judge_by_source(located(metrics, "save_metric", culprit, (LOGDICT,)), Workspace((LOGDICT,)))
    assert (verdict.scenario, verdict.confidence) == (1, "medium")
    assert shown(verdict) == (
        f"logfw/metrics.py:{line_of(metrics, '_STEP_METRICS.clear()')}: reset every logging step in log_metrics(): "
        "`_STEP_METRICS.clear()`",
        f"logfw/metrics.py:{line_of(metrics, culprit)}: accumulated from detached values in save_metric(): `{culprit}`",
        f"logfw/metrics.py:{line_of(metrics, 'writer.add_scalar(name, value.item(), iteration)')}: read for logging "
        "in log_metrics(): `writer.add_scalar(name, value.item(), iteration)`",
    )


def test_moving_average_updated_from_itself_and_scaling_the_loss_is_scenario_2():
    scaling = EMA / "emafw" / "scaling.py"
    culprit = "return loss / _GRAD_NORM_EMA.clamp(min=1e-6)"
    verdict = judge_by_source(located(scaling, "scaled_loss", culprit, (EMA,)), Workspace((EMA,)))
    assert (verdict.scenario, verdict.confidence) == (2, "medium")
    update = "_GRAD_NORM_EMA = _GRAD_NORM_EMA * decay + (1 - decay) * grad_norm.detach()"
    assert shown(verdict) == (
        f"emafw/scaling.py:{line_of(scaling, update)}: updated from its own previous value in update_grad_norm_ema(): `{update}`",
        f"emafw/scaling.py:{line_of(scaling, culprit)}: read to compute the return value in scaled_loss(): `{culprit}`",
    )
    # The lazy first assignment under `if _GRAD_NORM_EMA is None:` and the progress print are no evidence.
    assert "it is updated from its own previous value, it is read to compute training values" in verdict.reason


def test_persistent_buffer_updated_in_place_is_scenario_2():
    norm = BUFFER / "buffw" / "norm.py"
    subject = located(norm, "forward", "return x - self.running_mean", (BUFFER,))
    assert subject.tensor == TensorRef("self.running_mean", GlobalName("buffw.norm", "RunningNorm", "running_mean"))
    verdict = judge_by_source(subject, Workspace((BUFFER,)))
    assert (verdict.scenario, verdict.confidence) == (2, "medium")
    update = "self.running_mean.mul_(1 - self.momentum).add_(self.momentum * x.mean(0))"
    register = 'self.register_buffer("running_mean", torch.zeros(dim))'
    assert shown(verdict) == (
        f"buffw/norm.py:{line_of(norm, update)}: updated from its own previous value in forward(): `{update}`",
        f"buffw/norm.py:{line_of(norm, register)}: registered as a persistent buffer in __init__(): `{register}`",
    )


def test_mixed_evidence_is_low_confidence_and_shows_both_sides():
    balance = MIXED / "mixfw" / "balance.py"
    subject = located(balance, "balance_loss", "share = _EXPERT_COUNTS / _EXPERT_COUNTS.sum()", (MIXED,))
    verdict = judge_by_source(subject, Workspace((MIXED,)))
    # Zeroed at the start of every step, so recomputed each step, but also turned into a loss.
    assert (verdict.scenario, verdict.confidence) == (1, "low")
    assert verdict.reason.endswith("; but it is read to compute training values: check by hand.")
    kinds = [what.split(" in ")[0] for _, _, what in evidence_at(verdict)]
    assert kinds == ["reset every iteration", "accumulated", "read to compute loss", "read to compute the return value"]


def test_nothing_found_says_what_to_check():
    table = NOTHING / "nothfw" / "table.py"
    verdict = judge_by_source(located(table, "positions", "return _POSITION_TABLE[:length]", (NOTHING,)), Workspace((NOTHING,)))
    assert verdict == HeuristicVerdict(
        None,
        None,
        "Found no reset and no carried state for _POSITION_TABLE in nothfw/table.py: check whether it depends on "
        "training iterations.",
        (),
    )


@pytest.mark.parametrize("roots", [(), (NOTHING,)], ids=["no-source-root", "unrelated-source-root"])
def test_missing_source_asks_for_a_source_root(roots):
    frame = Frame("/job/ghostfw/state.py", 12, "step", "_GHOST_BUFFER.zero_()")
    [finding] = locate([unsafe(frame)], Workspace(roots))
    assert finding.tensor.name.variable == "_GHOST_BUFFER"
    verdict = judge_by_source(finding.subject, Workspace(roots))
    assert verdict == HeuristicVerdict(
        None, None, "Could not read the source of _GHOST_BUFFER: pass --source-root pointing at the training code.", ()
    )


def test_a_tensor_the_log_does_not_name_gets_no_verdict():
    frame = Frame(
        "/job/ModelLink/megatron/core/transformer/moe/gone_utils.py",
        907,
        "clear_aux_losses_tracker",
        'tracker[name]["values"].zero_()',
    )
    [finding] = locate([unsafe(frame)], Workspace(()))
    assert finding.tensor.name.variable is None
    verdict = judge_by_source(finding.subject, Workspace(()))
    assert verdict.scenario is None and shown(verdict) == ()
    assert verdict.reason.startswith("The log does not name the global behind tracker[name]")


NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    variable=st.one_of(NAMES, st.text(max_size=12)),
    module=st.one_of(st.none(), st.lists(NAMES, min_size=1, max_size=3).map(".".join), st.text(max_size=12)),
    owner=st.one_of(st.none(), NAMES),
    culprit=st.one_of(st.none(), st.text(max_size=30)),
)
def test_judge_never_raises_on_arbitrary_names(tmp_path, variable, module, owner, culprit):
    frame = Frame(culprit, 1, "f", None) if culprit is not None else None
    subject = Subject(TensorRef(variable, GlobalName(module, owner, variable)), frame, None)
    verdict = judge_by_source(subject, Workspace((tmp_path,)))
    assert verdict.scenario in (None, 1, 2) and verdict.reason


# --- single rules, on one-module packages ----------------------------------------------------------

RULES = [
    pytest.param(
        """
        _X = torch.zeros(4)
        def train_step(batch):
            _X.fill_(0)
        """,
        1,
        ["reset every iteration in train_step()"],
        id="fill_-in-train-step",
    ),
    pytest.param(
        """
        _X = {}
        def drop(key):
            del _X[key]
        """,
        1,
        ["reset in drop()"],
        id="del-entry",
    ),
    pytest.param(
        """
        _X = torch.zeros(4)
        def restore_after_capture():
            saved = _X.clone()
            capture()
            _X.copy_(saved)
        """,
        None,
        [],
        id="restoring-a-saved-clone-is-no-update",
    ),
    pytest.param(
        """
        _X = None
        def get_x(device):
            global _X
            if _X is None:
                _X = torch.ones(4, device=device)
            _X = _X.to(torch.float32)
            return _X
        """,
        None,
        [],
        id="lazy-build-and-cast-are-no-evidence",
    ),
    pytest.param(
        """
        _X = torch.zeros(())
        def count():
            global _X
            _X += 1
        """,
        2,
        ["accumulated in count()"],
        id="counter-never-reset",
    ),
    pytest.param(
        """
        @functools.lru_cache(maxsize=8)
        def _X(seq_len, device):
            return torch.ones(seq_len, seq_len, device=device).triu(1)
        """,
        1,
        ["_X() is an lru_cache, rebuilt deterministically"],
        id="lru-cache",
    ),
    pytest.param(
        """
        _X = {}
        def mask_for(hidden):
            _X[hidden.shape] = torch.ones(hidden.shape)
        """,
        1,
        ["cache keyed by shape in mask_for()"],
        id="cache-keyed-by-shape",
    ),
    pytest.param(
        """
        _X = []
        def produce(t):
            _X.append(t)
        def consume():
            return _X.pop(0)
        """,
        1,
        ["entries appended elsewhere are consumed in consume()"],
        id="queue",
    ),
    pytest.param(
        """
        _X = None
        def get_group():
            return _X
        def step_exchange(t):
            output_grad = send_recv(t, group=get_group())
        """,
        None,
        [],
        id="a-group-handle-carries-no-data",
    ),
    pytest.param(
        """
        _X = torch.ones(())
        def apply_lr(optimizer):
            for group in optimizer.param_groups:
                group["lr"] = _X.item()
        """,
        2,
        ["read to compute lr in apply_lr()"],
        id="read-into-the-learning-rate",
    ),
]


@pytest.mark.parametrize(("code", "scenario", "expected"), RULES)
def test_single_rule(tmp_path, code, scenario, expected):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("import functools\nimport torch\n" + textwrap.dedent(code))
    subject = Subject(TensorRef("_X", GlobalName("pkg.mod", None, "_X")), None, None)
    verdict = judge_by_source(subject, Workspace((tmp_path,)))
    assert verdict.scenario == scenario
    whats = [what for _, _, what in evidence_at(verdict)]
    assert [what.split(":")[0] for what in whats] == expected


# --- where evidence is looked for ------------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(textwrap.dedent(text))


SCRATCH = Subject(TensorRef("_SCRATCH", GlobalName("scopefw.state", None, "_SCRATCH")), None, None)
RESET_IN_TRAIN_STEP = """
    from scopefw import state
    def train_step():
        state._SCRATCH.zero_()
"""


def test_only_the_package_and_source_roots_are_searched_skipping_tests_and_environments(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    _tree(
        root,
        {
            "scopefw/__init__.py": "",
            "scopefw/state.py": "import torch\n_SCRATCH = torch.zeros(16)\n",
            "tests/test_state.py": RESET_IN_TRAIN_STEP,
            ".venv/lib/python3.11/site-packages/other/train.py": RESET_IN_TRAIN_STEP,
            "venv/train.py": RESET_IN_TRAIN_STEP,
        },
    )
    _tree(elsewhere, {"train.py": RESET_IN_TRAIN_STEP})
    verdict = judge_by_source(SCRATCH, Workspace((root,)))
    assert verdict.scenario is None
    assert verdict.reason.startswith("Found no reset and no carried state for _SCRATCH in scopefw/state.py")
    verdict = judge_by_source(SCRATCH, Workspace((root, elsewhere)))
    assert verdict.scenario == 1
    assert shown(verdict) == ("train.py:4: reset every iteration in train_step(): `state._SCRATCH.zero_()`",)


def test_search_stops_after_max_files_and_says_so(tmp_path):
    _tree(
        tmp_path,
        {
            "aaa/__init__.py": "",
            "scopefw/__init__.py": "",
            "scopefw/state.py": "_SCRATCH = None\n",
            "zzz/train.py": RESET_IN_TRAIN_STEP,
        },
    )
    for index in range(MAX_FILES):
        (tmp_path / "aaa" / f"m{index:04}.py").write_text("")
    verdict = judge_by_source(SCRATCH, Workspace((tmp_path,)))
    assert verdict.scenario is None
    assert verdict.reason.endswith(f"(searched the first {MAX_FILES:,} files only).")


# --- the toy trainer in samples/framework ------------------------------------------------------------


def test_toytrain_loss_log_is_scenario_1():
    state, train = TOYTRAIN / "toytrain" / "state.py", TOYTRAIN / "toytrain" / "train.py"
    subject = located(state, "record_loss", "LOSS_LOG[name] += loss.detach()", (TOYTRAIN,))
    verdict = judge_by_source(subject, Workspace((TOYTRAIN,)))
    assert (verdict.scenario, verdict.confidence) == (1, "medium")
    assert shown(verdict)[:2] == (
        f"toytrain/state.py:{line_of(state, 'value.zero_()')}: reset in reset_loss_log(): `value.zero_()`",
        f"toytrain/train.py:{line_of(train, 'state.reset_loss_log()')}: log() calls reset_loss_log() every logging step",
    )


def test_toytrain_gradient_norm_average_is_scenario_2():
    train = TOYTRAIN / "toytrain" / "train.py"
    culprit = "max_norm = CLIP_FACTOR * state._EMA_GRAD_NORM"
    verdict = judge_by_source(located(train, "clip_gradients", culprit, (TOYTRAIN,)), Workspace((TOYTRAIN,)))
    assert (verdict.scenario, verdict.confidence) == (2, "medium")
    update = "state._EMA_GRAD_NORM.mul_(EMA_DECAY).add_(grad_norm, alpha=1 - EMA_DECAY)"
    assert shown(verdict)[0] == (
        f"toytrain/train.py:{line_of(train, update)}: updated from its own previous value in clip_gradients(): `{update}`"
    )
    assert any(
        line.startswith(f"toytrain/train.py:{line_of(train, 'grad.mul_(scale)')}: read to update grad") for line in shown(verdict)
    )


# --- megatron-core 0.16.1, as installed --------------------------------------------------------------

TRACKER_LINE = 'tracker[name]["values"][layer_number - 1] += loss.detach()  # Aggregate the loss for the layer.'


def tracker_subject() -> Subject:
    return located(MOE / "moe_utils.py", "save_to_aux_losses_tracker", TRACKER_LINE)


def expert_bias_subject() -> Subject:
    source = "self.expert_bias.data = self.expert_bias.data.to(torch.float32)"
    return located(MOE / "router.py", "_maintain_float32_expert_bias", source)


def test_megatron_moe_logging_tracker_is_scenario_1_cleared_by_clear_aux_losses_tracker():
    subject = tracker_subject()
    assert subject.tensor.name.variable == "_MOE_LAYER_WISE_LOGGING_TRACKER"
    verdict = judge_by_source(subject, Workspace(()))
    assert (verdict.scenario, verdict.confidence) == (1, "medium")
    moe_utils = (MOE / "moe_utils.py").resolve()
    zero = line_of(moe_utils, 'tracker[name]["values"].zero_()')
    call = line_of(moe_utils, "clear_aux_losses_tracker()", after="def track_moe_metrics(")
    assert evidence_at(verdict)[:3] == [
        (moe_utils, zero, 'reset in clear_aux_losses_tracker(): `tracker[name]["values"].zero_()`'),
        (moe_utils, call, "track_moe_metrics() calls clear_aux_losses_tracker() every logging step"),
        (
            moe_utils,
            line_of(moe_utils, TRACKER_LINE),
            "accumulated from detached values in save_to_aux_losses_tracker(): "
            '`tracker[name]["values"][layer_number - 1] += loss.detach()  # Aggregate the l...`',
        ),
    ]
    assert all(what.startswith("read for logging in track_moe_metrics()") for _, _, what in evidence_at(verdict)[3:])
    # cuda_graphs.py saves the tracker with torch.clone and restores it with copy_: no carried state.
    assert "check by hand" not in verdict.reason


def test_megatron_router_expert_bias_is_scenario_2_updated_by_update_router_expert_bias():
    subject = expert_bias_subject()
    assert subject.tensor.name.owner == "TopKRouter"
    verdict = judge_by_source(subject, Workspace(()))
    assert (verdict.scenario, verdict.confidence) == (2, "medium")
    router = (MOE / "router.py").resolve()
    register = line_of(router, "'expert_bias',") - 1  # self.register_buffer(\n 'expert_bias', ...
    assert evidence_at(verdict) == [
        (
            FINALIZE.resolve(),
            line_of(FINALIZE, "expert_bias.copy_(updated_expert_bias)"),
            "updated from its own previous value in _update_router_expert_bias(): `expert_bias.copy_(updated_expert_bias)`",
        ),
        (
            router,
            register,
            "registered as a persistent buffer in __init__(): `self.register_buffer( 'expert_bias', torch.zeros( "
            "self.config.num_moe_experts...`",
        ),
    ]


def test_megatron_router_token_counts_are_scenario_1_zeroed_every_step():
    source = "self.local_tokens_per_expert += routing_map.sum(dim=0)"
    verdict = judge_by_source(located(MOE / "router.py", "_apply_expert_bias", source), Workspace(()))
    assert (verdict.scenario, verdict.confidence) == (1, "medium")
    assert evidence_at(verdict)[:2] == [
        (
            FINALIZE.resolve(),
            line_of(FINALIZE, "module.local_tokens_per_expert.zero_()"),
            "reset in reset_model_temporary_tensors(): `module.local_tokens_per_expert.zero_()`",
        ),
        (
            FINALIZE.resolve(),
            line_of(FINALIZE, "reset_model_temporary_tensors(config, model)"),
            "finalize_model_grads() calls reset_model_temporary_tensors() every iteration",
        ),
    ]


def test_megatron_faq_tracker_name_is_absent_from_this_version():
    name = GlobalName("megatron.core.parallel_state", None, "_MOE_AUX_LOSSES_LOGGING_TRACKER")
    tensor = TensorRef("parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER[name]", name)
    verdict = judge_by_source(Subject(tensor, None, None), Workspace(()))
    assert verdict.scenario is None
    assert verdict.reason == (
        f"Found no reset and no carried state for _MOE_AUX_LOSSES_LOGGING_TRACKER in {CORE / 'parallel_state.py'}: "
        "check whether it depends on training iterations."
    )


@pytest.mark.parametrize("make", [tracker_subject, expert_bias_subject], ids=["tracker", "expert_bias"])
def test_judging_a_megatron_finding_gives_the_same_evidence_in_the_same_order_every_time(make):
    """Speed is measured by benchmarks/, not asserted here."""
    subject = make()
    first = judge_by_source(subject, Workspace(()))
    assert first.evidence
    assert judge_by_source(subject, Workspace(())) == first


def test_judging_imports_neither_torch_nor_megatron():
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from unsafe_doctor.knowledge.heuristics import judge_by_source
        from unsafe_doctor.source.workspace import Workspace
        from unsafe_doctor.knowledge.subject import Subject, TensorRef
        from unsafe_doctor.log.global_name import GlobalName
        for variable, module, owner in [
            ("_MOE_LAYER_WISE_LOGGING_TRACKER", "megatron.core.transformer.moe.moe_utils", None),
            ("expert_bias", "megatron.core.transformer.moe.router", "TopKRouter"),
            ("_EMA_GRAD_NORM", "toytrain.state", None),
        ]:
            tensor = TensorRef(variable, GlobalName(module, owner, variable))
            verdict = judge_by_source(Subject(tensor, None, None), Workspace((Path({str(TOYTRAIN)!r}),)))
            assert verdict.scenario in (1, 2), verdict
        loaded = [name for name in sys.modules if name.split(".")[0] in ("torch", "megatron", "toytrain")]
        assert not loaded, loaded
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
