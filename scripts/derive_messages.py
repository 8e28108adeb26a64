"""Derive knowledge_base/adaptor_messages.json: every message each adaptor generation can log.

    python scripts/derive_messages.py --mindspeed-llm PATH_TO_GIT_DIR --mind-cluster PATH_TO_GIT_DIR

Both are git directories (bare clones of github.com/Ascend/MindSpeed-LLM and github.com/Ascend/mind-cluster).
The generation a log shows is read from these messages (`unsafe_doctor.knowledge.generations`), so they
come from the generations' real files, never from strings picked by hand:

- each release's adaptor files (`ADAPTOR_SOURCES`: the folder, the tags, the profile of
  knowledge_base/adaptors.yaml they belong to) are parsed with `ast`; every logging call (`X.info`,
  `.warning`, `.error`, `.debug`, `.exception`, `.critical`, `.warn`, `.log(level, msg)` on a logger) and
  every print (`print`, `print_rank_0` and the other `print_*` helpers) gives its message's format, with
  each `%s` / `{}` / f-string hole as a wildcard (`{}` in the output, literal braces doubled);
- the logger: `getLogger(__name__)` logs under the module's name, a name imported from `mindio_ttp` is
  MindIO's logger (its lines name the file: `[PYH repair_callback.py:54]`);
- a message is dropped when it tells no generation apart: fewer than MIN_WORDS words of two letters or
  more in its literal text; a format MindIO's own Python (`MINDIO_SOURCE`, under every generation) can
  log; a print (the adaptors print only what Megatron's checkpoint loader prints in every run);
- the legacy `mindio_ttp` wheel's adaptor was never published: its lines, as far as they are known,
  are `RECORDED`, each with where it is known from and the wheel's files known to log it (each with
  where that is known from), kept apart from the derived ones.

Each message records where it comes from (repo, tag, commit, path, line). Run it again after a new
release; tests/knowledge/test_adaptor_messages.py holds the shipped file to what this script derives.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from unsafe_doctor.knowledge.generations import MINDIO_LOGGER, WORD

OUTPUT = Path(__file__).resolve().parents[1] / "knowledge_base" / "adaptor_messages.json"
MIN_WORDS = 3  # words of two letters or more in a message's literal text: fewer tell no generation apart
LEVELS = frozenset({"info", "warning", "warn", "error", "debug", "exception", "critical", "log"})


@dataclass(frozen=True)
class Source:
    repo: str  # "Ascend/MindSpeed-LLM"
    option: str  # the command-line option that gives the git directory
    tags: tuple[str, ...]  # refs read; "master" is read at its commit
    folder: str  # the adaptor's folder in the repository
    import_root: str  # the folder its modules' names are relative to
    generation: str | None  # a profile id of adaptors.yaml; None: lines every generation shares


ADAPTOR_SOURCES = (
    # MindSpeed-LLM 2.1.0 / 2.2.0 hold only hooks around the mindio_ttp wheel's adaptor (they log nothing);
    # 1.x and 2.0.0 hook in from training/*.py, with no adaptor file of their own
    Source(
        "Ascend/MindSpeed-LLM",
        "mindspeed_llm",
        ("v2.1.0", "v2.2.0"),
        "mindspeed_llm/features_manager/high_availability/",
        "",
        "mindio-ttp-legacy",
    ),
    Source(
        "Ascend/MindSpeed-LLM", "mindspeed_llm", ("v2.3.0",), "mindspeed_llm/core/high_availability/", "", "mindspeed-llm-2.3"
    ),
    Source(
        "Ascend/MindSpeed-LLM",
        "mindspeed_llm",
        ("v26.0.0", "v26.1.0", "master"),
        "mindspeed_llm/core/high_availability/",
        "",
        "mindspeed-llm-26",
    ),
    Source(
        "Ascend/mind-cluster",
        "mind_cluster",
        ("v7.2.RC1", "v7.2.RC1.SPC1", "v7.2.RC1.SPC2"),
        "component/taskd/taskd/python/adaptor/elastic_training/",
        "component/taskd/",
        "taskd-elastic",
    ),
)
MINDIO_SOURCE = Source(
    "Ascend/mind-cluster",
    "mind_cluster",
    ("v7.3.0", "v7.3.2", "v26.0.0", "v26.1.0", "master"),
    "component/mindio/tft/src/python/",
    "component/mindio/tft/src/python/",
    None,
)

# The legacy wheel's lines as far as they are known (its source was never published). The texts are
# those MindSpeed-LLM's commit 5dd34295 ("move mindio_ttp adaptor to MindSpeed", 2025-11-10) carried
# in-tree; the wheel logs through MindIO's logger, as taskd's copy of its code does (`ttp_logger.LOGGER`,
# mind-cluster v7.2.RC1), so each line names its file: the file the commit moved it from, or the one
# file the FAQ names for the whole adaptor of older wheels.
_KNOWN_FROM = "domain notes §4; MindSpeed-LLM 5dd34295 moved the wheel's adaptor in-tree with this text (adaptors.yaml notes)"
_MOVED = "the wheel's file 5dd34295 moved it from"
_FAQ = "the one adaptor file of older wheels the FAQ names"
RECORDED = (
    ("rank {} check uce memory result: {}", "tft_stop_clean.py"),
    ("[clean] rank:{}, type:{}, cost:{}s, ret:{}", "tft_stop_clean.py"),
    (
        "[repair] rank {}, repair type:{}, src ranks:{}, dst ranks:{}, rank list:{}, optim idxs:{}, step:{}",
        "tft_optimizer_data_repair.py",
    ),
    ("rank:{} successfully gather and rollback at iteration {}", "tft_rollback.py"),
    ("[rollback] rank {} rollback total time consumed:{}", "tft_rollback.py"),
)

_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?[diouxXeEfFgGcrsab%]")
HOLE = None  # a wildcard among a message's parts


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(repo), *args], capture_output=True, text=True, check=True).stdout


def _commit(repo: Path, ref: str) -> str:
    return _git(repo, "rev-parse", f"{ref}^{{commit}}").strip()


def files_of(repo: Path, ref: str, folder: str) -> Iterator[tuple[str, str]]:
    """(path, text) of each Python file under the folder at the ref."""
    for path in _git(repo, "ls-tree", "-r", "--name-only", ref, "--", folder).splitlines():
        if path.endswith(".py"):
            yield path, _git(repo, "show", f"{ref}:{path}")


# --- one file's messages -------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    text: str  # the format, `{}` for each hole, literal braces doubled
    logger: str | None  # a module's name, MINDIO_LOGGER, "root", "unknown", or None (a print)
    line: int


def messages_in(source: str, module: str) -> list[Message]:
    """Every message the module's logging calls and prints can write, in line order (too generic ones included)."""
    tree = ast.parse(source)
    loggers = _loggers(tree, module)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = _called(node, loggers)
        if called is None:
            continue
        logger, argument = called
        parts = _parts(argument, percent_args=len(node.args) > (2 if _level(node) == "log" else 1))
        found.append(Message(_format(parts), logger, node.lineno))
    return sorted(found, key=lambda message: message.line)


def is_specific(text: str) -> bool:
    """Whether a message's literal text is enough to tell a generation: MIN_WORDS words or more."""
    literal = "".join(part for part in _braces(text) if part is not HOLE)
    return len(WORD.findall(literal)) >= MIN_WORDS


def _loggers(tree: ast.Module, module: str) -> dict[str, str]:
    """Names bound to a logger: `getLogger(__name__)` (the module's name), `getLogger("x")`, names
    imported from mindio_ttp (MindIO's logger), and `logging` itself (the root logger)."""
    loggers: dict[str, str] = {"logging": "root"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mindio_ttp"):
            loggers.update((alias.asname or alias.name, MINDIO_LOGGER) for alias in node.names if "log" in alias.name.lower())
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            function = node.value.func
            if getattr(function, "id", getattr(function, "attr", None)) != "getLogger":
                continue
            argument = node.value.args[0] if node.value.args else None
            name = (
                module
                if isinstance(argument, ast.Name) and argument.id == "__name__"
                else (argument.value if isinstance(argument, ast.Constant) and isinstance(argument.value, str) else "root")
            )
            loggers.update((target.id, name) for target in node.targets if isinstance(target, ast.Name))
    return loggers


def _level(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) and call.func.attr in LEVELS else None


def _called(call: ast.Call, loggers: dict[str, str]) -> tuple[str | None, ast.expr] | None:
    """(the logger, the message argument) of a logging call or print; None for any other call."""
    function = call.func
    if isinstance(function, ast.Name) and function.id.startswith("print") and call.args:
        return None, call.args[0]
    level = _level(call)
    if level is None or not isinstance(function, ast.Attribute):
        return None
    root = function.value
    while isinstance(root, ast.Attribute):
        root = root.value
    if not isinstance(root, ast.Name) or (root.id not in loggers and "log" not in root.id.lower()):
        return None
    position = 1 if level == "log" else 0
    if len(call.args) <= position:
        return None
    return loggers.get(root.id, "unknown"), call.args[position]


def _parts(node: ast.expr, *, percent_args: bool = False) -> list[str | None]:
    """The message as literal strings and HOLEs."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _percent(node.value) if percent_args else [node.value]
    if isinstance(node, ast.JoinedStr):
        return [value.value if isinstance(value, ast.Constant) else HOLE for value in node.values]
    if (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Mod)
        and isinstance(node.left, ast.Constant)
        and isinstance(node.left.value, str)
    ):
        return _percent(node.left.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _parts(node.left) + _parts(node.right)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
        and isinstance(node.func.value, ast.Constant)
        and isinstance(node.func.value.value, str)
    ):
        return _braces(node.func.value.value)
    return [HOLE]


def _percent(text: str) -> list[str | None]:
    parts: list[str | None] = []
    position = 0
    for spec in _PERCENT.finditer(text):
        parts.append(text[position : spec.start()])
        parts.append("%" if spec.group() == "%%" else HOLE)
        position = spec.end()
    return [*parts, text[position:]]


def _braces(text: str) -> list[str | None]:
    import string

    parts: list[str | None] = []
    for literal, field, _, _ in string.Formatter().parse(text):
        parts.append(literal)
        if field is not None:
            parts.append(HOLE)
    return parts


def _format(parts: list[str | None]) -> str:
    """Literal parts joined, each run of holes one `{}`, literal braces doubled."""
    text = ""
    for part in parts:
        if part is HOLE:
            text += "" if text.endswith("{}") and not text.endswith("{{}") else "{}"
        else:
            text += part.replace("{", "{{").replace("}", "}}")
    return text


# --- the whole file --------------------------------------------------------------------------------


def _module(path: str, import_root: str) -> str:
    return path.removeprefix(import_root).removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def derive(repos: dict[str, Path]) -> dict:
    """The data file's content, from the git directories by option name."""
    shared = {
        message.text
        for tag in MINDIO_SOURCE.tags
        for path, text in files_of(repos[MINDIO_SOURCE.option], tag, MINDIO_SOURCE.folder)
        for message in messages_in(text, _module(path, MINDIO_SOURCE.import_root))
    }
    messages: dict[tuple[str, str | None], dict] = {}
    read = []
    dropped = {"too generic": 0, "MindIO's own": 0, "a print": 0}
    for source in ADAPTOR_SOURCES:
        repo = repos[source.option]
        for tag in source.tags:
            commit = _commit(repo, tag)
            files = list(files_of(repo, tag, source.folder))
            read.append(
                {
                    "repo": source.repo,
                    "ref": tag,
                    "commit": commit,
                    "folder": source.folder,
                    "generation": source.generation,
                    "files": len(files),
                }
            )
            for path, text in files:
                for message in messages_in(text, _module(path, source.import_root)):
                    if not is_specific(message.text):
                        dropped["too generic"] += 1
                        continue
                    if message.text in shared:
                        dropped["MindIO's own"] += 1
                        continue
                    if message.logger is None:
                        dropped["a print"] += 1
                        continue
                    entry = messages.setdefault(
                        (message.text, message.logger),
                        {
                            "text": message.text,
                            "logger": message.logger,
                            "file": path.rpartition("/")[2],
                            "generations": [],
                            "found": [],
                        },
                    )
                    if source.generation not in entry["generations"]:
                        entry["generations"].append(source.generation)
                    where = next(
                        (found for found in entry["found"] if found["generation"] == source.generation and found["path"] == path),
                        None,
                    )
                    if where is None:
                        entry["found"].append(
                            {
                                "generation": source.generation,
                                "repo": source.repo,
                                "refs": [tag],
                                "commit": commit,
                                "path": path,
                                "line": message.line,
                            }
                        )
                    elif tag not in where["refs"]:
                        where["refs"].append(tag)
    return {
        "generated_by": "python scripts/derive_messages.py --mindspeed-llm GIT_DIR --mind-cluster GIT_DIR "
        "(see its docstring: every logging call and print of each generation's adaptor files, read "
        "with ast; `{}` is a hole; `found` names the first commit of each path's message, `refs` "
        "every release that has it)",
        "dropped": {
            "rule": f"fewer than {MIN_WORDS} words of two letters in the literal text; a format MindIO's "
            "own Python logs (every generation shares it); a print (Megatron's checkpoint loader's "
            "lines, printed in every run)",
            **dropped,
        },
        "read": read,
        "messages": sorted(messages.values(), key=lambda entry: (entry["generations"][0], entry["file"], entry["text"])),
        "recorded": [
            {
                "text": text,
                "logger": MINDIO_LOGGER,
                "files": {file: _MOVED, "modellink_adaptor.py": _FAQ},
                "generations": ["mindio-ttp-legacy"],
                "known_from": _KNOWN_FROM,
            }
            for text, file in RECORDED
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mindspeed-llm", type=Path, required=True, help="git directory of MindSpeed-LLM")
    parser.add_argument("--mind-cluster", type=Path, required=True, help="git directory of mind-cluster")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    arguments = parser.parse_args()
    data = derive({"mindspeed_llm": arguments.mindspeed_llm, "mind_cluster": arguments.mind_cluster})
    arguments.output.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"{arguments.output}: {len(data['messages'])} messages, {len(data['recorded'])} recorded", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
