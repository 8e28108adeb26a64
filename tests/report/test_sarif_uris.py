"""SARIF locations are URI references: a relative path is percent-encoded, so that a folder
`w#1 %41` points a URI reader at that folder's file, not at the file `w` with a fragment."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples"
FOLDER = "w#1 %41"


def test_a_relative_sarif_uri_is_percent_encoded(tmp_path):
    shutil.copytree(SAMPLES / "framework", tmp_path / FOLDER)
    result = run_cli(
        "diagnose", str(SAMPLES / "logs" / "toytrain_ema"), "--source-root", FOLDER, "--format", "sarif", cwd=tmp_path
    )
    [finding] = json.loads(result.stdout)["runs"][0]["results"]
    uri = finding["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
    assert uri == "w%231%20%2541/toytrain/train.py"
    parts = urlsplit(uri)
    assert (parts.scheme, parts.fragment, unquote(parts.path)) == ("", "", f"{FOLDER}/toytrain/train.py")
