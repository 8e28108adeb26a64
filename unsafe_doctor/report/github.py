"""GitHub Actions annotations: each SARIF result as a workflow command (`::error file=F,line=L,title=T::message`),
so a CI step shows findings on the pull request's lines without an upload step.

Escaping follows the Actions toolkit (`@actions/core` command.ts): in the message `%`, CR and LF;
in a property value also `:` and `,`, which would otherwise end the value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

_LEVELS = {"error": "error", "warning": "warning", "note": "notice", "none": "notice"}


def from_sarif(document: dict[str, Any], workspace: Path) -> list[str]:
    """One workflow command per result; files as paths relative to `workspace` (the checkout) when under it."""
    lines = []
    for run in document.get("runs", []):
        titles = {rule["id"]: rule.get("shortDescription", {}).get("text", rule["id"]) for rule in run["tool"]["driver"]["rules"]}
        for result in run.get("results", []):
            lines.append(_command(result, titles, workspace))
    return lines


def _command(result: dict[str, Any], titles: dict[str, str], workspace: Path) -> str:
    properties: list[tuple[str, str]] = []
    locations = result.get("locations") or []
    if locations:
        physical = locations[0]["physicalLocation"]
        properties.append(("file", _path(physical["artifactLocation"]["uri"], workspace)))
        line = physical.get("region", {}).get("startLine")
        if line:
            properties.append(("line", str(line)))
    rule = result.get("ruleId", "unsafe-doctor")
    properties.append(("title", titles.get(rule, rule)))
    level = _LEVELS.get(result.get("level", "warning"), "warning")
    fields = ",".join(f"{name}={escape_property(value)}" for name, value in properties)
    return f"::{level} {fields}::{escape_data(result['message']['text'])}"


def _path(uri: str, workspace: Path) -> str:
    parsed = urlparse(uri)
    path = unquote(parsed.path) if parsed.scheme == "file" else uri
    if os.path.isabs(path):
        relative = os.path.relpath(path, workspace)
        if not relative.startswith(".."):
            return Path(relative).as_posix()
    return path


def escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")
