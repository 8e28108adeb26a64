"""The speed scripts refuse to report on a loaded machine (figures measured beside a test
suite moved 2-3x), unless --loaded asks for figures that then say so. Nothing here is timed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEED_SCRIPTS = ["audit_speed", "diagnose_speed", "input_shapes", "replay_speed", "sentinel_walk", "small_log_speed"]
sys.path.insert(0, str(ROOT / "benchmarks"))
import quiet  # noqa: E402  (benchmarks/quiet.py, found as the scripts find it)

sys.path.remove(str(ROOT / "benchmarks"))


def test_a_loaded_machine_is_refused_in_one_line_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        quiet.require_quiet(loaded_ok=False, load=quiet.Load(1.2, 2))
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "load average 1.20 on 2 cores (0.60 per core)" in error and "--loaded" in error


def test_loaded_figures_say_they_were_measured_under_load(capsys):
    assert quiet.require_quiet(loaded_ok=True, load=quiet.Load(1.2, 2)).per_core == 0.6
    assert "MEASURED UNDER LOAD" in capsys.readouterr().out


def test_half_a_core_of_load_is_still_quiet(capsys):
    quiet.require_quiet(loaded_ok=False, load=quiet.Load(1.0, 2))
    assert capsys.readouterr().out == "machine: load average 1.00 on 2 cores (0.50 per core): quiet\n"


@pytest.mark.parametrize("script", SPEED_SCRIPTS)
def test_each_speed_script_refuses_before_it_measures(script, tmp_path):
    """The real script, run as a user runs it, with the kernel's load average read as 99: it stops with
    the refusal before it builds anything (no venv, log or model)."""
    run = (
        "import os, runpy, sys; os.getloadavg = lambda: (99.0, 99.0, 99.0); "
        f"sys.argv = [{str(ROOT / 'benchmarks' / script) + '.py'!r}]; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().startswith(f"{script}.py: load average 99.00"), result.stderr[-2000:]
    assert result.stdout == ""
