"""A subject built without a log, classified by the user's answer and planned by the fixer: typed outcomes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from unsafe_doctor.adaptor.plan import Planned, Skipped, plan_fix
from unsafe_doctor.knowledge.classify import Classification, Classified, Unclassified, classify_as
from unsafe_doctor.knowledge.context import groundwork
from unsafe_doctor.knowledge.render.template import FixPlan, NoFix
from unsafe_doctor.knowledge.subject import Evidence, Subject, TensorRef
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.tracebacks import Frame

LEGACY_ADAPTOR = Path(__file__).parents[2] / "samples" / "adaptors" / "legacy" / "mindio_ttp" / "adaptor" / "modellink_adaptor.py"


@dataclass(frozen=True)
class Item:
    """What an audit hands the fixer: a subject and its classification, no log."""

    subject: Subject
    classification: Classification
    suspect: None = None  # an audited holder is never a chosen suspect


def test_a_subject_from_the_source_names_the_global_as_locate_would():
    name = GlobalName("pkg.state", "Holder", "table")
    subject = Subject.of_global(name, "/src/pkg/state.py", 3, function="Holder.reset", code="x")
    assert subject.tensor == TensorRef("Holder.table", GlobalName("pkg.state", "Holder", "table"))
    assert subject.tensor.name.dotted == "pkg.state.Holder.table"
    assert subject.frame == Frame("/src/pkg/state.py", 3, "Holder.reset", "x")
    assert (subject.source_file, subject.source_differs) == ("/src/pkg/state.py", False)


def test_evidence_prints_as_file_line_what():
    assert str(Evidence("pkg/state.py", 12, "reset in step(): `_X.zero_()`")) == "pkg/state.py:12: reset in step(): `_X.zero_()`"


def test_the_users_answer_plans_the_generic_fix_for_a_subject_with_no_log():
    context = groundwork().detect(adaptor=LEGACY_ADAPTOR)
    subject = Subject.of_global(GlobalName("toytrain.state", None, "LOSS_LOG"), "/src/toytrain/state.py", 22)
    classification = classify_as(subject, 1, context, ())
    assert isinstance(classification, Classified) and isinstance(classification.fix, FixPlan)
    plan = plan_fix([Item(subject, classification)], context)
    assert plan.outcomes == (Planned(1, "generic.reinitialise:toytrain.state.LOSS_LOG"),)
    assert plan.skipped == () and len(plan.edits) == 1


def test_a_fix_the_names_cannot_fill_is_skipped_with_its_own_reason_not_a_parsed_note():
    context = groundwork().detect(adaptor=LEGACY_ADAPTOR)
    subject = Subject(TensorRef("tracker[name]", GlobalName(None, None, "tracker")), None, None)  # no module: no import to write
    classification = classify_as(subject, 1, context, ())
    assert isinstance(classification.fix, NoFix)
    assert classification.fix.reason.startswith(
        "no fix can be shown: the fix must import the module that holds the "
        "global, and the log does not say which module that is (nothing in "
        "the log names it)"
    )
    assert classification.notes == (classification.fix.reason,)
    unclassified = Unclassified("nothing decided", (), ())
    plan = plan_fix([Item(subject, classification), Item(subject, unclassified)], context)
    assert plan.edits == ()
    assert plan.outcomes == (
        Skipped(1, classification.fix.reason),
        Skipped(2, "unclassified: scenario 1 or 2 is not known, so there is no fix to write"),
    )
    assert str(plan.skipped[1]) == "finding 2: unclassified: scenario 1 or 2 is not known, so there is no fix to write"


def test_an_unclassified_subject_holds_no_scenario_and_no_fix_by_its_type():
    unclassified = Unclassified("check it by hand", (Evidence("a.py", 1, "read"),), ())
    assert (unclassified.scenario, unclassified.rule, unclassified.confidence, unclassified.fix) == (None, None, None, None)
