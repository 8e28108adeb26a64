"""Derive knowledge_base/index/megatron-core-arguments.json: the arguments each megatron-core release's parser adds.

    python scripts/derive_arguments.py --cache WHEELS --repo MEGATRON_LM_GIT_DIR

Megatron-LM's `_print_args` prints every attribute of the parsed arguments, so a job's arguments dump
holds every `dest` its release's parser adds; names come and go release by release, and the dump tells
the release (`unsafe_doctor.knowledge.argument_releases`). For each release sources.yaml pins, the
script reads with `ast` the release's own parser file: `megatron/training/arguments.py` of the wheel
(0.17 and newer ship it, checked against the pinned sha256 as `scripts/build_index.py` checks it),
else of the Megatron-LM tag `core_v<release>` (`megatron/arguments.py` in tags that predate
megatron/training/). A release with no tag is left out and said so. The dests are argparse's: an
explicit `dest=`, else the first long option (dashes to underscores), else the first option; and
for each `ArgumentGroupFactory(Config, exclude=...)` (0.16 on), every init field of the dataclass
and its bases, less those excluded, under its name or its `argparse_meta` `dest`. The same sources
give the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from build_index import SOURCES, megatron_releases  # scripts/ is the script's own folder on sys.path
from packaging.version import Version

from unsafe_doctor.knowledge.argument_releases import ARGUMENTS_FILE
from unsafe_doctor.source.index import pinned_releases

WHEEL_PARSER_SINCE = Version("0.17.0")  # the first wheels that ship megatron/training/
PARSER_PATHS = ("megatron/training/arguments.py", "megatron/arguments.py")
FACTORY = "ArgumentGroupFactory"

Reader = Callable[[str], "str | None"]  # a file of the release by path, or None


def option_dest(call: ast.Call) -> str | None:
    """The dest argparse gives an `add_argument(...)` call whose names and dest are literals."""
    for keyword in call.keywords:
        if keyword.arg == "dest":
            return keyword.value.value if isinstance(keyword.value, ast.Constant) else None
    options = [arg.value for arg in call.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
    if not options:
        return None
    chosen = next((option for option in options if option.startswith("--")), options[0])
    return chosen.lstrip("-").replace("-", "_")


def _module_path(module: str, read: Reader) -> str | None:
    base = module.replace(".", "/")
    return next((path for path in (f"{base}.py", f"{base}/__init__.py") if read(path) is not None), None)


def _absolute(module: str | None, level: int, path: str) -> str:
    """The module a `from module import ...` of file `path` names (relative imports resolved)."""
    if level == 0:
        return module or ""
    return ".".join([*path.split("/")[:-level], *([module] if module else [])])


def find_class(name: str, path: str, read: Reader, depth: int = 0) -> tuple[ast.ClassDef, str] | None:
    """The class `name` as file `path` sees it: defined there, or imported (re-exports followed)."""
    text = read(path)
    if text is None or depth > 8:
        return None
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node, path
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    target = _module_path(_absolute(node.module, node.level, path), read)
                    if target is not None:
                        found = find_class(alias.name, target, read, depth + 1)
                        if found is not None:
                            return found
    return None


def _is_init_field(statement: ast.AnnAssign) -> bool:
    annotation = ast.unparse(statement.annotation)
    if "ClassVar" in annotation or "InitVar" in annotation:
        return False
    value = statement.value
    if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field"):
        return not any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in value.keywords)
    return True


def _metadata_dest(statement: ast.AnnAssign) -> str | None:
    """The `dest` a field's `metadata={"argparse_meta": {"dest": ...}}` sets."""
    value = statement.value
    if not isinstance(value, ast.Call):
        return None
    for keyword in value.keywords:
        if keyword.arg == "metadata" and isinstance(keyword.value, ast.Dict):
            for key, meta in zip(keyword.value.keys, keyword.value.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "argparse_meta" and isinstance(meta, ast.Dict):
                    for inner, dest in zip(meta.keys, meta.values, strict=True):
                        if isinstance(inner, ast.Constant) and inner.value == "dest" and isinstance(dest, ast.Constant):
                            return str(dest.value)
    return None


def dataclass_dests(name: str, path: str, read: Reader) -> dict[str, str]:
    """Field name -> dest of every init field of the dataclass `name` (seen from `path`) and its bases."""
    found = find_class(name, path, read)
    if found is None:
        raise ValueError(f"{path}: cannot find the class {name}")
    node, where = found
    fields: dict[str, str] = {}
    for base in node.bases:
        if isinstance(base, ast.Name):
            fields.update(dataclass_dests(base.id, where, read) if find_class(base.id, where, read) else {})
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and _is_init_field(statement):
            fields[statement.target.id] = _metadata_dest(statement) or statement.target.id
    return fields


def _listed(value: ast.expr, assigned: dict[str, ast.expr]) -> list[str]:
    """The strings of a literal list, of a name assigned one in the same function, or of their sum."""
    if isinstance(value, ast.Name) and value.id in assigned:
        return _listed(assigned[value.id], assigned)
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        return _listed(value.left, assigned) + _listed(value.right, assigned)
    if isinstance(value, (ast.List, ast.Tuple)):
        return [item.value for item in value.elts if isinstance(item, ast.Constant) and isinstance(item.value, str)]
    raise ValueError(f"an exclude list the script cannot read: {ast.unparse(value)}")


def parser_dests(path: str, read: Reader) -> set[str]:
    """Every dest the parser file adds: its `add_argument` calls and its dataclass argument groups."""
    text = read(path)
    assert text is not None
    dests: set[str] = set()
    for function in ast.walk(ast.parse(text)):
        if not isinstance(function, (ast.FunctionDef, ast.Module)):
            continue
        assigned = {
            target.id: node.value
            for node in ast.walk(function)
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for call in ast.walk(function):
            if not isinstance(call, ast.Call):
                continue
            callee = ast.unparse(call.func)
            if callee.endswith(".add_argument"):
                dest = option_dest(call)
                if dest is not None:
                    dests.add(dest)
            elif callee.split(".")[-1] == FACTORY and call.args and isinstance(call.args[0], ast.Name):
                exclude = {keyword.arg: keyword.value for keyword in call.keywords}.get("exclude")
                skipped = set(_listed(exclude, assigned)) if exclude is not None else set()
                fields = dataclass_dests(call.args[0].id, path, read)
                dests |= {dest for name, dest in fields.items() if name not in skipped}
    return dests


def _git_reader(repo: Path, commit: str) -> Reader:
    cache: dict[str, str | None] = {}

    def read(path: str) -> str | None:
        if path not in cache:
            shown = subprocess.run(["git", "--git-dir", str(repo), "show", f"{commit}:{path}"], capture_output=True)
            cache[path] = shown.stdout.decode("utf-8", "replace") if shown.returncode == 0 else None
        return cache[path]

    return read


def release_parsers(cache: Path, repo: Path, sources: Path) -> Iterator[tuple[str, dict[str, str], set[str]]]:
    """(release, provenance, dests) for each pinned release, oldest first; a release with no source is said on stderr."""
    wheels = {
        release.name: files for release, files in megatron_releases(cache, lambda version: version >= WHEEL_PARSER_SINCE, sources)
    }
    for release in pinned_releases("megatron-core", sources):
        if release.name in wheels:
            files = wheels[release.name]
            read: Reader = lambda path, files=files: files[path].decode() if path in files else None  # noqa: E731
            provenance = {"wheel": release.source.removeprefix("pypi:"), "sha256": release.digest}
        else:
            tag = f"core_v{release.name}"
            shown = subprocess.run(
                ["git", "--git-dir", str(repo), "rev-parse", "-q", "--verify", f"{tag}^{{commit}}"],
                capture_output=True,
                text=True,
            )
            if shown.returncode != 0:
                print(f"megatron-core {release.name}: no tag {tag} in {repo}: left out", file=sys.stderr)
                continue
            commit = shown.stdout.strip()
            read = _git_reader(repo, commit)
            provenance = {"tag": tag, "commit": commit}
        path = next((path for path in PARSER_PATHS if read(path) is not None), None)
        if path is None:
            raise ValueError(f"megatron-core {release.name}: no parser file ({', '.join(PARSER_PATHS)})")
        dests = parser_dests(path, read)
        print(f"megatron-core {release.name}: {len(dests)} arguments from {path}", file=sys.stderr)
        yield release.name, {**provenance, "path": path}, dests


def derived_json(parsers: list[tuple[str, dict[str, str], set[str]]]) -> str:
    """Each argument once, with the indices of the releases whose parser adds it."""
    releases = [{"release": name, **provenance} for name, provenance, _ in parsers]
    names = sorted({dest for _, _, dests in parsers for dest in dests})
    held = {name: [index for index, (_, _, dests) in enumerate(parsers) if name in dests] for name in names}
    rows = [f"  {json.dumps(name)}: {json.dumps(indices, separators=(',', ':'))}" for name, indices in held.items()]
    return "\n".join(
        [
            "{",
            f' "about": {json.dumps(__doc__.splitlines()[0])},',
            ' "releases": [',
            ",\n".join(f"  {json.dumps(release)}" for release in releases),
            " ],",
            ' "arguments": {',
            ",\n".join(rows),
            " }",
            "}",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, help="where downloaded wheels are kept")
    parser.add_argument("--repo", type=Path, required=True, help="git directory of a Megatron-LM clone (its core_v tags)")
    parser.add_argument("--sources", type=Path, default=SOURCES, help="the pinned list of releases")
    parser.add_argument("--out", type=Path, default=ARGUMENTS_FILE)
    arguments = parser.parse_args()
    cache = arguments.cache or Path(tempfile.mkdtemp(prefix="megatron-core-wheels-"))
    if subprocess.run(["git", "--git-dir", str(arguments.repo), "rev-parse"], capture_output=True).returncode != 0:
        parser.exit(2, f"derive_arguments: {arguments.repo} is no git directory (give a Megatron-LM clone's)\n")
    try:
        parsers = list(release_parsers(cache, arguments.repo, arguments.sources))
    except ValueError as error:
        parser.exit(2, f"derive_arguments: {error}\n")
    arguments.out.write_text(derived_json(parsers))
    print(f"wrote {arguments.out} ({len(parsers)} releases)", file=sys.stderr)


if __name__ == "__main__":
    main()
