"""locate(): culprit frame, tensor expression, resolution to a global, module names, folding."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unsafe_doctor.diagnose.locate import locate
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.subject import TensorRef
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.lines import LogLine
from unsafe_doctor.log.tracebacks import Frame, Marker, Traceback, parse_tracebacks
from unsafe_doctor.source.files import is_internal_file
from unsafe_doctor.source.workspace import Origin, Workspace, module_from_path

UNSAFE = "There is unsafe data in the input tensor."
FIXTURES = Path(__file__).parents[1] / "fixtures" / "locate"
SRC = FIXTURES / "src"
USER = SRC / "fw" / "user.py"
STATE = SRC / "fw" / "state.py"


def _megatron_core() -> Path:
    """megatron-core (a test dependency) found on disk: importing it would import torch."""
    for entry in sys.path:
        if (Path(entry or ".") / "megatron" / "core" / "parallel_state.py").is_file():
            return Path(entry or ".") / "megatron" / "core"
    raise AssertionError("megatron-core is not installed: pip install -e '.[test]'")


MOE = _megatron_core() / "transformer" / "moe"
# Where a log from another machine prints megatron-core's files: not present here.
REMOTE_SITE = "/usr/local/python3.10/lib/python3.10/site-packages/megatron/core/transformer/moe/"
FAQ_FILE = "/home/ma-user/gitee_0925/ModelLink/megatron/core/transformer/moe/moe_utils.py"
FAQ_LINE = "parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER[name][layer_number - 1] += loss.detach()"
TORCH_FRAME = Frame("/usr/local/lib/python3.10/site-packages/torch/_tensor.py", 40, "wrapped", "return f(*args, **kwargs)")


def line_of(path: Path, source: str) -> int:
    """Line number of `source` (stripped) in a real file, so tests follow the installed version."""
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if text.strip() == source:
            return number
    raise AssertionError(f"{source!r} not in {path}")


def at(path: Path | str, function: str, source: str | None, line: int | None = None) -> Frame:
    """A frame of a real file: its line found by its text unless given."""
    if line is None:
        line = line_of(Path(path), source) if Path(path).is_file() else 1
    return Frame(str(path), line, function, source)


def tb(
    *frames: Frame,
    rank: int | None = 3,
    npu_rank: int | None = None,
    message: str = UNSAFE,
    offset: int = 0,
    source: str = "train.log",
    caused_by: Traceback | None = None,
) -> Traceback:
    return Traceback(
        rank=rank,
        source=source,
        offset=offset,
        frames=frames,
        exception_type="RuntimeError",
        message=message,
        error_code="ERR00003",
        npu_rank=npu_rank,
        device=None,
        truncated=False,
        caused_by=caused_by,
        chain_kind="cause" if caused_by else None,
    )


def only(tracebacks: list[Traceback], source_roots: tuple[Path, ...] = ()):
    findings = locate(tracebacks, Workspace(source_roots))
    assert len(findings) == 1, findings
    return findings[0]


# --- internal frames and module names --------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/usr/local/lib/python3.10/site-packages/torch/nn/modules/module.py",
        "/opt/conda/lib/python3.8/site-packages/torch_npu/utils/_error_code.py",
        "/home/u/pytorch/torch/_tensor.py",
        "<frozen importlib._bootstrap>",
        "/usr/lib/python3.8/functools.py",
        "/root/.pyenv/versions/3.11.7/lib/python3.11/contextlib.py",
        "C:\\Python311\\Lib\\site-packages\\torch\\_ops.py",
    ],
)
def test_torch_and_stdlib_files_are_internal(path):
    assert is_internal_file(path)


@pytest.mark.parametrize(
    "path",
    [
        "/usr/local/python3.10/lib/python3.10/site-packages/megatron/core/parallel_state.py",
        "/usr/lib/python3/dist-packages/mindio_ttp/framework_ttp/ttp_decorator.py",
        "/home/u/ModelLink/pretrain_gpt.py",
    ],
)
def test_framework_and_user_files_are_not_internal(path):
    assert not is_internal_file(path)


@pytest.mark.parametrize(
    ("path", "module"),
    [
        ("/usr/local/python3.8/lib/python3.8/site-packages/mindio_ttp/adaptor/utils.py", "mindio_ttp.adaptor.utils"),
        ("/usr/lib/python3/dist-packages/fw/core/__init__.py", "fw.core"),
        # Not on this machine, but megatron/core/parallel_state.py is in this environment's site-packages.
        ("/home/u/ModelLink/megatron/core/parallel_state.py", "megatron.core.parallel_state"),
        # Found nowhere: the suffix from a well-known top-level package.
        ("/home/u/repo/mindspeed_llm/core/high_availability/utils.py", "mindspeed_llm.core.high_availability.utils"),
        ("/home/u/train_tools/run.py", None),
    ],
)
def test_module_from_printed_path(path, module):
    assert module_from_path(path) == module


def test_module_of_a_local_file_walks_up_init_files(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "mod.py").write_text("X = 1\n")
    assert module_from_path(str(tmp_path / "pkg" / "sub" / "mod.py")) == "pkg.sub.mod"
    assert module_from_path(str(tmp_path / "pkg" / "sub" / "__init__.py")) == "pkg.sub"


def test_module_under_an_explicit_source_root_uses_the_longest_suffix():
    assert module_from_path("/job/remote/fw/user.py", [SRC]) == "fw.user"
    assert module_from_path("/job/remote/fw/user.py") is None


def test_a_source_root_that_is_not_a_directory_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError):
        locate([tb(at(USER, "add_to_buf", "BUF[name] += x"))], Workspace([tmp_path / "missing"]))


# --- culprit frame ---------------------------------------------------------------------------------


def test_culprit_skips_torch_stdlib_and_forwarding_wrapper_frames():
    frames = (
        at("/usr/lib/python3.10/runpy.py", "_run_module_as_main", "return _run_code(code, main_globals, None,", 196),
        at(USER, "train_step", "return torch.add(_SCALE, x)"),
        at(USER, "wrapper", "return func(*args, **kwargs)"),
        at("/usr/lib/python3.10/functools.py", "wrapper", "return func(*args, **kwargs)", 20),
        TORCH_FRAME,
    )
    finding = only([tb(*frames)])
    assert finding.culprit == frames[1]
    assert finding.tensor == TensorRef("_SCALE", GlobalName("fw.user", None, "_SCALE"))
    assert finding.source_file == str(USER)


def test_culprit_without_any_tensor_operand_falls_back_to_the_innermost_framework_frame():
    frames = (at(USER, "wrapper", "return func(*args, **kwargs)"), TORCH_FRAME)
    finding = only([tb(*frames)])
    assert finding.culprit == frames[0]
    assert finding.tensor is None


def test_frame_with_unknown_source_is_a_culprit_candidate():
    inner = Frame("/job/remote/fw/kernels.py", 12, "fused_add", None)
    finding = only([tb(at(USER, "train_step", "return torch.add(_SCALE, x)"), inner, TORCH_FRAME)])
    assert finding.culprit == inner
    assert finding.tensor is None
    assert any("cannot be named" in note for note in finding.notes)


def test_no_culprit_when_every_frame_is_internal_or_there_are_no_frames():
    internal = only([tb(TORCH_FRAME)])
    assert internal.culprit is None and internal.tensor is None
    assert any("inside torch" in note for note in internal.notes)
    empty = only([tb()])
    assert empty.culprit is None and "the traceback has no frames" in empty.notes


def test_unsafe_link_is_the_chain_link_with_the_error():
    cause = tb(at(USER, "add_to_buf", "BUF[name] += x"), TORCH_FRAME)
    outer = tb(
        Frame(
            "/usr/local/python3.8/lib/python3.8/site-packages/mindio_ttp/framework_ttp/ttp_decorator.py",
            90,
            "wrapper",
            "raise RuntimeError(f'rollback failed: {e}')",
        ),
        message="rollback failed",
        caused_by=cause,
    )
    other = tb(at(USER, "add_to_buf", "BUF[name] += x"), message="CUDA out of memory")
    finding = only([other, outer])
    assert finding.traceback is outer
    assert finding.unsafe is cause
    assert finding.tensor == TensorRef("BUF[name]", GlobalName("fw.state", None, "BUF"))


# --- resolution in the synthetic tree --------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "function", "source", "tensor"),
    [
        # from fw.state import BUF
        (USER, "add_to_buf", "BUF[name] += x", TensorRef("BUF[name]", GlobalName("fw.state", None, "BUF"))),
        # `global _BUFFER` in the function
        (STATE, "accumulate", "_BUFFER += x", TensorRef("_BUFFER", GlobalName("fw.state", None, "_BUFFER"))),
        # module global beside a parameter
        (STATE, "scaled", "return x * _BUFFER", TensorRef("_BUFFER", GlobalName("fw.state", None, "_BUFFER"))),
        # attribute of an imported module
        (
            USER,
            "add_to_module_attribute",
            "state._BUFFER.add_(x)",
            TensorRef("state._BUFFER", GlobalName("fw.state", None, "_BUFFER")),
        ),
        # class attribute of an imported class
        (
            USER,
            "clear_table",
            "Holder.table[key].zero_()",
            TensorRef("Holder.table[key]", GlobalName("fw.state", "Holder", "table")),
        ),
        # singleton held by a class attribute
        (
            USER,
            "clear_prefetch",
            "SwapPrefetch.swap_prefetch.prefetch_list[i].zero_()",
            TensorRef(
                "SwapPrefetch.swap_prefetch.prefetch_list[i]", GlobalName("fw.singletons", "SwapPrefetch", "prefetch_list")
            ),
        ),
        # singleton returned by a getter
        (
            USER,
            "clear_slots",
            "get_instance().slots[0].zero_()",
            TensorRef("get_instance().slots[0]", GlobalName("fw.singletons", "Slots", "slots")),
        ),
        # local alias of a global returned by an imported function
        (USER, "through_local", "return buffer + x", TensorRef("buffer", GlobalName("fw.state", None, "_BUFFER"))),
        # self attribute: owner is the class of the method
        (USER, "update", "self.bias += x", TensorRef("self.bias", GlobalName("fw.user", "Router", "bias"))),
        # multi-line call whose first line names no tensor: the whole statement is read from the file
        (USER, "multi_line", "result = combine(", TensorRef("_SCALE", GlobalName("fw.user", None, "_SCALE"))),
    ],
)
def test_resolution_in_a_local_tree(path, function, source, tensor):
    finding = only([tb(at(path, function, source), TORCH_FRAME)])
    assert finding.tensor == tensor
    assert finding.source_file == str(path)
    assert not any("may differ" in note for note in finding.notes)  # read at the printed path


def test_local_alias_and_getter_are_explained_in_notes():
    finding = only([tb(at(USER, "through_local", "return buffer + x"))])
    assert "buffer is a local alias of _BUFFER: `buffer = get_buffer()`" in finding.notes


def test_constant_module_flags_are_not_tensors(tmp_path):
    code = "HAVE_FUSED = True\n_TABLE = {}\n\n\ndef f(x):\n    if HAVE_FUSED and _TABLE[x].any():\n        pass\n"
    (tmp_path / "flags.py").write_text(code)
    finding = only([tb(at(tmp_path / "flags.py", "f", "if HAVE_FUSED and _TABLE[x].any():"))])
    assert finding.tensor == TensorRef("_TABLE[x]", GlobalName("flags", None, "_TABLE"))


def test_parameter_is_followed_to_the_caller_argument():
    frames = (at(USER, "route", "return topk(logits, bias=self.bias)"), at(USER, "topk", "return logits + bias"))
    finding = only([tb(*frames)])
    assert finding.culprit == frames[1]
    assert finding.tensor == TensorRef("self.bias", GlobalName("fw.user", "Router", "bias"))
    assert any("got the tensor as a parameter: followed to" in note for note in finding.notes)


def test_parameter_without_a_framework_caller_stays_unresolved():
    finding = only([tb(TORCH_FRAME, at(USER, "topk", "return logits + bias"))])
    assert finding.tensor == TensorRef("logits", GlobalName("fw.user", None, None))
    assert any("its caller could not be followed" in note for note in finding.notes)


def test_explicit_source_root_finds_a_file_printed_with_a_remote_path():
    remote = Frame("/job/remote/fw/user.py", line_of(USER, "BUF[name] += x"), "add_to_buf", "BUF[name] += x")
    finding = only([tb(remote)], (SRC,))
    assert finding.tensor == TensorRef("BUF[name]", GlobalName("fw.state", None, "BUF"))
    assert finding.source_file == str(USER)
    assert finding.origin is Origin.JOB


def test_printed_source_found_at_another_line_uses_that_line():
    moved = Frame(str(USER), 3, "update", "self.bias += x")
    finding = only([tb(moved)])
    assert finding.tensor == TensorRef("self.bias", GlobalName("fw.user", "Router", "bias"))
    assert finding.source_differs and finding.origin is Origin.JOB


def test_source_line_missing_from_the_log_is_read_from_the_file():
    bare = Frame(str(USER), line_of(USER, "BUF[name] += x"), "add_to_buf", None)
    finding = only([tb(bare)])
    assert finding.culprit == Frame(bare.file, bare.line, "add_to_buf", "BUF[name] += x")
    assert finding.tensor == TensorRef("BUF[name]", GlobalName("fw.state", None, "BUF"))
    assert finding.origin is Origin.JOB


# --- a statement's own bindings, calls of global callables, lru caches ----------------------------


def write_package(root: Path, files: dict[str, str]) -> None:
    """A package `pkg` under `root` from dedented sources."""
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    for name, code in files.items():
        (root / "pkg" / name).write_text(textwrap.dedent(code))


def test_a_statement_reads_the_binding_made_before_it_not_its_own(tmp_path):
    """`buf = buf + x`: the `buf` read is the one bound earlier (a global's alias), not this line's result."""
    write_package(
        tmp_path,
        {
            "step.py": """\
        _BUF = None


        def accumulate(x):
            buf = _BUF
            buf = buf + x
            return buf
        """
        },
    )
    path = tmp_path / "pkg" / "step.py"
    finding = only([tb(at(path, "accumulate", "buf = buf + x"))], (tmp_path,))
    assert finding.tensor == TensorRef("buf", GlobalName("pkg.step", None, "_BUF"))


def test_calling_a_callable_a_global_holds_is_not_that_global(tmp_path):
    """`return _fused_op(t)` under `global _fused_op` returns the op's result, not `_fused_op`."""
    write_package(
        tmp_path,
        {
            "step.py": """\
        _fused_op = None
        _SCALE = torch.ones(1)


        def apply(t):
            global _fused_op
            return _fused_op(t)


        def step(x):
            out = apply(x)
            return out * _SCALE
        """
        },
    )
    path = tmp_path / "pkg" / "step.py"
    finding = only([tb(at(path, "step", "return out * _SCALE"))], (tmp_path,))
    assert finding.tensor == TensorRef("_SCALE", GlobalName("pkg.step", None, "_SCALE"))


# --- comprehensions: a loop variable stands for an element of its iterable ------------------------


def frames_in(path: Path, *calls: tuple[str, str]) -> tuple[Frame, ...]:
    """Frames of `path`, outermost first, each a (function, printed source line)."""
    return tuple(at(path, function, source) for function, source in calls)


def test_a_genexpr_frame_reads_its_element_from_a_module_global(tmp_path):
    """In the `<genexpr>` frame only the generator runs: `t[0]` is an element of `_LOSSES`, not
    `_BIAS`, which the enclosing line reads before the generator starts."""
    write_package(
        tmp_path,
        {
            "step.py": """\
        _BIAS = None
        _LOSSES = []


        def total():
            return _BIAS + sum(t[0] for t in _LOSSES)
        """
        },
    )
    line = "return _BIAS + sum(t[0] for t in _LOSSES)"
    frames = frames_in(tmp_path / "pkg" / "step.py", ("total", line), ("<genexpr>", line))
    finding = only([tb(*frames)], (tmp_path,))
    assert finding.culprit == frames[0]  # the function the generator runs in, as a rule names it
    assert finding.tensor == TensorRef("_LOSSES", GlobalName("pkg.step", None, "_LOSSES"))
    assert "t is an element of _LOSSES" in finding.notes


def test_a_listcomp_over_a_parameter_is_followed_past_its_function_to_the_caller(tmp_path):
    """`<listcomp>` is called by `scaled` at the same line: the parameter `losses` is followed to
    the caller of `scaled`, not looked up in `scaled`'s own line."""
    write_package(
        tmp_path,
        {
            "step.py": """\
        _LOSSES = []


        def scaled(losses):
            return [t * 2 for t in losses]


        def step():
            return scaled(_LOSSES)
        """
        },
    )
    comprehension = "return [t * 2 for t in losses]"
    path = tmp_path / "pkg" / "step.py"
    frames = frames_in(path, ("step", "return scaled(_LOSSES)"), ("scaled", comprehension), ("<listcomp>", comprehension))
    finding = only([tb(*frames)], (tmp_path,))
    assert finding.culprit == frames[1]
    assert finding.tensor == TensorRef("_LOSSES", GlobalName("pkg.step", None, "_LOSSES"))
    assert any(
        note.startswith("scaled() got the tensor as a parameter: followed to") and note.endswith(":9 (step)")
        for note in finding.notes
    )


def test_a_dictcomp_tuple_target_over_a_getters_items_is_the_global_the_getter_returns(tmp_path):
    """`for k, v in get_stats().items()`: `v` is a value of the dict `get_stats()` returns, `_STATS`;
    `_TOTAL`, read by the enclosing line, is not what the `<dictcomp>` frame reads."""
    write_package(
        tmp_path,
        {
            "step.py": """\
        _TOTAL = None
        _STATS = {}


        def get_stats():
            return _STATS


        def summary():
            return _TOTAL, {k: v.item() for k, v in get_stats().items()}
        """
        },
    )
    line = "return _TOTAL, {k: v.item() for k, v in get_stats().items()}"
    frames = frames_in(tmp_path / "pkg" / "step.py", ("summary", line), ("<dictcomp>", line))
    finding = only([tb(*frames)], (tmp_path,))
    assert finding.tensor == TensorRef("get_stats()", GlobalName("pkg.step", None, "_STATS"))


@pytest.mark.parametrize(
    "comprehension_frame",
    [
        True,  # Python < 3.12 runs the comprehension in its own frame
        False,  # from 3.12 a list comprehension runs inline, in the function's frame
    ],
)
def test_a_loop_variable_that_shadows_a_global_is_the_iterables_element_not_the_global(tmp_path, comprehension_frame):
    write_package(
        tmp_path,
        {
            "step.py": """\
        grad = None
        _GRADS = []


        def norms(grads):
            return [grad.norm() for grad in grads]


        def step():
            return norms(_GRADS)
        """
        },
    )
    line = "return [grad.norm() for grad in grads]"
    calls = [("step", "return norms(_GRADS)"), ("norms", line), *([("<listcomp>", line)] if comprehension_frame else [])]
    finding = only([tb(*frames_in(tmp_path / "pkg" / "step.py", *calls))], (tmp_path,))
    assert finding.tensor == TensorRef("_GRADS", GlobalName("pkg.step", None, "_GRADS"))


def test_a_local_built_by_a_comprehension_is_followed_through_its_iterable(tmp_path):
    """MindSpeed-LLM's log repair: `t` is an element of a local list of elements of a parameter."""
    write_package(
        tmp_path,
        {
            "repair.py": """\
        class LogArgs:
            losses_reduced_ = None


        def average(losses_reduced):
            for key in losses_reduced[0]:
                for_key = [x[key] for x in losses_reduced]
                total = sum(t[0] for t in for_key)
            return total


        def repair():
            return average(LogArgs.losses_reduced_)
        """
        },
    )
    line = "total = sum(t[0] for t in for_key)"
    calls = [("repair", "return average(LogArgs.losses_reduced_)"), ("average", line), ("<genexpr>", line)]
    finding = only([tb(*frames_in(tmp_path / "pkg" / "repair.py", *calls))], (tmp_path,))
    assert finding.tensor == TensorRef("LogArgs.losses_reduced_", GlobalName("pkg.repair", "LogArgs", "losses_reduced_"))


MASKCACHE = Path(__file__).parents[1] / "corpus" / "frameworks" / "maskcache"
MASKED_FILL = 'scores = scores.masked_fill(causal_mask(scores.shape[-1], scores.device), float("-inf"))'


def test_an_lru_cached_call_passed_inline_is_chosen_over_a_fresh_local():
    """maskcache: `scores` is computed two lines above; the mask comes from an lru_cache."""
    frame = at(MASKCACHE / "maskcache" / "train.py", "forward", MASKED_FILL)
    finding = only([tb(frame, TORCH_FRAME)], (MASKCACHE,))
    assert finding.tensor == TensorRef(
        "causal_mask(scores.shape[-1], scores.device)", GlobalName("maskcache.masks", None, "causal_mask"), cached=True
    )
    assert "causal_mask() is an lru_cache: it returns what earlier steps built" in finding.notes


MAKE_MASK = GlobalName("pkg.mask", None, "make_mask")


@pytest.mark.parametrize(
    ("imports", "decorator", "tensor"),
    [
        (
            "import functools",
            "@functools.lru_cache(maxsize=None)",
            TensorRef("make_mask(n)", MAKE_MASK, cached=True),
        ),
        ("from functools import lru_cache", "@lru_cache", TensorRef("make_mask(n)", MAKE_MASK, cached=True)),
        ("import functools", "@functools.cache", TensorRef("make_mask(n)", MAKE_MASK, cached=True)),
        # not cached: a fresh value, not an operand; the tensor is the parameter
        ("import functools", "", TensorRef("x", GlobalName("pkg.mask", None, None))),
    ],
)
def test_a_call_result_counts_only_when_the_function_is_an_lru_cache(tmp_path, imports, decorator, tensor):
    write_package(
        tmp_path,
        {
            "mask.py": f"""\
        {imports}
        import torch


        {decorator}
        def make_mask(n):
            return torch.ones(n, n, dtype=torch.bool).triu(1)


        def masked(x, n):
            return x.masked_fill(make_mask(n), 0.0)
        """
        },
    )
    path = tmp_path / "pkg" / "mask.py"
    finding = only([tb(at(path, "masked", "return x.masked_fill(make_mask(n), 0.0)"))], (tmp_path,))
    assert finding.tensor == tensor


ROPE = """\
    from functools import lru_cache

    import torch


    class Rope(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.inv_freq = torch.ones(dim // 2)

        @lru_cache(maxsize=32)
        def forward(self, seq):
            return torch.outer(torch.arange(seq), self.inv_freq)
    """
APPLY = """\
    import torch


    def apply_rope(t, freqs, scale=1.0):
        return _rotate(t, freqs, scale=scale)


    def _rotate(t, freqs, scale):
        cos = (torch.cos(freqs) * scale).to(t.dtype)
        return t * cos
    """


@pytest.mark.parametrize(
    ("module_import", "init", "apply", "expression"),
    [
        # the class imported inside __init__, the embedding held in a local first
        (
            "",
            ["from pkg.rope import Rope", "self.rope = Rope(8)"],
            ["freqs = self.rope(hidden.shape[0])", "query = apply_rope(query, freqs)"],
            "freqs",
        ),
        # the class named through its module
        (
            "from pkg import rope",
            ["self.rope = rope.Rope(8)"],
            ["freqs = self.rope(hidden.shape[0])", "query = apply_rope(query, freqs)"],
            "freqs",
        ),
        # the embedding passed inline
        (
            "",
            ["from pkg.rope import Rope", "self.rope = Rope(8)"],
            ["query = apply_rope(query, self.rope(hidden.shape[0]))"],
            "self.rope(hidden.shape[0])",
        ),
    ],
)
def test_parameter_followed_to_a_submodule_whose_forward_is_an_lru_cache(tmp_path, module_import, init, apply, expression):
    """As Megatron's attention applies RotaryEmbedding's cached output: the caret's `freqs`, not `t`,
    is followed by position into the callers, to `self.rope(...)`, a Rope whose forward is cached."""
    body = "\n".join(f"        {line}" for line in init)
    step = "\n".join(f"        {line}" for line in apply)
    attention = (
        f"import torch\n{module_import}\nfrom pkg.apply import apply_rope\n\n\n"
        "class Attention(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.query = torch.nn.Linear(8, 8)\n"
        f"{body}\n\n"
        "    def forward(self, hidden):\n"
        "        query = self.query(hidden)\n"
        f"{step}\n"
        "        return query\n"
    )
    write_package(tmp_path, {"rope.py": ROPE, "apply.py": APPLY, "attention.py": attention})
    pkg = tmp_path / "pkg"
    frames = (
        at(pkg / "attention.py", "forward", apply[-1]),
        at(pkg / "apply.py", "apply_rope", "return _rotate(t, freqs, scale=scale)"),
        at(pkg / "apply.py", "_rotate", "cos = (torch.cos(freqs) * scale).to(t.dtype)"),
        TORCH_FRAME,
    )
    finding = only([tb(*frames)], (tmp_path,))
    assert finding.culprit == frames[2]
    assert finding.tensor == TensorRef(expression, GlobalName("pkg.rope", "Rope", "forward"), cached=True)
    assert "self.rope is a Rope, whose forward() is an lru_cache: it returns what earlier steps built" in finding.notes


# --- without the file ------------------------------------------------------------------------------

REMOTE_TRAIN = "/job/remote/train.py"


@pytest.mark.parametrize(
    ("source", "tensor"),
    [
        ("_X[name].zero_()", TensorRef("_X[name]", GlobalName(None, None, "_X"))),
        ("return torch.add(_BUF, x)", TensorRef("_BUF", GlobalName(None, None, "_BUF"))),
        ("if _FLAGS.sum() > 0:", TensorRef("_FLAGS", GlobalName(None, None, "_FLAGS"))),
        ("elif _FLAGS.any():", TensorRef("_FLAGS", GlobalName(None, None, "_FLAGS"))),
        ("for value in _BUFFERS:", TensorRef("_BUFFERS", GlobalName(None, None, "_BUFFERS"))),
        ("with torch.no_grad(), guard(_LOCK):", TensorRef("_LOCK", GlobalName(None, None, "_LOCK"))),
        ("out = fuse(_BUF,  # first part", TensorRef("_BUF", GlobalName(None, None, "_BUF"))),
        ("bias=_EXPERT_BIAS,", TensorRef("_EXPERT_BIAS", GlobalName(None, None, "_EXPERT_BIAS"))),
        (
            "SwapPrefetch.swap_prefetch.swap_tensors[0].zero_()",
            TensorRef("SwapPrefetch.swap_prefetch.swap_tensors[0]", GlobalName(None, "SwapPrefetch", "swap_tensors")),
        ),
        ('tracker[name]["values"].zero_()', TensorRef("tracker[name]", GlobalName(None, None, None))),
        ("mod.obj.field.add_(x)", TensorRef("mod.obj.field", GlobalName(None, None, None))),
        (
            "self.expert_bias.data = self.expert_bias.data.to(torch.float32)",
            TensorRef("self.expert_bias", GlobalName(None, None, "expert_bias")),
        ),
    ],
)
def test_expression_from_the_printed_line_alone(source, tensor):
    finding = only([tb(Frame(REMOTE_TRAIN, 10, "step", source), TORCH_FRAME)])
    assert finding.tensor == tensor
    assert finding.source_file is None
    assert finding.origin is Origin.LOG


def test_multi_line_first_line_without_tensor_defers_to_the_caller_when_the_file_is_missing():
    outer = Frame(REMOTE_TRAIN, 5, "main", "out = multi_line(_INPUT)")
    inner = Frame(REMOTE_TRAIN, 20, "multi_line", "result = combine(")
    assert only([tb(outer, inner)]).culprit == outer
    alone = only([tb(inner)])
    assert alone.culprit == inner and alone.tensor is None


REMOTE_FW_UTILS = "/remote/lib/python3.8/site-packages/fw/core/moe/utils.py"


def test_missing_file_module_attribute_found_next_to_the_frame_under_a_source_root():
    frame = Frame(REMOTE_FW_UTILS, 9, "save", "parallel_state._TRACKER[name] += loss")
    finding = only([tb(frame)], (FIXTURES / "partial",))
    assert finding.tensor == TensorRef("parallel_state._TRACKER[name]", GlobalName("fw.core.parallel_state", None, "_TRACKER"))
    assert any("taken as fw.core.parallel_state" in note for note in finding.notes)


def test_missing_file_module_attribute_not_found_anywhere_keeps_the_alias_as_module():
    frame = Frame(REMOTE_FW_UTILS, 9, "save", "parallel_state._TRACKER[name] += loss")
    finding = only([tb(frame)])
    assert finding.tensor == TensorRef("parallel_state._TRACKER[name]", GlobalName("parallel_state", None, "_TRACKER"))
    assert any("was not found near fw.core.moe.utils" in note for note in finding.notes)


def test_file_missing_everywhere_is_best_effort():
    frame = Frame("/job/remote/fw/user.py", 15, "add_to_buf", "BUF[name] += x")
    finding = only([tb(frame)])
    assert finding.culprit == frame
    assert finding.tensor == TensorRef("BUF[name]", GlobalName(None, None, "BUF"))
    assert finding.origin is Origin.LOG and finding.source_file is None


def test_unparseable_printed_line_gives_a_culprit_without_tensor():
    frame = Frame("/job/remote/fw/user.py", 15, "step", "x = = y")
    finding = only([tb(frame)])
    assert finding.culprit == frame and finding.tensor is None


# --- megatron-core 0.16.1, read from this environment ----------------------------------------------

TRACKER_LINE = 'tracker[name]["values"][layer_number - 1] += loss.detach()  # Aggregate the loss for the layer.'


def test_megatron_tracker_alias_resolves_to_the_module_global():
    line = line_of(MOE / "moe_utils.py", TRACKER_LINE)
    frame = Frame(REMOTE_SITE + "moe_utils.py", line, "save_to_aux_losses_tracker", TRACKER_LINE)
    finding = only([tb(frame, TORCH_FRAME)])
    assert finding.tensor == TensorRef(
        "tracker[name]", GlobalName("megatron.core.transformer.moe.moe_utils", None, "_MOE_LAYER_WISE_LOGGING_TRACKER")
    )
    assert finding.origin is Origin.INDEX  # the shipped index comes before a local installation
    assert finding.source_file == "<megatron-core 0.16.1>/megatron/core/transformer/moe/moe_utils.py"
    assert finding.release == "megatron-core 0.16.0–0.16.1, from 1 frame"
    assert any(note.startswith("tracker is a local alias of _MOE_LAYER_WISE_LOGGING_TRACKER") for note in finding.notes)


def test_megatron_tracker_clear_without_source_leaves_the_variable_unknown():
    frame = Frame(
        "/job/ModelLink/megatron/core/transformer/moe/gone_utils.py",
        907,
        "clear_aux_losses_tracker",
        'tracker[name]["values"].zero_()',
    )
    finding = only([tb(frame)])
    assert finding.tensor == TensorRef("tracker[name]", GlobalName("megatron.core.transformer.moe.gone_utils", None, None))


def test_faq_line_on_an_old_tree_names_the_old_tracker_in_parallel_state():
    frames = (
        Frame(
            "/home/ma-user/gitee_0925/ModelLink/modellink/core/transformer/moe/router.py",
            93,
            "apply_z_loss",
            'save_to_aux_losses_tracker("z_loss", z_loss / moe_z_loss_coeff, self.layer_number, self.config.num_layers)',
        ),
        Frame(FAQ_FILE, 172, "save_to_aux_losses_tracker", FAQ_LINE),
        TORCH_FRAME,
    )
    finding = only([tb(*frames)])
    assert finding.culprit == frames[1]
    assert finding.tensor == TensorRef(
        "parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER[name]",
        GlobalName("megatron.core.parallel_state", None, "_MOE_AUX_LOSSES_LOGGING_TRACKER"),
    )
    assert finding.origin is Origin.INDEX and finding.release is not None
    assert finding.release.startswith("megatron-core 0.6.0")  # not the 0.16.1 installed here


def test_faq_line_with_no_local_file_finds_parallel_state_in_the_environment():
    frame = Frame(
        "/home/ma-user/ModelLink/megatron/core/transformer/moe/old_moe_utils.py", 172, "save_to_aux_losses_tracker", FAQ_LINE
    )
    finding = only([tb(frame)])
    assert finding.tensor == TensorRef(
        "parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER[name]",
        GlobalName("megatron.core.parallel_state", None, "_MOE_AUX_LOSSES_LOGGING_TRACKER"),
    )


EXPERT_BIAS = TensorRef("self.expert_bias", GlobalName("megatron.core.transformer.moe.router", "TopKRouter", "expert_bias"))


def test_megatron_router_expert_bias_is_an_attribute_of_topkrouter():
    source = "self.expert_bias.data = self.expert_bias.data.to(torch.float32)"
    frame = Frame(REMOTE_SITE + "router.py", line_of(MOE / "router.py", source), "_maintain_float32_expert_bias", source)
    finding = only([tb(frame, TORCH_FRAME)])
    assert finding.tensor == EXPERT_BIAS


def test_megatron_expert_bias_parameter_is_followed_into_the_router():
    call = "probs, routing_map = topk_routing_with_score_function("
    frames = (
        Frame(REMOTE_SITE + "router.py", line_of(MOE / "router.py", call), "routing", call),
        Frame(
            REMOTE_SITE + "moe_utils.py",
            line_of(MOE / "moe_utils.py", "scores_for_routing = scores + expert_bias"),
            "topk_routing_with_score_function",
            "scores_for_routing = scores + expert_bias",
        ),
        TORCH_FRAME,
    )
    finding = only([tb(*frames)])
    assert finding.culprit == frames[1]
    assert finding.tensor == EXPERT_BIAS


def test_locating_megatron_cases_imports_neither_torch_nor_megatron():
    tracker_line = line_of(MOE / "moe_utils.py", TRACKER_LINE)
    bias_source = "self.expert_bias.data = self.expert_bias.data.to(torch.float32)"
    bias_line = line_of(MOE / "router.py", bias_source)
    script = textwrap.dedent(
        f"""
        import json, sys
        from unsafe_doctor.diagnose.locate import locate
        from unsafe_doctor.source.workspace import Workspace
        from unsafe_doctor.log.tracebacks import Frame, Traceback
        frames = [
            Frame({REMOTE_SITE + "moe_utils.py"!r}, {tracker_line}, "save_to_aux_losses_tracker", {TRACKER_LINE!r}),
            Frame({FAQ_FILE!r}, 172, "save_to_aux_losses_tracker", {FAQ_LINE!r}),
            Frame({REMOTE_SITE + "router.py"!r}, {bias_line}, "_maintain_float32_expert_bias", {bias_source!r}),
        ]
        tracebacks = [Traceback(3, "log", i, (frame,), "RuntimeError", {UNSAFE!r}, None, None, None, False, None, None)
                      for i, frame in enumerate(frames)]
        findings = locate(tracebacks, Workspace(()))
        print(json.dumps({{"variables": [f.tensor.name.variable for f in findings],
                          "imported": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))}}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    assert result["variables"] == ["_MOE_LAYER_WISE_LOGGING_TRACKER", "_MOE_AUX_LOSSES_LOGGING_TRACKER", "expert_bias"]
    assert result["imported"] == []


def test_importing_locate_does_not_import_torch():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, unsafe_doctor.diagnose.locate; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "False"


# --- folding ---------------------------------------------------------------------------------------


def test_identical_findings_on_several_ranks_fold_into_one():
    frame = at(USER, "add_to_buf", "BUF[name] += x")
    first = tb(frame, rank=5, offset=100, source="rank_5.log")
    tracebacks = [first, tb(frame, rank=1, source="rank_1.log"), tb(frame, rank=5, offset=900, source="rank_5.log")]
    finding = only(tracebacks)
    assert finding.ranks == (1, 5)
    assert finding.traceback is first


def test_rank_falls_back_to_torch_npu_rank_id_and_ignores_minus_one():
    frame = at(USER, "add_to_buf", "BUF[name] += x")
    finding = only([tb(frame, rank=None, npu_rank=7), tb(frame, rank=None, npu_rank=-1), tb(frame, rank=None)])
    assert finding.ranks == (7,)


def test_different_tensors_or_lines_stay_separate_in_first_occurrence_order():
    buf = at(USER, "add_to_buf", "BUF[name] += x")
    bias = at(USER, "update", "self.bias += x")
    findings = locate([tb(bias, rank=2), tb(buf, rank=0), tb(bias, rank=1), tb(buf, rank=4)], Workspace(()))
    assert [finding.tensor.name.variable for finding in findings] == ["bias", "BUF"]
    assert [finding.ranks for finding in findings] == [(1, 2), (0, 4)]


def test_tracebacks_without_the_unsafe_error_give_no_finding():
    assert locate([tb(at(USER, "add_to_buf", "BUF[name] += x"), message="CUDA out of memory")], Workspace(())) == []


# --- robustness ------------------------------------------------------------------------------------

frames_strategy = st.lists(
    st.builds(
        Frame,
        file=st.one_of(st.sampled_from([str(USER), str(STATE), REMOTE_SITE + "moe_utils.py", FAQ_FILE]), st.text()),
        line=st.one_of(st.none(), st.integers(min_value=-5, max_value=2000)),
        function=st.text(max_size=20),
        source=st.one_of(st.none(), st.text(max_size=80), st.sampled_from([FAQ_LINE, TRACKER_LINE, "if x:", "f(a,"])),
        marker=st.one_of(
            st.none(),
            st.builds(Marker, st.integers(-3, 90), st.integers(-3, 90), st.tuples(st.integers(-3, 90), st.integers(-3, 90))),
        ),
    ),
    max_size=4,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=frames_strategy)
def test_locate_never_raises_on_arbitrary_frames(frames):
    findings = locate([tb(*frames)], Workspace(()))
    assert len(findings) == 1
    assert findings[0].culprit is None or findings[0].culprit.file in {frame.file for frame in frames}


def test_the_source_of_a_copy_is_the_tensor_read_not_its_destination():
    """torch_npu checks only copy_'s source; the destination is written and marked safe."""
    frame = Frame(
        "/opt/acme/swap.py", 12, "swap_out", "self.tensor_cpu.storage().copy_(self.tensor.storage(), non_blocking=True)"
    )
    traceback = Traceback(
        rank=0, source="x.log", offset=0, frames=(frame,), exception_type="RuntimeError",
        message="There is unsafe data in the input tensor.", error_code=None, npu_rank=None, device=None,
        truncated=False, caused_by=None, chain_kind=None,
    )  # fmt: skip
    [finding] = locate([traceback], Workspace(()))
    assert finding.tensor.name.variable == "tensor"


# --- Python 3.11+ position markers: the operand the marked part reads ------------------------------

needs_py311 = pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.11+ prints position markers")

# A device tensor as torch_npu sees it: reading an unsafe one raises from C++, so the traceback
# ends at the user's line (the hook cuts this module's frames, as the corpus' torch_npu stand-in does).
NPU_MODULE = f'''\
import sys


class Tensor:
    def __init__(self, unsafe=False):
        self.unsafe = unsafe

    def _read(self, *others):
        if self.unsafe or any(getattr(other, "unsafe", False) for other in others):
            raise RuntimeError("{UNSAFE}")
        return Tensor()

    def __add__(self, other):
        return self._read(other)

    __mul__ = __radd__ = __rmul__ = __add__

    def sum(self):
        return self._read()

    def mul_(self, other):
        return self._read(other)


def _hook(kind, error, tb):
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    kept = [entry for entry in entries if entry.tb_frame.f_code.co_filename != __file__]
    for entry, after in zip(kept, kept[1:] + [None]):
        entry.tb_next = after
    sys.__excepthook__(kind, error, kept[0] if kept else None)


sys.excepthook = _hook
'''

MARKED_STEP = """\
import sys

from pkg.npu import Tensor

_OFFSETS = Tensor()
_EMA = Tensor(unsafe=True)
_NAMES = {"loss": "lm loss"}
_STATS = {"loss": Tensor(unsafe=True)}


def get_stats():
    return _STATS


def binary(x):
    return _OFFSETS + x * _EMA


def calls(x):
    return _OFFSETS.sum() + _EMA.sum() + x.sum()


def with_lambda(x):
    norm = lambda name: _NAMES[name] + _STATS[name].sum()  # noqa: E731
    return norm("loss")


def summary():
    return {_NAMES[k]: v.sum() for k, v in get_stats().items()}


def whole_line(x):
    _EMA.mul_(x)


if __name__ == "__main__":
    case = getattr(sys.modules[__name__], sys.argv[1])
    case(Tensor()) if sys.argv[1] != "summary" else case()
"""


def run_marked(root: Path, case: str) -> str:
    """The traceback a real Python prints for one function of MARKED_STEP, as the log shows it."""
    if not (root / "pkg").is_dir():
        write_package(root, {"npu.py": NPU_MODULE, "step.py": MARKED_STEP})
    done = subprocess.run([sys.executable, "-m", "pkg.step", case], cwd=root, capture_output=True, text=True, check=False)
    assert UNSAFE in done.stderr, done.stderr
    return done.stderr


def parsed(text: str) -> list[Traceback]:
    return parse_tracebacks([LogLine(0, line, "train.log", 0) for line in text.splitlines()])


def located(text: str, source_roots: tuple[Path, ...] = ()):
    return only(parsed(text), source_roots)


@needs_py311
@pytest.mark.parametrize(
    ("case", "marked", "expression", "variable"),
    [
        # `_OFFSETS + x * _EMA`: the markers are under the right operand, not the global on the left
        ("binary", ("x * _EMA", "*"), "_EMA", "_EMA"),
        # `_OFFSETS.sum() + _EMA.sum() + x.sum()`: the second of three calls raised
        ("calls", ("_EMA.sum()", "_EMA.sum()"), "_EMA", "_EMA"),
        # in the `<lambda>` frame: not `_NAMES[name]`, nor the lambda's parameter `name`
        ("with_lambda", ("_STATS[name].sum()", "_STATS[name].sum()"), "_STATS[name]", "_STATS"),
        # in the `<dictcomp>` frame: `v` is a value of `get_stats().items()`; the key `_NAMES[k]` did not raise
        ("summary", ("v.sum()", "v.sum()"), "get_stats()", "_STATS"),
    ],
)
def test_position_markers_choose_the_operand_that_raised(tmp_path, case, marked, expression, variable):
    text = run_marked(tmp_path, case)
    [traceback] = parsed(text)
    innermost = traceback.frames[-1]
    start, end = innermost.marker.primary
    assert (innermost.source[innermost.marker.start : innermost.marker.end], innermost.source[start:end]) == marked
    finding = located(text, (tmp_path,))
    tensor = finding.tensor
    assert (tensor.expression, tensor.name.variable, tensor.name.module) == (expression, variable, "pkg.step")


@needs_py311
def test_position_markers_are_read_on_the_printed_line_when_the_file_is_not_here(tmp_path):
    """The job's file is elsewhere: the markers are placed on the printed line, parsed alone."""
    text = run_marked(tmp_path, "binary").replace(str(tmp_path / "pkg"), "/remote/job/pkg")
    finding = located(text)
    assert finding.culprit.file == "/remote/job/pkg/step.py"
    assert (finding.tensor.expression, finding.tensor.name.variable) == ("_EMA", "_EMA")


@needs_py311
def test_a_line_without_markers_falls_back_to_every_operand(tmp_path):
    """`_EMA.mul_(x)` is the whole line: Python prints no markers, and the best-tiered operand wins."""
    text = run_marked(tmp_path, "whole_line")
    assert "^" not in text.split("_EMA.mul_(x)")[1].splitlines()[1]
    finding = located(text, (tmp_path,))
    assert (finding.tensor.expression, finding.tensor.name.variable) == ("_EMA", "_EMA")


@needs_py311
def test_markers_that_fit_no_expression_are_ignored(tmp_path):
    """Markers moved one column (a mangled log) mark no expression of the line: every operand counts."""
    text = run_marked(tmp_path, "binary")
    assert "\n                      ~~^~~~~~\n" in text
    text = text.replace("\n                      ~~^~~~~~\n", "\n                     ~~^~~~~~\n")
    finding = located(text, (tmp_path,))
    assert finding.tensor.name.variable == "_OFFSETS"  # the leftmost global, as without markers
