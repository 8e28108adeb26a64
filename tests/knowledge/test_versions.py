"""detect_environment(): framework versions from trees, frames and metadata; the adaptor profile."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.version import Version

from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.knowledge.versions import DEFAULT_PROFILE, detect_environment
from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.source.workspace import Workspace

ADAPTORS = Path(__file__).parents[1] / "fixtures" / "adaptors"
LEGACY_ROOT = ADAPTORS / "legacy"
LEGACY = LEGACY_ROOT / "mindio_ttp" / "adaptor" / "modellink_adaptor.py"
LLM26_ROOT = ADAPTORS / "llm26"
HA = Path("mindspeed_llm") / "core" / "high_availability"
KNOWLEDGE = load_knowledge()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def megatron_tree(root: Path, minor: int, pre_release: str = "") -> Path:
    """A Megatron checkout's version file plus one module, as the package lays them out."""
    write(
        root / "megatron" / "core" / "package_info.py",
        f"""
        MAJOR = 0
        MINOR = {minor}
        PATCH = 0
        PRE_RELEASE = {pre_release!r}
        VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)
        """,
    )
    write(root / "megatron" / "core" / "__init__.py", "")
    write(root / "megatron" / "core" / "transformer" / "__init__.py", "")
    write(root / "megatron" / "core" / "transformer" / "moe" / "__init__.py", "")
    return write(root / "megatron" / "core" / "transformer" / "moe" / "moe_utils.py", "TRACKER = {}\n")


def egg_info(root: Path, name: str, version: str) -> None:
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    write(root / f"{name.replace('-', '_')}.egg-info" / "PKG-INFO", metadata)


def test_megatron_version_from_source_root_package_info_beats_installed(tmp_path):
    megatron_tree(tmp_path, minor=7)
    environment = detect_environment(KNOWLEDGE, Workspace([tmp_path]))
    assert environment.versions["megatron-core"] == Version("0.7.0")
    assert environment.origins["megatron-core"] == str(tmp_path / "megatron" / "core" / "package_info.py")


def test_megatron_pre_release_is_part_of_the_version(tmp_path):
    megatron_tree(tmp_path, minor=8, pre_release="rc0")
    assert detect_environment(KNOWLEDGE, Workspace([tmp_path])).versions["megatron-core"] == Version("0.8.0rc0")


def test_installed_metadata_is_the_last_resort():
    environment = detect_environment(KNOWLEDGE, Workspace(()))
    assert environment.versions["megatron-core"] == Version(importlib.metadata.version("megatron-core"))
    assert environment.origins["megatron-core"] == "installed"


def test_frame_file_present_here_gives_the_version_of_its_tree(tmp_path):
    module = megatron_tree(tmp_path / "ModelLink", minor=7)
    frame = Frame(str(module), 1, "save_to_aux_losses_tracker", "TRACKER = {}")
    environment = detect_environment(KNOWLEDGE, Workspace(()), frames=[frame])
    assert environment.versions["megatron-core"] == Version("0.7.0")
    assert environment.origins["megatron-core"] == str(tmp_path / "ModelLink" / "megatron" / "core" / "package_info.py")


def test_source_root_wins_over_frames(tmp_path):
    megatron_tree(tmp_path / "root", minor=12)
    frame = Frame(str(megatron_tree(tmp_path / "ModelLink", minor=7)), 1, "f", None)
    environment = detect_environment(KNOWLEDGE, Workspace([tmp_path / "root"]), frames=[frame])
    assert environment.versions["megatron-core"] == Version("0.12.0")


def test_frames_missing_here_are_ignored(tmp_path):
    frame = Frame("/nowhere/ModelLink/megatron/core/transformer/moe/moe_utils.py", 172, "f", None)
    assert detect_environment(KNOWLEDGE, Workspace(()), frames=[frame]).origins["megatron-core"] == "installed"


def test_mindspeed_version_from_its_setup_py(tmp_path):
    write(tmp_path / "mindspeed" / "__init__.py", "")
    write(
        tmp_path / "setup.py",
        """
        import setuptools
        __version__ = '0.12.1'
        __package_name__ = 'mindspeed'
        setuptools.setup(name=__package_name__, version=__version__, packages=[])
        """,
    )
    environment = detect_environment(KNOWLEDGE, Workspace([tmp_path]))
    assert environment.versions["mindspeed"] == Version("0.12.1")
    assert environment.origins["mindspeed"] == str(tmp_path / "setup.py")


def test_mindspeed_llm_setup_py_placeholder_is_not_a_version(tmp_path):
    """MindSpeed-LLM's setup.py declares `modellink 0.0.1` whatever the release."""
    write(tmp_path / "mindspeed_llm" / "__init__.py", "")
    write(tmp_path / "setup.py", "import setuptools\nsetuptools.setup(name='modellink', version='0.0.1')\n")
    assert "mindspeed-llm" not in detect_environment(KNOWLEDGE, Workspace([tmp_path])).versions


def test_mindspeed_llm_version_from_egg_info_picks_the_profile_without_an_adaptor(tmp_path):
    egg_info(tmp_path / "a", "mindspeed_llm", "2.3.0")
    egg_info(tmp_path / "b", "mindspeed_llm", "26.0.0")
    egg_info(tmp_path / "c", "mindspeed_llm", "2.2.0")
    older = detect_environment(KNOWLEDGE, Workspace([tmp_path / "a"]))
    assert older.versions["mindspeed-llm"] == Version("2.3.0")
    assert older.origins["mindspeed-llm"] == str(tmp_path / "a" / "mindspeed_llm.egg-info")
    assert (older.profile.id, older.adaptor) == ("mindspeed-llm-2.3", None)
    assert detect_environment(KNOWLEDGE, Workspace([tmp_path / "b"])).profile.id == "mindspeed-llm-26"
    assert detect_environment(KNOWLEDGE, Workspace([tmp_path / "c"])).profile.id == "mindio-ttp-legacy"


def test_no_adaptor_and_no_version_gives_the_default_profile():
    environment = detect_environment(KNOWLEDGE, Workspace(()))
    assert (environment.profile.id, environment.adaptor) == (DEFAULT_PROFILE, None)


def test_given_legacy_adaptor_fits_the_legacy_profile():
    environment = detect_environment(KNOWLEDGE, Workspace(()), adaptor=LEGACY)
    assert (environment.profile.id, environment.adaptor) == ("mindio-ttp-legacy", LEGACY)


@pytest.mark.parametrize("name", ["tft_rollback.py", "tft_optimizer_data_repair.py"])
def test_given_in_tree_adaptor_of_26_fits_the_26_profile(name):
    assert detect_environment(KNOWLEDGE, Workspace(()), adaptor=LLM26_ROOT / HA / name).profile.id == "mindspeed-llm-26"


def test_receive_with_need_rebuild_fits_the_2_3_profile(tmp_path):
    shutil.copytree(LLM26_ROOT, tmp_path, dirs_exist_ok=True)
    repair = tmp_path / HA / "tft_optimizer_data_repair.py"
    repair.write_text(
        repair.read_text().replace(
            "def recv_rank_repair(src_ranks: list, dest_ranks: list, optim_idxs: list, rank_list",
            "def recv_rank_repair(src_ranks: list, dest_ranks: list, optim_idxs: list, need_rebuild: bool, rank_list",
        )
    )
    assert "need_rebuild" in repair.read_text()
    environment = detect_environment(KNOWLEDGE, Workspace(()), adaptor=tmp_path / HA / "tft_rollback.py")
    assert environment.profile.id == "mindspeed-llm-2.3"


def test_legacy_functions_in_a_users_own_file_fit_by_names_and_repair_group_import(tmp_path):
    own = write(tmp_path / "my_recovery.py", LEGACY.read_text())
    assert detect_environment(KNOWLEDGE, Workspace(()), adaptor=own).profile.id == "mindio-ttp-legacy"


def test_version_breaks_a_tie_between_in_tree_generations(tmp_path):
    """Only the rollback file: 2.3 and 26 fit alike, the detected MindSpeed-LLM version decides."""
    rollback = write(tmp_path / HA / "tft_rollback.py", (LLM26_ROOT / HA / "tft_rollback.py").read_text())
    assert detect_environment(KNOWLEDGE, Workspace(()), adaptor=rollback).profile.id == DEFAULT_PROFILE
    egg_info(tmp_path, "mindspeed_llm", "2.3.0")
    assert detect_environment(KNOWLEDGE, Workspace([tmp_path]), adaptor=rollback).profile.id == "mindspeed-llm-2.3"


def test_adaptor_found_under_a_source_root_is_the_file_with_the_rollback():
    legacy = detect_environment(KNOWLEDGE, Workspace([LEGACY_ROOT]))
    assert (legacy.profile.id, legacy.adaptor) == ("mindio-ttp-legacy", LEGACY)
    in_tree = detect_environment(KNOWLEDGE, Workspace([LLM26_ROOT]))
    assert (in_tree.profile.id, in_tree.adaptor) == ("mindspeed-llm-26", LLM26_ROOT / HA / "tft_rollback.py")


def test_adaptor_found_through_a_frames_tree(tmp_path):
    shutil.copytree(LLM26_ROOT, tmp_path, dirs_exist_ok=True)
    frame = Frame(str(tmp_path / HA / "tft_rollback.py"), 14, "feature_rollback", None)
    environment = detect_environment(KNOWLEDGE, Workspace(()), frames=[frame])
    assert environment.adaptor is not None
    assert environment.adaptor.resolve() == (tmp_path / HA / "tft_rollback.py").resolve()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"source_roots": [Path("/no/such/root")]}, "is not a directory"),
        ({"adaptor": Path("/no/such/adaptor.py")}, "no such file"),
    ],
)
def test_bad_paths_are_usage_errors(arguments, message):
    workspace = Workspace(arguments.pop("source_roots", ()))
    with pytest.raises(UsageError, match=message):
        detect_environment(KNOWLEDGE, workspace, **arguments)


def test_adaptor_that_is_not_python_is_a_usage_error(tmp_path):
    broken = write(tmp_path / "adaptor.py", "def feature_rollback(:\n")
    with pytest.raises(UsageError, match="not valid Python"):
        detect_environment(KNOWLEDGE, Workspace(()), adaptor=broken)


def test_detection_never_imports_torch_or_the_frameworks():
    code = (
        "import sys; from pathlib import Path; import unsafe_doctor.knowledge.versions, unsafe_doctor.recovery_code.stale; "
        "from unsafe_doctor.knowledge.loading import load_knowledge; "
        "from unsafe_doctor.knowledge.versions import detect_environment; "
        "from unsafe_doctor.recovery_code.stale import stale_resets; from unsafe_doctor.source.workspace import Workspace; "
        f"k = load_knowledge(); e = detect_environment(k, Workspace(()), adaptor=Path({str(LEGACY)!r})); "
        "stale_resets(e.adaptor, e.profile, e, Workspace(()), k.rules); "
        "assert not {'torch', 'megatron', 'mindspeed', 'mindio_ttp'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
