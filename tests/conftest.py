"""Logs shared by several test files, produced here by running real code under the emulated check."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from helpers import close_warm_pythons, load_module

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORK = ROOT / "samples" / "framework"
SHARED_REAL = ROOT.parent / "shared" / "real"
# A module whose buffer a step updates in place: an audit holder (tests of the audit and of its halves).
ROUTER_MODULE = """import torch


class Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("counts", torch.zeros(4, device="npu"))

    def forward(self, routing_map):
        self.counts += routing_map.sum(dim=0)
"""


@pytest.fixture(scope="module", autouse=True)
def no_warm_python_left() -> Iterator[None]:
    """The warm Pythons a module's tests started end with the module (helpers.warm_python)."""
    yield
    close_warm_pythons()


@pytest.fixture(autouse=True)
def no_module_left_from_a_temporary_folder() -> Iterator[None]:
    """What a test imported from a temporary folder (a copied adaptor, a package written there) is
    forgotten after it: a later test, and the replay launchers it forks from this process, import
    their own copy, as a fresh process would, never this one's."""
    before = set(sys.modules)
    yield
    temporary = tempfile.gettempdir() + os.sep
    ours = (str(ROOT) + os.sep, sys.prefix + os.sep)  # this checkout and its venv may lie there too (CI clones into /tmp)
    for name in set(sys.modules) - before:
        file = getattr(sys.modules[name], "__file__", None) or ""
        if file.startswith(temporary) and not file.startswith(ours):
            del sys.modules[name]


@pytest.fixture(scope="session")
def run_audit_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An audit cache shared by this run's xdist workers (the folder above each worker's own), for the
    session fixtures that audit the same trees in every worker: the first to finish an audit keeps it
    for the others (an entry stands only while nothing it read has changed)."""
    base = tmp_path_factory.getbasetemp()
    return _made((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "run-audit-cache")


@pytest.fixture(scope="session", autouse=True)
def megatron_core_loaded() -> None:
    """megatron-core (the installed 0.16.1) loaded once in each worker: the replays that tests run in
    this process fork their launchers from it, and each launcher would otherwise import it again
    (seconds of CPU, most of them torch.compile loading inductor at import). Releases other than the
    installed one run in processes of their own, never here. The log path's venvs (.ci/run) have
    neither it nor torch: nothing is loaded there."""
    if importlib.util.find_spec("megatron") is None:
        return
    import megatron.core  # noqa: F401


@pytest.fixture(autouse=True)
def own_audit_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's audits, and the commands it starts that keep this environment, keep their cache
    in a folder of the test's own: never the user's, never another test's."""
    monkeypatch.setenv("UNSAFE_DOCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("audit-cache")))


@pytest.hookimpl(optionalhook=True)
@contextlib.contextmanager
def importable_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, files: Mapping[str, str]) -> Iterator[Path]:
    """A real package `name` (an empty `__init__.py` unless `files` gives one), written under tmp_path
    and put on sys.path, for code the sentinel walks from sys.modules; forgotten by sys.modules after."""
    root = tmp_path / "src" / name
    root.mkdir(parents=True)
    for file, text in {"__init__.py": "", **files}.items():
        (root / file).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    try:
        yield root
    finally:
        for module in [module for module in sys.modules if module.partition(".")[0] == name]:
            del sys.modules[module]


STANDIN_PACKAGES = ("mindspeed", "mindspeed_llm", "modellink")  # frameworks that cannot be installed here


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], types.ModuleType]]:
    """Writes a few-line stand-in of a framework module that cannot be installed here at its real
    import path under tmp_path, and imports it by its real name, as a rendered fix imports it; the
    stand-in frameworks' modules are forgotten before and after."""
    root = tmp_path / "standins"
    monkeypatch.syspath_prepend(str(root))

    def forget() -> None:
        for module in [module for module in sys.modules if module.partition(".")[0] in STANDIN_PACKAGES]:
            del sys.modules[module]

    def write(module: str, source: str) -> types.ModuleType:
        path = root / (module.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in path.relative_to(root).parents[:-1]:
            (root / folder / "__init__.py").touch()  # a package, ahead of any installed one later on sys.path
        path.write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        return importlib.import_module(module)

    forget()
    yield write
    forget()


def script_module(name: str):
    """A script of scripts/, imported as its own folder would run it (each imports build_index beside it)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def pytest_xdist_auto_num_workers(config) -> int | None:
    """`-n auto` (addopts): a worker more than the cores this process may use (then --maxprocesses 4).
    Many tests wait, idle, on what they start (replays up to their timeout, a CLI run, a pip install),
    so one worker per core leaves cores unused: on 2 cores, 3 workers take 6 minutes where 2 take 7.5.
    PYTEST_XDIST_AUTO_NUM_WORKERS still decides where set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores + 1


@pytest.fixture(scope="session")
def real(tmp_path_factory) -> Path:
    """The real third-party files (MindSpeed-LLM, MindSpeed, mind-cluster), kept out of the repository
    in ``../shared/real/`` beside it (its MANIFEST.md: repositories, commits, paths). A test that
    asks for it is skipped, with the reason, where that folder is absent. The shared files are
    read-only, and fix writes into the copies tests make of them: what is given is a writable copy,
    byte for byte, made once per session (per xdist worker)."""
    if not (SHARED_REAL / "MANIFEST.md").is_file():
        pytest.skip(
            f"../shared/real is absent: {SHARED_REAL} (the real MindSpeed-LLM, MindSpeed and mind-cluster "
            "files these tests run on) is not beside the repository"
        )
    copy = tmp_path_factory.mktemp("real")
    for folder, _, files in os.walk(SHARED_REAL):
        target = copy / Path(folder).relative_to(SHARED_REAL)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copyfile(Path(folder, name), target / name)  # the content, not the read-only mode
    return copy


def load_rules_generator():
    """tests/fixtures/rules/generate.py: captures a real traceback and writes it as a rank's log."""
    return load_module("rules_generator", ROOT / "tests" / "fixtures" / "rules" / "generate.py")


@pytest.fixture(scope="session")
def megatron_core_release():
    """A megatron-core release in a pip target, to put first on PYTHONPATH: ``release("0.12.1")`` is
    the folder holding its ``megatron`` package and metadata. Installed once with ``pip install
    --no-deps --target`` (pure Python; 0.7 and 0.8 import pkg_resources, hence setuptools) and kept
    under the temp dir for later runs; a release pip cannot install is skipped with pip's reason."""
    cache = Path(tempfile.gettempdir()) / "unsafe-doctor-megatron-core"
    failed: dict[str, str] = {}

    def release(version: str) -> Path:
        target = cache / version
        if not target.is_dir() and version not in failed:
            partial = Path(tempfile.mkdtemp(prefix=f"{version}-", dir=_made(cache)))
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--no-deps",
                    "--target",
                    str(partial),
                    f"megatron-core=={version}",
                    "setuptools<81",
                ],
                capture_output=True,
                text=True,
                timeout=600,
                env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
            )
            if result.returncode == 0:
                with contextlib.suppress(OSError):  # another run may have put it there first
                    partial.rename(target)
            else:
                failed[version] = (result.stderr.strip().splitlines() or ["no output"])[-1]
            shutil.rmtree(partial, ignore_errors=True)
        if version in failed:
            pytest.skip(f"pip could not install megatron-core {version}: {failed[version]}")
        return target

    return release


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def load_stale_expert_bias():
    """tests/fixtures/replay/stale_expert_bias.py: megatron-core's TopKRouter routes with a stale expert_bias."""
    path = ROOT / "tests" / "fixtures" / "replay" / "stale_expert_bias.py"
    return load_module("stale_expert_bias", path)


def _record_into_stale_loss_log(mark) -> None:
    """toytrain adds the next step's loss into a LOSS_LOG entry the fault left unsafe."""
    import torch

    sys.path.insert(0, str(FRAMEWORK))
    try:
        from toytrain import state

        state.init_state("cpu")
        state.record_loss("loss", torch.ones(()))
        mark(state.LOSS_LOG["loss"])
        state.record_loss("loss", torch.ones(()))
    finally:
        sys.path.remove(str(FRAMEWORK))
        for name in [name for name in sys.modules if name == "toytrain" or name.startswith("toytrain.")]:
            del sys.modules[name]  # a test that imports toytrain gets its own copy


@pytest.fixture(scope="session")
def toytrain_loss_log(tmp_path_factory) -> Path:
    """rank 3's traceback: toytrain.state.record_loss reads LOSS_LOG["loss"] (scenario 1)."""
    generator = load_rules_generator()
    path = tmp_path_factory.mktemp("logs") / "toytrain_loss_log.log"
    path.write_text(generator.as_log(generator.capture(_record_into_stale_loss_log), rank_prefix=True))
    return path


@pytest.fixture(scope="session")
def router_expert_bias_log(tmp_path_factory) -> Path:
    """rank 3's traceback: megatron-core's TopKRouter.routing reads expert_bias (scenario 2)."""
    generator = load_rules_generator()
    path = tmp_path_factory.mktemp("logs") / "router_expert_bias.log"
    path.write_text(generator.as_log(generator.capture(load_stale_expert_bias().route_with_stale_bias), rank_prefix=True))
    return path
