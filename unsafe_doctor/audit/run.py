"""One audit, start to end: read the trees, scan them for holders, find the adaptor, judge each
holder's coverage, classify it."""

from __future__ import annotations

import gc
import stat
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from unsafe_doctor.audit.bridge import classification
from unsafe_doctor.audit.cache import AuditCache
from unsafe_doctor.audit.halves import Worker, shared_out
from unsafe_doctor.audit.holders import ScanFindings, conversion_only, holders, named_by_rules, scan_module
from unsafe_doctor.errors import AmbiguousAdaptor, UsageError, os_reason
from unsafe_doctor.knowledge.classify import Classification, Classified
from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.knowledge.rules import KnowledgeBase, Rule
from unsafe_doctor.knowledge.subject import Subject
from unsafe_doctor.knowledge.versions import AdaptorChooser, detect_environment
from unsafe_doctor.recovery_code.coverage import CoverageJudge
from unsafe_doctor.recovery_code.index import Index, ModuleInfo, audited_files
from unsafe_doctor.recovery_code.model import Audit, AuditedHolder, AuditProgress, CacheOutcome, Coverage, Holder, Site, Stage
from unsafe_doctor.recovery_code.names import Accessors
from unsafe_doctor.recovery_code.stale import stale_resets
from unsafe_doctor.source import looked_at
from unsafe_doctor.source.files import ImportRoots, read_replacing
from unsafe_doctor.source.markers import MARKER_BEGIN, markers
from unsafe_doctor.source.workspace import Parsed

_STATUS_ORDER = {"uncovered": 0, "unsafe": 1, "covered": 2}
_NO_ADAPTOR = Coverage("uncovered", None, None, (), (), "no adaptor was found")


def audit(
    paths: Sequence[Path],
    *,
    adaptor: Path | None = None,
    rule_paths: Sequence[Path] = (),
    progress: AuditProgress | None = None,
    choose_adaptor: AdaptorChooser | None = None,
    cache: Path | None = None,
) -> Audit:
    """Scan the source trees, find the adaptor (given, or under the paths: of several, the one
    `choose_adaptor` names, else refused), judge each holder; `progress` is told how far each stage
    got (a command line draws it: the core never prints). `cache`: the folder of the audit's cache
    (`audit.cache`), whose entry for this invocation stands for the audit while nothing it read has
    changed, and takes this audit otherwise; None: no cache."""
    knowledge = load_knowledge(rule_paths)  # first: a bad rule file fails before anything else is read
    given = _given(paths)
    store = AuditCache(cache) if cache is not None else None
    key = store.key(given, adaptor, list(rule_paths)) if store is not None else ""
    if store is not None and (remembered := store.load(key)) is not None:
        return remembered
    asked: list[AmbiguousAdaptor] = []
    chooser = None
    if choose_adaptor is not None:
        ask = choose_adaptor

        def chooser(error: AmbiguousAdaptor) -> Path:
            asked.append(error)
            return ask(error)

    if store is not None:
        store.prepare()
    recording = looked_at.recording(unwatched=cache) if store is not None else nullcontext(looked_at.LookedAt())
    with warnings.catch_warnings(), recording as looked:
        # invalid escapes and the like in the framework are not ours to report
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.filterwarnings("ignore", "invalid escape sequence", DeprecationWarning)
        result = _audit(given, adaptor, knowledge, progress or _unwatched, chooser)
    if store is None:
        return result
    if asked:  # the person's answer is not in the key: asked again next time
        return replace(result, cache=CacheOutcome("not stored", "the adaptor was chosen at the terminal"))
    if not looked.complete:
        return replace(
            result,
            cache=CacheOutcome("not stored", f"an import root holds more than {looked_at.MAX_TREE_FOLDERS:,} folders to watch"),
        )
    return replace(result, cache=store.store(key, looked, result))


def _unwatched(stage: Stage, done: int, total: int) -> None:
    """No one follows the progress."""


def _audit(
    given: list[Path],
    adaptor: Path | None,
    knowledge: KnowledgeBase,
    progress: AuditProgress,
    choose_adaptor: AdaptorChooser | None,
) -> Audit:
    files = audited_files(given)
    if not files:
        raise UsageError(f"no Python file (*.py) to audit under {', '.join(map(str, given))}")
    import_roots = ImportRoots()
    root_of = {path: import_roots.of(path) for path in files}
    roots = list(dict.fromkeys([*root_of.values(), *(import_roots.of(path) for path in given)]))
    index = Index(given, roots)
    for root in roots:  # where names lead: a module added there is found next time
        looked_at.note_tree(root)
        looked_at.note_folder(root.parent)  # an `__init__.py` there moves the root up
    for entry in sys.path:  # a package installed or removed; an entry made since
        looked_at.note_folder(entry or ".")
    accessors = Accessors(index)
    with _collecting_by_hand() as collection:
        for done, path in enumerate(files, 1):
            index.expect(path, root_of[path])
            progress("reading", done, len(files))
        found = ScanFindings()
        unreadable = _scan(files, index, accessors, knowledge.rules, found, progress=progress)
        scanned = holders(found, index)
        conversion = tuple(holder.name.dotted for holder in scanned if conversion_only(holder, knowledge.rules))
        framework = [holder for holder in scanned if holder.name.dotted not in conversion]
        framework += named_by_rules(found, framework)
        index.let_go()
        collection.scanned()
        environment = detect_environment(
            knowledge, index.workspace, adaptor=adaptor, search_under=given, choose_adaptor=choose_adaptor
        )
        context = RunContext(knowledge, index.workspace, environment)
        notes: list[str] = []
        judge = None
        if environment.adaptor is not None:
            judge = CoverageJudge(index, accessors, environment.adaptor, environment.profile, notes)
        else:
            notes.append("no recovery adaptor found under the paths (give --adaptor FILE): nothing covers any global")
        judged = []
        for holder in framework:
            if judge is not None:
                holder = _without_adaptor_uses(holder, judge.shown)
            judged.append((holder, judge.judge(holder) if judge is not None else _NO_ADAPTOR))
        audited = []
        ours = _our_blocks(judge.files) if judge is not None else {}
        for (holder, verdict), (subject, classified) in zip(judged, _classified(judged, context, progress), strict=True):
            if judge is not None and verdict.status == "uncovered":
                verdict = _our_block(classified, ours) or verdict
            audited.append(AuditedHolder(holder, verdict, classified, subject))
    audited.sort(key=lambda item: (_STATUS_ORDER[item.coverage.status], item.holder.name.dotted))
    stale = (
        stale_resets(environment.adaptor, environment.profile, environment, index.workspace, knowledge.rules)
        if environment.adaptor
        else []
    )
    return Audit(tuple(given), len(files), tuple(unreadable), tuple(audited), context, tuple(stale), tuple(notes), conversion)


@dataclass
class _Share:
    """One process's share of the scan: what it found, the files it read for it and the modules it
    made of them, and the files it could not read or scan."""

    found: ScanFindings
    parsed: Parsed
    added: list[Path]
    modules: list[ModuleInfo]
    unreadable: list[Path]
    unscanned: list[Path]


def _scan(
    files: Sequence[Path],
    index: Index,
    accessors: Accessors,
    rules: Sequence[Rule],
    found: ScanFindings,
    *,
    progress: AuditProgress,
) -> list[str]:
    """Scan every audited file, shared out between this process, from the first file on, and a copy
    of it on another core, from the last file back (`shared_out`): files given together import each
    other most. What the scan finds is put back in the order of the files; the files that could not
    be read, then those that could not be scanned, are returned."""
    position = {path: number for number, path in enumerate(files)}
    work = partial(_scan_share, files=files, position=position, index=index, accessors=accessors, rules=rules)
    shares = shared_out(len(files), work, lambda done: progress("scanning", done, len(files)))
    index.scanning(None)
    for share in shares:
        index.workspace.sources.adopt(share.parsed)
        found.take(share.found, index.adopt(share.added, share.modules), position)
    found.in_order(position)
    unreadable = sorted((path for share in shares for path in share.unreadable), key=position.__getitem__)
    unscanned = sorted((path for share in shares for path in share.unscanned), key=position.__getitem__)
    return [index.display(path) for path in unreadable + unscanned]


def _scan_share(
    worker: Worker, *, files: Sequence[Path], position: dict[Path, int], index: Index, accessors: Accessors, rules: Sequence[Rule]
) -> _Share:
    """Scan the files this process claims, each right after it is read, its tree still fresh:
    parsed once for both. A file a scan's names lead to is claimed then, and scanned next, before
    its tree is let go; so is a file read ahead before the scan (`Index.expect`) and claimed when
    the scan began, even where this process claims no other file."""
    index.scanning(lambda path: worker.claim(position[path]))
    found = ScanFindings()
    added: dict[Path, None] = {}  # in the order read
    modules: list[ModuleInfo] = []
    unreadable: list[Path] = []
    unscanned: list[Path] = []
    for path in reversed(files) if worker.copy else files:
        current = path if worker.claim(position[path]) else index.read_ahead()
        while current is not None:
            added[current] = None
            info = index.add(current)
            if info is None:
                unreadable.append(current)
            else:
                modules.append(info)
                try:
                    scan_module(index, accessors, info, found, rules)
                except RecursionError:  # a statement nested past Python's recursion limit: listed, not fatal
                    unscanned.append(current)
            worker.tick()
            current = index.read_ahead()
    return _Share(found, index.workspace.sources.parsed(), list(added), modules, unreadable, unscanned)


def _classified(
    judged: Sequence[tuple[Holder, Coverage]], context: RunContext, progress: AuditProgress
) -> list[tuple[Subject, Classification | None]]:
    """Each holder classified, shared out between this process and a copy of it on another core
    (`shared_out`): a few take most of the heuristics' time, whichever process is free takes the next."""

    def classify_claimed(worker: Worker) -> dict[int, tuple[Subject, Classification | None]]:
        result = {}
        for number, (holder, verdict) in enumerate(judged):
            if worker.claim(number):
                result[number] = classification(holder, verdict, context)
                worker.tick()
        return result

    shares = shared_out(len(judged), classify_claimed, lambda done: progress("judging", done, len(judged)))
    merged = {number: classified for share in shares for number, classified in share.items()}
    return [merged[number] for number in range(len(judged))]


def _our_blocks(adaptor_files: Sequence[Path]) -> dict[str, Site]:
    """The first block unsafe-doctor wrote for each rule in the adaptor's files (a key is the rule's
    id, or `rule:global` for a named global), where its begin marker is."""
    found: dict[str, Site] = {}
    for path in adaptor_files:
        try:
            text = read_replacing(path)
        except OSError:
            continue
        for marker in markers(text):
            if marker.begins:
                found.setdefault(marker.key.split(":")[0], Site(str(path), marker.line + 1, None, MARKER_BEGIN + marker.key))
    return found


def _our_block(classified: Classification | None, ours: dict[str, Site]) -> Coverage | None:
    """Covered by the block unsafe-doctor wrote for the holder's rule: the rule's fix is made for
    what the rule names, even where it reaches it in ways the coverage reading cannot follow (the
    model's modules walked for `inv_freq`, the optimizer in `train_args` for the grad scaler)."""
    rule = classified.rule if isinstance(classified, Classified) else None
    site = ours.get(rule) if rule is not None else None
    if site is None:
        return None
    return Coverage("covered", "rebuilt", None, (), (site,), f"by unsafe-doctor's block for rule {rule}")


def _given(paths: Sequence[Path]) -> list[Path]:
    given = [Path(path) for path in paths]
    if not given:
        raise UsageError("no path to audit: name one or more source folders or files")
    for path in given:
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise UsageError(f"{path}: no such file or folder") from None
        except (OSError, ValueError) as error:  # a loop of links, `file.py/x`, a name too long
            raise UsageError(f"{path}: {os_reason(error)}") from None
        if not stat.S_ISDIR(mode) and not (stat.S_ISREG(mode) and path.suffix == ".py"):
            raise UsageError(f"{path}: not a Python file (*.py) nor a folder of them")
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
