"""Options that several commands take, declared once so that their help reads the same everywhere."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class Format(str, Enum):
    """fix, verify and rules: their output has no place in a source file, so no SARIF."""

    text = "text"
    json = "json"


class LocatedFormat(str, Enum):
    """diagnose and audit: each finding has a file and line, so SARIF and GitHub annotations too."""

    text = "text"
    json = "json"
    sarif = "sarif"
    github = "github"


# Each shared option can come from an UNSAFE_DOCTOR_* variable, named in its help. show_envvar=False:
# click would otherwise name the variable in every bad-value error, given on the command line or not
# (`main` says where a bad value came from).
FORMAT_VARIABLE = "UNSAFE_DOCTOR_FORMAT"
FormatOption = Annotated[
    Format,
    typer.Option(
        "--format",
        "-f",
        help="text for people, json for tools. Env: UNSAFE_DOCTOR_FORMAT.",
        case_sensitive=False,  # UNSAFE_DOCTOR_FORMAT=JSON
        envvar=FORMAT_VARIABLE,
        show_envvar=False,
    ),
]
LocatedFormatOption = Annotated[
    LocatedFormat,
    typer.Option(
        "--format",
        "-f",
        help="text for people; json or sarif for tools; github: GitHub Actions annotations. Env: UNSAFE_DOCTOR_FORMAT.",
        case_sensitive=False,
        envvar=FORMAT_VARIABLE,
        show_envvar=False,
    ),
]
LogsArgument = Annotated[
    list[str] | None,
    typer.Argument(help="Log files or folders (.gz too). None or '-': read standard input.", show_default=False),
]
NoInputOption = Annotated[bool, typer.Option("--no-input", help="Never ask questions.")]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Accept every offer without asking.")]
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Show the diff; write nothing.")]
SOURCE_ROOT_VARIABLE = "UNSAFE_DOCTOR_SOURCE_ROOT"
CACHE_VARIABLE = "UNSAFE_DOCTOR_CACHE_DIR"
SourceRootOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--source-root",
        help="Folder holding the training code and its frameworks, where the adaptor is looked for (repeatable). "
        "Env: UNSAFE_DOCTOR_SOURCE_ROOT.",
        exists=True,
        file_okay=False,
        dir_okay=True,
        envvar=SOURCE_ROOT_VARIABLE,
        show_envvar=False,
    ),
]
LogOnlyOption = Annotated[
    bool,
    typer.Option(
        "--log-only",
        help="Diagnose from the log's text alone: read no source file the log names, no installed package "
        "(the --adaptor file is still read). Findings are labelled as guesses. Not with --source-root.",
    ),
]
ProfileOption = Annotated[
    str | None,
    typer.Option(
        "--profile",
        metavar="ID",
        help="The adaptor's generation, when its files do not tell it alone: an adaptor profile id (mindio-ttp-legacy, "
        "mindspeed-llm-2.3, mindspeed-llm-26, taskd-elastic, or one of a --rules file).",
    ),
]
RulesOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--rules",
        help="Extra knowledge-base rule file or folder (repeatable). Env: UNSAFE_DOCTOR_RULES.",
        exists=True,
        envvar="UNSAFE_DOCTOR_RULES",
        show_envvar=False,
    ),
]
ADAPTOR_VARIABLE = "UNSAFE_DOCTOR_ADAPTOR"
AdaptorOption = Annotated[
    Path | None,
    typer.Option(
        "--adaptor",
        help="The recovery adaptor file (feature_rollback, send/recv_rank_repair); found under --source-root if not given. "
        "Env: UNSAFE_DOCTOR_ADAPTOR.",
        exists=True,
        dir_okay=False,
        envvar=ADAPTOR_VARIABLE,
        show_envvar=False,
    ),
]
ParameterOption = Annotated[
    list[str] | None,
    typer.Option(
        "--parameter",
        help="The adaptor's parameter for a role when its name differs from the profile's: src_ranks=NAME, "
        "dest_ranks=NAME, train_args=NAME, ...; peer=NAME for one rank on the other side (no lists), "
        "group=NAME for a parameter holding the repair group (comma-separated or repeated). NAME may be an "
        "attribute (args.src_ranks); a role given twice names the send and the receive function's. Env: UNSAFE_DOCTOR_PARAMETER.",
        envvar="UNSAFE_DOCTOR_PARAMETER",
        show_envvar=False,
    ),
]
FunctionOption = Annotated[
    list[str] | None,
    typer.Option(
        "--function",
        help="The adaptor's function for a role when its name differs from the profile's: "
        "rollback=NAME, send=NAME, recv=NAME (comma-separated or repeated). Env: UNSAFE_DOCTOR_FUNCTION.",
        envvar="UNSAFE_DOCTOR_FUNCTION",
        show_envvar=False,
    ),
]
SuspectOption = Annotated[
    list[int] | None,
    typer.Option(
        "--suspect",
        metavar="N",
        help="Take suspect N of the log's shortlist as a finding (an error logged without a traceback: diagnose "
        "lists the suspects; repeatable): fix writes its fix, verify proves that fix for that suspect, not that it "
        "is the culprit. Never implied.",
    ),
]
OutputOption = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        help="Write the report to this file (once complete, in place as > writes it) instead of stdout.",
        dir_okay=False,
    ),
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="Print the report only: no notes or progress on stderr.")]
VerboseOption = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Also say which settings apply: pyproject.toml and UNSAFE_DOCTOR_* variables; "
        "diagnose: also the adaptor generation the log shows, with its lines.",
    ),
]
ExitZeroOption = Annotated[
    bool,
    typer.Option("--exit-zero", help="Exit 0 where the command would exit 1 (findings, a block not written); bad usage: 2."),
]


EXAMPLES = {  # shown under each command's help; "unsafe-doctor": under the top-level help
    "unsafe-doctor": [
        "unsafe-doctor train.log",
        "kubectl logs job/llm | unsafe-doctor",
        "unsafe-doctor fix train.log --adaptor ~/job/recovery.py --yes",
        "unsafe-doctor verify train.log --adaptor ~/job/recovery.py",
        "unsafe-doctor audit ~/job/src",
    ],
    "diagnose": [
        "unsafe-doctor train.log",
        "unsafe-doctor logs/ --source-root ~/job --format json -o findings.json",
        "kubectl logs job/llm | unsafe-doctor",
    ],
    "fix": [
        "unsafe-doctor fix train.log --source-root ~/job --dry-run > fix.patch",
        "unsafe-doctor fix train.log --adaptor ~/job/recovery.py --yes",
        "unsafe-doctor fix --revert --adaptor ~/job/recovery.py",
    ],
    "audit": [
        "unsafe-doctor audit ~/job/src",
        "unsafe-doctor audit ~/job/src --fix --yes",
        "unsafe-doctor audit --format github",
    ],
    "verify": ["unsafe-doctor verify train.log --source-root ~/job", "unsafe-doctor verify train.log --mode block --ranks 8"],
    "sentinel install": [
        "unsafe-doctor sentinel install --source-root ~/job --dry-run",
        "unsafe-doctor sentinel install --adaptor ~/job/recovery.py --mode raise --yes",
    ],
}


def examples(command: str) -> str:
    """The epilog of a command's help."""
    return "Examples:\n\n" + "\n\n".join(f"  {line}" for line in EXAMPLES[command])
