"""The repair's heal between real processes: a gloo process group on loopback, MindIO's rank lists
(one entry per optimizer index), a package whose globals every data-parallel copy keeps alike (an
EMA), one a wrong rule calls scenario 2 (a rank-local buffer, another shape on each rank) and one of
scenario 1 (a loss log), an emulated fault on each faulty rank, then the rollback's sentinel in mode
heal. What the faulty rank got is compared bit for bit with what the replica holds."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

from helpers import run_cli, run_ranks

from unsafe_doctor.log.sentinel_lines import Served, UnsafeGlobal, parse_line

ROOT = Path(__file__).resolve().parents[2]

STATE = """
import torch

EMA = None
LOCAL = None
LOSS_LOG = {}


def build(rank):
    global EMA, LOCAL
    EMA = torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.5 + 1  # alike on every data-parallel copy
    LOCAL = torch.zeros(2 + rank)  # rank-local: its shape differs from rank to rank
    LOSS_LOG["lm"] = torch.zeros(())
"""

RULES = """
rules:
  - id: healpkg.ema
    title: the running average
    match: {variable: EMA, module: healpkg.state}
    scenario: 2
    phase: repair
    fix:
      imports: [import torch.distributed as dist, from healpkg import state]
      send: |
        dist.send(state.EMA, dst=$dst, group=$group)
      recv: |
        dist.recv(state.EMA, src=$src, group=$group)
    reason: carries from step to step
  - id: healpkg.local
    title: a rank-local buffer, wrongly said to be kept alike
    match: {variable: LOCAL, module: healpkg.state}
    scenario: 2
    phase: repair
    fix:
      imports: [import torch.distributed as dist, from healpkg import state]
      send: |
        dist.send(state.LOCAL, dst=$dst, group=$group)
      recv: |
        dist.recv(state.LOCAL, src=$src, group=$group)
    reason: wrong on purpose
  - id: healpkg.loss-log
    title: the step's losses
    match: {variable: LOSS_LOG, module: healpkg.state}
    scenario: 1
    phase: rollback
    fix:
      imports: [from healpkg import state]
      code: |
        state.LOSS_LOG.clear()
    reason: zeroed every step
"""

WORKER = """
import json, logging, os, sys
import torch
import torch.distributed as dist
from healpkg import state
from unsafe_doctor.npu.backend import EmulatedBackend
from unsafe_doctor.sentinel import UnsafeStateError, check, heal

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
rank, plan = int(os.environ["RANK"]), json.loads(os.environ["HEAL_PLAN"])
heal.STEP_SECONDS = plan["step_seconds"]
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
state.build(rank)
faulty, replica = plan["faulty"], plan["replica"]
members = sorted({*faulty, replica})
group = dist.new_group(members, use_local_synchronization=True) if rank in members else None
rules = [os.environ["HEAL_RULES"]]
backend = EmulatedBackend(rank)
result = {"rank": rank}
with backend.activate():
    if rank in faulty:
        with backend.unchecked():
            state.EMA.fill_(-7.0)  # what the fault left
            backend.mark_all_unsafe()
        backend.set_check(enabled=True)
        optimizers = 2  # MindIO's lists hold one entry per (source, destination, optimizer index)
        records = heal.receive_state(group, [replica] * optimizers, [rank] * optimizers, rules=rules, packages=["healpkg"])
        result["records"] = len(records)
        result["ema_safe"] = backend.is_safe(state.EMA)
        try:
            check(mode="heal", rules=rules, packages=["healpkg"])
            result["rollback"] = "ran"
        except UnsafeStateError as error:
            result["rollback"] = "raised: " + ", ".join(item.name.dotted for item in error.report.still_unsafe)
        open(plan["done"], "w").close()  # the unpaired replica may go
        with backend.unchecked():
            result["ema"] = state.EMA.tolist()
    elif rank == replica and plan["replica_answers"]:
        sources = [rank] * (2 * len(faulty))
        destinations = [dest for dest in faulty for _ in range(2)]
        result["records"] = len(heal.send_state(group, sources, destinations, packages=["healpkg"]))
        result["ema"] = state.EMA.tolist()
    elif rank == replica:  # alive, in the group, but running no heal: an unpaired peer, until the faulty rank is done
        import pathlib, time
        for _ in range(2400):  # a safety net of 240 s, not a timing
            if pathlib.Path(plan["done"]).exists():
                break
            time.sleep(0.1)
print(json.dumps(result), flush=True)
if plan["replica_answers"]:
    dist.barrier()
    dist.destroy_process_group()
os._exit(0)
"""


def run_heal(
    tmp_path: Path, world: int, *, faulty: list[int], replica: int, replica_answers: bool = True, step_seconds: float = 30.0
):
    """Every rank's printed result, and every record its log lines hold; the lines in job.log."""
    package = tmp_path / "src" / "healpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "state.py").write_text(textwrap.dedent(STATE))
    rules = tmp_path / "rules.yaml"
    rules.write_text(textwrap.dedent(RULES))
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    plan = {
        "faulty": faulty,
        "replica": replica,
        "replica_answers": replica_answers,
        "step_seconds": step_seconds,
        "done": str(tmp_path / "faulty-done"),
    }
    env = dict(
        os.environ,
        HEAL_PLAN=json.dumps(plan),
        HEAL_RULES=str(rules),
        PYTHONPATH=os.pathsep.join([str(tmp_path / "src"), str(ROOT)]),
    )
    ranks = run_ranks(worker, world, env)
    assert [code for code, _, _ in ranks] == [0] * world, ranks
    outputs = [(out, err) for _, out, err in ranks]
    results = {json.loads(out)["rank"]: json.loads(out) for out, _ in outputs}
    records = {
        rank: [record for line in err.splitlines() if (record := parse_line(line))] for rank, (_, err) in enumerate(outputs)
    }
    job = "".join(f"[rank{rank}]: {line}\n" for rank, (_, err) in enumerate(outputs) for line in err.splitlines())
    (tmp_path / "job.log").write_text(job)  # every rank's lines, as torchrun's --tee prefixes them
    return results, records


def by_name(records, kind):
    """The first record of `kind` for each global: on a faulty rank the repair's, before the rollback's."""
    named = {}
    for record in records:
        if isinstance(record, kind):
            named.setdefault(record.dotted if kind is Served else record.name.dotted, record)
    return named


def test_the_faulty_rank_gets_its_replicas_ema_bit_for_bit_and_refuses_the_rank_local_buffer(tmp_path):
    """4 ranks, the replica half the world away; 8 ranks are replayed by verify (tests/replay/test_verify_as_is.py)."""
    world = 4
    results, records = run_heal(tmp_path, world, faulty=[1], replica=world // 2 + 1)
    replica = world // 2 + 1
    assert results[1]["ema"] == results[replica]["ema"]  # bit-identical: floats of the same bytes
    assert results[1]["ema_safe"] is True
    healed = by_name(records[1], UnsafeGlobal)
    assert healed["healpkg.state.EMA"].healed_from == replica and healed["healpkg.state.EMA"].healed
    local = healed["healpkg.state.LOCAL"]
    assert not local.healed and local.healed_from is None
    assert "differs in shape or dtype" in local.heal_error and f"rank {replica}" in local.heal_error
    served = by_name(records[replica], Served)
    assert "healpkg.state.LOSS_LOG" not in served and healed["healpkg.state.LOSS_LOG"].healed  # scenario 1: the rollback's
    assert served["healpkg.state.EMA"].sent == 1 and served["healpkg.state.EMA"].peer == 1
    assert served["healpkg.state.LOCAL"].sent == 0 and "differs" in served["healpkg.state.LOCAL"].refused
    # the rollback's sentinel: the EMA healed, the loss log re-initialised, the refused buffer left: it raises for that one
    assert results[1]["rollback"] == "raised: healpkg.state.LOCAL"


def test_two_faulty_ranks_with_one_replica_are_each_answered_once(tmp_path):
    results, records = run_heal(tmp_path, 4, faulty=[1, 2], replica=0)
    for faulty in (1, 2):
        assert results[faulty]["ema"] == results[0]["ema"]
        assert by_name(records[faulty], UnsafeGlobal)["healpkg.state.EMA"].healed_from == 0
    assert sorted(
        record.peer for record in records[0] if isinstance(record, Served) and record.dotted == "healpkg.state.EMA"
    ) == [1, 2]


def test_a_replica_that_never_answers_ends_the_heal_at_its_bound_and_the_rollback_raises(tmp_path):
    results, records = run_heal(tmp_path, 2, faulty=[1], replica=0, replica_answers=False, step_seconds=2)
    ema = by_name(records[1], UnsafeGlobal)["healpkg.state.EMA"]
    assert not ema.healed and "the hello with rank 0 did not complete within 2 s" in ema.heal_error
    assert results[1]["ema"] == [[-7.0] * 3] * 2  # nothing copied
    assert results[1]["rollback"] == "raised: healpkg.state.EMA, healpkg.state.LOCAL"


def test_diagnose_reads_both_sides_of_the_heal_and_still_names_the_fix_to_make_permanent(tmp_path):
    run_heal(tmp_path, 2, faulty=[1], replica=0)
    done = run_cli(str(tmp_path / "job.log"), "--rules", str(tmp_path / "rules.yaml"), "--format", "json")
    report = json.loads(done.stdout)
    findings = {f"{finding['tensor']['module']}.{finding['tensor']['variable']}": finding for finding in report["findings"]}
    ema = findings["healpkg.state.EMA"]
    assert ema["sentinel"]["healed"] and ema["sentinel"]["healed_ranks"] == [1]
    assert any("copied from the replica (rank 0)" in note and "still needs the fix" in note for note in ema["notes"])
    assert ema["scenario"] == 2 and ema["rule"] == "healpkg.ema" and ema["fix"]  # the fix to make permanent
    assert not findings["healpkg.state.LOCAL"]["sentinel"]["healed"]
    served = {item["global"]: item for item in report["sentinel_served"]}
    assert served["healpkg.state.EMA"] == {"rank": 0, "peer": 1, "global": "healpkg.state.EMA", "sent": 1, "refused": None}
    assert "differs in shape or dtype" in served["healpkg.state.LOCAL"]["refused"]
