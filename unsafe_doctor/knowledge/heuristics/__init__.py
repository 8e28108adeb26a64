"""Scenario evidence from source code, for globals no rule knows.

Scenario 1: the tensor is reset every iteration (zeroed, cleared or rebound by a function the
training step calls). Scenario 2: it carries state into the next iteration (updated from its own
previous value, read to compute parameters, losses or the next step's inputs, a registered buffer
that nothing resets). Each piece of evidence is reported as (file, line, what was seen).

Where the evidence comes from: the module defining the global, the culprit's file, and the Python
files under the module's top-level package and the source roots (at most `MAX_FILES`, skipping
virtual environments and tests) that name the variable or one of its accessors (module functions
that `return` it). Files are parsed with `ast`, never imported. The tensor is followed through
local aliases (`tracker = get_tracker()`, `for t in tracker.values()`, `lst.append(module.x)`) and
values computed from it (`y = f(x)`, any call taking it; not through `group=` / `stream=`
handles), one function at a time.

Rules of evidence, per statement that touches the tensor (or an element of it):

* **reset** (1): `.zero_()`, `.fill_(const)`, `.clear()`, `.cache_clear()`, `del X[k]`,
  `.copy_(zeros)`, rebinding to `{}` / `[]` / `None` / `torch.zeros(...)`; not at module level nor
  in set-up functions (`__init__`, `init_*`, `setup*`, `build*`). It runs *every iteration* when
  its function is named like a training or logging step (`train_step`, `training_log`,
  `forward_backward_*`, `track_*_metrics`; not a helper named for what it does, `reset_loss_log`),
  sits in a loop of a train-like function, or is called from such a function (up to three calls
  up, matched by name); that call site is a further piece (**per-step**). A reset reached only
  from logging functions is *for logging*.
* **accumulate**: `+=` / `.add_()`; scenario 1 when the value is detached (`.detach()`, under
  `torch.no_grad()`) or the tensor is reset somewhere, else a running total carried on (2).
* **log-read** (1): passed to a logging call (`print`, `writer.add_scalar`, `logger.*`, `wandb`);
  dropped when a training read exists.
* **overwrite** (1): `.copy_(v)` / rebinding from values that do not involve itself. Inside
  `if X is None:` / `if k not in X:` a store builds what is missing and says nothing.
* **cache** (1): an `lru_cache` function; a dict filled under keys built from shapes or dtypes.
* **queue** (1): entries appended and popped (consumed within the step).
* **buffer** : `register_buffer("x", ..., persistent=False)` (1); a persistent one (2) only when
  it is also updated in place and never reset.
* **self-update** (2): rebuilt from its own value: `X = X * d + v`, `.mul_()` / `.lerp_()` / ...,
  `.copy_(f(X))` (a copy of a *computed* value: restoring a saved clone does not count).
* **training-read** (2): outside logging functions (named so, or logging without `backward` /
  `step`), the tensor or a value computed from it feeds a name about training
  (`loss`, `grad`, `param`, `lr`, `scale`: an assigned name, a keyword argument, the receiver of
  an in-place update, the return of such a function) or a `.backward()`.

Weighing: strong evidence is reset (1), self-update and training-read (2). Strong evidence for one
side only decides; for both, 2 wins when the value is carried (self-update) or every reset is for
logging, else 1 (a value reset every step is recomputed). Weak evidence alone decides by majority.
Confidence is `medium` with two or more kinds of evidence for the chosen side and none against,
else `low`.

Where the source gives no evidence at all, the culprit's printed line and the accessor that builds
the global may still decide (`lines`: a self-update or a ring buffer read on the line, a global
built on first use), with low confidence.

The weighing is here; the rest by stage: `gather` (the files in scope, the study's events, who calls
a reset), `events` (one file, one function: statements read as events), `aliases` (what stands for
the tensor in one scope) and `vocabulary` (the token sets and name tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from unsafe_doctor.knowledge.heuristics.events import Event, EvidenceKind
from unsafe_doctor.knowledge.heuristics.gather import MAX_FILES, TensorStudy
from unsafe_doctor.knowledge.heuristics.lines import from_the_line
from unsafe_doctor.knowledge.subject import Evidence, Subject
from unsafe_doctor.source.workspace import Workspace

MAX_EVIDENCE = 8
MAX_PER_KIND = 3

_STRONG = {"reset": 1, "self-update": 2, "training-read": 2}
_ORDER = ("reset", "per-step", "self-update", "training-read", "accumulate", "buffer", "overwrite", "cache", "queue", "log-read")


@dataclass(frozen=True)
class HeuristicVerdict:
    scenario: Literal[1, 2] | None
    confidence: Literal["medium", "low"] | None
    reason: str  # one or two sentences; with no verdict, what the user should check
    evidence: tuple[Evidence, ...]


def judge_by_source(subject: Subject, workspace: Workspace) -> HeuristicVerdict:
    """Scenario 1 or 2 from the evidence in the source, with how sure; None with what to check.

    `workspace`: the command's, over the source roots (`context.Groundwork`)."""
    tensor = subject.tensor
    if tensor is None or not tensor.name.variable or not tensor.name.variable.isidentifier():
        shown = tensor.expression if tensor else "the tensor"
        return HeuristicVerdict(
            None,
            None,
            f"The log does not name the global behind {shown}: read the culprit line and check whether it "
            "depends on training iterations.",
            (),
        )
    study = TensorStudy(subject, tensor, workspace)
    study.gather()
    verdict = _weigh(study)
    if verdict.scenario is None and not verdict.evidence:
        seen = from_the_line(subject, tensor, workspace)
        if seen is not None:
            return HeuristicVerdict(seen.scenario, "low", seen.reason + ".", (seen.evidence,))
    return verdict


# --- weighing -------------------------------------------------------------------------------------


def _weigh(study: TensorStudy) -> HeuristicVerdict:
    """The verdict from a study's events, by the rules of weighing in this module's docstring."""
    variable = study.variable
    if study.defining is None and not study.referencing and study.unparsable is not None:
        path, why = study.unparsable
        return HeuristicVerdict(
            None,
            None,
            f"Could not read how {variable} is used: {study.shown(path)}, which defines it, "
            f"{why}. Check whether it depends on training iterations.",
            (),
        )
    if study.defining is None and not study.referencing:
        return HeuristicVerdict(
            None, None, f"Could not read the source of {variable}: pass --source-root pointing at the training code.", ()
        )
    one, two = _sides(list(study.events.values()))
    suffix = f" (searched the first {MAX_FILES:,} files only)" if study.truncated else ""
    if study.unparsed:
        suffix += f" (left out, nested too deeply to read: {', '.join(map(study.shown, study.unparsed))})"
    if not one and not two:
        files = study.referencing or ([study.defining.path] if study.defining else [])
        return HeuristicVerdict(
            None,
            None,
            f"Found no reset and no carried state for {variable} in {_files(study, files)}: "
            f"check whether it depends on training iterations{suffix}.",
            (),
        )
    strong_one = any(_STRONG.get(event.kind) == 1 for event in one)
    strong_two = any(_STRONG.get(event.kind) == 2 for event in two)
    scenario: Literal[1, 2]
    if strong_one and strong_two:
        resets = [event for event in one if event.kind == "reset"]
        carried = any(event.kind == "self-update" for event in two)
        scenario = 2 if carried or all(event.for_logging for event in resets) else 1
    elif strong_one or strong_two:
        scenario = 1 if strong_one else 2
    elif len(_kinds(one)) != len(_kinds(two)):
        scenario = 1 if len(_kinds(one)) > len(_kinds(two)) else 2
    else:
        reason = (
            f"Mixed evidence for {variable}: {_summary(one, 1)}, but {_summary(two, 2)}: check whether it "
            f"depends on training iterations{suffix}."
        )
        return HeuristicVerdict(None, None, reason, _lines(study, one, two))
    chosen, other = (one, two) if scenario == 1 else (two, one)
    confidence: Literal["medium", "low"] = "medium" if len(_kinds(chosen)) >= 2 and not other else "low"
    if scenario == 1:
        reason = f"{variable} looks independent of the training iterations: {_summary(chosen, 1)}"
    else:
        reason = f"{variable} carries state into the next iteration: {_summary(chosen, 2)}"
    if other:
        reason += f"; but {_summary(other, scenario % 2 + 1)}: check by hand"
    return HeuristicVerdict(scenario, confidence, reason + suffix + ".", _lines(study, chosen, other))


def _sides(events: list[Event]) -> tuple[list[Event], list[Event]]:
    """The events for scenario 1 and for scenario 2; some count only with others (see the rules)."""
    kinds = {event.kind for event in events}
    reset = "reset" in kinds
    one: list[Event] = []
    two: list[Event] = []
    for event in events:
        if event.kind == "accumulate":
            (one if event.detached or reset else two).append(event)
        elif event.kind == "log-read":
            if "training-read" not in kinds:
                one.append(event)
        elif event.kind == "buffer":
            updated = "self-update" in kinds or any(e.kind == "accumulate" and not e.detached for e in events)
            if not event.persistent:
                one.append(event)
            elif updated and not reset:
                two.append(event)
        elif event.kind in ("self-update", "training-read"):
            two.append(event)
        else:
            one.append(event)
    return one, two


def _lines(study: TensorStudy, chosen: list[Event], other: list[Event]) -> tuple[Evidence, ...]:
    """The chosen side's evidence first, strongest kinds first, at most a few lines of each kind."""
    lines: list[Evidence] = []
    for side in (chosen, other):
        shown: dict[EvidenceKind, int] = {}
        for event in sorted(side, key=lambda event: (_ORDER.index(event.kind), str(event.path), event.line)):
            shown[event.kind] = shown.get(event.kind, 0) + 1
            if shown[event.kind] <= MAX_PER_KIND:
                lines.append(Evidence(study.shown(event.path), event.line, event.what))
    return tuple(lines[:MAX_EVIDENCE])


def _files(study: TensorStudy, paths: list[Path]) -> str:
    shown = [study.shown(path) for path in paths[:3]]
    more = f" and {len(paths) - 3} more files" if len(paths) > 3 else ""
    return ", ".join(shown) + more if shown else "the source"


def _kinds(events: list[Event]) -> set[EvidenceKind]:
    return {event.kind for event in events}


def _summary(events: list[Event], scenario: int) -> str:
    """The kinds of evidence in words, strongest first."""
    phrases = []
    for kind in _ORDER:
        matching = [event for event in events if event.kind == kind]
        if not matching:
            continue
        if kind == "reset":
            functions = ", ".join(dict.fromkeys(f"{event.function}()" for event in matching))
            phrases.append(f"it is reset by {functions}")
        elif kind == "per-step":
            logging = all(event.for_logging for event in matching)
            phrases.append("that reset runs every logging step" if logging else "that reset runs every iteration")
        elif kind == "accumulate":
            phrases.append(
                "it accumulates values within a step" if scenario == 1 else "it accumulates across iterations and is never reset"
            )
        elif kind == "training-read":
            phrases.append("it is read to compute training values")
        else:
            phrases.append(
                {
                    "self-update": "it is updated from its own previous value",
                    "buffer": "it is a non-persistent buffer" if scenario == 1 else "it is a persistent buffer updated in place",
                    "overwrite": "it is overwritten with fresh values",
                    "cache": "it is a cache rebuilt deterministically",
                    "queue": "it is a queue consumed within the step",
                    "log-read": "it is read for logging",
                }[kind]
            )
    return ", ".join(phrases)
