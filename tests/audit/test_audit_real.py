"""`audit` on real MindSpeed 26.0.0 and MindSpeed-LLM master files (../shared/real/MANIFEST.md:
repository, commit and path of each): the globals they keep device tensors in at run time are
found, CPU shared memory and the MindSpore backend are not, and every global a shipped rule names
that these files define is found."""

from __future__ import annotations

import ast
import re
import sysconfig
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from conftest import SHARED_REAL

from unsafe_doctor.audit.run import audit
from unsafe_doctor.knowledge.loading import load_knowledge

MINDSPEED = Path("mindspeed-26.0.0", "mindspeed")  # under ../shared/real (the real fixture)
LLM = Path("mindspeed-llm-master", "mindspeed_llm")


@pytest.fixture(scope="session")  # once per xdist worker; "module" rebuilds it each time other files' tests come between
def found(real, run_audit_cache) -> dict[str, object]:
    """The shared files themselves (the audit only reads), so that every worker's audit is the one in the run's cache."""
    result = audit([SHARED_REAL / MINDSPEED, SHARED_REAL / LLM], cache=run_audit_cache)
    return {item.holder.name.dotted: item for item in result.holders}


@pytest.mark.parametrize(
    "name",
    [
        # lists and dicts that receive tensors at run time
        "mindspeed.core.transformer.moe.moe_utils.AG_SHARED_EXPERTS_INPUTS",  # .append((tensor, handle))
        "mindspeed.core.context_parallel.utils.CACHED_GRID_MASK",
        "mindspeed.core.context_parallel.utils.CACHED_MASK_LIST",
        # set through setter functions from a parameter
        "mindspeed.utils._POSITION_IDS",
        "mindspeed.utils._ACTUAL_SEQ_LEN",
        "mindspeed_llm.training.utils._MTP_POSITION_ID",
        "mindspeed.core.transformer.flash_attention.generate_mask.generate_mask._GLOBAL_ATTN_MASK",
        # a class attribute the recovery code itself fills with a received device tensor
        "mindspeed_llm.core.high_availability.tft_optimizer_data_repair.LogArgs.losses_reduced_",
        # the MoE overlap's saved tensors
        "mindspeed.core.transformer.moe.moe_utils.GEMM_BACKWARD_NEED_TENSORS",
        "mindspeed.core.transformer.moe.moe_feature.overlap.moe_common.SWAP_TENSOR",
    ],
)
def test_audit_finds_what_real_code_keeps_device_tensors_in(found, name):
    assert name in found


def test_audit_leaves_out_cpu_shared_memory_and_the_mindspore_backend(found):
    assert "mindspeed_llm.training.utils._GLOBAL_SHM_MANAGER" not in found  # torch.frombuffer over shared memory
    assert not [name for name in found if "adaptive_memory_tool" in name]  # frombuffer of a pickle
    assert not [item for item in found.values() if "/mindspore/" in item.holder.definition.file]


def test_metadata_kept_beside_tensors_is_no_holder(tmp_path):
    """`tensor_shape` and `seq_length: int` name metadata, not tensors."""
    (tmp_path / "p2p.py").write_text(
        "class P2PCommParams:\n"
        "    tensor_shape = None\n\n"
        "def set_shape(tensor_shape):\n"
        "    P2PCommParams.tensor_shape = tensor_shape\n\n"
        "_WORK = {}\n\n"
        "def remember(seq_length: int):\n"
        "    _WORK['n'] = seq_length\n"
    )
    assert audit([tmp_path]).holders == ()


def defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_bytes())
    return {
        target.id
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }


def test_every_global_a_shipped_rule_names_in_these_files_is_found(found, real):
    """For each rule block naming MindSpeed or MindSpeed-LLM globals (a name or a pattern, in a
    module or module glob), the module-level globals of the real files it fits are all found."""
    roots = (real / MINDSPEED.parent, real / LLM.parent)
    files = {
        path: ".".join(path.relative_to(root).with_suffix("").parts)
        for root in roots
        for path in root.rglob("*.py")
        if path.name != "__init__.py"
    }
    named = []
    for rule in load_knowledge([]).rules:
        for block in rule.matches:
            if not block.module or not block.module.startswith(("mindspeed", "mindspeed_llm")):
                continue
            for path, module in files.items():
                if not fnmatchcase(module, block.module):
                    continue
                for variable in sorted(defined_names(path)):
                    if variable == block.variable or (block.variable_regex and re.fullmatch(block.variable_regex, variable)):
                        named.append((rule.id, f"{module}.{variable}"))
    assert len(named) >= 15
    assert [(rule, name) for rule, name in named if name not in found and "mindspore" not in name] == []


MEGATRON_RULE_GLOBALS = {  # every global a shipped rule names that megatron-core 0.16.1 defines, and its rule
    "megatron.core.transformer.moe.moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER": "megatron.moe-layer-wise-tracker-moe-utils",
    "megatron.core.transformer.multi_token_prediction.MTPLossLoggingHelper.tracker": "megatron.mtp-loss-tracker",
    "megatron.core.parallel_state._GLOBAL_MEMORY_BUFFER": "megatron.global-memory-buffer",
    "megatron.core.utils.GlobalMemoryBuffer.buffer": "megatron.global-memory-buffer",
    "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.forward": "megatron.rotary-emb-cache",
    "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.inv_freq": "megatron.rotary-inv-freq",
    "megatron.core.transformer.moe.router.TopKRouter.expert_bias": "megatron.router-expert-bias",
    "megatron.core.transformer.moe.router.TopKRouter.local_tokens_per_expert": "megatron.router-local-tokens-per-expert",
    "megatron.core.optimizer.optimizer.MixedPrecisionOptimizer.found_inf": "megatron.optimizer-found-inf",
    "megatron.core.optimizer.grad_scaler.DynamicGradScaler._scale": "megatron.grad-scaler",
}


def test_every_global_a_shipped_rule_names_in_megatron_core_is_found_with_its_rule():
    """On the installed megatron-core 0.16.1 (the test extra's): instance attributes of classes that
    are no singleton (`self.inv_freq`, `self.found_inf`) included."""
    megatron = Path(sysconfig.get_paths()["purelib"]) / "megatron" / "core"
    audited = {item.holder.name.dotted: item for item in audit([megatron]).holders}
    rules = {name: getattr(audited[name].classification, "rule", None) for name in MEGATRON_RULE_GLOBALS if name in audited}
    assert rules == MEGATRON_RULE_GLOBALS


def test_yarn_cos_and_sin_caches_rebuilt_at_run_time_are_found():
    """YarnRotaryEmbedding registers cos_cached / sin_cached again when a longer sequence comes: a
    buffer registered outside __init__ is a cache kept across steps."""
    megatron = Path(sysconfig.get_paths()["purelib"]) / "megatron" / "core" / "models" / "common" / "embeddings"
    audited = {item.holder.name.dotted: item.holder for item in audit([megatron]).holders}
    yarn = "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding.YarnRotaryEmbedding"
    assert {audited[f"{yarn}.cos_cached"].kind, audited[f"{yarn}.sin_cached"].kind} == {"buffer"}
