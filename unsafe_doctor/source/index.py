"""The framework index: skeletons and line fingerprints of every release of the frameworks, shipped as data.

Most logs are read where the job's framework is not installed, or another release of it is. The
index stands in for the job's files: per framework one zip in `knowledge_base/index/`, written by
`scripts/build_index.py` from the real releases pinned in `knowledge_base/index/sources.yaml`
(`pinned_releases`: megatron-core wheels from the package index with their sha256, MindSpeed and
MindSpeed-LLM commits of their public repositories).

Format (`FORMAT`), per zip:

* `releases.json`: `{"format", "framework", "releases": [{"name", "source", "digest"}]}`, oldest
  first; `source` says where the release was read (`pypi:<wheel>` or `git:<framework>@<commit>`),
  `digest` the wheel's sha256 or the commit id.
* `files/<path inside the release>`: JSON list of the file's distinct versions,
  `{"releases": [indices], "sha256", "hashes": base64 of little-endian uint16 line hashes,
  "skeleton"}` (`unsafe_doctor.source.skeleton`).

Nothing is read until a log names a path under a framework's package folder; then only that
framework's directory and the files asked for are read, each once.
"""

from __future__ import annotations

import base64
import json
import sys
import zipfile
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

FORMAT = 1
INDEX_FOLDER = Path(__file__).resolve().parents[2] / "knowledge_base" / "index"  # in a checkout; see `index_folder`
# The package folders each framework's release holds, as a printed path shows them.
FRAMEWORK_FOLDERS: dict[str, tuple[str, ...]] = {
    "megatron-core": ("megatron/core/", "megatron/training/"),  # training/: in the wheels of 0.17 and newer
    "mindspeed": ("mindspeed/",),
    "mindspeed-llm": ("mindspeed_llm/", "modellink/"),
}


@dataclass(frozen=True)
class Release:
    name: str  # "0.12.1", "2.3.0", "master@c77308a1"
    source: str  # where it was read: "pypi:<wheel file>", "git:<framework>@<commit>"
    digest: str  # the wheel's sha256, or the commit id


@dataclass
class FileVersion:
    releases: list[int]  # indices into the framework's releases
    sha256: str  # of the file as released
    hashes: list[int]  # `skeleton.line_hash` of each line
    skeleton: str


def index_folder() -> Path:
    """`knowledge_base/index` beside the package in a checkout; inside the package once installed."""
    if INDEX_FOLDER.is_dir():
        return INDEX_FOLDER
    return Path(__file__).resolve().parents[1] / "knowledge_base" / "index"


def pinned_releases(framework: str, sources: Path) -> tuple[Release, ...]:
    """The releases `sources` (`sources.yaml`) pins for a framework, in index order, as its zip records them:
    a wheel by file name and sha256, a commit by its id. A malformed list raises ValueError."""
    import yaml  # here: the knowledge stage imports this module for INDEX_FOLDER, and a diagnosis needs no YAML

    try:
        listed = yaml.safe_load(sources.read_text(encoding="utf-8"))[framework]
        releases = tuple(
            Release(entry["release"], f"pypi:{entry['wheel']}", entry["sha256"])
            if "wheel" in entry
            else Release(entry["release"], f"git:{framework}@{entry['commit']}", entry["commit"])
            for entry in listed
        )
    except (OSError, yaml.YAMLError, TypeError, KeyError) as error:
        raise ValueError(f"{sources}: no list of {framework} releases ({error!r})") from error
    unquoted = [release.name for release in releases if not all(isinstance(text, str) for text in vars(release).values())]
    if unquoted:  # YAML reads 0.10 or a digits-only id as a number: quote them
        raise ValueError(f"{sources}: {framework} release {unquoted[0]!r}: every value must be a string")
    return releases


def write_index(out: Path, framework: str, releases: Sequence[Release], files: dict[str, list[FileVersion]]) -> None:
    """One framework's zip (used by `scripts/build_index.py`); written aside, then moved in place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as archive:

        def member(name: str, text: str) -> None:  # a fixed date: the same releases give the same bytes
            archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), text, zipfile.ZIP_DEFLATED, 9)

        meta = {"format": FORMAT, "framework": framework, "releases": [vars(release) for release in releases]}
        member("releases.json", json.dumps(meta, indent=1))
        for path in sorted(files):
            rows = [
                {
                    "releases": version.releases,
                    "sha256": version.sha256,
                    "hashes": base64.b64encode(_little_endian(version.hashes).tobytes()).decode(),
                    "skeleton": version.skeleton,
                }
                for version in files[path]
            ]
            member(f"files/{path}", json.dumps(rows, separators=(",", ":")))
    partial.replace(out)


def _little_endian(values: Sequence[int]) -> array:
    packed = array("H", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed


class IndexedFramework:
    """One framework's zip, opened on first use; each file's versions read once."""

    def __init__(self, name: str, path: Path):
        self.name = name
        self.path = path
        self._versions: dict[str, list[FileVersion]] = {}

    @cached_property
    def _archive(self) -> zipfile.ZipFile:
        return zipfile.ZipFile(self.path)

    @cached_property
    def releases(self) -> tuple[Release, ...]:
        meta = json.loads(self._archive.read("releases.json"))
        if meta.get("format") != FORMAT:
            return ()
        return tuple(Release(**release) for release in meta["releases"])

    @cached_property
    def paths(self) -> frozenset[str]:
        return frozenset(name.removeprefix("files/") for name in self._archive.namelist() if name.startswith("files/"))

    @cached_property
    def folders(self) -> frozenset[str]:
        """Every folder a path lies in (`megatron`, `megatron/core`, ...): packages, namespace ones too."""
        return frozenset("/".join(path.split("/")[:depth]) for path in self.paths for depth in range(1, path.count("/") + 1))

    def path_of(self, printed: str) -> str | None:
        """The release path a printed path ends with, when the frame ran one of this framework's files."""
        normal = printed.replace("\\", "/")
        for folder in FRAMEWORK_FOLDERS[self.name]:
            at = normal.rfind("/" + folder)
            start = at + 1 if at >= 0 else (0 if normal.startswith(folder) else -1)
            if start >= 0 and normal[start:] in self.paths:
                return normal[start:]
        return None

    def ships_folder_everywhere(self, path: str) -> bool:
        """Whether every release holds the package folder the path is in (megatron-core's wheels hold
        `megatron/training/` from 0.17 only, though every Megatron-LM checkout has it): read from the
        folder's `__init__.py`; a folder without one counts as held everywhere."""
        folder = next((folder for folder in FRAMEWORK_FOLDERS[self.name] if path.startswith(folder)), None)
        if folder is None or f"{folder}__init__.py" not in self.paths:
            return True
        held = {release for version in self.versions(f"{folder}__init__.py") for release in version.releases}
        return len(held) == len(self.releases)

    def versions(self, path: str) -> list[FileVersion]:
        if path not in self._versions:
            rows = json.loads(self._archive.read(f"files/{path}")) if path in self.paths else []
            self._versions[path] = [
                FileVersion(row["releases"], row["sha256"], _hashes(row["hashes"]), row["skeleton"]) for row in rows
            ]
        return self._versions[path]

    def version_in(self, path: str, release: int) -> FileVersion | None:
        return next((version for version in self.versions(path) if release in version.releases), None)


def _hashes(encoded: str) -> list[int]:
    packed = array("H")
    packed.frombytes(base64.b64decode(encoded))
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


class FrameworkIndex:
    """Every shipped framework's index; none opened until asked for."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder if folder is not None else index_folder()
        self._frameworks = {
            name: IndexedFramework(name, self.folder / f"{name}.zip")
            for name in FRAMEWORK_FOLDERS
            if (self.folder / f"{name}.zip").is_file()
        }

    @property
    def frameworks(self) -> tuple[IndexedFramework, ...]:
        return tuple(self._frameworks.values())

    def framework_of(self, printed: str) -> tuple[IndexedFramework, str] | None:
        """The framework whose release holds the printed path, and the path inside the release;
        only a path under one of `FRAMEWORK_FOLDERS` opens an index."""
        normal = printed.replace("\\", "/")
        for name, folders in FRAMEWORK_FOLDERS.items():
            if name in self._frameworks and any(("/" + folder) in normal or normal.startswith(folder) for folder in folders):
                path = self._frameworks[name].path_of(normal)
                if path is not None:
                    return self._frameworks[name], path
        return None
