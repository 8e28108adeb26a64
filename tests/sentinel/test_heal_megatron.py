"""The repair's heal on real megatron-core: two data-parallel replicas of a GPT/MoE model
(tests/fixtures/sentinel/megatron_gpt_moe.py, the same seed) in a gloo world; a fault on rank 1
after which the recovery makes the parameters and Adam's state safe, as MindSpeed-LLM 26's clean
does, and rebuilds nothing else. Heal copies what the shipped scenario-2 rules name (the routers'
expert_bias, the rotary inv_freq) bit for bit from rank 0; the rollback's check in mode heal then
re-initialises scenario 1, and the first step after the recovery runs under the check, on both ranks, as it does in a job."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers import run_ranks

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import json, os, sys
import torch
import torch.distributed as dist
import megatron_gpt_moe as gpt
from unsafe_doctor.npu.backend import EmulatedBackend
from unsafe_doctor.sentinel import examine, heal

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
shape = gpt.Shape(layers=2, hidden=64, experts=4, expert_hidden=128, heads=4, vocabulary=1024)
with gpt.megatron_on_cpu():
    torch.manual_seed(0)
    trained = gpt.train(shape, steps=2)
    model, optimizer = trained.model, trained.optimizer
    routers = [module for module in model.modules() if type(module).__name__ == "TopKRouter"]
    group = dist.new_group([0, 1], use_local_synchronization=True)
    backend = EmulatedBackend(rank)
    result = {"rank": rank}
    with backend.activate():
        if rank == 1:
            with backend.unchecked():
                for router in routers:
                    router.expert_bias.fill_(-1.0)  # what the fault left
                backend.mark_host(*gpt.host_tensors(trained))
                backend.mark_all_unsafe()
                for tensor in [*model.parameters(), *(v for s in optimizer.state.values() for k, v in s.items() if k != "step")]:
                    backend.mark_safe(tensor)  # the recovery's own repair of the parameters and the optimizer
            backend.set_check(enabled=True)
            records = heal.receive_state(group, [0, 0], [1, 1], model, optimizer, packages=["megatron"])
            result["healed"] = sorted(record.name.dotted for record in records if record.healed_from == 0)
            rollback = examine(model, optimizer, mode="heal", packages=["megatron"])  # the rollback's check
            result["left"] = [item.name.dotted for item in rollback.still_unsafe]
        else:
            heal.send_state(group, [0, 0], [1, 1], model, optimizer, packages=["megatron"])
        with backend.unchecked():
            result["bias"] = [router.expert_bias.tolist() for router in routers]
        generator = torch.Generator().manual_seed(1)  # the first step after the recovery, on every rank
        gpt._step(model, optimizer, torch.randint(0, shape.vocabulary, (gpt.BATCH, gpt.SEQUENCE), generator=generator))
        result["step"] = "ran"
        with backend.unchecked():
            result["inv_freq"] = model.rotary_pos_emb.inv_freq.tolist()
    print(json.dumps(result), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_heal_copies_the_routers_expert_bias_bit_for_bit_and_the_first_step_runs(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    path = os.pathsep.join([str(ROOT / "tests" / "fixtures" / "sentinel"), str(ROOT)])
    ranks = run_ranks(worker, 2, dict(os.environ, PYTHONPATH=path), timeout=300)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    replica, faulty = (json.loads(out.strip().splitlines()[-1]) for _, out, _ in ranks)
    assert faulty["healed"] == [
        "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.inv_freq",
        "megatron.core.transformer.moe.router.TopKRouter.expert_bias",
    ]
    assert faulty["bias"] == replica["bias"] and faulty["inv_freq"] == replica["inv_freq"]  # the replica's bytes
    assert faulty["left"] == []
    assert faulty["step"] == "ran"


SCALER_WORKER = """
import json, os, types
import torch
import torch.distributed as dist
from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from unsafe_doctor.npu.backend import EmulatedBackend
from unsafe_doctor.sentinel import heal

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
made = torch.tensor
torch.tensor = lambda *args, device=None, **kwargs: made(*args, **kwargs)  # CPU stand-in: the scaler asks for 'cuda'
try:
    scaler = DynamicGradScaler(2.0**16, 1.0, 2.0, 0.5, growth_interval=2, hysteresis=2)
finally:
    torch.tensor = made
for overflow in (False, False, True, True, False, False):  # the same steps on every data-parallel copy
    scaler.update(torch.tensor([float(overflow)]))
optimizer = types.SimpleNamespace(grad_scaler=scaler)  # what an fp16 MegatronOptimizer holds it as
group = dist.new_group([0, 1], use_local_synchronization=True)
backend = EmulatedBackend(rank)
result = {"rank": rank}
names = ("_scale", "min_scale", "growth_factor", "backoff_factor")
with backend.activate():
    if rank == 1:
        with backend.unchecked():
            scaler._scale.fill_(0.0)  # what the fault left
            backend.mark_all_unsafe()
        backend.set_check(enabled=True)
        records = heal.receive_state(group, [0], [1], optimizer, packages=["megatron"])
        result["healed"] = sorted(record.name.dotted for record in records if record.healed_from == 0)
        result["safe"] = all(backend.is_safe(getattr(scaler, name)) for name in names)
        result["loss"] = (torch.ones(1) * scaler.scale).tolist()  # what scale_loss reads first in the step
    else:
        heal.send_state(group, [0], [1], optimizer, packages=["megatron"])
    with backend.unchecked():
        result["scale"] = scaler._scale.tolist()
print(json.dumps(result), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_heal_copies_an_fp16_grad_scalers_loss_scale_from_the_replica(tmp_path):
    """megatron-core's DynamicGradScaler (its tensors made on the CPU here), its scale moved by the same
    overflows on both copies and held by the optimizer as `grad_scaler`: no rule names that holder, the
    shipped rule megatron.grad-scaler (scenario 2) names the scaler's own attributes, and heal copies
    them, so the loss scale the step reads first is the replica's."""
    worker = tmp_path / "worker.py"
    worker.write_text(SCALER_WORKER)
    ranks = run_ranks(worker, 2, dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    replica, faulty = (json.loads(out.strip().splitlines()[-1]) for _, out, _ in ranks)
    assert faulty["scale"] == replica["scale"] != [0.0]
    assert faulty["loss"] == replica["scale"] and faulty["safe"]
    assert set(faulty["healed"]) == {
        f"megatron.core.optimizer.grad_scaler.DynamicGradScaler.{name}"
        for name in ("_scale", "min_scale", "growth_factor", "backoff_factor")
    }
