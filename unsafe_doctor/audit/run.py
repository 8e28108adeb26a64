"""One audit, start to end: read the trees, scan them for holders, find the adaptor, judge each
holder's coverage, classify it."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from unsafe_doctor.audit.bridge import classification
from unsafe_doctor.audit.coverage import CoverageJudge, adaptor_in_tree
from unsafe_doctor.audit.holders import ScanFindings, holders, named_by_rules, scan_module
from unsafe_doctor.audit.index import Index, audited_files
from unsafe_doctor.audit.model import Audit, AuditedHolder, Coverage, Holder, Progress, Site, Stage
from unsafe_doctor.audit.resolve import Accessors
from unsafe_doctor.classify import Classification, Classified
from unsafe_doctor.context import RunContext
from unsafe_doctor.errors import UsageError, os_reason
from unsafe_doctor.knowledge import load_knowledge
from unsafe_doctor.markers import MARKER_BEGIN
from unsafe_doctor.source.files import ImportRoots
from unsafe_doctor.stale import stale_resets
from unsafe_doctor.versions import detect_environment

_STATUS_ORDER = {"uncovered": 0, "unsafe": 1, "covered": 2}
_NO_ADAPTOR = Coverage("uncovered", None, None, (), (), "no adaptor was found")


def audit(
    paths: Sequence[Path], *, adaptor: Path | None = None, rule_paths: Sequence[Path] = (), progress: Progress | None = None
) -> Audit:
    """Scan the source trees, find the adaptor (given, or under the paths), judge each holder;
    `progress` is told how far each stage got (a command line draws it: the core never prints)."""
    with warnings.catch_warnings():  # invalid escapes and the like in the framework are not ours to report
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.filterwarnings("ignore", "invalid escape sequence", DeprecationWarning)
        return _audit(paths, adaptor, rule_paths, progress or _unwatched)


def _unwatched(stage: Stage, done: int, total: int) -> None:
    """No one follows the progress."""


def _audit(paths: Sequence[Path], adaptor: Path | None, rule_paths: Sequence[Path], progress: Progress) -> Audit:
    knowledge = load_knowledge(rule_paths)
    given = _given(paths)
    files = audited_files(given)
    import_roots = ImportRoots()
    roots = list(dict.fromkeys([*(import_roots.of(path) for path in files), *(import_roots.of(path) for path in given)]))
    index = Index(given, roots)
    accessors = Accessors(index)
    with _collecting_by_hand() as collection:
        for done, path in enumerate(files, 1):
            index.expect(path, import_roots.of(path))
            progress("reading", done, len(files))
        found = ScanFindings()
        unreadable = _scan(files, index, accessors, found, progress)
        framework = holders(found, index)
        framework += named_by_rules(index, knowledge.rules, framework)
        index.let_go()
        collection.scanned()
        if adaptor is None:
            adaptor = adaptor_in_tree(index, knowledge)
        context = RunContext(knowledge, index.workspace, detect_environment(knowledge, index.workspace, adaptor=adaptor))
        environment = context.environment
        notes: list[str] = []
        judge = None
        if environment.adaptor is not None:
            judge = CoverageJudge(index, accessors, environment.adaptor, environment.profile, notes)
        else:
            notes.append("no recovery adaptor found under the paths (give --adaptor FILE): nothing covers any global")
        audited = []
        for holder in framework:
            if judge is not None:
                holder = _without_adaptor_uses(holder, judge.shown)
            verdict = judge.judge(holder) if judge is not None else _NO_ADAPTOR
            subject, classified = classification(holder, verdict, context)
            if judge is not None and verdict.status == "uncovered":
                verdict = _our_block(classified, judge.files) or verdict
            audited.append(AuditedHolder(holder, verdict, classified, subject))
            progress("judging", len(audited), len(framework))
    audited.sort(key=lambda item: (_STATUS_ORDER[item.coverage.status], item.holder.name))
    stale = stale_resets(environment.adaptor, environment.profile, environment, index.workspace) if environment.adaptor else []
    return Audit(tuple(given), len(files), tuple(unreadable), tuple(audited), context, tuple(stale), tuple(notes))


def _scan(files: Sequence[Path], index: Index, accessors: Accessors, found: ScanFindings, progress: Progress) -> list[str]:
    """Scan every audited file, each right after it is read, its tree still fresh: parsed once for
    both. A file a scan's names lead to is read then, and scanned next, before its tree is let go.
    What the scan finds is put back in the order of the files; the files that could not be read,
    then those that could not be scanned, are returned."""
    position = {path: number for number, path in enumerate(files)}
    unreadable: list[Path] = []
    unscanned: list[Path] = []
    done: set[Path] = set()
    for path in files:
        current = None if path in done else path
        while current is not None:
            done.add(current)
            info = index.add(current)
            if info is None:
                unreadable.append(current)
            else:
                try:
                    scan_module(index, accessors, info, found)
                except RecursionError:  # a statement nested past Python's recursion limit: listed, not fatal
                    unscanned.append(current)
            progress("scanning", len(done), len(files))
            current = index.read_ahead()
    found.in_order(position)
    in_order = sorted(unreadable, key=position.__getitem__) + sorted(unscanned, key=position.__getitem__)
    return [index.display(path) for path in in_order]


def _our_block(classified: Classification | None, adaptor_files: Sequence[Path]) -> Coverage | None:
    """Covered by the block unsafe-doctor wrote for the holder's rule: the rule's fix is made for
    what the rule names, even where it reaches it in ways the coverage reading cannot follow (the
    model's modules walked for `inv_freq`, the optimizer in `train_args` for the grad scaler)."""
    rule = classified.rule if isinstance(classified, Classified) else None
    if rule is None:
        return None
    marker = MARKER_BEGIN + rule
    for path in adaptor_files:
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for number, line in enumerate(lines, 1):
            if line.strip() == marker or line.strip().startswith(marker + ":"):
                site = Site(str(path), number, None, line.strip())
                return Coverage("covered", "rebuilt", None, (), (site,), f"by unsafe-doctor's block for rule {rule}")
    return None


def _given(paths: Sequence[Path]) -> list[Path]:
    given = [Path(path) for path in paths]
    if not given:
        raise UsageError("no path to audit: name one or more source folders or files")
    for path in given:
        try:
            path.stat()
        except FileNotFoundError:
            raise UsageError(f"{path}: no such file or folder") from None
        except (OSError, ValueError) as error:  # a loop of links, `file.py/x`, a name too long
            raise UsageError(f"{path}: {os_reason(error)}") from None
    return given


def _without_adaptor_uses(holder: Holder, adaptor_files: set[str]) -> Holder:
    """The adaptor's own uses are its coverage, not the framework's writes and reads."""
    return replace(
        holder,
        writers=tuple(site for site in holder.writers if site.file not in adaptor_files),
        readers=tuple(site for site in holder.readers if site.file not in adaptor_files),
    )


class _Collection:
    """No garbage collection over an audit. Left to run, the cyclic collector would walk the syntax
    trees again and again as they are parsed (half the time on a Megatron tree), and neither they
    nor the scan's and the heuristics' objects hold cycles: reference counts free them. Once the
    scan is done what it kept is frozen out of the collector's sight, so that its first run after
    the audit does not walk it all."""

    def __init__(self) -> None:
        self.frozen = False

    def scanned(self) -> None:
        gc.freeze()
        self.frozen = True


@contextmanager
def _collecting_by_hand() -> Iterator[_Collection]:
    collecting = gc.isenabled()
    collection = _Collection()
    gc.disable()
    try:
        yield collection
    finally:
        if collection.frozen:
            gc.unfreeze()
        if collecting:
            gc.enable()
