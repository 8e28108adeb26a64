"""Files and module names: which files are internal, which Python files a folder holds, how a
source file is read and a file written in place, the framework packages, import roots and dotted
names. Nothing here parses a file."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator, Sequence
from importlib.util import decode_source
from pathlib import Path

from unsafe_doctor.log.inputs import is_regular
from unsafe_doctor.source.looked_at import note_folder, note_read, note_unlisted, regular_bytes

# Distribution -> its top-level package: the frameworks whose versions are detected.
FRAMEWORK_DISTRIBUTIONS = {"megatron-core": "megatron", "mindspeed": "mindspeed", "mindspeed-llm": "mindspeed_llm"}
# Top-level packages of the frameworks adaptors call into: read when a name leads there, recognised
# in a printed path without a local file, and packages even without an `__init__.py` (megatron in
# megatron-core is a namespace package).
FRAMEWORK_PACKAGES = frozenset({*FRAMEWORK_DISTRIBUTIONS.values(), "modellink", "mindio_ttp"})

# --- which files are internal ----------------------------------------------------------------------

_INTERNAL_PARTS = ("/torch/", "/torch_npu/", "site-packages/torch", "dist-packages/torch")
_STDLIB_DIR = re.compile(r"/lib(?:64)?/python\d+(?:\.\d+)?/(?!(?:site|dist)-packages/)")
_STDLIB_WRAPPERS = frozenset({"functools.py", "contextlib.py", "threading.py", "runpy.py"})


def is_internal_file(path: str) -> bool:
    """True for torch / torch_npu and Python standard-library files: code the user does not change."""
    normal = path.replace("\\", "/")
    return (
        normal.startswith("<")  # <frozen importlib._bootstrap>, <string>
        or any(part in normal for part in _INTERNAL_PARTS)
        or _STDLIB_DIR.search(normal) is not None
        or normal.rsplit("/", 1)[-1] in _STDLIB_WRAPPERS
    )


def shown_path(path: Path) -> Path:
    """Relative to the working folder when inside it, as the user typed the adaptor's path."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a log's path may be too long, or hold a NUL byte
        return False


def is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):  # a `sys.path` entry under a folder this user may not enter
        return False


# --- which Python files a folder holds -------------------------------------------------------------

_SKIP_FOLDERS = frozenset(
    # mindspore: MindSpeed's MindSpore backend (mindspeed/mindspore/), which a torch job never runs
    {"__pycache__", "site-packages", "dist-packages", "node_modules", "tests", "test", "build", "dist", "mindspore"}
)


def _skipped(folder: str) -> bool:
    """Hidden folders, caches, tests, build output, MindSpore backends and installed environments
    (`venv`, `.venv`, `myvenv`, `*.egg-info`): code the user's job does not run, or another copy of
    what it runs."""
    return folder.startswith(".") or folder in _SKIP_FOLDERS or folder.endswith(("venv", ".egg-info"))


def python_files(path: Path) -> Iterator[Path]:
    """Regular `*.py` files under a folder in a stable order (a folder's files before its
    subfolders, both sorted), skipping what `_skipped` says; a file given itself is its only file,
    whatever its name. A FIFO or device named `x.py` is never listed: reading it would block."""
    if is_file(path):
        yield path
        return
    for folder, subfolders, names in os.walk(path, onerror=note_unlisted):
        note_folder(folder, subfolders + names)
        subfolders[:] = sorted(name for name in subfolders if not _skipped(name))
        for name in sorted(names):
            if name.endswith(".py") and is_regular(Path(folder, name)):
                yield Path(folder, name)


# --- reading a source file -------------------------------------------------------------------------

# Megatron's largest module is about 200 KB; a "source" file past this is generated data, and a
# frame pointing at one must not make the run read gigabytes.
MAX_SOURCE_BYTES = 16 << 20
# What is built from a file grows with its tokens, not its bytes: Python's tree takes about 540 bytes
# a node, and a generated 4 MB module of 1.5 M tokens made an 880 MB tree (2.1 GB for the whole
# diagnose). Megatron's largest module has 30,000 tokens, torch's largest test table 270,000.
MAX_SOURCE_TOKENS = 300_000
_TOKEN = re.compile(r"\w+|[^\s\w]")


def read_source(path: Path) -> str | None:
    """The text of a regular file of at most MAX_SOURCE_BYTES (`python_text`), read at most
    that far; None for anything else."""
    data = source_bytes(path)
    note_read(path, data)
    if data is None:
        return None
    text = python_text(data)
    return None if _too_many_tokens(text) else text


def source_bytes(path: str | os.PathLike[str]) -> bytes | None:
    """The bytes of a regular file of at most MAX_SOURCE_BYTES, read at most that far; None for
    anything else."""
    return regular_bytes(path, MAX_SOURCE_BYTES)


def read_replacing(path: Path) -> str:
    """The file's text as UTF-8, undecodable bytes replaced, newlines made `\\n` (as `read_text(errors=
    "replace")` reads it), recorded as read (`looked_at`); OSError when it cannot be read."""
    try:
        data = path.read_bytes()
    except OSError:
        note_read(path, None, whole=True)
        raise
    note_read(path, data, whole=True)
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def _too_many_tokens(text: str) -> bool:
    """More than MAX_SOURCE_TOKENS words and symbols; counted only in a file long enough to hold them."""
    if len(text) <= MAX_SOURCE_TOKENS:
        return False
    return any(count > MAX_SOURCE_TOKENS for count, _ in enumerate(_TOKEN.finditer(text), 1))


def python_text(data: bytes) -> str:
    """A Python file's text as Python reads it: in the encoding its PEP 263 coding line names (a
    cp932 adaptor holds bytes that are not UTF-8), a BOM dropped, universal newlines; a file that
    names no encoding it can be read in is read as UTF-8 with replacement."""
    try:
        return decode_source(data)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        text = data.decode("utf-8-sig", errors="replace")
        return text.replace("\r\n", "\n").replace("\r", "\n")


def why_not_read(path: Path) -> str:
    """Why `read_source` (or parsing) gave nothing, as a note's phrase."""
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return "could not be read"
    if not stat.S_ISREG(status.st_mode):
        return "is not a regular file: not read"
    if status.st_size > MAX_SOURCE_BYTES:
        return f"is larger than {MAX_SOURCE_BYTES >> 20} MB: not read, the log's text is used"
    if status.st_size > MAX_SOURCE_TOKENS and read_source(path) is None:
        return f"has more than {MAX_SOURCE_TOKENS:,} tokens (generated code?): not parsed, the log's text is used"
    return "could not be read or parsed"


# --- writing a file in place ----------------------------------------------------------------------


def write_over(descriptor: int, data: bytes) -> None:
    """`data` as the whole content of the file open (for writing) at `descriptor`, written into it as
    `>` does, not renamed over it: the file keeps its inode, hard links, owner, group, mode and
    attributes. Its space is taken first, so a full disk fails before a byte changes."""
    if data:
        os.posix_fallocate(descriptor, 0, len(data))
    view = memoryview(data)
    offset = 0
    while offset < len(view):
        offset += os.pwrite(descriptor, view[offset:], offset)
    os.ftruncate(descriptor, len(data))
    os.fsync(descriptor)


# --- import roots and module names -----------------------------------------------------------------


def import_root(path: Path, module: str) -> Path | None:
    """The folder above the module's top package: its sibling modules are importable from there."""
    depth = len(module.split(".")) - (0 if path.name == "__init__.py" else 1)
    parents = path.resolve().parents
    return parents[depth] if depth < len(parents) else None


def package_folder(path: Path, module: str) -> Path | None:
    """The folder of the module's top-level package: `.../megatron` for megatron.core.parallel_state;
    None for a top-level module file, which is in no package."""
    root = import_root(path, module)
    if root is None or (path.name != "__init__.py" and "." not in module):
        return None
    return root / module.split(".")[0]


def package_of(path: Path, module: str | None) -> str | None:
    """The package the file's relative imports start from (the module itself for an `__init__.py`)."""
    package = module if path.name == "__init__.py" else (module.rpartition(".")[0] if module else None)
    return package or None


def dotted(parts: Sequence[str]) -> str | None:
    """`("pkg", "sub", "mod.py")` -> `pkg.sub.mod` (an `__init__.py` names its package); None unless
    every part is an identifier."""
    names = list(parts)
    if not names:
        return None
    names[-1] = names[-1].removesuffix(".py")
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names) if names and all(name.isidentifier() for name in names) else None


def after_site_packages(normal: str) -> str | None:
    """The module of an installed file: the path after `site-packages/` (or `dist-packages/`)."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in normal:
            return dotted(normal.rsplit(marker, 1)[1].split("/"))
    return None


def framework_suffix(parts: Sequence[str]) -> str | None:
    """`/home/u/ModelLink/megatron/core/x.py` -> `megatron.core.x`, without any local file."""
    for index, part in enumerate(parts):
        if part in FRAMEWORK_PACKAGES:
            name = dotted(parts[index:])
            if name:
                return name
    return None


class ImportRoots:
    """The folder above the top package holding a file or folder (the folder itself when it is no
    package): where Python would import it from, so modules are named as the code imports them.

    A folder is part of a package when it has an `__init__.py`, when it sits in a folder that has
    one (a namespace subpackage, as megatron-core has), or when it is a framework's namespace
    package (`megatron` in megatron-core has no `__init__.py`)."""

    def __init__(self) -> None:
        self._roots: dict[Path, Path] = {}  # by resolved folder
        self._named: dict[Path, Path] = {}  # by folder as named: resolving a path reads every folder on it

    def of(self, path: Path) -> Path:
        named = path if path.is_dir() else path.parent
        if named not in self._named:
            self._named[named] = self._of_folder(named.resolve())
        return self._named[named]

    def _of_folder(self, folder: Path) -> Path:
        if folder not in self._roots:
            package = (
                (folder / "__init__.py").is_file()
                or (folder.parent / "__init__.py").is_file()
                or folder.name in FRAMEWORK_PACKAGES
            )
            self._roots[folder] = self._of_folder(folder.parent) if package and folder.parent != folder else folder
        return self._roots[folder]
