"""Build the framework index shipped in knowledge_base/index/ from the real releases.

    python scripts/build_index.py megatron-core                       # every release on the package index
    python scripts/build_index.py mindspeed --repo PATH_TO_GIT_DIR   # every tag of a clone, and its HEAD
    python scripts/build_index.py mindspeed-llm --repo PATH_TO_GIT_DIR

megatron-core releases are the wheels `pip download` fetches (0.5.0 and newer: older ones predate
the MoE and memory-buffer globals the rules name); MindSpeed and MindSpeed-LLM publish no wheels, so
their releases are the tags of a clone of their public repositories (github.com/Ascend/MindSpeed,
github.com/Ascend/MindSpeed-LLM), plus the clone's HEAD, each recorded with its commit id.
The output records, per release, where it came from; per file version, its sha256 and the
releases that ship it. See `unsafe_doctor.source.index` for the format.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from packaging.version import Version

from unsafe_doctor.source.index import FRAMEWORK_FOLDERS, INDEX_FOLDER, FileVersion, Release, write_index
from unsafe_doctor.source.skeleton import line_hashes, skeleton

FIRST_MEGATRON = Version("0.5.0")


def _is_indexed(path: str, framework: str) -> bool:
    return path.endswith(".py") and path.startswith(FRAMEWORK_FOLDERS[framework]) and "/tests/" not in path


def megatron_releases(
    cache: Path, wanted: Callable[[Version], bool] = lambda version: True
) -> Iterator[tuple[Release, dict[str, bytes]]]:
    """Every megatron-core release from FIRST_MEGATRON on (that `wanted` takes), as its wheel's Python files."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "megatron-core"], capture_output=True, text=True, check=True
    ).stdout
    line = next(line for line in listed.splitlines() if line.startswith("Available versions:"))
    versions = sorted(Version(text.strip()) for text in line.split(":", 1)[1].split(","))
    chosen = (version for version in versions if version >= FIRST_MEGATRON and not version.is_prerelease and wanted(version))
    for version in chosen:
        wheels = sorted(cache.glob(f"megatron_core-{version}-*.whl"))
        if not wheels:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                 f"megatron-core=={version}", "-d", str(cache)],
                check=True,
            )
            wheels = sorted(cache.glob(f"megatron_core-{version}-*.whl"))
        wheel = wheels[0]
        with zipfile.ZipFile(wheel) as archive:
            files = {name: archive.read(name) for name in archive.namelist() if _is_indexed(name, "megatron-core")}
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        yield Release(str(version), f"pypi:{wheel.name}", digest), files


def git_releases(repo: Path, framework: str) -> Iterator[tuple[Release, dict[str, bytes]]]:
    """Every tag of the clone, oldest first, then HEAD when no tag names it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "--git-dir", str(repo), *args], capture_output=True, text=True, check=True).stdout

    tags = git("for-each-ref", "--sort=creatordate", "--format=%(refname:short) %(objectname) %(*objectname)", "refs/tags")
    named: list[tuple[str, str]] = []
    for row in tags.splitlines():
        tag, obj, peeled = (row.split() + [""])[:3]
        named.append((tag.removeprefix("v"), peeled or obj))
    head = git("rev-parse", "HEAD").strip()
    if head not in {commit for _, commit in named}:
        named.append((f"master@{head[:8]}", head))
    for name, commit in named:
        listing = git("ls-tree", "-r", commit)
        blobs = {}
        for row in listing.splitlines():
            meta, path = row.split("\t", 1)
            if _is_indexed(path, framework):
                blobs[path] = meta.split()[2]
        contents = subprocess.run(
            ["git", "--git-dir", str(repo), "cat-file", "--batch"],
            input="\n".join(blobs.values()).encode() + b"\n", capture_output=True, check=True,
        ).stdout
        yield Release(name, f"git:{framework}@{commit}", commit), dict(zip(blobs, _batch_blobs(contents), strict=True))


def _batch_blobs(output: bytes) -> Iterator[bytes]:
    """The contents `git cat-file --batch` printed, in request order."""
    at = 0
    while at < len(output):
        header_end = output.index(b"\n", at)
        size = int(output[at:header_end].split()[2])
        yield output[header_end + 1 : header_end + 1 + size]
        at = header_end + 1 + size + 1


def build(framework: str, releases: Iterator[tuple[Release, dict[str, bytes]]], out: Path) -> None:
    shipped: list[Release] = []
    versions: dict[str, dict[str, FileVersion]] = {}  # path -> sha256 -> version
    unparsed = 0
    for release, files in releases:
        index = len(shipped)
        shipped.append(release)
        print(f"{framework} {release.name}: {len(files)} files", file=sys.stderr)
        for path, content in sorted(files.items()):
            digest = hashlib.sha256(content).hexdigest()
            known = versions.setdefault(path, {})
            if digest in known:
                known[digest].releases.append(index)
                continue
            text = content.decode("utf-8", "replace")
            reduced = skeleton(text)
            if reduced is None:
                unparsed += 1
                continue
            known[digest] = FileVersion([index], digest, line_hashes(text), reduced)
    write_index(out, framework, shipped, {path: list(found.values()) for path, found in versions.items()})
    print(f"wrote {out} ({out.stat().st_size // 1024} KB, {len(shipped)} releases, "
          f"{sum(map(len, versions.values()))} file versions, {unparsed} unparsable)", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("framework", choices=sorted(FRAMEWORK_FOLDERS))
    parser.add_argument("--repo", type=Path, help="git directory of a clone (mindspeed, mindspeed-llm)")
    parser.add_argument("--cache", type=Path, help="where downloaded wheels are kept (megatron-core)")
    parser.add_argument("--out", type=Path, default=INDEX_FOLDER)
    arguments = parser.parse_args()
    out = arguments.out / f"{arguments.framework}.zip"
    if arguments.framework == "megatron-core":
        cache = arguments.cache or Path(tempfile.mkdtemp(prefix="megatron-core-wheels-"))
        build(arguments.framework, megatron_releases(cache), out)
    elif arguments.repo is None:
        parser.error(f"{arguments.framework} is built from a clone: give --repo")
    else:
        build(arguments.framework, git_releases(arguments.repo, arguments.framework), out)


if __name__ == "__main__":
    main()
