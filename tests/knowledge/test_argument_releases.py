"""The megatron-core release from the job's arguments dump, when no frame names it.

knowledge_base/index/megatron-core-arguments.json is derived by scripts/derive_arguments.py from
each pinned release's own parser; the dumps here were written by the real releases' own parsers
(tests/corpus/arguments/from_release.py) or printed by a real core_v0.12.1 run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import warm_python
from packaging.version import Version
from test_rules_shipped import release_root

from unsafe_doctor.diagnose.pipeline import diagnose
from unsafe_doctor.knowledge.argument_releases import ARGUMENTS_FILE, DumpFit, NoDecision, dump_releases
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.report.diagnosis import diagnosis_json
from unsafe_doctor.source.index import index_folder, pinned_releases

ROOT = Path(__file__).resolve().parents[2]
ARGUMENTS = ROOT / "tests" / "corpus" / "arguments"
LOGS = ROOT / "tests" / "corpus" / "logs"
SOURCES = index_folder() / "sources.yaml"
# Where the pinned wheels are kept, and a Megatron-LM clone's git directory (its core_v tags): set them to
# check the shipped file against a fresh derivation (tests/knowledge/test_coverage.py reads the same wheels variable).
WHEELS = Path(os.environ.get("UNSAFE_DOCTOR_WHEELS", "/nonexistent"))
MEGATRON_LM = Path(os.environ.get("UNSAFE_DOCTOR_MEGATRON_LM", "/nonexistent"))


def names_of(dump: str) -> list[str]:
    return list(json.loads((ARGUMENTS / dump).read_text())["arguments"])


def derive(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "derive_arguments.py"), *map(str, arguments)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


# --- the derived file -----------------------------------------------------------------------------


def test_the_derived_file_holds_every_pinned_release_with_its_source():
    derived = json.loads(ARGUMENTS_FILE.read_text())
    pinned = pinned_releases("megatron-core", SOURCES)
    assert [entry["release"] for entry in derived["releases"]] == [release.name for release in pinned]
    for entry, release in zip(derived["releases"], pinned, strict=True):
        if Version(release.name) >= Version("0.17.0"):  # the wheel ships megatron/training/
            assert (entry["wheel"], entry["sha256"], entry["path"]) == (
                release.source.removeprefix("pypi:"),
                release.digest,
                "megatron/training/arguments.py",
            )
        else:
            assert entry["tag"] == f"core_v{release.name}" and len(entry["commit"]) == 40
            assert entry["path"] in ("megatron/training/arguments.py", "megatron/arguments.py")
    indices = {index for held in derived["arguments"].values() for index in held}
    assert indices == set(range(len(pinned)))


@pytest.mark.skipif(
    not (
        MEGATRON_LM.is_dir()
        and all(
            (WHEELS / release.source.removeprefix("pypi:")).is_file() for release in pinned_releases("megatron-core", SOURCES)
        )
    ),
    reason="set UNSAFE_DOCTOR_WHEELS (every pinned wheel) and UNSAFE_DOCTOR_MEGATRON_LM (a clone's git directory)",
)
def test_the_shipped_file_is_what_the_pinned_sources_derive(tmp_path):
    done = derive("--cache", WHEELS, "--repo", MEGATRON_LM, "--out", tmp_path / "derived.json")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "derived.json").read_bytes() == ARGUMENTS_FILE.read_bytes()


# as from_release.py runs a release: what each release's script starts with, in one warm Python
STANDINS = (
    f"import sys; sys.path[:0] = [{str(ROOT / 'tests' / 'corpus')!r}, {str(ROOT / 'samples' / 'workers')!r}]\n"
    "from cases import python_312_standins; python_312_standins()"
)


@pytest.mark.parametrize("release", ["0.17.1", "0.18.2", "0.19.2"])
def test_the_derived_dests_are_those_the_real_parser_adds(release):
    """The release's own add_megatron_arguments, run: the same dests, but for those it adds only when an
    optional package imports (NVIDIA Kitchen's: a dump without it lacks them, which the matcher tolerates)."""
    root = release_root(release)
    if root is None:
        pytest.skip(f"megatron-core {release} cannot be had here")
    script = (
        "import argparse, json, sys\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        "from megatron.training.arguments import add_megatron_arguments\n"
        "print(json.dumps(sorted(vars(add_megatron_arguments(argparse.ArgumentParser()).parse_args([])))))"
    )
    done = warm_python(STANDINS).run(script)
    assert done.returncode == 0, done.stderr[-2000:]
    real = set(json.loads(done.stdout.splitlines()[-1]))
    derived = json.loads(ARGUMENTS_FILE.read_text())
    index = [entry["release"] for entry in derived["releases"]].index(release)
    ours = {name for name, held in derived["arguments"].items() if index in held}
    assert real <= ours and ours - real == {"kitchen_config_file", "kitchen_recipe_number"}


def git(repo: Path, *arguments: str) -> str:
    fixed = {
        f"GIT_{who}_{what}": value
        for who in ("AUTHOR", "COMMITTER")
        for what, value in (("DATE", "2026-01-01T00:00:00"), ("NAME", "t"), ("EMAIL", "t@t"))
    }
    return subprocess.run(
        ["git", "-C", str(repo), *arguments], capture_output=True, text=True, check=True, env={**os.environ, **fixed}
    ).stdout.strip()


OLD_PARSER = """
def _add_args(parser):
    group = parser.add_argument_group(title='old')
    group.add_argument('--hidden-size', type=int)
    group.add_argument('--no-masked-softmax-fusion', action='store_false', dest='masked_softmax_fusion')
    group.add_argument('-v', '--verbose-log', action='store_true')
    return parser
"""
CONFIG = """
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class BaseConfig:
    seed: int = 1234


@dataclass
class TrainingConfig(BaseConfig):
    micro_batch_size: int = 1
    fully_parallel_save: bool = field(default=True, metadata={"argparse_meta": {"dest": "ckpt_fully_parallel_save"}})
    internal: int = field(default=0, init=False)
    shared: ClassVar[int] = 0
    left_out: int = 0
"""
NEW_PARSER = """
from megatron.training.argument_utils import ArgumentGroupFactory
from megatron.training.config import TrainingConfig


def _add_args(parser):
    parser.add_argument('--hidden-size', type=int)
    exclude = ["left_out"]
    ArgumentGroupFactory(TrainingConfig, exclude=exclude).build_group(parser, "training")
    return parser
"""


def test_the_script_reads_each_release_parser_as_argparse_names_its_dests_and_gives_the_same_bytes(tmp_path):
    """A tag with the old path, a tag with megatron/training/, a wheel with a dataclass argument group,
    and a release with no tag (left out, said so)."""
    repo = tmp_path / "Megatron-LM"
    git(tmp_path, "init", "-q", repo.name)
    for tag, path in (("core_v0.5.0", "megatron/arguments.py"), ("core_v0.6.0", "megatron/training/arguments.py")):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(OLD_PARSER)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", tag)
        git(repo, "tag", tag)
        (repo / path).unlink()
    cache = tmp_path / "wheels"
    cache.mkdir()
    wheel = cache / "megatron_core-0.17.0-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("megatron/training/arguments.py", NEW_PARSER)
        archive.writestr("megatron/training/config/__init__.py", "from .training_config import TrainingConfig\n")
        archive.writestr("megatron/training/config/training_config.py", CONFIG)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    sources = tmp_path / "sources.yaml"
    tagged = "".join(f'  - {{release: "{release}", wheel: none.whl, sha256: "0"}}\n' for release in ("0.4.0", "0.5.0", "0.6.0"))
    sources.write_text(f'megatron-core:\n{tagged}  - {{release: "0.17.0", wheel: {wheel.name}, sha256: {digest}}}\n')
    outputs = []
    for out in ("first.json", "second.json"):
        done = derive("--cache", cache, "--repo", repo / ".git", "--sources", sources, "--out", tmp_path / out)
        assert done.returncode == 0, done.stderr
        assert f"megatron-core 0.4.0: no tag core_v0.4.0 in {repo / '.git'}: left out" in done.stderr
        outputs.append((tmp_path / out).read_bytes())
    assert outputs[0] == outputs[1]
    derived = json.loads(outputs[0])
    assert [(entry["release"], entry.get("tag"), entry["path"]) for entry in derived["releases"]] == [
        ("0.5.0", "core_v0.5.0", "megatron/arguments.py"),
        ("0.6.0", "core_v0.6.0", "megatron/training/arguments.py"),
        ("0.17.0", None, "megatron/training/arguments.py"),
    ]
    assert derived["releases"][2]["sha256"] == digest
    assert derived["arguments"] == {
        "ckpt_fully_parallel_save": [2],
        "hidden_size": [0, 1, 2],
        "masked_softmax_fusion": [0, 1],
        "micro_batch_size": [2],
        "seed": [2],
        "verbose_log": [0, 1],
    }
    parser = argparse.ArgumentParser()  # the dests are argparse's own
    exec(compile(OLD_PARSER, "old", "exec"), namespace := {})
    assert set(vars(namespace["_add_args"](parser).parse_args([]))) == {"hidden_size", "masked_softmax_fusion", "verbose_log"}


# --- the matcher ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "release, fits",
    [
        ("0.17.0", ["0.17.0"]),
        ("0.17.1", ["0.17.1"]),
        ("0.18.2", ["0.18.0", "0.18.2"]),
        ("0.19.0", ["0.19.0", "0.19.2"]),
        ("0.19.2", ["0.19.0", "0.19.2"]),
    ],
)
def test_a_dump_the_release_parser_wrote_fits_that_release(release, fits):
    fit = dump_releases(names_of(f"megatron-lm-core_v{release}.json"))
    assert isinstance(fit, DumpFit)
    assert [str(version) for version in fit.releases] == fits
    assert fit.deciding >= 6  # 0.17.0 and 0.17.1 differ by six names, the closest two parsers


def test_the_core_v0_12_1_dump_fits_the_0_12_releases():
    fit = dump_releases(names_of("megatron-lm-core_v0.12.1.json"))
    assert isinstance(fit, DumpFit)
    assert fit.describe() == "megatron-core 0.12.0–0.12.3, from the arguments dump"


def test_names_no_release_parser_adds_are_no_evidence():
    """MindSpeed-LLM's own names (its 26.0.0 dump's) beside a 0.19.2 dump change nothing."""
    plain = dump_releases(names_of("megatron-lm-core_v0.19.2.json"))
    mixed = dump_releases(
        [*names_of("megatron-lm-core_v0.19.2.json"), *names_of("mindspeed-llm-26.0.0.json"), "not_an_argument_of_any_release"]
    )
    assert isinstance(mixed, DumpFit) and isinstance(plain, DumpFit) and mixed.releases == plain.releases


def test_a_dump_cut_to_a_few_lines_decides_nothing():
    assert isinstance(dump_releases(names_of("megatron-lm-core_v0.19.2.json")[:20]), NoDecision)
    assert isinstance(dump_releases([]), NoDecision)


def printed_dump(names: list[str]) -> str:
    """A dump as Megatron-LM's `_print_args` prints it: each name padded with dots to column 48, sorted."""
    return (
        "\n".join(
            [
                "------------------------ arguments ------------------------",
                *(f"  {name} {'.' * (48 - len(name))} None" for name in sorted(names)),
                "-------------------- end of arguments ---------------------",
            ]
        )
        + "\n"
    )


def test_a_printed_dump_fits_as_its_names_do(tmp_path):
    """Names too long for the dots the input stage looks for are never read from a log: the releases' names
    leave them out too, so a printed dump is no worse evidence than its list of names."""
    names = names_of("megatron-lm-core_v0.19.2.json")
    assert any(len(name) > 40 for name in names)  # their lines carry fewer than eight dots
    log = tmp_path / "train.log"
    log.write_text(printed_dump(names))
    read = diagnose([str(log)], groundwork(log_only=True)).context.environment.dump_fit
    assert read == dump_releases(names) and isinstance(read, DumpFit)
    assert [str(version) for version in read.releases] == ["0.19.0", "0.19.2"]


# --- the diagnosis --------------------------------------------------------------------------------


def test_an_untraced_log_names_the_release_its_dump_fits_in_the_summary_json_and_suspects():
    diagnosis = diagnose([str(LOGS / "release-0.17.0-v26-layer-wise-tracker.log")], groundwork(log_only=True))
    assert diagnosis.context.environment.job_releases()["megatron-core"] == (
        (Version("0.17.0"),),
        "the release the arguments dump fits",
    )
    report = diagnosis_json(diagnosis)
    assert report["summary"]["frameworks"]["megatron-core"] == {
        "version": "0.17.0",
        "from": "the arguments dump (megatron-core 0.17.0, from the arguments dump)",
    }
    assert diagnosis.untraced is not None
    assert diagnosis.untraced.shortlist.suspects[0].rule.id == "megatron.moe-layer-wise-tracker-moe-utils"


def test_the_dump_outranks_the_release_installed_here():
    """Without --log-only the installed megatron-core (this venv's) is found, but it did not run the job."""
    diagnosis = diagnose([str(LOGS / "release-0.19.0-v7.3-moe-metrics-tracker.log")], groundwork())
    assert diagnosis.context.environment.origins.get("megatron-core") == "installed"  # the test extra installs one
    releases, origin = diagnosis.context.environment.job_releases()["megatron-core"]
    assert releases == (Version("0.19.0"), Version("0.19.2")) and origin == "the releases the arguments dump fits"


def test_the_frames_win_over_the_dump(tmp_path):
    """A 0.12 traceback with a 0.19.2 dump printed before it: the frames name the release."""
    log = tmp_path / "train.log"
    log.write_text(printed_dump(names_of("megatron-lm-core_v0.19.2.json")) + (LOGS / "megatron-0.12-causal-mask.log").read_text())
    diagnosis = diagnose([str(log)], groundwork(log_only=True))
    assert isinstance(diagnosis.context.environment.dump_fit, DumpFit)
    assert diagnosis.context.environment.origins["megatron-core"].startswith("the log's frames (megatron-core 0.12")


def test_a_traced_finding_whose_frames_fit_no_release_takes_its_rule_for_the_dumps_release(tmp_path):
    """The 0.7 corpus run with its megatron lines patched (no frame fingerprints a release), after a dump of
    0.7.0's parser: the rule is chosen for the release the dump fits, and the finding says so."""
    derived = json.loads(ARGUMENTS_FILE.read_text())
    index = [entry["release"] for entry in derived["releases"]].index("0.7.0")
    dump = printed_dump([name for name, held in derived["arguments"].items() if index in held])
    lines = (LOGS / "megatron-0.7-aux-losses-tracker.log").read_text().splitlines()
    patched = tmp_path / "patched.log"  # each megatron frame's printed line, changed
    patched.write_text(
        dump
        + "\n".join(
            line + "  # patch" if 'File "' in before and "/megatron/core/" in before else line
            for before, line in zip(["", *lines[:-1]], lines, strict=True)
        )
        + "\n"
    )
    diagnosis = diagnose([str(patched)], groundwork(log_only=True))
    assert "megatron-core" not in diagnosis.context.workspace.releases  # no frame fits a release
    (finding,) = diagnosis_json(diagnosis)["findings"]
    assert finding["rule"] == "megatron.moe-aux-losses-tracker"
    assert "rule chosen for megatron-core 0.7.0, from the arguments dump" in finding["notes"]
    assert not any("version unknown" in note for note in finding["notes"])
