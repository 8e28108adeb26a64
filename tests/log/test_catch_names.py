"""MindIO's catch lines, `rank:N catch <NAME> exception, …`, each a recovery event with its rank and kind.

The names are read from MindIO's real `framework_ttp/ttp_decorator.py` at six refs of mind-cluster
(../shared/real/mind-cluster-mindio/, the real fixture; its MANIFEST.md names each ref): what the handlers of
`fault_handles` return (the keys of `fault_dict` in the first public version, which prints the key itself),
and the names written literally in its catch format strings. The lines are written with each ref's own catch
format string, read from the file too. MindSpeed-LLM's `PRECISION ERROR` is registered outside these files
(`tft_train_initialize.py`, 26.0.0 on) and is taken as `CATCH_NAMES` states it.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import pytest
from conftest import SHARED_REAL
from helpers import run_cli

from unsafe_doctor.log.lines import LogLine
from unsafe_doctor.log.recovery import CATCH_NAMES, MARKERS, FaultReading, catch_name, read_fault, read_recovery

REPO = Path(__file__).resolve().parents[2]
REFS = ("492fde0c", "v7.3.0", "v7.3.2", "v26.0.0", "v26.1.0", "22bb3d98")
MINDIO = SHARED_REAL / "mind-cluster-mindio"
# A literal name in a format string: "rank:%s catch other exception", "catch HBM exception, but can't repair "
_LITERAL_NAME = re.compile(r"catch ([A-Za-z][A-Za-z ']*?) exception\b")
# What each kind is as an event: a fault of its rank, or a stop or repair step on a rank that did not fault.
EVENT_OF_KIND = {
    "memory-fault": "fault",
    "link-fault": "fault",
    "precision-retry": "fault",
    "force-stop": "stop",
    "step-pause": "stop",
    "rescheduled": "repair",
}


@functools.cache  # each ref's file is read by every name's cases: parsed once, read only
def _decorator(ref: str) -> ast.Module:
    path = MINDIO / ref / "framework_ttp" / "ttp_decorator.py"
    if not path.is_file():
        pytest.skip(f"../shared/real is absent: {path} (MindIO's real exception handler) is not beside the repository")
    return ast.parse(path.read_text())


def _strings(node: ast.AST) -> set[str]:
    return {each.value for each in ast.walk(node) if isinstance(each, ast.Constant) and isinstance(each.value, str)}


def _returned(module: ast.Module, handler: ast.expr) -> set[str]:
    """The names a handler of `fault_handles` can return: a lambda's constants, a function's returned constants."""
    if isinstance(handler, ast.Lambda):
        return _strings(handler.body)
    assert isinstance(handler, ast.Name), ast.dump(handler)
    (function,) = [node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == handler.id]
    return set().union(*(_strings(node.value) for node in ast.walk(function) if isinstance(node, ast.Return) and node.value))


def _module_dict(module: ast.Module, name: str) -> ast.Dict | None:
    for node in module.body:
        if isinstance(node, ast.Assign) and [getattr(target, "id", None) for target in node.targets] == [name]:
            assert isinstance(node.value, ast.Dict)
            return node.value
    return None


def printed_names(ref: str) -> dict[str, str | None]:
    """Every exception name the ref's catch lines can print (registered handlers aside), with the error text that
    makes it print the name (the handler's key; None for a name its format strings write literally)."""
    module = _decorator(ref)
    names: dict[str, str | None] = {name: None for name in _literal_formats(ref)}
    if (handles := _module_dict(module, "fault_handles")) is not None:  # v7.3.0 on: the handler's answer is printed
        for key, handler in zip(handles.keys, handles.values, strict=True):
            assert isinstance(key, ast.Constant)
            names.update({name: key.value for name in _returned(module, handler) if name != "OTHER"})
        return names | {"OTHER": None}
    fault_dict = _module_dict(module, "fault_dict")  # the first public version prints the key
    assert fault_dict is not None, f"{ref}: neither fault_handles nor fault_dict"
    return names | {key.value: key.value for key in fault_dict.keys if isinstance(key, ast.Constant)}


# A format string's fields, as `str.format` fields: MindIO's %-style and f-string placeholders by what precedes them.
_FIELDS = (
    (re.compile(r"rank:(?:%s|\{rank_\})"), "rank:{rank}"),
    (re.compile(r"catch (?:%s|\{exception\}|\{dict_str\}) exception"), "catch {name} exception"),
    (re.compile(r"error_code:(?:%s|\{error_code\})"), "error_code:{code}"),
    (re.compile(r"ex instance:(?:%s|\{err_str\}|\{str\(e\)\})"), "ex instance:{message}"),
)


@functools.cache
def _catch_templates(ref: str) -> frozenset[str]:
    """The ref's format strings of a catch line with the error's message, as `str.format` templates."""
    templates = set()
    for node in ast.walk(_decorator(ref)):
        if isinstance(node, ast.JoinedStr):  # f"rank:{rank_} catch {exception} exception, ex instance:{err_str}"
            text = "".join(
                part.value if isinstance(part, ast.Constant) else "{" + ast.unparse(part.value) + "}" for part in node.values
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # "rank:%s catch %s exception, …"
            text = node.value
        else:
            continue
        for field, template in _FIELDS:
            text = field.sub(template, text)
        if " catch " in text and text.endswith("ex instance:{message}"):
            templates.add(text)
    return frozenset(templates)


def _literal_formats(ref: str) -> dict[str, list[str]]:
    """The catch templates that write their name literally ("catch HBM exception, but can't repair …"), by name."""
    found: dict[str, list[str]] = {}
    for template in sorted(_catch_templates(ref)):
        if match := _LITERAL_NAME.search(template):
            found.setdefault(match[1], []).append(template)
    return found


def _lines(ref: str, name: str, message: str) -> list[str]:
    """The catch lines of rank 5 that the ref writes for `name`: its literal templates, or those naming a field."""
    templates = _literal_formats(ref).get(name) or sorted(each for each in _catch_templates(ref) if "{name}" in each)
    assert templates, f"{ref}: no catch format string read for {name}"
    return [template.format(rank=5, name=name, code="", message=message) for template in templates]


def _printing(name: str) -> dict[str, str]:
    """The refs whose catch lines can name `name`, each with the error text that makes it (MindSpeed-LLM's
    PRECISION ERROR: where the ref has `tft_register_exception_handler`, its only way in)."""
    if name == "PRECISION ERROR":
        return {
            ref: name
            for ref in REFS
            if any(
                isinstance(node, ast.FunctionDef) and node.name == "tft_register_exception_handler"
                for node in _decorator(ref).body
            )
        }
    found = {ref: printed_names(ref) for ref in REFS}
    return {ref: names[name] or _LITERAL_MESSAGES.get(name, name) for ref, names in found.items() if name in names}


# The error text behind a literal name: the first public version writes "HBM" for an HBM ECC error it cannot repair.
_LITERAL_MESSAGES = {"HBM": "NPU function error: HBM MULTI BIT ECC ERROR."}


@pytest.mark.parametrize("ref", REFS)
def test_every_name_a_release_prints_is_known(ref):
    names = printed_names(ref)
    assert {"FORCE STOP", "UCE ERROR"} <= names.keys()  # the reading found the table
    assert names.keys() - CATCH_NAMES.keys() == set()


@pytest.mark.parametrize("name", sorted(CATCH_NAMES))
def test_every_known_name_is_printed_by_a_release(name):
    assert _printing(name), f"no ref of MindIO prints {name!r}"


def test_the_link_errors_are_v26_1_names():
    assert {"UB LINK ERROR", "HCCS LINK ERROR"} <= printed_names("v26.1.0").keys()
    assert not {"UB LINK ERROR", "HCCS LINK ERROR"} & printed_names("v26.0.0").keys()
    assert sorted(_printing("PRECISION ERROR")) == ["22bb3d98", "v26.0.0", "v26.1.0"]


@pytest.mark.parametrize("name", sorted(name for name, kind in CATCH_NAMES.items() if kind != "other"))
def test_a_catch_line_of_every_release_that_prints_it_is_an_event_of_its_rank_and_kind(name):
    for ref, message in _printing(name).items():
        for text in _lines(ref, name, message):
            assert any(marker in text.encode() for marker in MARKERS), text  # the inputs stage keeps the line
            (event,) = read_recovery([LogLine(None, text, "ttp_log.log", 0)]).events
            assert (event.kind, event.rank, event.catch_kind) == (EVENT_OF_KIND[CATCH_NAMES[name]], 5, CATCH_NAMES[name]), text
            assert catch_name(text) == name


@pytest.mark.parametrize("ref", REFS)
def test_force_stopped_ranks_are_no_fault_ranks(ref):
    uce = _lines(ref, "UCE ERROR", "UCE ERROR")[0]
    stop = _lines(ref, "FORCE STOP", "FORCE STOP. By mindio-ttp BeginUpdating")[0]
    lines = [LogLine(None, uce.replace("rank:5", "rank:3"), "a.log", 0)] + [
        LogLine(None, stop.replace("rank:5", f"rank:{rank}"), "a.log", rank + 1) for rank in (0, 1, 2)
    ]
    context = read_recovery(lines)
    assert context.fault_ranks == (3,)
    assert [event.rank for event in context.events if event.kind == "stop"] == [0, 1, 2]
    assert context.seen  # MindIO stopped the healthy ranks: its recovery ran


@pytest.mark.parametrize("ref", [ref for ref in REFS if ref != "492fde0c"])  # the first public one never prints OTHER
def test_an_other_line_tells_by_its_message(ref):
    (other,) = _lines(ref, "OTHER", "NPU function error: EZ9999")
    assert read_recovery([LogLine(3, other, "a.log", 0)]).events == ()
    for fault, kind in (("UCE ERROR", "memory-fault"), ("UB LINK ERROR", "link-fault")):  # retry off: OTHER
        (event,) = read_recovery([LogLine(3, other.replace("EZ9999", f"{fault}."), "a.log", 0)]).events
        assert (event.kind, event.catch_kind, catch_name(event.text)) == ("fault", kind, fault)


@pytest.mark.parametrize("name", sorted(name for name, kind in CATCH_NAMES.items() if kind in ("link-fault", "precision-retry")))
def test_a_retried_or_link_fault_marks_no_memory(name):
    (text,) = _lines("v26.1.0", name, name)
    assert read_fault(read_recovery([LogLine(None, text, "a.log", 0)])) == FaultReading("none-marked", name, 5)


def test_a_force_stop_alone_marks_nothing_known():
    (text,) = _lines("v26.1.0", "FORCE STOP", "FORCE STOP")
    context = read_recovery([LogLine(None, text, "a.log", 0)])
    assert context.fault_ranks == ()
    assert read_fault(context).marking == "unknown"


def test_a_name_is_read_whole_not_its_prefix():
    assert catch_name("rank:1 catch HBM MULTI BIT ECC can't repair exception, error_code:， ex instance:x") == (
        "HBM MULTI BIT ECC can't repair"
    )
    assert catch_name("rank:1 catch HBM exception, but can't repair ex instance:x") == "HBM"
    assert catch_name("rank:1 catch UCE ERRORS exception, ex instance:x") is None


def test_each_fault_rank_keeps_the_kind_its_lines_name():
    memory, link, precision = (_lines("v26.1.0", name, name)[0] for name in ("UCE ERROR", "UB LINK ERROR", "PRECISION ERROR"))
    lines = [
        LogLine(None, memory.replace("rank:5", "rank:3"), "a.log", 0),
        LogLine(None, link.replace("rank:5", "rank:1"), "a.log", 1),
        LogLine(None, precision.replace("rank:5", "rank:2"), "a.log", 2),
        LogLine(None, link.replace("rank:5", "rank:3"), "a.log", 3),
    ]  # rank 3's UCE is not undone by a link line
    assert read_recovery(lines).fault_kinds() == {1: "link-fault", 2: "precision-retry", 3: "memory-fault"}


def test_the_report_names_a_link_fault_as_a_link_fault(tmp_path):
    """A corpus run whose ECC recovery stopped rank 1 for a v26.1 link error: the phase names each fault's kind."""
    log = (REPO / "tests" / "corpus" / "logs" / "megatron-global-memory-buffer.log").read_text(encoding="utf-8")
    stopped = "rank:1 catch FORCE STOP exception, error_code:， ex instance:FORCE STOP, "
    assert stopped in log
    linked = tmp_path / "link.log"
    linked.write_text(
        log.replace(stopped, "rank:1 catch UB LINK ERROR exception, error_code:， ex instance:UB LINK ERROR"), encoding="utf-8"
    )
    result = run_cli("diagnose", "--log-only", str(linked), cwd=REPO, env={"COLUMNS": "200"})
    assert result.returncode == 1, result.stderr
    assert "(link fault on rank 1, hardware fault on rank 3, recovery at step 120)" in result.stdout


def test_the_json_gives_each_fault_rank_its_kind_from_a_real_v26_1_link_error_line(tmp_path):
    """The corpus run of the test above, rank 1's stop line replaced by the line v26.1.0's own catch format
    writes for a UB link error: `recovery.faults` says what the text's phase line says."""
    log = (REPO / "tests" / "corpus" / "logs" / "megatron-global-memory-buffer.log").read_text(encoding="utf-8")
    stopped = "rank:1 catch FORCE STOP exception, error_code:， ex instance:FORCE STOP, "
    (link,) = _lines("v26.1.0", "UB LINK ERROR", "UB LINK ERROR")
    assert stopped in log and link.startswith("rank:5 catch UB LINK ERROR exception")
    linked = tmp_path / "link.log"
    linked.write_text(log.replace(stopped, link.replace("rank:5", "rank:1")), encoding="utf-8")
    result = run_cli("diagnose", "--log-only", "--format", "json", str(linked), cwd=REPO)
    assert result.returncode == 1, result.stderr
    (finding,) = json.loads(result.stdout)["findings"]
    assert finding["recovery"]["fault_ranks"] == [1, 3]
    assert finding["recovery"]["faults"] == [{"rank": 1, "kind": "link-fault"}, {"rank": 3, "kind": "memory-fault"}]
