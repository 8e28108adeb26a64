"""The shipped framework index against its pinned list of releases, and scripts/build_index.py building from it.

knowledge_base/index/sources.yaml pins each release to its source (a wheel and its sha256, or a
commit); the shipped zips must hold exactly those releases, and the same sources must give the same
bytes. The builds here run the real script on a real git repository and a real wheel-shaped zip.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from unsafe_doctor.source.index import FRAMEWORK_FOLDERS, IndexedFramework, index_folder, pinned_releases

ROOT = Path(__file__).resolve().parents[2]
SOURCES = index_folder() / "sources.yaml"


def build_index(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_index.py"), *map(str, arguments)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize("framework", sorted(FRAMEWORK_FOLDERS))
def test_the_shipped_zip_holds_exactly_the_pinned_releases(framework):
    """Every listed release, with its source and digest, in the list's order; nothing else."""
    shipped = IndexedFramework(framework, index_folder() / f"{framework}.zip")
    assert shipped.releases == pinned_releases(framework, SOURCES)


def test_the_list_pins_every_megatron_core_release_to_0_19():
    names = [release.name for release in pinned_releases("megatron-core", SOURCES)]
    assert names[0] == "0.5.0" and names[-1] == "0.19.2"
    assert {"0.17.0", "0.17.1", "0.18.0", "0.18.2", "0.19.0"} <= set(names)


def test_the_list_pins_mindspeeds_newer_branches():
    names = [release.name for release in pinned_releases("mindspeed", SOURCES)]
    for branch in ("core_r0.16.0@", "core_r0.17.0@", "core_r0.18.0@", "26.1.0_core_r0.12.1@"):
        assert any(name.startswith(branch) for name in names), branch
    assert "26.1.0" in [release.name for release in pinned_releases("mindspeed-llm", SOURCES)]


def git(repo: Path, *arguments: str) -> str:
    fixed = {
        f"GIT_{who}_{what}": value
        for who in ("AUTHOR", "COMMITTER")
        for what, value in (("DATE", "2026-01-01T00:00:00"), ("NAME", "t"), ("EMAIL", "t@t"))
    }
    return subprocess.run(
        ["git", "-C", str(repo), *arguments], capture_output=True, text=True, check=True, env={**os.environ, **fixed}
    ).stdout.strip()


def two_commits(repo: Path) -> list[str]:
    """A MindSpeed-shaped repository: a file of two versions, one commit each."""
    git(repo.parent, "init", "-q", repo.name)
    commits = []
    for body in ("_CACHE = {}\n\n\ndef f():\n    return _CACHE\n", "_CACHE = None\n\n\ndef g():\n    return _CACHE\n"):
        (repo / "mindspeed").mkdir(exist_ok=True)
        (repo / "mindspeed" / "state.py").write_text(body)
        git(repo, "add", ".")
        git(repo, "commit", "-q", "-m", "version")
        commits.append(git(repo, "rev-parse", "HEAD"))
    return commits


def test_the_same_pinned_commits_build_the_same_bytes(tmp_path):
    repo = tmp_path / "MindSpeed"
    old, new = two_commits(repo)
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        f'mindspeed:\n  - {{release: "1.0.0", commit: "{old}"}}\n  - {{release: "master@{new[:8]}", commit: "{new}"}}\n'
    )
    for out in ("first", "second"):
        done = build_index("mindspeed", "--repo", repo / ".git", "--sources", sources, "--out", tmp_path / out)
        assert done.returncode == 0, done.stderr
    first, second = (tmp_path / out / "mindspeed.zip" for out in ("first", "second"))
    assert first.read_bytes() == second.read_bytes()
    with zipfile.ZipFile(first) as archive:  # no date of the build in it
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        assert archive.namelist() == ["releases.json", "files/mindspeed/state.py"]
    assert IndexedFramework("mindspeed", first).releases == pinned_releases("mindspeed", sources)


def test_a_commit_the_clone_lacks_is_a_one_line_error(tmp_path):
    repo = tmp_path / "MindSpeed"
    two_commits(repo)
    sources = tmp_path / "sources.yaml"
    missing = "0" * 40  # quoted below: unquoted, YAML reads it as a number
    sources.write_text(f'mindspeed:\n  - {{release: "9.9.9", commit: "{missing}"}}\n')
    done = build_index("mindspeed", "--repo", repo / ".git", "--sources", sources, "--out", tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [f"build_index: mindspeed 9.9.9: {repo / '.git'} has no commit {missing}"]
    assert not (tmp_path / "mindspeed.zip").exists()


def wheel(cache: Path, version: str) -> Path:
    """A wheel-shaped zip with one megatron/core file, named as the package index names 0.17's wheels."""
    path = cache / f"megatron_core-{version}-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("megatron/core/parallel_state.py", "_GLOBAL_MEMORY_BUFFER = None\n")
    return path


def test_a_wheel_is_read_only_when_its_sha256_is_the_pinned_one(tmp_path):
    cache = tmp_path / "wheels"
    cache.mkdir()
    path = wheel(cache, "0.17.0")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    sources = tmp_path / "sources.yaml"
    sources.write_text(f'megatron-core:\n  - {{release: "0.17.0", wheel: {path.name}, sha256: {digest}}}\n')
    done = build_index("megatron-core", "--cache", cache, "--sources", sources, "--out", tmp_path / "good")
    assert done.returncode == 0, done.stderr
    built = IndexedFramework("megatron-core", tmp_path / "good" / "megatron-core.zip")
    assert built.releases == pinned_releases("megatron-core", sources) and built.paths == {"megatron/core/parallel_state.py"}

    sources.write_text(f'megatron-core:\n  - {{release: "0.17.0", wheel: {path.name}, sha256: {"f" * 64}}}\n')
    done = build_index("megatron-core", "--cache", cache, "--sources", sources, "--out", tmp_path / "bad")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"build_index: {path}: sha256 {digest}, but {sources} pins {'f' * 64}"
    assert not (tmp_path / "bad" / "megatron-core.zip").exists()


def test_a_release_yaml_reads_as_a_number_is_refused(tmp_path):
    sources = tmp_path / "sources.yaml"
    sources.write_text("mindspeed-llm:\n  - {release: 2.10, commit: abc}\n")
    with pytest.raises(ValueError, match="every value must be a string"):
        pinned_releases("mindspeed-llm", sources)
