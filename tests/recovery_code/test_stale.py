"""stale_resets(): rollback resets of names the detected framework lacks, and splitting rebinds."""

from __future__ import annotations

import importlib.util
import shutil
import textwrap
from pathlib import Path

import pytest
from helpers import load_module

from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.knowledge.versions import detect_environment
from unsafe_doctor.recovery_code.stale import StaleReset, stale_resets
from unsafe_doctor.source.workspace import Workspace

ADAPTORS = Path(__file__).parents[1] / "fixtures" / "adaptors"
LEGACY = ADAPTORS / "legacy" / "mindio_ttp" / "adaptor" / "modellink_adaptor.py"
LLM26_ROLLBACK = ADAPTORS / "llm26" / "mindspeed_llm" / "core" / "high_availability" / "tft_rollback.py"
KNOWLEDGE = load_knowledge()
TRACKER = "_MOE_AUX_LOSSES_LOGGING_TRACKER"
MOE_UTILS = "mindspeed.core.transformer.moe.moe_utils"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def line_of(path: Path, text: str) -> int:
    return next(number for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip() == text)


def resets(adaptor: Path, *source_roots: Path, paired: bool = False) -> list[StaleReset]:
    """The adaptor's stale resets against the framework found here (installed, or under the roots):
    its profile named as --profile names it. `paired`: as detected from the adaptor's names, whose
    generation then says which releases the job ran (`Environment.job_releases`)."""
    detected = detect_environment(KNOWLEDGE, Workspace(source_roots), adaptor=adaptor)
    workspace = Workspace(source_roots)
    chosen = None if paired else detected.profile
    environment = detect_environment(KNOWLEDGE, workspace, adaptor=adaptor, chosen=chosen)
    return stale_resets(adaptor, environment.profile, environment, workspace, KNOWLEDGE.rules)


def rollback(tmp_path: Path, body: str, imports: str = "") -> Path:
    """A one-function adaptor: `feature_rollback` with the given body."""
    code = textwrap.dedent(imports) + "\n\ndef feature_rollback():\n" + textwrap.indent(textwrap.dedent(body), "    ")
    return write(tmp_path / "adaptor" / "my_adaptor.py", code)


def mindspeed_tree(root: Path, *, importer_at_module_level: bool = True) -> Path:
    """MindSpeed's overlap list: defined in moe_utils, imported by name by a producer module."""
    moe = root / "mindspeed" / "core" / "transformer" / "moe"
    for folder in (root / "mindspeed", root / "mindspeed" / "core", root / "mindspeed" / "core" / "transformer", moe):
        write(folder / "__init__.py", "")
    write(moe / "moe_utils.py", "AG_SHARED_EXPERTS_INPUTS = []\n")
    if importer_at_module_level:
        write(moe / "moe_layer_overlap_all2all.py", "from .moe_utils import AG_SHARED_EXPERTS_INPUTS\n")
    write(
        moe / "layers.py",
        """
        def shared_expert_input():
            from mindspeed.core.transformer.moe.moe_utils import AG_SHARED_EXPERTS_INPUTS
            return AG_SHARED_EXPERTS_INPUTS.pop(0)
        """,
    )
    return root


def test_faq_legacy_adaptor_resets_a_tracker_megatron_core_0_16_no_longer_has():
    found = resets(LEGACY)
    assert found == [
        StaleReset(
            file=LEGACY.resolve(),
            line=line_of(LEGACY, f"mpu.{TRACKER} = {{}}"),
            statement=f"mpu.{TRACKER} = {{}}",
            symbol=TRACKER,
            module="megatron.core.parallel_state",
            kind="missing",
            why=(
                f"megatron-core 0.16.1 has no {TRACKER} in megatron.core.parallel_state; its likely successor is "
                "_MOE_LAYER_WISE_LOGGING_TRACKER in megatron.core.transformer.moe.moe_utils; the right reset is rule "
                "megatron.moe-layer-wise-tracker-moe-utils's fix (unsafe-doctor fix writes it)"
            ),
        )
    ]


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="the stale check reads an installed megatron-core")
def test_a_generation_that_runs_with_other_releases_is_checked_against_those_releases():
    """megatron-core 0.16.1 is installed here, but the legacy adaptor's generation runs on
    0.6.0, 0.7.0, 0.8.0 or 0.12.1: the job ran one of those, as the suspects assume, so the reset is
    compared with their modules in the shipped index; 0.6.0 and 0.7.0 still had the tracker."""
    [reset] = [reset for reset in resets(LEGACY, paired=True) if reset.symbol == TRACKER]
    assert reset.why == (
        f"megatron-core 0.8.0 and 0.12.1 (the releases the mindio-ttp-legacy adaptor runs with) have no {TRACKER} "
        "in megatron.core.parallel_state"
    )


def legacy_adaptor_with(tmp_path: Path, imports: str, statements: str) -> Path:
    """A copy of the legacy adaptor (its generation runs with megatron-core 0.6.0 to 0.12.1) whose
    rollback function also runs `statements` first."""
    shutil.copytree(ADAPTORS / "legacy", tmp_path / "legacy")
    adaptor = tmp_path / "legacy" / LEGACY.relative_to(ADAPTORS / "legacy")
    text = adaptor.read_text().replace("from megatron.core import mpu\n", f"from megatron.core import mpu\n{imports}")
    adaptor.write_text(
        text.replace("def feature_rollback():\n", "def feature_rollback():\n" + textwrap.indent(statements, "    "))
    )
    return adaptor


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="the stale check reads an installed megatron-core")
def test_a_rebinding_is_flagged_when_the_job_ran_other_releases_that_define_the_name(tmp_path):
    """The index holds trtllm_layers in 0.12.1 only, with the list defined; the installed
    megatron-core imports it by name elsewhere, so rebinding it still splits the two."""
    adaptor = legacy_adaptor_with(
        tmp_path, "from megatron.core.export.trtllm import trtllm_layers\n", "trtllm_layers.NON_TRANSFORMER_LAYERS_NAMES = []\n"
    )
    [reset] = [reset for reset in resets(adaptor, paired=True) if reset.symbol == "NON_TRANSFORMER_LAYERS_NAMES"]
    assert (reset.kind, reset.module) == ("rebinding", "megatron.core.export.trtllm.trtllm_layers")
    assert reset.why.endswith("empty it in place with trtllm_layers.NON_TRANSFORMER_LAYERS_NAMES.clear()")


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="the stale check reads an installed megatron-core")
def test_releases_whose_module_the_index_lacks_are_named_unchecked_not_counted_as_defining(tmp_path):
    """num_microbatches_calculator is in megatron-core from 0.8.0 on: the index holds it in
    0.8.0 and 0.12.1, which both lack the name; 0.6.0 and 0.7.0 were not compared, not 'fine'."""
    adaptor = legacy_adaptor_with(
        tmp_path,
        "from megatron.core import num_microbatches_calculator\n",
        "num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES = None\n",
    )
    [reset] = [reset for reset in resets(adaptor, paired=True) if reset.symbol == "_GLOBAL_NUM_MICROBATCHES"]
    assert reset.why == (
        "megatron-core 0.8.0 or 0.12.1 (the releases the mindio-ttp-legacy adaptor runs with) has no _GLOBAL_NUM_MICROBATCHES "
        "in megatron.core.num_microbatches_calculator; not checked on 0.6.0 and 0.7.0 (the index does not hold the module there)"
    )


def test_in_tree_26_adaptor_has_the_same_stale_reset():
    assert [(reset.symbol, reset.kind) for reset in resets(LLM26_ROLLBACK)] == [(TRACKER, "missing")]


def test_tracker_present_in_the_source_root_framework_is_not_stale(tmp_path):
    """A megatron-core 0.7 tree given as source root is the framework compared, not site-packages."""
    core = tmp_path / "megatron" / "core"
    write(core / "__init__.py", "from megatron.core import parallel_state\nmpu = parallel_state\n")
    write(core / "parallel_state.py", f"{TRACKER} = {{}}\n")
    write(core / "package_info.py", "MAJOR = 0\nMINOR = 7\nPATCH = 0\nPRE_RELEASE = ''\n")
    assert resets(LEGACY, tmp_path) == []


def test_rebinding_a_list_another_module_imported_by_name_is_flagged(tmp_path):
    found = resets(LEGACY, mindspeed_tree(tmp_path))
    rebinding = [reset for reset in found if reset.kind == "rebinding"]
    assert [(reset.symbol, reset.module, reset.statement) for reset in rebinding] == [
        ("AG_SHARED_EXPERTS_INPUTS", MOE_UTILS, "moe_utils.AG_SHARED_EXPERTS_INPUTS = []")
    ]
    importer = "mindspeed.core.transformer.moe.moe_layer_overlap_all2all"
    assert f"{importer} imports AG_SHARED_EXPERTS_INPUTS from {MOE_UTILS} by name" in rebinding[0].why
    assert rebinding[0].why.endswith("moe_utils.AG_SHARED_EXPERTS_INPUTS.clear()")
    assert [reset.kind for reset in found] == ["missing", "rebinding"]


def test_rebinding_is_fine_when_importers_only_import_inside_functions(tmp_path):
    found = resets(LEGACY, mindspeed_tree(tmp_path, importer_at_module_level=False))
    assert [reset.kind for reset in found] == ["missing"]


def test_clearing_in_place_is_not_flagged(tmp_path):
    adaptor = rollback(
        tmp_path,
        "moe_utils.AG_SHARED_EXPERTS_INPUTS.clear()\n",
        "from mindspeed.core.transformer.moe import moe_utils\n",
    )
    assert resets(adaptor, mindspeed_tree(tmp_path / "src")) == []


def test_method_call_setattr_and_subscript_resets_of_a_missing_name_are_all_stale(tmp_path):
    adaptor = rollback(
        tmp_path,
        f"""
        parallel_state.{TRACKER}.clear()
        setattr(parallel_state, "{TRACKER}", {{}})
        parallel_state.{TRACKER}["load_balancing_loss"] = None
        parallel_state.destroy_global_memory_buffer()
        """,
        "from megatron.core import parallel_state\n",
    )
    written = [f"parallel_state.{TRACKER}.clear()", f'setattr(parallel_state, "{TRACKER}", {{}})']
    written.append(f'parallel_state.{TRACKER}["load_balancing_loss"] = None')
    found = resets(adaptor)
    assert [(reset.line, reset.statement, reset.symbol, reset.module) for reset in found] == [
        (line_of(adaptor, text), text, TRACKER, "megatron.core.parallel_state") for text in written
    ]


def test_reset_of_a_name_the_framework_has_is_not_stale(tmp_path):
    """megatron-core 0.16.1 keeps the tracker in moe_utils, and no module imports it by name."""
    adaptor = rollback(
        tmp_path,
        "moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER = {}\n",
        "from megatron.core.transformer.moe import moe_utils\n",
    )
    assert resets(adaptor) == []


def test_name_that_moved_to_another_module_says_where_it_is_now(tmp_path):
    """Megatron core 0.8-0.12 kept the layer-wise tracker in parallel_state; 0.13+ moved it to moe_utils."""
    adaptor = rollback(tmp_path, "mpu._MOE_LAYER_WISE_LOGGING_TRACKER = {}\n", "from megatron.core import mpu\n")
    [reset] = resets(adaptor)
    assert reset.why == (
        "megatron-core 0.16.1 has no _MOE_LAYER_WISE_LOGGING_TRACKER in megatron.core.parallel_state; "
        "it is now in megatron.core.transformer.moe.moe_utils; the right reset is rule "
        "megatron.moe-layer-wise-tracker-moe-utils's fix (unsafe-doctor fix writes it)"
    )


def test_modules_not_found_here_are_skipped(tmp_path):
    adaptor = rollback(
        tmp_path,
        "megatron.training.global_vars._GLOBAL_TIMERS = None\nSwapPrefetch.swap_prefetch.prefetch_list = []\n",
        """
        import megatron.training.global_vars
        from mindspeed.core.memory.adaptive_recomputing.prefetch import SwapPrefetch
        """,
    )
    assert resets(adaptor) == []


def test_global_declarations_star_imports_and_module_getattr_count_as_defined(tmp_path):
    fw = tmp_path / "src" / "fw"
    write(fw / "__init__.py", "")
    write(fw / "declared.py", "def init():\n    global _BUFFER\n    _BUFFER = {}\n")
    write(fw / "starred.py", "from fw.declared import *\n")
    write(fw / "lazy.py", "def __getattr__(name):\n    return {}\n")
    adaptor = rollback(
        tmp_path,
        "declared._BUFFER = {}\nstarred._OTHER = {}\nlazy._ANY = {}\n",
        "from fw import declared, starred, lazy\n",
    )
    assert resets(adaptor, tmp_path / "src") == []


def test_relative_imports_and_unknown_versions_name_the_file(tmp_path):
    root = tmp_path / "src"
    write(root / "fw" / "__init__.py", "")
    state = write(root / "fw" / "state.py", "_GLOBAL_CACHE_BUFFER = None\n")
    adaptor = write(
        root / "fw" / "recovery.py",
        """
        from . import state


        def feature_rollback():
            state._GLOBAL_BUFFER = None
        """,
    )
    [reset] = resets(adaptor, root)
    assert (reset.symbol, reset.module, reset.line) == ("_GLOBAL_BUFFER", "fw.state", 5)
    assert reset.why == (
        f"fw.state at {state.resolve()} has no _GLOBAL_BUFFER in fw.state; "
        "its likely successor is _GLOBAL_CACHE_BUFFER in fw.state"
    )


def test_function_local_import_shadows_the_module_level_one(tmp_path):
    fw = tmp_path / "src" / "fw"
    write(fw / "__init__.py", "")
    write(fw / "old.py", "_STATE = {}\n")
    write(fw / "new.py", "_OTHER = {}\n")
    adaptor = rollback(tmp_path, "from fw import new as state\nstate._STATE = {}\n", "from fw import old as state\n")
    assert [(reset.module, reset.symbol) for reset in resets(adaptor, tmp_path / "src")] == [("fw.new", "_STATE")]


def test_adaptor_without_the_rollback_function_has_nothing_to_report(tmp_path):
    adaptor = write(tmp_path / "adaptor.py", "def something_else():\n    pass\n")
    environment = detect_environment(KNOWLEDGE, Workspace(()))
    assert stale_resets(adaptor, environment.profile, environment, Workspace(environment.source_roots), KNOWLEDGE.rules) == []


def test_unparseable_adaptor_is_a_usage_error(tmp_path):
    adaptor = write(tmp_path / "adaptor.py", "def feature_rollback(:\n")
    environment = detect_environment(KNOWLEDGE, Workspace(()))
    with pytest.raises(UsageError, match="not valid Python"):
        stale_resets(adaptor, environment.profile, environment, Workspace(environment.source_roots), KNOWLEDGE.rules)


# --- megatron-core 0.18: the tracker became an object; the old name and the getter's copy reset nothing


def release_tree(version: str) -> Path:
    """The unpacked real release (tests/fixtures/rules/release.py), as a source root."""
    module = load_module("rules_fixture_release", Path(__file__).parents[1] / "fixtures" / "rules" / "release.py")
    root = module.release_root(version)
    if root is None:
        pytest.skip(f"megatron-core {version} cannot be had here")
    return root


OLD_TRACKER_RESETS = """
    moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER.clear()
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
"""
METRICS_RESET = "the right reset is rule megatron.moe-metrics-tracker's fix"


def test_on_0_18_the_old_tracker_name_and_the_getters_copy_are_named_with_the_right_reset(tmp_path):
    adaptor = rollback(tmp_path, OLD_TRACKER_RESETS, "from megatron.core.transformer.moe import moe_utils")
    found = resets(adaptor, release_tree("0.18.2"))
    assert [(reset.kind, reset.symbol, reset.module) for reset in found] == [
        ("missing", "_MOE_LAYER_WISE_LOGGING_TRACKER", "megatron.core.transformer.moe.moe_utils"),
        ("copy", "get_moe_layer_wise_logging_tracker", "megatron.core.transformer.moe.moe_utils"),
    ]
    for reset in found:
        assert reset.why.startswith("megatron-core 0.18.2")
        assert reset.why.endswith(METRICS_RESET + " (unsafe-doctor fix writes it)"), reset.why
    assert "_MOE_METRICS_TRACKER in megatron.core.transformer.moe.moe_logging" in found[0].why
    assert "returns a new container on each call" in found[1].why


def test_on_0_17_the_same_resets_reach_the_tracker(tmp_path):
    adaptor = rollback(tmp_path, OLD_TRACKER_RESETS, "from megatron.core.transformer.moe import moe_utils")
    assert resets(adaptor, release_tree("0.17.1")) == []


def test_the_aux_losses_name_is_missing_on_0_18_too(tmp_path):
    adaptor = rollback(tmp_path, f"mpu.{TRACKER} = {{}}\n", "from megatron.core import parallel_state as mpu")
    [found] = resets(adaptor, release_tree("0.18.2"))
    assert (found.kind, found.symbol) == ("missing", TRACKER)
    assert found.why.startswith(f"megatron-core 0.18.2 has no {TRACKER} in megatron.core.parallel_state")
