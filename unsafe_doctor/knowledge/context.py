"""What the stages of one command share: the knowledge base, one workspace, the environment.

A command sets them up once and hands them down; no stage loads the knowledge, builds a workspace
or detects the environment itself. Two steps, because a diagnosis learns where the user's trees are
from the log: `Groundwork` (knowledge and workspace) comes first, so that a bad rule file fails
before gigabytes of log are read; `RunContext` adds the environment once the log's frames are known
(an audit or a revert has no frames and takes both steps at once).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.knowledge.rules import AdaptorProfile, KnowledgeBase
from unsafe_doctor.knowledge.versions import AdaptorChooser, Environment, detect_environment
from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.source.workspace import Workspace


@dataclass(frozen=True)
class Groundwork:
    knowledge: KnowledgeBase  # the shipped rules and profiles, and the user's --rules
    workspace: Workspace  # files found, read and parsed once, over the --source-root folders
    profile: AdaptorProfile | None = None  # the adaptor generation the user named (--profile)
    choose_adaptor: AdaptorChooser | None = None  # which of several adaptors found is the one; None: the refusal

    def detect(
        self,
        frames: Sequence[Frame] = (),
        adaptor: Path | None = None,
        logged: Sequence[AdaptorProfile] = (),
        dumped: Collection[str] | None = None,
    ) -> RunContext:
        """The run context, with the environment read from the source roots, the frames' trees and the
        adaptor; `logged`: the generations the log shows, which choose the profile when no adaptor is found;
        `dumped`: the names of the log's arguments dump, which tell the megatron-core release when nothing else does."""
        environment = detect_environment(
            self.knowledge,
            self.workspace,
            frames=frames,
            adaptor=adaptor,
            logged=logged,
            chosen=self.profile,
            choose_adaptor=self.choose_adaptor,
            dumped=dumped,
        )
        return RunContext(self.knowledge, self.workspace, environment)


@dataclass(frozen=True)
class RunContext:
    knowledge: KnowledgeBase
    workspace: Workspace
    environment: Environment  # framework versions, adaptor profile and file


def groundwork(
    rule_paths: Sequence[Path] = (),
    source_roots: Sequence[Path] = (),
    *,
    log_only: bool = False,
    profile: str | None = None,
    choose_adaptor: AdaptorChooser | None = None,
) -> Groundwork:
    """The knowledge (first: a bad rule file fails before anything else is read) and the workspace.

    `log_only` (`--log-only`): the one switch that keeps the diagnosis off local files: the workspace
    opens no file a log names and never searches `sys.path`, and the environment reads no installed
    metadata (`versions.detect_environment` asks the workspace). `profile`: an adaptor profile's id,
    which fixes are then written for whatever the adaptor looks like. `choose_adaptor`: which of
    several adaptors found under the roots is the one (the person's answer, asked in this same run:
    a log on stdin cannot be read twice), or the refusal; None: the refusal."""
    if log_only and source_roots:
        raise UsageError("--log-only reads no local source: drop --source-root, or drop --log-only")
    knowledge = load_knowledge(rule_paths)
    chosen = knowledge.profile(profile) if profile is not None else None
    if profile is not None and chosen is None:
        known = ", ".join(item.id for item in knowledge.profiles)
        raise UsageError(f"--profile {profile!r}: no such adaptor profile (known: {known})")
    return Groundwork(knowledge, Workspace(source_roots, log_only=log_only), chosen, choose_adaptor)
