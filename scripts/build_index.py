"""Build the framework index shipped in knowledge_base/index/ from the releases its sources.yaml pins.

    python scripts/build_index.py megatron-core                       # downloads the pinned wheels
    python scripts/build_index.py mindspeed --repo PATH_TO_GIT_DIR   # the pinned commits of a clone
    python scripts/build_index.py mindspeed-llm --repo PATH_TO_GIT_DIR

megatron-core releases are wheels of the package index (0.5.0 and newer: older ones predate the MoE
and memory-buffer globals the rules name), each checked against its pinned sha256; MindSpeed and
MindSpeed-LLM publish no wheels, so their releases are commits of their public repositories
(github.com/Ascend/MindSpeed, github.com/Ascend/MindSpeed-LLM): tags, branches, master.
The same pinned sources give the same bytes. The output records, per release, where it came from;
per file version, its sha256 and the releases that ship it. See `unsafe_doctor.source.index` for the format.
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

from packaging.utils import parse_wheel_filename
from packaging.version import Version

from unsafe_doctor.source.index import (
    FRAMEWORK_FOLDERS,
    INDEX_FOLDER,
    FileVersion,
    Release,
    pinned_releases,
    write_index,
)
from unsafe_doctor.source.skeleton import line_hashes, skeleton

SOURCES = INDEX_FOLDER / "sources.yaml"


def _is_indexed(path: str, framework: str) -> bool:
    return path.endswith(".py") and path.startswith(FRAMEWORK_FOLDERS[framework]) and "/tests/" not in path


def megatron_releases(
    cache: Path, wanted: Callable[[Version], bool] = lambda version: True, sources: Path = SOURCES
) -> Iterator[tuple[Release, dict[str, bytes]]]:
    """Every pinned megatron-core release (that `wanted` takes), as its wheel's Python files; a wheel not
    in `cache` is downloaded for the Python its name is built for (0.17 and newer declare Python >= 3.12)."""
    for release in pinned_releases("megatron-core", sources):
        if not wanted(Version(release.name)):
            continue
        wheel = cache / release.source.removeprefix("pypi:")
        if not wheel.is_file():
            interpreter = next(iter(parse_wheel_filename(wheel.name)[3])).interpreter  # cp312
            fetched = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--quiet",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--python-version",
                    f"{interpreter[2]}.{interpreter[3:]}",
                    f"megatron-core=={release.name}",
                    "-d",
                    str(cache),
                ],
                capture_output=True,
                text=True,
            )
            if fetched.returncode != 0:
                reason = (fetched.stderr.strip().splitlines() or ["no reason given"])[-1]
                raise ValueError(f"megatron-core {release.name}: pip could not download {wheel.name} into {cache}: {reason}")
        if not wheel.is_file():
            raise ValueError(f"megatron-core {release.name}: pip did not fetch {wheel.name}")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != release.digest:
            raise ValueError(f"{wheel}: sha256 {digest}, but {sources} pins {release.digest}")
        with zipfile.ZipFile(wheel) as archive:
            files = {name: archive.read(name) for name in archive.namelist() if _is_indexed(name, "megatron-core")}
        yield release, files


def git_releases(repo: Path, framework: str, sources: Path = SOURCES) -> Iterator[tuple[Release, dict[str, bytes]]]:
    """Every pinned release of the framework, read from its commit in the clone's git directory."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "--git-dir", str(repo), *args], capture_output=True, text=True)

    for release in pinned_releases(framework, sources):
        listing = git("ls-tree", "-r", release.digest)
        if listing.returncode != 0:
            raise ValueError(f"{framework} {release.name}: {repo} has no commit {release.digest}")
        blobs = {}
        for row in listing.stdout.splitlines():
            meta, path = row.split("\t", 1)
            if _is_indexed(path, framework):
                blobs[path] = meta.split()[2]
        contents = subprocess.run(
            ["git", "--git-dir", str(repo), "cat-file", "--batch"],
            input="\n".join(blobs.values()).encode() + b"\n",
            capture_output=True,
            check=True,
        ).stdout
        yield release, dict(zip(blobs, _batch_blobs(contents), strict=True))


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
    print(
        f"wrote {out} ({out.stat().st_size // 1024} KB, {len(shipped)} releases, "
        f"{sum(map(len, versions.values()))} file versions, {unparsed} unparsable)",
        file=sys.stderr,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("framework", choices=sorted(FRAMEWORK_FOLDERS))
    parser.add_argument("--repo", type=Path, help="git directory of a clone (mindspeed, mindspeed-llm)")
    parser.add_argument("--cache", type=Path, help="where downloaded wheels are kept (megatron-core)")
    parser.add_argument("--sources", type=Path, default=SOURCES, help="the pinned list of releases")
    parser.add_argument("--out", type=Path, default=INDEX_FOLDER)
    arguments = parser.parse_args()
    out = arguments.out / f"{arguments.framework}.zip"
    if arguments.framework == "megatron-core":
        cache = arguments.cache or Path(tempfile.mkdtemp(prefix="megatron-core-wheels-"))
        releases = megatron_releases(cache, sources=arguments.sources)
    elif arguments.repo is None:
        parser.error(f"{arguments.framework} is built from a clone: give --repo")
    else:
        releases = git_releases(arguments.repo, arguments.framework, arguments.sources)
    try:
        build(arguments.framework, releases, out)
    except ValueError as error:
        parser.exit(2, f"build_index: {error}\n")


if __name__ == "__main__":
    main()
