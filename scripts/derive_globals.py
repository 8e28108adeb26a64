"""Derive knowledge_base/index/globals.json: every global the audit reports in every pinned release.

    python scripts/derive_globals.py --cache WHEELS --mindspeed MINDSPEED_GIT_DIR --mindspeed-llm MINDSPEED_LLM_GIT_DIR

Each release pinned in knowledge_base/index/sources.yaml (megatron-core wheels, as
`scripts/build_index.py` fetches and checks them; MindSpeed and MindSpeed-LLM commits of their clones)
is written to a temporary folder laid out as its packages (`megatron/core/...`, `mindspeed/...`), and
`unsafe_doctor.audit.run.audit` (what `unsafe-doctor audit` runs, with no adaptor) audits it alone:
its modules are named as in a user's tree. Every holder the audit reports (a global, class attribute,
singleton, lru cache or buffer that may keep a device tensor across steps; a checkpoint converter's
are left out, as the audit leaves them out) is listed once per framework, module, class and name,
with the releases it is held in, its kind and where it is defined (both as the newest of those
releases has them), and the functions it is read and written in (what a rule's frame fields are
matched against). Each release is recorded with its source and digest. The same sources, audited with
the same shipped rules (the audit adds the globals a rule names where the scan sees no tensor), give
the same bytes. tests/knowledge/test_coverage.py holds every listed global to a shipped rule that claims each of
its releases, or to knowledge_base/reviewed_globals.yaml.

All 54 releases take about 3 minutes on this shared 2-core machine (2 m 33 s and 2 m 57 s in two
runs; 1 to 16 s a release, the newest megatron-core and MindSpeed the longest). `--only
FRAMEWORK=RELEASE` (repeated) audits only those releases and prints their globals, for the test that
finds the shipped file current. `--check` audits nothing: it lists each global of the shipped file
that no rule claims and no review names.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml
from build_index import SOURCES, git_releases, megatron_releases  # scripts/ is the script's own folder on sys.path
from packaging.version import Version

from unsafe_doctor.audit.run import audit
from unsafe_doctor.knowledge.loading import REVIEWED_FILE, load_knowledge, shipped_knowledge_dir, validate_files
from unsafe_doctor.knowledge.matching import frame_named, rule_matches
from unsafe_doctor.knowledge.rules import KnowledgeBase, Rule
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.recovery_code.model import Holder
from unsafe_doctor.source.fingerprint import release_version
from unsafe_doctor.source.index import FRAMEWORK_FOLDERS, INDEX_FOLDER, Release

GLOBALS_FILE = INDEX_FOLDER / "globals.json"
REVIEWED = shipped_knowledge_dir() / REVIEWED_FILE
FORMAT = 1
Files = dict[str, bytes]


def audited(files: Files) -> list[dict]:
    """The holders the audit reports in one release's files, laid out as its packages."""
    with tempfile.TemporaryDirectory(prefix="release-") as folder:
        root = Path(folder)
        for path, content in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(content)
        tops = sorted({path.split("/", 1)[0] for path in files})
        found = audit([root / top for top in tops])
        return [_entry(item.holder, folder + "/") for item in found.holders]


def _entry(holder: Holder, root: str) -> dict:
    """One holder: its names, kind, definition, and the functions of its sites (where the audit
    reads it against the rules' frame fields), paths relative to the release's folder."""
    sites = (holder.definition, *holder.writers, *holder.readers)
    return {
        "module": holder.name.module,
        "class": holder.name.owner,
        "name": holder.name.variable,
        "kind": holder.kind,
        "defined": f"{holder.definition.file.removeprefix(root)}:{holder.definition.line}",
        "sites": sorted({f"{site.file.removeprefix(root)}:{site.function or '<module>'}" for site in sites}),
    }


def releases(
    cache: Path | None, stacks: dict[str, Path], only: set[tuple[str, str]] | None, sources: Path = SOURCES
) -> Iterator[tuple[str, Release, Files]]:
    """Every pinned release (of `only`, when given) of megatron-core (with a cache) and of the clones given."""
    if cache is not None:

        def wanted(version: Version) -> bool:
            return only is None or ("megatron-core", str(version)) in only

        for release, files in megatron_releases(cache, wanted, sources):
            yield "megatron-core", release, files
    for framework, repo in stacks.items():
        for release, files in git_releases(repo, framework, sources):
            if only is None or (framework, release.name) in only:
                yield framework, release, files


def derive(found: Iterator[tuple[str, Release, Files]]) -> dict:
    """The document: each release's provenance, and each global with the releases that hold it."""
    provenance: dict[str, list[dict]] = {}
    held: dict[tuple[str, str, str, str], dict] = {}  # (framework, module, class, name) -> entry
    for framework, release, files in found:
        started = time.monotonic()
        holders = audited(files)
        print(f"{framework} {release.name}: {len(holders)} globals, {time.monotonic() - started:.1f} s", file=sys.stderr)
        provenance.setdefault(framework, []).append({"release": release.name, "source": release.source, "digest": release.digest})
        for holder in holders:
            key = (framework, holder["module"], holder["class"] or "", holder["name"])
            entry = held.setdefault(
                key,
                {
                    "framework": framework,
                    "module": holder["module"],
                    "class": holder["class"],
                    "name": holder["name"],
                    "releases": [],
                },
            )
            entry["releases"].append(release.name)
            entry.update(kind=holder["kind"], defined=holder["defined"], sites=holder["sites"])  # the newest release's
    return {
        "format": FORMAT,
        "generated_by": "python scripts/derive_globals.py --cache WHEELS --mindspeed MINDSPEED_GIT_DIR "
        "--mindspeed-llm MINDSPEED_LLM_GIT_DIR (see its docstring; do not edit by hand)",
        "releases": provenance,
        "globals": [held[key] for key in sorted(held)],
    }


# --- the check: every global covered by a rule, the step's own writes, or a review -----------------------


def reviewed(path: Path = REVIEWED) -> list[dict]:
    """The reviewed globals, schema-checked as knowledge files are (`rules validate`): those that need
    no rule, then the known holes (`needs_rule`: true), which no rule covers yet."""
    problems = validate_files([path])
    if problems:
        raise ValueError(problems[0])
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [*data.get("reviewed", []), *({**entry, "needs_rule": True} for entry in data.get("needs_rule", []))]


def claimed_by(knowledge: KnowledgeBase, found: dict, version: Version | None) -> list[str]:
    """The ids of the shipped rules that name the global at one of its sites or at the frame a rule
    names for it (as the audit matches them: `audit.bridge`) and claim the release (its framework
    and `versions`), and of the entries the step writes before it reads."""
    name = GlobalName(found["module"], found["class"], found["name"])
    sites = [
        (f"/{file}", function.rpartition(".")[2]) for file, _, function in (site.rpartition(":") for site in found["sites"])
    ]  # (file, function) as the audit reads them
    definition = Path("/" + found["defined"].rpartition(":")[0])
    rules = [
        rule.id
        for rule in knowledge.rules
        if rule.framework in (None, found["framework"])
        and (rule.versions is None or version is not None and rule.versions.contains(version, prereleases=True))
        and any(rule_matches(rule, name, file, function=function) for file, function in [*sites, *_named(rule, name, definition)])
    ]
    return rules + [entry.id for entry in knowledge.step_written if entry.names(name)]


def _named(rule: Rule, name: GlobalName[str, str], definition: Path) -> list[tuple[str, str]]:
    """The frame the rule names for the global, which the audit takes as given (`audit.bridge`)."""
    frame = frame_named(rule, name, definition)
    return [(frame.file, frame.function)] if frame is not None else []


def problems(document: dict, knowledge: KnowledgeBase, reviews: list[dict]) -> list[str]:
    """Each global, in each release that holds it, that no rule claims and no review names; each
    review of a global a rule claims too (stale), or of a global no release holds. A release named
    without a version (`master@...`) is taken as the newest numbered release before it."""
    versions: dict[tuple[str, str], Version | None] = {}
    for framework, pinned in document["releases"].items():
        newest = None
        for release in pinned:
            newest = release_version(release["release"]) or newest
            versions[framework, release["release"]] = newest
    found_problems = []
    used: set[int] = set()
    for found in document["globals"]:
        name = ".".join(part for part in (found["module"], found["class"], found["name"]) if part)
        for release in found["releases"]:
            claims = claimed_by(knowledge, found, versions[found["framework"], release])
            review = next((number for number, entry in enumerate(reviews) if _reviews(entry, found, release)), None)
            if review is not None:
                used.add(review)
            if claims and review is not None:
                found_problems.append(
                    f"{found['framework']} {release}: {name} is reviewed, but {claims[0]} covers it: remove the review (stale)"
                )
            elif not claims and review is None:
                found_problems.append(
                    f"{found['framework']} {release}: {name} ({found['kind']}, {found['defined']}): "
                    f"no rule claims it and no review names it"
                )
    found_problems += [
        f"{entry['framework']}: the review of {entry['module']}.{entry.get('class') or ''}"
        f"{'.' if entry.get('class') else ''}{entry['name']} names a global no release holds"
        for number, entry in enumerate(reviews)
        if number not in used
    ]
    return found_problems


def _reviews(entry: dict, found: dict, release: str) -> bool:
    return (entry["framework"], entry["module"], entry.get("class"), entry["name"]) == (
        found["framework"],
        found["module"],
        found["class"],
        found["name"],
    ) and (entry["releases"] == "all" or release in entry["releases"])


def dumped(document: dict) -> str:
    return json.dumps(document, indent=1, ensure_ascii=False) + "\n"


def parse_only(values: Sequence[str]) -> set[tuple[str, str]] | None:
    pairs = {tuple(value.split("=", 1)) for value in values}
    if any(len(pair) != 2 or pair[0] not in FRAMEWORK_FOLDERS for pair in pairs):
        raise ValueError(f"--only takes FRAMEWORK=RELEASE, FRAMEWORK one of {', '.join(sorted(FRAMEWORK_FOLDERS))}")
    return {(pair[0], pair[1]) for pair in pairs} or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, help="where downloaded megatron-core wheels are kept")
    parser.add_argument("--mindspeed", type=Path, help="git directory of a MindSpeed clone")
    parser.add_argument("--mindspeed-llm", type=Path, help="git directory of a MindSpeed-LLM clone")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="FRAMEWORK=RELEASE",
        help="audit only these releases and print their document (the shipped file is left alone)",
    )
    parser.add_argument("--out", type=Path, default=GLOBALS_FILE)
    parser.add_argument(
        "--check", action="store_true", help="audit nothing: list the globals of --out that no rule claims and no review names"
    )
    arguments = parser.parse_args()
    if arguments.check:
        try:
            found = problems(json.loads(arguments.out.read_text(encoding="utf-8")), load_knowledge(), reviewed())
        except (OSError, ValueError) as error:
            parser.exit(2, f"derive_globals: {error}\n")
        holes = sum(1 for entry in reviewed() if entry.get("needs_rule"))
        print(
            "\n".join(found)
            or f"every global of {arguments.out.name} is claimed by a rule or reviewed "
            f"({holes} of the reviews are holes that need a rule: `needs_rule`)"
        )
        sys.exit(1 if found else 0)
    try:
        only = parse_only(arguments.only)
    except ValueError as error:
        parser.exit(2, f"derive_globals: {error}\n")
    given = (("mindspeed", arguments.mindspeed), ("mindspeed-llm", arguments.mindspeed_llm))
    stacks = {name: path for name, path in given if path}
    if only is None and (arguments.cache is None or len(stacks) < 2):
        parser.exit(2, "derive_globals: every release is read: give --cache, --mindspeed and --mindspeed-llm\n")
    try:
        document = derive(releases(arguments.cache, stacks, only))
    except ValueError as error:
        parser.exit(2, f"derive_globals: {error}\n")
    if only is not None:
        read = {(framework, pinned["release"]) for framework, releases in document["releases"].items() for pinned in releases}
        if missing := sorted(only - read):
            parser.exit(2, f"derive_globals: {missing[0][0]} {missing[0][1]}: not pinned, or its source not given\n")
        sys.stdout.write(dumped(document))
        return
    arguments.out.write_text(dumped(document), encoding="utf-8")
    print(f"wrote {arguments.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
