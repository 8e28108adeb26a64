"""SARIF 2.1.0, shared by diagnose and audit: the log of one run, locations, and fixes as replacements."""

from __future__ import annotations

from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from unsafe_doctor import __version__

if TYPE_CHECKING:
    from unsafe_doctor.adaptor.splice import FileEdit


def sarif_log(rules: dict[str, str], results: list[dict[str, Any]]) -> dict[str, Any]:
    """A SARIF 2.1.0 log of one run of unsafe-doctor: its rules (id -> description) and results."""
    driver = {
        "name": "unsafe-doctor",
        "version": __version__,
        "rules": [{"id": rule_id, "shortDescription": {"text": text}} for rule_id, text in rules.items()],
    }
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{"tool": {"driver": driver}, "results": results}],
    }


def file_uri(file: str) -> str:
    """A local file as SARIF wants it: a file URI when absolute, a relative reference otherwise."""
    path = Path(file)
    return path.as_uri() if path.is_absolute() else path_reference(file)


def path_reference(file: str) -> str:
    """A path as a URI reference, percent-encoded (a folder `w#1 %41` is not the file `w` with a
    fragment): a relative one, or a path of another machine (a log's)."""
    return quote(Path(file).as_posix(), safe="/")


def location(uri: str, line: int | None) -> dict[str, Any]:
    """A physical location; without a line, the whole artifact."""
    region = {"startLine": line} if line else {}
    return {"physicalLocation": {"artifactLocation": {"uri": uri}, "region": region}}


def artifact_change(edit: FileEdit) -> dict[str, Any]:
    """The edit's inserted blocks as SARIF replacements, one per place in the original file.

    Character offsets count the original as its encoding decodes it, lines split as the fixer splits them.
    """
    lines = edit.original.splitlines(keepends=True)
    replacements = []
    for line, inserted in groupby(edit.insertions, key=lambda insertion: insertion.line):
        offset = len(b"".join(lines[:line]).decode(edit.encoding, errors="replace"))
        region: dict[str, Any] = {"charOffset": offset, "charLength": 0}
        if line < len(lines):
            region.update(startLine=line + 1, startColumn=1, endLine=line + 1, endColumn=1)
        text = "".join(insertion.text for insertion in inserted)
        replacements.append({"deletedRegion": region, "insertedContent": {"text": text}})
    return {"artifactLocation": {"uri": file_uri(str(edit.path))}, "replacements": replacements}
