"""Prove a fix by replaying the fault and the recovery, unpatched (red) then patched (green).

``plan_replay`` turns a diagnosis and the adaptor's files into a ReplayPlan (no torch needed);
``verify`` runs it (forked ranks on this machine, or this rank under torchrun) and ``judge_replay`` reads
every rank's results into one verdict per finding. Nothing here prints or exits.
"""

from __future__ import annotations

import ast
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from unsafe_doctor.adaptor.code import ROLES, AdaptorFile, read_adaptor
from unsafe_doctor.adaptor.plan import marker_key
from unsafe_doctor.diagnose.pipeline import DiagnosedFinding, Diagnosis
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.classify import Classified, Unclassified
from unsafe_doctor.knowledge.render.template import NoFix
from unsafe_doctor.knowledge.rules import GROUP_PARAMETERS, AdaptorProfile, KnowledgeBase, map_parameters
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.replay.plan import MAX_RANKS, MAX_TIMEOUT, MODES, RUNS, AdaptorCode, Block, ReplayPlan, Target
from unsafe_doctor.replay.results import Milestone, RankResult, RunResult, StepOutcome
from unsafe_doctor.source.syntax import import_bindings
from unsafe_doctor.source.workspace import module_from_path

if TYPE_CHECKING:
    from unsafe_doctor.replay.launch import ReplayStopped  # imports torch's side of the replay only when it runs

ReplayOutcome = Literal["proven", "block-proven", "failed", "no-fix", "not-modelled", "survives", "dies"]
"""proven: the patched adaptor's own functions recovered the global; block-proven: its fix blocks did,
run alone in their functions' scope because the functions' own code cannot run here (a weaker proof).
survives / dies (``--as-is``): the adaptor as it stands, with whatever it holds (fixes, the sentinel's
heal), recovered the global so that the first step ran, or the recovery or that step stopped on it."""


@dataclass(frozen=True)
class ReplayVerdict:
    target: Target
    outcome: ReplayOutcome
    unpatched: str  # what the unpatched run showed
    patched: str | None  # what the patched run showed; None when it was not judged
    problems: tuple[str, ...]  # why it failed


@dataclass(frozen=True)
class Verification:
    verdicts: tuple[ReplayVerdict, ...]
    skipped: tuple[str, ...]  # findings not replayed, and why
    backend: str  # "emulated" | "npu": the one that ran
    transport: str  # "gloo" | "hccl"
    mode: str
    world_size: int
    faulty: int
    replica: int
    seconds: float
    phase_seconds: dict[str, float]  # "unpatched build" -> slowest rank's time
    notes: tuple[str, ...]
    sentinel: dict[str, tuple[str, ...]] = field(default_factory=dict)  # run -> globals the sentinel named after its rollback
    proved: str = ""  # one line: which functions ran, with which stand-ins, on which backend
    as_is: bool = False  # the adaptor as it stands was replayed (runs: without unsafe-doctor's blocks, as written)

    @property
    def exit_code(self) -> int:
        outcomes = {verdict.outcome for verdict in self.verdicts}
        if not outcomes or "not-modelled" in outcomes:
            return 2
        return 0 if outcomes <= {"proven", "block-proven", "survives"} else 1


def plan_replay(
    diagnosis: Diagnosis,
    knowledge: KnowledgeBase,
    *,
    suspects: Sequence[DiagnosedFinding] = (),
    ranks: int = 4,
    mode: str = "adaptor",
    probe: str | None = None,
    timeout: float = 60.0,
    functions: dict[str, str] | None = None,
    parameters: Mapping[str, Sequence[str]] | None = None,
    as_is: bool = False,
) -> tuple[ReplayPlan, tuple[str, ...]]:
    """The replay of every classified finding and chosen suspect (`Diagnosis.chosen_suspects`: each
    replayed as the global the recovery left unsafe), and the findings left out with why;
    `parameters` as `fix` took them (`--parameter`), so that the blocks get the values their roles
    stand for; `as_is`: the adaptor as it stands, the sentinel's blocks included, is what runs patched."""
    if not 2 <= ranks <= MAX_RANKS:
        raise UsageError(f"--ranks must be between 2 and {MAX_RANKS} on this machine, not {ranks}")
    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r}; expected one of: {', '.join(MODES)}")
    if probe is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", probe):
        raise UsageError(f"--probe {probe!r} is not MODULE:FUNCTION")
    if not 0 < timeout <= MAX_TIMEOUT:  # also refuses nan, which compares false with everything
        raise UsageError(f"--timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT:g}, not {timeout:g}")
    for suspect in suspects:
        _check_replayable(suspect)
    targets, skipped = [], []
    items = [*enumerate(diagnosis.findings, 1), *((item.suspect, item) for item in suspects)]
    for number, item in items:
        tensor, classification = item.finding.tensor, item.classification
        if isinstance(classification, Unclassified):
            skipped.append(f"finding {number}: unclassified, so no fix to prove")
        elif tensor is None or tensor.name.module is None or tensor.name.variable is None:
            skipped.append(f"finding {number}: the global it read is not resolved to a module and a name")
        else:
            rule = knowledge.rule(classification.rule) if classification.rule else None
            key = marker_key(item.subject, classification, knowledge)
            name = GlobalName(tensor.name.module, tensor.name.owner, tensor.name.variable)
            targets.append(
                Target(
                    key,
                    name,
                    classification.scenario,
                    classification.rule,
                    knowledge.switches(rule) if rule else (),
                    rule.probe if rule else None,
                    str(rule.versions) if rule and rule.versions is not None else None,
                    tensor.runs_as_main,
                    item.suspect,
                )
            )
    if not targets:
        raise UsageError("nothing to verify: " + ("; ".join(skipped) if skipped else _no_finding(diagnosis)))
    environment = diagnosis.context.environment
    files = read_adaptor(environment)
    mapped = dict(parameters or {})
    groups = mapped.pop("group", ())
    if len(groups) > 1:
        raise UsageError(f"--parameter group: one parameter, not {', '.join(groups)}")
    profile = map_parameters(environment.profile, mapped)
    given = dict(functions or {})
    functions = {role: given.get(role, getattr(profile, role)) for role in ROLES}
    callback = profile.rollback_callback
    if as_is and "rollback" not in given and callback in {name for file in files for name in file.functions}:
        functions["rollback"] = callback  # what MindIO calls: the sentinel's block is at its end
    faulty, notes = _faulty_rank(diagnosis, [item for _, item in items], ranks)
    blocks = _blocks(files, functions, as_is=as_is)
    _check_bound(blocks, profile, groups[0] if groups else None)
    replicas = _replicas(faulty, ranks)
    roots = tuple(str(Path(root).resolve()) for root in environment.source_roots)
    codes = _in_import_order(tuple(_code(file, roots, as_is=as_is) for file in files))
    standins = _standins(codes, profile.repair_group_imports, switched=any(target.switches for target in targets))
    plan = ReplayPlan(
        targets=tuple(targets),
        blocks=tuple(blocks),
        files=codes,
        functions=functions,
        parameters=dict(profile.parameters),
        ranks_are_lists=profile.ranks_are_lists,
        rebuilds_model=profile.rebuilds_model,
        group_parameter=groups[0] if groups else None,
        repair_group_imports=profile.repair_group_imports,
        mode=mode,
        world_size=ranks,
        faulty=faulty,
        replica=replicas[0],
        replicas=replicas,
        standins=standins,
        group_getters=tuple(
            sorted({name for item in knowledge.profiles for line in item.repair_group_imports for name in _imported_names(line)})
        ),
        source_roots=roots,
        probe=probe,
        timeout=timeout,
        notes=tuple(notes),
        as_is=as_is,
    )
    return plan, tuple(skipped)


def _check_replayable(suspect: DiagnosedFinding) -> None:
    """A suspect is replayed because a person chose it: one that cannot be is refused, not skipped."""
    tensor, classification = suspect.finding.tensor, suspect.classification
    assert tensor is not None and isinstance(classification, Classified), "a suspect is a rule's global, classified by it"
    if isinstance(classification.fix, NoFix):  # in the words diagnose and fix use for it
        raise UsageError(f"--suspect {suspect.suspect}: {classification.fix.reason}")
    shown, rule = tensor.name.dotted or tensor.expression, classification.rule
    if tensor.name.variable is None or tensor.name.module is None:
        named = "by a pattern, not a name" if tensor.name.variable is None else "without the one module that holds it"
        raise UsageError(f"--suspect {suspect.suspect}: the replay cannot build {shown}: rule {rule} names it {named}")


def _no_finding(diagnosis: Diagnosis) -> str:
    """Why a log gives nothing to replay: an error without a traceback gives suspects, to choose from."""
    untraced = diagnosis.untraced
    if untraced is None:
        return "the log has no unsafe-data finding"
    count = len(untraced.shortlist.suspects)
    if not count:
        return (
            "the log's unsafe-data error has no traceback and no suspect fits "
            "(unsafe-doctor sentinel install names the tensor at the next fault)"
        )
    return (
        f"the log's unsafe-data error has no traceback: choose which of its {count} suspect{'s' if count != 1 else ''} "
        "to replay with --suspect N (diagnose lists them)"
    )


def _faulty_rank(diagnosis: Diagnosis, items: list[DiagnosedFinding], ranks: int) -> tuple[int, list[str]]:
    logged = diagnosis.first_failed_rank
    if logged is None:
        logged = min((rank for item in items for rank in item.finding.ranks), default=0)
    if logged < ranks:
        return logged, []
    return logged % ranks, [f"the log's faulty rank {logged} is replayed as rank {logged % ranks} of {ranks}"]


_NEVER_STOOD_IN = {"torch", "torch_npu", "unsafe_doctor"}  # an NPU is never pretended, nor our own code


def _check_bound(blocks: list[Block], profile: AdaptorProfile, group: str | None) -> None:
    """Each parameter a block reads is one the replay gives a value (a role, the step, the group):
    otherwise it would run on None and wait for a peer that never sends, a minute later."""
    bound = {name.split(".")[0] for names in profile.parameters.values() for name in names} | {"step", *GROUP_PARAMETERS}
    for block in blocks:
        given = bound | {name for name in (group, block.own_group) if name}
        read = {node.id for node in ast.walk(ast.parse(block.code)) if isinstance(node, ast.Name)}
        unbound = sorted(read & set(block.parameters) - given)
        if unbound:
            raise UsageError(
                f"{block.path}:{block.line}: the block {block.key} in {block.function}() reads {', '.join(unbound)}, "
                f"which no role of adaptor profile {profile.id} names: give --parameter as fix was given"
            )


def _replicas(faulty: int, ranks: int) -> tuple[int, ...]:
    """The ranks that send to the faulty one: half the world away, and (with three ranks or more) a
    second one, as when MindIO takes two optimizer indices from two replicas."""
    first = (faulty + ranks // 2) % ranks
    others = [rank for rank in ((faulty + step) % ranks for step in range(1, ranks)) if rank != first]
    return (first, others[0]) if others else (first,)


def _standins(codes: tuple[AdaptorCode, ...], group_imports: tuple[str, ...], *, switched: bool) -> tuple[str, ...]:
    """What may be stood in: the modules the unpatched adaptor imports, the profile's repair-group
    module where the adaptor imports from that module's package (its own generation), and Megatron's
    ``get_args`` module where a fix's guard reads switches (a rule of Megatron's: the job has it)."""
    imported = {name for code in codes for name in _imported_modules(code.unpatched, code.module.rpartition(".")[0])}
    packages = {name.partition(".")[0] for name in imported} | {code.module.partition(".")[0] for code in codes}
    for line in group_imports:
        imported |= {name for name in _imported_modules(line, "") if name.partition(".")[0] in packages}
    if switched:
        imported.add("megatron.training")
    own = {code.module for code in codes}  # the adaptor's files run as written
    return tuple(sorted(name for name in imported if name.partition(".")[0] not in _NEVER_STOOD_IN and name not in own))


def _in_import_order(codes: tuple[AdaptorCode, ...]) -> tuple[AdaptorCode, ...]:
    """The adaptor's files, those that import fewer of the others first (its group module before the
    repair functions that import it), as they are run one by one."""
    own = {code.module for code in codes}

    def imports_of_ours(code: AdaptorCode) -> int:
        return len(_imported_modules(code.unpatched, code.module.rpartition(".")[0]) & own)

    return tuple(sorted(codes, key=imports_of_ours))


def _parsed(text: str) -> ast.Module:
    try:
        return ast.parse(text)
    except SyntaxError:  # the replay reports it where it executes the file
        return ast.Module([], [])


def _imported_modules(text: str, package: str) -> set[str]:
    """Every module an import of the text names (relative ones resolved against ``package``)."""
    found = set()
    for node in ast.walk(_parsed(text)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= {name.rpartition(".")[0] for name in (item.target for item in import_bindings(node, package).values())}
    return {name for name in found if name}


def _imported_names(line: str) -> set[str]:
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return set()
    return {name for node in tree.body if isinstance(node, ast.ImportFrom) for name in import_bindings(node, None)}


def _blocks(files: tuple[AdaptorFile, ...], functions: dict[str, str], *, as_is: bool) -> list[Block]:
    """The fix blocks; `as_is`, the sentinel's too: where a function's own code cannot run here, they
    run alone in its scope as the fix blocks do."""
    role_of = {name: role for role, name in functions.items()}
    return [
        Block(
            block.key,
            role_of.get(block.function, "other"),
            block.function,
            str(block.path.resolve()),
            block.line,
            block.code,
            tuple(sorted(block.parameters)),
            block.own_group,
        )
        for file in files
        for block in (*file.blocks, *(file.sentinel_blocks if as_is else ()))
    ]


_UNKNOWN_PACKAGE = "unknown_package"  # the package of an adaptor file outside every source root, for its relative imports


def _code(file: AdaptorFile, roots: tuple[str, ...], *, as_is: bool) -> AdaptorCode:
    """The file as its module: its dotted name under a source root, else its stem; in a package of
    stand-ins where it has no package and imports relatively (a copy of one file of a package);
    patched as written, the sentinel's blocks too, where `as_is`."""
    path = str(file.path.resolve())
    module = module_from_path(path, [Path(root) for root in roots]) or file.path.stem
    if "." not in module and any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(_parsed(file.unpatched))):
        module = f"{_UNKNOWN_PACKAGE}.{module}"
    return AdaptorCode(path, module, file.unpatched, file.as_written if as_is else file.patched, tuple(sorted(file.functions)))


def verify(
    plan: ReplayPlan, skipped: tuple[str, ...] = (), progress: Callable[[Milestone], None] | None = None
) -> Verification | None:
    """Run the plan and judge it; under torchrun, None on every rank but 0. ``progress`` hears each
    phase the faulty rank enters (forked ranks only: under torchrun every rank has its own output)."""
    from unsafe_doctor.npu.backend import npu_unavailable_reason
    from unsafe_doctor.replay.launch import ReplayStopped, fork_ranks, join_torchrun, under_torchrun

    start = time.perf_counter()
    backend = "emulated"  # forked ranks; under torchrun, what the ranks pick (for a report with no results)
    transport = "gloo"
    try:
        if under_torchrun():
            backend = "emulated" if npu_unavailable_reason() else "npu"
            results = join_torchrun(plan)
            if results is None:
                return None
            transport = "hccl" if results[0].backend == "npu" else "gloo"
        else:
            results = fork_ranks(plan, progress)
    except ReplayStopped as stopped:
        return _stopped(plan, skipped, stopped, backend, time.perf_counter() - start)
    return judge_replay(plan, skipped, results, transport, time.perf_counter() - start)


def judge_replay(
    plan: ReplayPlan, skipped: tuple[str, ...], results: list[RankResult], transport: str, seconds: float
) -> Verification:
    faulty = results[plan.faulty]
    verdicts = tuple(_verdict(plan, target, results) for target in plan.targets)
    phase_seconds = {}
    for run in RUNS:
        for phase in faulty.run(run).seconds:
            phase_seconds[f"{run} {phase}"] = max(result.run(run).seconds.get(phase, 0.0) for result in results)
    return Verification(
        verdicts,
        skipped,
        faulty.backend,
        transport,
        plan.mode,
        plan.world_size,
        plan.faulty,
        plan.replica,
        seconds,
        phase_seconds,
        (*plan.notes, *faulty.notes),
        {run: names for run in RUNS if (names := faulty.run(run).sentinel) is not None},
        _proved(plan, results, transport),
        plan.as_is,
    )


def _alone(results: list[RankResult]) -> dict[str, str]:
    """The adaptor functions whose own code could not run here, on any rank, and why."""
    return {name: why for result in results for name, why in result.patched.alone.items()}


def _proved(plan: ReplayPlan, results: list[RankResult], transport: str) -> str:
    """What the replay ran, in one line."""
    if results[plan.faulty].unpatched.adaptor_unavailable:
        return "ran nothing of the adaptor: it does not import here"
    present = {name for code in plan.files for name in code.functions}
    functions = [name for role in ("recv", "send", "rollback") if (name := plan.functions.get(role)) in present]
    alone = _alone(results)
    own = [name for name in functions if name not in alone and plan.mode == "adaptor"]
    ran = []
    if own:
        named = ", ".join(f"{name}()" for name in own)
        if plan.as_is:
            ran.append(f"the adaptor's own {named} as it stands, the sentinel's blocks included")
        elif plan.blocks:
            ran.append(f"the patched adaptor's own {named}")
        else:
            ran.append(f"the adaptor's own {named} (it holds no fix block: nothing was patched)")
    blocked = [name for name in functions if name not in own and any(block.function == name for block in plan.blocks)]
    if blocked:
        why = "" if plan.mode == "block" else f" (their own code cannot run here: {next(iter(alone.values()))})"
        which = "unsafe-doctor's blocks" if plan.as_is else "the fix blocks"
        ran.append(f"{which} alone in " + ", ".join(f"{name}()" for name in blocked) + why)
    parts = [f"ran {' and '.join(ran) or 'no adaptor function'}"]
    parts += [note for result in results[:1] for note in result.notes if note.startswith("stand-ins")]
    arguments = sorted({name for result in results for name in result.patched.stood_in})
    if arguments:
        parts.append(f"{', '.join(arguments)} stood in (not built here; the fault model makes them safe)")
    if len(parts) == 1:
        parts.append("no stand-ins")
    backend = results[plan.faulty].backend
    parts.append(f"{backend} backend ({'CPU' if backend == 'emulated' else 'NPU'}, {transport})")
    return "; ".join(parts)


def _verdict(plan: ReplayPlan, target: Target, results: list[RankResult]) -> ReplayVerdict:
    red = results[plan.faulty].unpatched
    if target.key in red.not_modelled:
        return ReplayVerdict(target, "not-modelled", red.not_modelled[target.key], None, ())
    if red.adaptor_unavailable:
        return ReplayVerdict(
            target,
            "not-modelled",
            f"the unpatched adaptor does not import here, even with stand-ins for what "
            f"this machine lacks ({red.adaptor_unavailable})",
            None,
            (),
        )
    reproduced = red.resume.get(target.key)
    if reproduced is None or reproduced.error is None:
        return ReplayVerdict(
            target,
            "not-modelled",
            f"{red.built[target.key]}; without the fix the first step after recovery ran clean on rank {plan.faulty}: "
            "the replay does not model this failure",
            None,
            (),
        )
    where = f" at {reproduced.where}" if reproduced.where else f" reading {target.name.dotted}"
    unpatched = f"reproduced `{reproduced.error}` on rank {plan.faulty}{where}"
    if reproduced.unsafe_global is not None and not target.names(reproduced.unsafe_global):  # the step reached another first
        unpatched += f", reading {reproduced.unsafe_global}"
    red_errors = [failure for failure in red.fix_failures if failure.kind == "unsafe-data"]
    if red_errors:
        unpatched += f" (the adaptor's own code also failed: {red_errors[0].error})"
    if plan.as_is:
        return _as_is_verdict(plan, target, results, unpatched)
    has_fix = any(block.key == target.key for block in plan.blocks)
    if not has_fix:
        return ReplayVerdict(target, "no-fix", unpatched, "reproduced, no fix present", ("no fix present",))
    problems = _patched_problems(plan, target, results)
    if problems:
        return ReplayVerdict(target, "failed", unpatched, problems[0], tuple(problems))
    outcome: ReplayOutcome = "block-proven" if plan.mode == "block" or _alone(results) else "proven"
    alone = " with the fix blocks run alone" if outcome == "block-proven" else ""
    if target.scenario == 2:
        return ReplayVerdict(
            target, outcome, unpatched, f"recovery clean{alone}, tensor bit-identical to replica rank {plan.replica}", ()
        )
    return ReplayVerdict(target, outcome, unpatched, f"recovery clean{alone}, no unsafe tensor left in {target.name.dotted}", ())


def _as_is_verdict(plan: ReplayPlan, target: Target, results: list[RankResult], unpatched: str) -> ReplayVerdict:
    """The adaptor as it stands: the first step after its recovery ran (survives), or the recovery or
    that step stopped on the global (dies); a fix block present or not."""
    problems = _patched_problems(plan, target, results)
    if problems:
        return ReplayVerdict(target, "dies", unpatched, problems[0], tuple(problems))
    ran = "the first step after recovery ran"
    if plan.mode == "block" or _alone(results):
        ran += " with unsafe-doctor's blocks run alone where a function's own code cannot run here"
    if target.scenario == 2:
        return ReplayVerdict(target, "survives", unpatched, f"{ran}, tensor bit-identical to replica rank {plan.replica}", ())
    return ReplayVerdict(target, "survives", unpatched, f"{ran}, no unsafe tensor left in {target.name.dotted}", ())


def _patched_problems(plan: ReplayPlan, target: Target, results: list[RankResult]) -> list[str]:
    """What is still wrong after the patched recovery, most telling first."""
    green = results[plan.faulty].patched
    if green.adaptor_unavailable:  # the file imported without our blocks: they broke it
        return [f"the patched adaptor does not import: {green.adaptor_unavailable}"]
    problems = []
    waited = {failure.role for result in results for failure in result.patched.fix_failures if failure.kind == "timeout"}
    if waited:
        mismatch = _likely_mismatch(plan, receiver_waited="recv" in waited, sender_waited="send" in waited)
        problems.append(f"a repair transfer waited {plan.timeout:g} s in vain: {mismatch}")
    for result in results:
        for failure in result.patched.fix_failures:
            at = f" at {failure.where}" if failure.where else ""
            problems.append(f"rank {result.rank}: {failure.function}() raised {failure.error}{at}")
    problems += green.unmatched
    if any(failure.role == "recv" and failure.kind == "send-to-self" for failure in green.fix_failures):
        problems.append(f"the receive function {plan.functions['recv']}() sends: send and receive are swapped")
    for result in results:
        outcome = result.patched.resume.get(target.key)
        if outcome is not None and outcome.error:
            problems.append(f"rank {result.rank}: {_step_death(plan, target, outcome, green)}")
    left = green.unsafe_left.get(target.key, 0)
    if left:
        problems.append(f"{left} tensor(s) reachable from {target.name.dotted} still unsafe on rank {plan.faulty}")
    equal = green.equal.get(target.key)
    if target.scenario == 2 and equal is False:
        problems.append(
            f"{target.name.dotted} on rank {plan.faulty} differs from what replica rank {plan.replica} held at the fault"
        )
    return problems


def _step_death(plan: ReplayPlan, target: Target, outcome: StepOutcome, green: RunResult) -> str:
    """The first step after recovery died: on the target's own global, or on another one, which is
    then named, and the target's own fix said to have held when the checks found nothing left."""
    at = f" at {outcome.where}" if outcome.where else ""
    died_on = outcome.unsafe_global
    if died_on is None or target.names(died_on):
        return f"the first step after recovery still fails reading {target.name.dotted}{at}"
    held = not green.unsafe_left.get(target.key) and green.equal.get(target.key) is not False
    fix = f"the fix of {target.name.dotted} held, but " if held else ""
    if any(other.names(died_on) for other in plan.targets):
        return f"{fix}the first step after recovery dies on {died_on}{at}, another finding's global (see its verdict)"
    return (
        f"{fix}the first step after recovery dies on {died_on}{at}, a global the log does not name "
        "and no fix covers: fix it too (the replay stops at the first unsafe read)"
    )


def _stopped(plan: ReplayPlan, skipped: tuple[str, ...], stopped: ReplayStopped, backend: str, seconds: float) -> Verification:
    """Ranks that never started, hung building the state, or crashed by the replay's own error or
    this machine's (a missing module, a harness fault: ``ReplayStopped.cause``): the replay does not
    model it (exit 2), never a failed fix; a rank that crashed in the adaptor's code or hung in the
    recovery: the check failed (exit 1)."""
    places = "; ".join(f"rank {rank}: {stopped.place(rank)}" for rank in sorted(stopped.histories))
    outcome: ReplayOutcome = "failed"
    if stopped.never_started:
        outcome = "not-modelled"
        problem = (
            f"no rank started: {stopped.never_started}; the replay imports the globals' modules and the probe's "
            "before its ranks start, and each must import without ending the process or blocking"
        )
    elif stopped.reason == "timeout" and _stuck_in(stopped, "build"):
        outcome = "not-modelled"
        problem = f"building the state did not finish within the {plan.timeout:g} s timeout ({places})"
    elif stopped.reason == "timeout":
        receiver = _waited_in_repair(stopped.histories.get(plan.faulty, ()), plan.functions["recv"])
        sender = _waited_in_repair(stopped.histories.get(plan.replica, ()), plan.functions["send"])
        problem = (
            f"the replay stopped at the {plan.timeout:g} s timeout ({places}); "
            f"likely cause: {_likely_mismatch(plan, receiver_waited=receiver, sender_waited=sender)}"
        )
    elif (cause := stopped.cause()) is not None and cause[1].blame == "replay":
        rank, crash = cause
        outcome = "not-modelled"
        at = f" at {crash.at}" if crash.at else ""
        when = f"in {stopped.place(rank)}" if stopped.histories.get(rank) else "while starting, before its first phase,"
        problem = (
            f"the replay could not run here, which says nothing of the fix: rank {rank} crashed {when} "
            f"with {crash.error}{at}, an error of the replay or of this machine "
            "(a module missing, a process group that does not start), not of the adaptor's code"
        )
    elif cause is not None:
        rank, crash = cause
        at = f" at {crash.where}" if crash.where else ""
        problem = f"a rank crashed in the adaptor's code ({places}): rank {rank}: {crash.error}{at}"
    else:
        tail = stopped.output.strip().splitlines()[-1:] or ["no output"]
        problem = f"a rank crashed ({places}): {tail[0]}"
    if outcome == "not-modelled":
        verdicts = tuple(ReplayVerdict(target, outcome, problem, None, ()) for target in plan.targets)
    else:
        verdicts = tuple(
            ReplayVerdict(target, outcome, "not judged: the replay stopped", problem, (problem,)) for target in plan.targets
        )
    return Verification(
        verdicts, skipped, backend, "gloo", plan.mode, plan.world_size, plan.faulty, plan.replica, seconds, {}, plan.notes
    )


def _stuck_in(stopped: ReplayStopped, phase: str) -> bool:
    """Some rank's last milestone is the phase (and not a failure in it)."""
    return any(history and history[-1].phase == phase and history[-1].failure is None for history in stopped.histories.values())


def _likely_mismatch(plan: ReplayPlan, *, receiver_waited: bool, sender_waited: bool) -> str:
    """Which side of the repair waited: the one with more transfers than its peer."""
    send, recv = plan.functions["send"], plan.functions["recv"]
    if receiver_waited and not sender_waited:
        return (
            f"{recv}() on rank {plan.faulty} waits for a tensor that {send}() on rank {plan.replica} never sends "
            "(a receive without its send, or send and receive swapped)"
        )
    if sender_waited and not receiver_waited:
        return (
            f"{send}() on rank {plan.replica} sends a tensor that {recv}() on rank {plan.faulty} never receives "
            "(a send without its receive, or send and receive swapped)"
        )
    if sender_waited and receiver_waited:
        return f"{send}() and {recv}() wait for each other: their transfers differ in order, number or shape"
    return "code that never returned where a rank stopped, or a collective that not every rank reaches"


def _waited_in_repair(history: tuple[Milestone, ...], function: str) -> bool:
    """The rank stopped inside the repair phase, or its transfer in ``function`` timed out."""
    stuck = bool(history) and history[-1].phase == "repair" and history[-1].failure is None
    return stuck or any(m.failure is not None and m.failure.function == function and m.failure.kind == "timeout" for m in history)
