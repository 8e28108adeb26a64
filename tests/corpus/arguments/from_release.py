"""Write arguments/megatron-lm-core_v<release>.json from an unpacked megatron-core release (0.17 and
newer ship megatron/training/): every argument Megatron-LM's own parser adds, at its default.

    .venv/bin/python tests/corpus/arguments/from_release.py 0.19.2 ...

The parser is the release's (`add_megatron_arguments`, parsed with no argument); the fields
validate_args derives (world_size, params_dtype, ...) are those the core_v0.12.1 file carries and
the parser does not add, at that file's value: the worker sets the job's own. The release is
imported as generate.py's runs import it (tests/fixtures/rules/release.py, cases.python_312_standins).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[2] / "samples" / "workers"), str(HERE.parents[1] / "fixtures" / "rules")]

from cases import python_312_standins  # noqa: E402
from release import release_root  # noqa: E402

BASE = json.loads((HERE / "megatron-lm-core_v0.12.1.json").read_text())["arguments"]


def _plain(value: object) -> object:
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def write(version: str) -> Path:
    root = release_root(version)
    if root is None:
        raise SystemExit(f"megatron-core {version} cannot be had: see tests/fixtures/rules/release.py")
    sys.path.insert(0, str(root))
    python_312_standins()
    from megatron.training.arguments import add_megatron_arguments

    parsed = vars(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args([]))
    derived = {name: value for name, value in BASE.items() if name not in parsed}
    arguments = {name: _plain(value) for name, value in sorted({**parsed, **derived}.items())}
    path = HERE / f"megatron-lm-core_v{version}.json"
    source = (
        f"megatron-core {version} (the package index's wheel) megatron/training/arguments.py: "
        "add_megatron_arguments' dests and defaults; validate_args' derived fields as in core_v0.12.1's file"
    )
    path.write_text(json.dumps({"source": source, "arguments": arguments}, indent=0) + "\n")
    return path


if __name__ == "__main__":
    for version in sys.argv[1:]:
        print(write(version))
