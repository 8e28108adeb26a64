"""What a command loads before it answers, so that it starts fast: `-V` none of the command line's
libraries, `--help` none of the core's stages nor the libraries only they use, a log with a
traceback none of the suspects' model, its JSON or SARIF report no renderer (rich, pygments) and
none of the adaptor's code. Read from `python -X importtime`, which names every module a real
process of the CLI imports: a list, the same on a loaded machine as on a quiet one, never a time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACED_LOG = ROOT / "samples" / "logs" / "megatron_moe_tracker.log"
CORE_STAGES = ("npu", "log", "source", "knowledge", "audit", "diagnose", "adaptor", "sentinel", "replay", "report")
CORE_LIBRARIES = {"yaml", "jsonschema", "re2", "packaging", "zipfile"}
MODE_NAMES = {"unsafe_doctor.log", "unsafe_doctor.log.sentinel_modes"}  # the names `sentinel install --mode` offers


def imported(cwd: Path, *args: str) -> set[str]:
    """Every module `unsafe-doctor ARGS` imports, run in `cwd` (no pyproject.toml there)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "unsafe_doctor", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode in (0, 1), result.stderr[-3000:]
    rows = [line.split("|") for line in result.stderr.splitlines() if line.startswith("import time:")]
    return {row[2].strip() for row in rows if row[1].strip().isdigit()}


def stages(modules: set[str]) -> set[str]:
    return {name for name in modules if name.split(".")[:2] in (["unsafe_doctor", stage] for stage in CORE_STAGES)}


@pytest.mark.parametrize("args", [["--help"], ["diagnose", "--help"], ["sentinel", "install", "--help"]])
def test_help_loads_no_stage_of_the_core_nor_its_libraries(tmp_path, args):
    modules = imported(tmp_path, *args)
    assert "typer" in modules  # the command line itself was built
    assert stages(modules) <= MODE_NAMES
    assert not CORE_LIBRARIES & {name.split(".")[0] for name in modules}


def test_version_loads_no_command_line_library(tmp_path):
    modules = imported(tmp_path, "-V")
    assert not {"typer", "click", "rich"} & {name.split(".")[0] for name in modules}
    assert not stages(modules)


def test_a_traced_log_loads_no_suspects_model(tmp_path):
    modules = imported(tmp_path, "diagnose", str(TRACED_LOG))
    assert "unsafe_doctor.report.diagnosis_text" in modules  # it did render
    assert not {"unsafe_doctor.diagnose.suspects", "unsafe_doctor.knowledge.writers"} & modules
    assert not {"jsonschema", "markdown_it"} & {name.split(".")[0] for name in modules}


@pytest.mark.parametrize("output_format", ["json", "sarif"])
def test_a_traced_log_for_tools_loads_no_renderer_no_suspects_no_adaptor_code(tmp_path, output_format):
    modules = imported(tmp_path, "diagnose", "--format", output_format, str(TRACED_LOG))
    assert "unsafe_doctor.diagnose.pipeline" in modules  # it did diagnose
    assert not {"rich", "pygments", "jsonschema", "markdown_it"} & {name.split(".")[0] for name in modules}
    assert not {"unsafe_doctor.diagnose.suspects", "unsafe_doctor.knowledge.writers"} & modules
    assert not {name for name in modules if name.startswith("unsafe_doctor.adaptor")}


@pytest.mark.parametrize("output_format", ["text", "json"])
def test_a_small_log_without_rules_reads_the_knowledge_without_yaml_or_jsonschema(tmp_path, output_format):
    modules = imported(tmp_path, "diagnose", "--format", output_format, str(TRACED_LOG))
    assert "unsafe_doctor.knowledge.loading" in modules  # it did load the knowledge
    assert not {"yaml", "jsonschema"} & {name.split(".")[0] for name in modules}
