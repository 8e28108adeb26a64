"""Make the corpus logs of prefix stacks: real corpus logs passed through the writers users put between
a job and its log file.

Usage, from the repository root::

    .venv/bin/python tests/corpus/prefixes.py          # writes tests/corpus/logs/prefix-*.log

Each output is one log of `logs/` (a real torchrun run, made by generate.py) with every line passed,
innermost first, through some of:

- `logging`: Python's `logging`, a `StreamHandler` with a `Formatter`, one record per line, as a
  launcher that forwards its workers' output through a logger writes it (stderr lines at ERROR,
  stdout lines at INFO). The colour variant is a `Formatter` that colours the level name, as
  colorlog does: ANSI codes inside the prefix.
- `ansi`: colour codes a coloured console adds to messages: the exception type bold red, torchrun's
  warnings yellow.
- `cri`: the container runtime's log file, written as containerd's CRI logger writes it
  (`<RFC 3339 nano time> <stream> <F|P> <content>`): a line longer than the runtime's buffer is cut
  into pieces tagged `P` up to the last one, tagged `F`. containerd's buffer is 16 KiB; here it is
  CRI_LIMIT bytes, so that the long lines of a traceback (`File "..."` with site-packages paths)
  are cut. Stdout and stderr are read by separate goroutines, so a piece of one stream can be
  followed by a line of the other before its continuation: the writer does that whenever a cut line
  is followed by a line of the other stream.
- `syslog`: an RFC 3164 stamp, `Dec  1 13:00:33 node1 tag[pid]: `, as rsyslog writes what a
  `logging.handlers.SysLogHandler` sends it: the stamp is a `logging.Formatter` with rsyslog's
  format and a space-padded day.
- `kubectl`: `kubectl logs --prefix --timestamps`: `[pod/<pod>/<container>] <RFC 3339 nano time> `.
  kubectl is not installed here; the format is written as kubectl prints it.

Which stream a line came on is not in the combined log: excepthook lines (`[rankN]: `), torchrun's
own glog lines (`W1201 ...`) and torch_npu's `[ERROR]` lines count as stderr, the rest as stdout.
The clock starts at 2026-12-01 13:00:00 UTC and advances
1.5 ms a line, so every run writes the same bytes.
"""

from __future__ import annotations

import io
import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOGS = HERE / "logs"
CRI_LIMIT = 120  # bytes of content per CRI line (containerd: 16 KiB)
START_NS = 1_796_130_000 * 10**9  # 2026-12-01 13:00:00 UTC
TICK_NS = 1_500_000

RED, BOLD_RED, YELLOW, RESET = "\x1b[31m", "\x1b[1;31m", "\x1b[33m", "\x1b[0m"


@dataclass(frozen=True)
class Line:
    """A line as it travels: the stream it came on, its time, its text so far."""

    stream: str
    created_ns: int
    text: str


Layer = Callable[[list[Line]], list[Line]]

_STDERR = re.compile(r"^(?:\[[A-Za-z]+\d+\]:)?(?:\[rank\d+\]: |[WEIF]\d{4} |\[ERROR\] )")


def read(name: str) -> list[Line]:
    lines = (LOGS / f"{name}.log").read_text().splitlines()
    return [
        Line("stderr" if _STDERR.match(text) else "stdout", START_NS + index * TICK_NS, text) for index, text in enumerate(lines)
    ]


# --- Python logging --------------------------------------------------------------------------------


class _ColourLevel(logging.Formatter):
    """Colours the level name, as colorlog's formatter does."""

    def format(self, record: logging.LogRecord) -> str:
        colour = RED if record.levelno >= logging.ERROR else ""
        record.levelname = f"{colour}{logging.getLevelName(record.levelno)}{RESET if colour else ''}"
        return super().format(record)


def _through_logger(lines: list[Line], formatter: logging.Formatter) -> list[Line]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.terminator = "\x00"  # one record per source line, even if a message held a newline
    handler.setFormatter(formatter)
    logger = logging.Logger("launcher")  # not registered: nothing else sees these records
    logger.addHandler(handler)
    for line in lines:
        level = logging.ERROR if line.stream == "stderr" else logging.INFO
        record = logger.makeRecord("launcher", level, __file__, 0, "%s", (line.text,), None)
        record.created, record.msecs = line.created_ns / 1e9, (line.created_ns // 10**6) % 1000
        logger.handle(record)
    texts = out.getvalue().split("\x00")[:-1]
    return [Line(line.stream, line.created_ns, text) for line, text in zip(lines, texts, strict=True)]


def _utc_formatter(fmt: str, datefmt: str | None = None, cls: type[logging.Formatter] = logging.Formatter) -> logging.Formatter:
    formatter = cls(fmt, datefmt)
    formatter.converter = time.gmtime
    return formatter


def logging_bracketed(lines: list[Line]) -> list[Line]:
    """`2026-12-01 13:00:00,001 ERROR [launcher] `"""
    return _through_logger(lines, _utc_formatter("%(asctime)s %(levelname)s [%(name)s] %(message)s"))


def logging_default_coloured(lines: list[Line]) -> list[Line]:
    """`2026-12-01 13:00:00,001 - launcher - <red>ERROR</red> - `: the documented default fields, coloured."""
    return _through_logger(lines, _utc_formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s", cls=_ColourLevel))


def syslog(lines: list[Line]) -> list[Line]:
    """`Dec  1 13:00:00 node1 torchrun[4242]: `"""
    formatter = _utc_formatter("%(asctime)s node1 torchrun[4242]: %(message)s", "%b %e %H:%M:%S")
    return _through_logger(lines, formatter)


# --- colour, CRI, kubectl ---------------------------------------------------------------------------

_EXCEPTION_TYPE = re.compile(r"(?<=\] )(RuntimeError)(?=: )|^(RuntimeError)(?=: )")
_GLOG_WARNING = re.compile(r"^W\d{4} .*")


def ansi(lines: list[Line]) -> list[Line]:
    def colour(text: str) -> str:
        text = _EXCEPTION_TYPE.sub(lambda m: f"{BOLD_RED}{m[0]}{RESET}", text)
        return _GLOG_WARNING.sub(lambda m: f"{YELLOW}{m[0]}{RESET}", text)

    return [Line(line.stream, line.created_ns, colour(line.text)) for line in lines]


def rfc3339_nano(created_ns: int) -> str:
    """Go's time.RFC3339Nano in UTC: trailing zeros of the fraction are dropped."""
    seconds, nanos = divmod(created_ns, 10**9)
    fraction = f"{nanos:09d}".rstrip("0")
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + (f".{fraction}" if fraction else "") + "Z"


def _cri_pieces(line: Line) -> list[Line]:
    content = line.text.encode()
    cuts = [content[at : at + CRI_LIMIT] for at in range(0, len(content), CRI_LIMIT)] or [b""]
    pieces = []
    for index, cut in enumerate(cuts):
        tag = "F" if index == len(cuts) - 1 else "P"
        created_ns = line.created_ns + index * 1000
        header = f"{rfc3339_nano(created_ns)} {line.stream} {tag} "
        pieces.append(
            Line(line.stream, created_ns, header + cut.decode("utf-8", "surrogateescape"))
        )  # cut bytes, as containerd does
    return pieces


def cri(lines: list[Line]) -> list[Line]:
    out: list[Line] = []
    index = 0
    while index < len(lines):
        pieces = _cri_pieces(lines[index])
        following = lines[index + 1] if index + 1 < len(lines) else None
        if len(pieces) > 1 and following is not None and following.stream != lines[index].stream:
            # the other stream's goroutine wrote its line between this line's pieces
            out += pieces[:1] + _cri_pieces(following) + pieces[1:]
            index += 2
        else:
            out += pieces
            index += 1
    return out


def kubectl(pod: str, container: str) -> Layer:
    def layer(lines: list[Line]) -> list[Line]:
        return [
            Line(line.stream, line.created_ns, f"[pod/{pod}/{container}] {rfc3339_nano(line.created_ns)} {line.text}")
            for line in lines
        ]

    return layer


# --- the stacks --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    source: str  # a log of logs/, without .log
    layers: tuple[Layer, ...]  # innermost first


STACKS: dict[str, Stack] = {
    "prefix-cri-router-expert-bias": Stack("megatron-router-expert-bias", (cri,)),
    "prefix-logging-cri-mtp-loss-tracker": Stack("megatron-mtp-loss-tracker", (logging_bracketed, cri)),
    "prefix-ansi-logging-syslog-grad-scaler": Stack("megatron-grad-scaler", (ansi, logging_default_coloured, syslog)),
    "prefix-ansi-kubectl-aux-losses-tracker": Stack(
        "megatron-0.7-aux-losses-tracker", (ansi, kubectl("train-master-0", "pytorch"))
    ),
    "prefix-cri-syslog-rotary-emb-cache": Stack("megatron-rotary-emb-cache", (cri, syslog)),
}


def apply(stack: Stack) -> str:
    lines = read(stack.source)
    for layer in stack.layers:
        lines = layer(lines)
    return "".join(line.text + "\n" for line in lines)


def main(names: list[str]) -> None:
    for name in names:
        (LOGS / f"{name}.log").write_text(apply(STACKS[name]), errors="surrogateescape")
        print(f"wrote logs/{name}.log")


if __name__ == "__main__":
    main(sys.argv[1:] or list(STACKS))
