"""Which operand of the culprit line was really the unsafe one. The logs of
tests/fixtures/operands/ have frames that are real lines of megatron-core 0.12.1 / 0.15.0, MindSpeed
26.0.0 and MindSpeed-LLM master (cases.yaml names each; make.py rendered them with Python 3.10,
3.12 and 3.13's own traceback modules): several tensor operands, a parameter a wrapper filled,
a local bound on two branches, a call spread over lines, and scenarios the printed line decides.
Each is diagnosed from the log alone (the shipped index only) and with the job's source."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
HERE = ROOT / "tests" / "fixtures" / "operands"
CASES = {case["name"]: case for case in yaml.safe_load((HERE / "cases.yaml").read_text())["cases"]}
RENDERINGS = ("py310", "py312", "py313")
REAL = ROOT.parent / "shared" / "real"


def diagnose(log: Path, *options: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", "diagnose", str(log), "--format", "json", *options],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode in (0, 1), run.stderr
    [finding] = json.loads(run.stdout)["findings"]
    return finding


def reported(finding: dict) -> dict:
    return {
        "variable": finding["tensor"]["variable"],
        "module": finding["tensor"]["module"],
        "scenario": finding["scenario"],
        "rule": finding["rule"],
    }


@pytest.mark.parametrize("rendering", RENDERINGS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_log_alone_names_the_operand_that_reaches_a_global_and_its_scenario(name, rendering):
    case = CASES[name]
    expected = dict(case["expected"])
    if "user_files" in case:
        expected["module"] = None  # the log's path alone does not say where the job's import root is
    assert reported(diagnose(HERE / "logs" / f"{name}-{rendering}.log", "--log-only")) == expected


def test_the_branch_the_arguments_dump_chose_is_read_with_the_source(megatron_core_release):
    """With megatron-core 0.15.0's own layers.py, `total_input` is bound on two branches; the
    dump's sequence_parallel True picks the global memory buffer's, and the report says why."""
    root = megatron_core_release("0.15.0")
    finding = diagnose(HERE / "logs" / "branch-sequence-parallel-py312.log", "--source-root", str(root))
    assert reported(finding) == CASES["branch-sequence-parallel"]["expected"]
    assert any(
        "the arguments dump says sequence_parallel = True" in note and "when sequence_parallel" in note
        for note in finding["notes"]
    ), finding["notes"]


def test_without_the_dump_both_branches_are_named(megatron_core_release, tmp_path):
    root = megatron_core_release("0.15.0")
    log = tmp_path / "no-dump.log"
    text = (HERE / "logs" / "branch-sequence-parallel-py312.log").read_text()
    log.write_text(text[text.index("end of arguments") :].split("\n", 1)[1])
    finding = diagnose(log, "--source-root", str(root))
    assert finding["tensor"]["variable"] == "_GLOBAL_MEMORY_BUFFER"  # the one path that reaches a global
    assert any("when sequence_parallel" in note for note in finding["notes"]), finding["notes"]


def test_a_small_functions_return_is_followed_in_the_real_file(megatron_core_release):
    mindspeed = REAL / "mindspeed-26.0.0"
    if not mindspeed.is_dir():
        pytest.skip(f"{mindspeed} is absent")
    root = megatron_core_release("0.12.1")
    finding = diagnose(
        HERE / "logs" / "multi-operand-rotation-matrix-py313.log", "--source-root", str(mindspeed), "--source-root", str(root)
    )
    assert finding["tensor"]["variable"] == "_ROTATION_MATRIX"
    assert finding["tensor"]["module"] == "mindspeed.mindspore.core.models.common.embeddings.rotary_pos_embedding"
    assert finding["source_from"] == "job"


@pytest.mark.parametrize("name", ["log-only-self-update", "log-only-ring-buffer"])
def test_with_the_users_source_the_scenario_and_module_hold(name, tmp_path):
    case = CASES[name]
    for path, text in case["user_files"].items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    (tmp_path / "train" / "__init__.py").write_text("")
    assert reported(diagnose(HERE / "logs" / f"{name}-py310.log", "--source-root", str(tmp_path))) == case["expected"]


def test_a_flag_of_the_run_arguments_is_never_named(tmp_path):
    """`args.pre_tockens` beside `self.attention_mask` in a call over many lines: the arguments
    global holds flags, the attention mask is what the kernel read."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "state.py").write_text("import argparse\n\n_GLOBAL_ARGS = None\n\n\ndef get_args():\n    return _GLOBAL_ARGS\n")
    (package / "attention.py").write_text(
        "import torch_npu\nfrom pkg.state import get_args\n\n\n"
        "class Attention:\n"
        "    def forward(self, query):\n"
        "        args = get_args()\n"
        "        output = torch_npu.npu_fusion_attention(\n"
        "            query,\n"
        "            args.shape_order,\n"
        "            atten_mask=self.attention_mask,\n"
        "            pre_tockens=args.pre_tockens,\n"
        "        )\n"
        "        return output\n"
    )
    log = tmp_path / "job.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        f'  File "{package / "attention.py"}", line 8, in forward\n'
        "    output = torch_npu.npu_fusion_attention(\n"
        "RuntimeError: There is unsafe data in the input tensor.\n"
    )
    finding = diagnose(log, "--source-root", str(tmp_path))
    assert finding["tensor"]["expression"] == "self.attention_mask"


def real_function(path: Path, name: str, line: int):
    import ast

    tree = ast.parse(path.read_text())
    return next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == name and node.lineno <= line <= (node.end_lineno or 0)
    )


def test_the_paths_of_a_local_bound_on_two_branches_of_real_code(megatron_core_release):
    import ast

    from unsafe_doctor.diagnose.branches import decided, paths_to

    layers = megatron_core_release("0.15.0") / "megatron" / "core" / "tensor_parallel" / "layers.py"
    forward = real_function(layers, "forward", 480)
    paths = paths_to(forward, ast.Name("total_input", ast.Load()), 480, skeleton=False)
    assert [(ast.unparse(path.value), ast.unparse(path.test), path.holds) for path in paths] == [
        ("input", "sequence_parallel", False),
        ("all_gather_buffer", "sequence_parallel", True),
    ]
    for printed, value in (("True", "all_gather_buffer"), ("False", "input"), ("None", "input")):
        kept, because = decided(paths, {"sequence_parallel": printed})
        assert [ast.unparse(path.value) for path in kept] == [value]
        assert because == f"the arguments dump says sequence_parallel = {printed}"
    assert decided(paths, {"tensor_model_parallel_size": "4"}) == (paths, None)  # the dump does not say


def test_a_dump_that_rules_out_the_buffer_leaves_the_parameter(megatron_core_release, tmp_path):
    root = megatron_core_release("0.15.0")
    log = tmp_path / "sequence-parallel-off.log"
    on = "  sequence_parallel " + "." * 31 + " True\n"
    text = (HERE / "logs" / "branch-sequence-parallel-py312.log").read_text()
    assert on in text
    log.write_text(text.replace(on, on.replace("True", "False")))
    finding = diagnose(log, "--source-root", str(root))
    assert finding["tensor"]["variable"] is None and finding["tensor"]["expression"] == "total_input"


def test_a_negated_or_getattr_switch_is_read_from_the_dump():
    import ast

    from unsafe_doctor.diagnose.branches import decided, paths_to

    function = ast.parse(
        "def f(x):\n"
        "    if not getattr(args, 'use_cache', False):\n"
        "        y = x\n"
        "    else:\n"
        "        y = _CACHE\n"
        "    return y * 2\n"
    ).body[0]
    paths = paths_to(function, ast.Name("y", ast.Load()), 6, skeleton=False)
    kept, _ = decided(paths, {"use_cache": "True"})
    assert [ast.unparse(path.value) for path in kept] == ["_CACHE"]
    kept, _ = decided(paths, {"use_cache": "False"})
    assert [ast.unparse(path.value) for path in kept] == ["x"]


def test_of_several_operands_the_one_a_cache_one_call_up_filled_is_named(tmp_path):
    """The rotary embedding's line, `q_embed = (q * cos) + (rotate_half(q) * sin)`: q, cos and sin are
    parameters; in the caller cos and sin are unpacked from an lru-cached function's result, q is
    the query just projected. cos (leftmost of the two) is named, and sin beside it is the same cache."""
    package = tmp_path / "model"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rope.py").write_text(
        "import functools\n\nimport torch\n\n\n"
        "@functools.lru_cache(maxsize=8)\n"
        "def cos_sin(seq_len, dim):\n"
        "    freqs = torch.arange(seq_len)[:, None] * torch.arange(dim)[None, :]\n"
        "    return freqs.cos(), freqs.sin()\n\n\n"
        "def rotate_half(x):\n"
        "    return torch.cat((-x[..., 1::2], x[..., ::2]), dim=-1)\n\n\n"
        "def apply_rotary_pos_emb(q, k, cos, sin):\n"
        "    q_embed = (q * cos) + (rotate_half(q) * sin)\n"
        "    k_embed = (k * cos) + (rotate_half(k) * sin)\n"
        "    return q_embed, k_embed\n\n\n"
        "def attention(layer, hidden):\n"
        "    q, k = layer.q(hidden), layer.k(hidden)\n"
        "    cos, sin = cos_sin(hidden.shape[0], q.shape[-1])\n"
        "    q, k = apply_rotary_pos_emb(q, k, cos, sin)\n"
        "    return q @ k.transpose(-1, -2)\n"
    )
    rope = package / "rope.py"
    log = tmp_path / "job.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        f'  File "{rope}", line 24, in attention\n'
        "    q, k = apply_rotary_pos_emb(q, k, cos, sin)\n"
        f'  File "{rope}", line 17, in apply_rotary_pos_emb\n'
        "    q_embed = (q * cos) + (rotate_half(q) * sin)\n"
        "RuntimeError: There is unsafe data in the input tensor.\n"
    )
    finding = diagnose(log, "--source-root", str(tmp_path))
    assert (finding["tensor"]["variable"], finding["tensor"]["module"], finding["scenario"]) == ("cos_sin", "model.rope", 1)
    assert any("cos is the cached result" in note for note in finding["notes"]), finding["notes"]


def test_the_globals_the_log_cannot_rule_out_are_listed_in_json():
    """The attention call also passes get_actual_seq_len_list()'s global: the JSON lists it, typed."""
    finding = diagnose(HERE / "logs" / "multiline-call-args-py310.log", "--log-only")
    assert finding["alternatives"] == [
        {"variable": "_ACTUAL_SEQ_LEN_LIST", "module": "mindspeed_llm.training.utils", "how": "another operand of the line"}
    ]
    assert any(
        note.startswith("mindspeed.model.transformer was read from the index of mindspeed master@") for note in finding["notes"]
    ), finding["notes"]  # no MindSpeed frame: which release stood in is said
    assert diagnose(HERE / "logs" / "wrapper-generate-mask-py312.log", "--log-only")["alternatives"] == []


def test_a_local_whose_paths_reach_two_globals_names_both_and_keeps_the_local():
    """MindSpeed's MoE linear: total_input is the queued shared-expert input or the global memory
    buffer; the log (no dump) cannot choose, so the finding keeps the local (the consumer frame's
    rule names the queue) and lists both."""
    log = ROOT / "tests" / "corpus" / "logs" / "replay-mindspeed-ag-shared-experts.log"
    finding = diagnose(log, "--log-only")
    assert finding["tensor"]["expression"] == "total_input" and finding["rule"] == "mindspeed.ag-shared-experts-inputs"
    assert {(each["variable"], each["how"]) for each in finding["alternatives"]} == {
        ("_GLOBAL_MEMORY_BUFFER", "on another path"),
        ("AG_SHARED_EXPERTS_INPUTS", "on another path"),
    }
