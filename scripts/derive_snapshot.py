"""Derive knowledge_base/snapshot.json: the shipped knowledge files as JSON, for runs without --rules.

    python scripts/derive_snapshot.py

Every run reads the shipped rules, templates, profiles and conditions from this file, with the json
module, instead of their YAML (a user's --rules files are still YAML): importing PyYAML and building Python objects from
its nodes were most of a small log's start-up. It holds each file's data as YAML reads it, the line
each item starts on (a rule's `file:line`, as `rules list` shows it) and the file's CRC-32 (a YAML
file edited since is read as YAML). Run it after editing a shipped
.yaml file; tests/knowledge/test_knowledge_snapshot.py holds the committed file to what this script writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from unsafe_doctor.knowledge.loading import SNAPSHOT_FILE, shipped_files, shipped_knowledge_dir, snapshot


def render() -> str:
    """The snapshot's text, as committed."""
    return json.dumps(snapshot(shipped_files()), indent=1, ensure_ascii=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=shipped_knowledge_dir() / SNAPSHOT_FILE)
    arguments = parser.parse_args()
    try:
        text = render()
    except ValueError as error:
        print(f"derive_snapshot: {error}", file=sys.stderr)
        return 2
    arguments.output.write_text(text, encoding="utf-8")
    print(f"{arguments.output}: {len(shipped_files())} files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
