"""`fix` judges the adaptor's own handling of a finding's global as `audit` does, on the real
MindSpeed-LLM adaptor (../shared/real/MANIFEST.md: commit and paths): a global it already
resets gets no second block (the log proves the first did not help), with where that reset is and
what can make it ineffective; a reset that is established to fail here is complemented."""

from __future__ import annotations

import hashlib
import json
import shutil
import textwrap
from pathlib import Path

import pytest
from helpers import run_cli

from unsafe_doctor.adaptor.existing_reset import AlreadyReset
from unsafe_doctor.adaptor.plan import Planned, plan_fix
from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.source.workspace import Workspace

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "corpus" / "logs"
LEGACY = ROOT / "tests" / "fixtures" / "adaptors" / "legacy"
UNSAFE = "RuntimeError: There is unsafe data in the input tensor."


@pytest.fixture
def real_adaptor(tmp_path: Path, real: Path) -> Path:
    """A copy of MindSpeed-LLM master's rollback adaptor; fix writes there."""
    tree = tmp_path / "llm"
    shutil.copytree(real / "mindspeed-llm-master", tree)
    return tree / "mindspeed_llm" / "core" / "high_availability" / "tft_rollback.py"


def fix_json(log: Path, adaptor: Path) -> tuple[int, dict]:
    result = run_cli("fix", str(log), "--adaptor", str(adaptor), "--format", "json", "--yes")
    return result.returncode, json.loads(result.stdout)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_aux_losses_tracker_the_real_rollback_resets_gets_no_second_block(tmp_path, real_adaptor):
    adaptor = real_adaptor
    before = digest(adaptor)
    code, report = fix_json(CORPUS / "megatron-0.7-aux-losses-tracker.log", adaptor)
    assert code == 1  # a fix left unwritten: the user has to look at the existing reset
    assert digest(adaptor) == before and report["files"] == [] and report["written"] == []
    [item] = report["already_reset"]
    assert item["global"] == "megatron.core.parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER"
    assert (item["function"], item["how"]) == ("feature_rollback", "reset")
    assert [(Path(site["file"]).name, site["line"]) for site in item["sites"]] == [("tft_rollback.py", 70)]
    assert any("`hasattr(args, 'num_experts') and args.num_experts`" in doubt and "line 69" in doubt for doubt in item["doubts"])


def test_the_memory_buffer_rebuilt_through_megatron_helpers_gets_no_second_block(tmp_path, real_adaptor):
    """The real rollback calls destroy_global_memory_buffer() and _set_global_memory_buffer(); the
    log's read fails inside GlobalMemoryBuffer.get_tensor, the rule names _GLOBAL_MEMORY_BUFFER."""
    adaptor = real_adaptor
    before = digest(adaptor)
    code, report = fix_json(CORPUS / "megatron-global-memory-buffer.log", adaptor)
    assert code == 1 and digest(adaptor) == before
    [item] = report["already_reset"]
    assert item["global"] == "megatron.core.parallel_state._GLOBAL_MEMORY_BUFFER"
    assert item["how"] == "rebuilt"
    assert all(site["file"].startswith("<megatron-core 0.16.1>/megatron/core/parallel_state.py") for site in item["sites"])
    assert any("hasattr(mpu, 'destroy_global_memory_buffer')" in doubt and "line 65" in doubt for doubt in item["doubts"])


def test_the_faq_adaptor_reset_of_the_faq_tracker_is_found_with_its_guard(tmp_path):
    tree = tmp_path / "legacy"
    shutil.copytree(LEGACY, tree)
    adaptor = tree / "mindio_ttp" / "adaptor" / "modellink_adaptor.py"
    code, report = fix_json(ROOT / "samples" / "logs" / "faq_modellink.log", adaptor)
    assert code == 1
    [item] = report["already_reset"]
    assert [site["line"] for site in item["sites"]] == [15]
    assert any("num_experts" in doubt for doubt in item["doubts"])


def test_a_global_the_adaptor_does_not_touch_still_gets_its_block(tmp_path, real_adaptor):
    """The layer-wise tracker of megatron-core 0.16 is not what the real rollback resets."""
    adaptor = real_adaptor
    setup = groundwork()
    diagnosis = diagnose([str(ROOT / "samples" / "logs" / "megatron_moe_tracker.log")], setup, adaptor=adaptor)
    plan = plan_fix(diagnosis.findings, diagnosis.context)
    assert [type(outcome) for outcome in plan.outcomes] == [Planned] and len(plan.edits) == 1


def test_an_unsafe_reset_in_the_adaptor_is_complemented_and_named(tmp_path, real):
    """Zeroing the tracker in place reads the unsafe tensors: not a reset; the block is written and
    the note says which statement is unsafe."""
    package = tmp_path / "mindspeed_llm" / "core" / "high_availability"
    shutil.copytree(real / "mindspeed-llm-master" / "mindspeed_llm", tmp_path / "mindspeed_llm")
    adaptor = package / "tft_rollback.py"
    text = adaptor.read_text()
    unsafe = "        for values in mpu._MOE_AUX_LOSSES_LOGGING_TRACKER.values():\n            values.zero_()\n"
    adaptor.write_text(text.replace("        mpu._MOE_AUX_LOSSES_LOGGING_TRACKER = {}\n", unsafe, 1))
    setup = groundwork()
    diagnosis = diagnose([str(CORPUS / "megatron-0.7-aux-losses-tracker.log")], setup, adaptor=adaptor)
    plan = plan_fix(diagnosis.findings, diagnosis.context)
    assert [type(outcome) for outcome in plan.outcomes] == [Planned] and len(plan.edits) == 1
    assert any("handling of _MOE_AUX_LOSSES_LOGGING_TRACKER is unsafe" in note for note in plan.notes)


LAYERS_LINE = "ag_shared_experts_inputs = AG_SHARED_EXPERTS_INPUTS.pop(0)"


def test_rebinding_a_list_that_a_module_imported_by_name_is_established_to_fail(tmp_path, real_adaptor):
    """MindSpeed master's moe_layer_overlap_all2all.py imports AG_SHARED_EXPERTS_INPUTS by name at
    module level, so the real rollback's `moe_utils.AG_SHARED_EXPERTS_INPUTS = []` leaves that
    module the old list: the fix is written (in place), with the importer named. The traceback is
    made here from MindSpeed master's real lines (layers.py:65)."""
    log = tmp_path / "train.log"
    log.write_text(
        textwrap.dedent(f"""\
        [rank1]: Traceback (most recent call last):
        [rank1]:   File "/job/MindSpeed/mindspeed/core/transformer/moe/layers.py", line 65, in forward
        [rank1]:     {LAYERS_LINE}
        [rank1]: {UNSAFE}
        """)
    )
    adaptor = real_adaptor
    setup = groundwork()
    diagnosis = diagnose([str(log)], setup, adaptor=adaptor)
    assert setup.workspace.releases["mindspeed"].describe().startswith("mindspeed ")
    [finding] = diagnosis.findings
    assert finding.classification.rule is not None
    plan = plan_fix(diagnosis.findings, diagnosis.context)
    assert not [outcome for outcome in plan.outcomes if isinstance(outcome, AlreadyReset)]
    assert len(plan.edits) == 1
    assert any("moe_layer_overlap_all2all.py:16 imported it by name" in note for note in plan.notes), plan.notes


def test_importers_by_name_are_read_from_the_fingerprinted_release():
    workspace = Workspace([])
    workspace.fingerprint([Frame("/job/MindSpeed/mindspeed/core/transformer/moe/layers.py", 65, "forward", LAYERS_LINE)])
    found = workspace.importers_by_name("mindspeed.core.transformer.moe.moe_utils", "AG_SHARED_EXPERTS_INPUTS")
    assert "mindspeed/core/transformer/moe/moe_layer_overlap_all2all.py:16" in found
    assert not any(path.startswith("mindspeed/core/transformer/moe/layers.py") for path in found)  # a function's import
