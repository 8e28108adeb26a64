"""The reports of the corpus and of every sample, byte for byte as recorded in tests/golden/.

Each case's report (stdout), what it says on stderr, and its exit code. A change meant to preserve
behaviour (moving modules, sharing a helper, a faster path) must leave every one as it was. Each
case runs the command in this process, as the CLI would, from the repository's root; the
repository's own path and wall times are the only parts replaced before the comparison. A change
meant to alter a report regenerates the files on purpose:

    UNSAFE_DOCTOR_GOLDEN=write python -m pytest tests/commands/test_outputs_unchanged.py

and the diff of tests/golden/ is then part of the change, for the reviewer to read.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
CORPUS = Path("tests") / "corpus"
sys.path.insert(0, str(ROOT / CORPUS))
from scoring import load_entries  # noqa: E402  (tests/corpus is no package)

_WALL_TIME = re.compile(r"\b\d+(?:\.\d+)?[ \n]+s\b")  # the summary may wrap before its unit
_JSON_SECONDS = re.compile(r'("\w*seconds\w*": )[\d.e-]+')


def _corpus_cases() -> dict[str, list[str]]:
    cases = {}
    for entry in load_entries():
        if entry.release:  # the megatron-core 0.17-0.19 measure: scored, not pinned
            continue
        argv = [str(CORPUS / entry.log)]
        argv += [f"--source-root={CORPUS / root}" for root in entry.source_roots]
        argv += [f"--rules={CORPUS / rules}" for rules in entry.rules]
        cases[f"corpus-{Path(entry.log).stem}"] = ["diagnose", *argv]
    return cases


def _sample_cases() -> dict[str, list[str]]:
    logs = Path("samples") / "logs"
    cases = {
        f"sample-{path.stem}": ["diagnose", str(path)] for path in sorted((ROOT / logs).iterdir()) if path.name != "README.md"
    }
    for name in ("toytrain_ema", "toytrain_sentinel.log"):  # the job's own framework, as docs/diagnose.md runs them
        cases[f"sample-{Path(name).stem}-source"] = ["diagnose", str(logs / name), "--source-root=samples/framework"]
    cases["sample-audit-toytrain"] = ["audit", "samples/framework/toytrain"]
    return cases


CASES = {**_corpus_cases(), **_sample_cases()}
FORMATS = {"json": ".json", "text": ".txt"}


def _normalised(text: str, fmt: str) -> str:
    text = text.replace(str(ROOT), "<ROOT>")
    return _JSON_SECONDS.sub(r"\g<1>0", text) if fmt == "json" else _WALL_TIME.sub("<T> s", text)


def _report(argv: list[str], fmt: str, capsys, monkeypatch) -> str:
    from unsafe_doctor.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "100")
    for variable in [name for name in os.environ if name.startswith("UNSAFE_DOCTOR_")]:
        monkeypatch.delenv(variable)
    argv = [*argv, "--no-cache"] if argv[0] == "audit" else argv  # an audit as it runs the first time
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        main([*argv, "--format", fmt])
    out, err = capsys.readouterr()
    return f"{_normalised(out, fmt)}\n[stderr]\n{_normalised(err, fmt)}\n[exit {ended.value.code}]\n"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", CASES)
def test_report_is_byte_identical_to_the_recorded_one(name, fmt, capsys, monkeypatch):
    writing = os.environ.get("UNSAFE_DOCTOR_GOLDEN") == "write"
    got = _report(CASES[name], fmt, capsys, monkeypatch)
    path = GOLDEN / f"{name}{FORMATS[fmt]}"
    if writing:
        path.parent.mkdir(exist_ok=True)
        path.write_text(got)
    assert got == path.read_text(), f"{' '.join(CASES[name])} --format {fmt} differs from {path.relative_to(ROOT)}"


def test_every_recorded_report_has_its_case():
    recorded = {path.name for path in GOLDEN.iterdir()}
    assert recorded == {f"{name}{suffix}" for name in CASES for suffix in FORMATS.values()}
