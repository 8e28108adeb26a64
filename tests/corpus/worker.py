"""The torchrun worker behind the corpus logs: `python tests/corpus/generate.py` launches it.

A small data-parallel language model trains on gloo/CPU under the emulated torch_npu and MindIO of
samples/workers/ (`torch_npu_standin.py` on unsafe_doctor/npu/backend.py, `emulated_mindio.py`). The hardware fault planned in
`SAMPLE_FAULT` strikes, MindIO runs stop -> clean -> repair -> rollback through the recovery
adaptor below, which restores the parameters and the optimizer state (and whatever the case says
its adaptor already repairs), and the next step runs the case's code (cases.py) on memory the
fault left unsafe. The output is what torchrun prints: the `[rankN]: ` traceback, MindIO's lines,
each rank's iteration lines and the launcher's ChildFailedError box.

    torchrun --nproc-per-node 4 tests/corpus/worker.py --case mtp-loss-tracker

What torch_npu and MindSpeed change on an NPU is shimmed: `torch.cuda.current_device()` and
`device="cuda"` land on the emulated device (transfer_to_npu sends them to the NPU); for
megatron-core cases, its JIT fuser is off and the CUDA RNG tracker's fork() does nothing (cases.py).
Collectives in a training step are guarded (`emulated_mindio.collective_guard`) so that a rank
dying mid-step does not leave the others blocked in gloo, as MindIO's stop would unblock them.

`EMULATED_ADAPTOR_GENERATION` (generations.py) picks the adaptor generation whose lines the
adaptor prints and whose recovery it does: its clean, repair (rebuilding the faulty rank's model
and optimizer where the generation does) and feature rollback; rank 0 then also prints the
arguments dump of that generation's release at start-up, with the case's settings
(`CORPUS_ARGUMENTS_DUMP=0`: none).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import cases
import emulated_mindio as ttp
import generations
import torch
import torch.distributed as dist
import torch_npu_standin
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

ARGUMENTS = Path(__file__).resolve().parent / "arguments"
GENERATION = generations.current()

START_ITERATION = 116
EXIT_ITERATION = 130
SEQ_LENGTH = 8
MICRO_BATCH_SIZE = 2
UCE_HIGH_LEVEL = 3  # check_uce_in_memory: persistent memory was hit
RT_SEND = 0  # mindio_ttp RepairType: this rank sends to the faulty ranks


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand")


def cuda_on_cpu() -> None:
    """`device="cuda"` allocations land on the emulated device, as transfer_to_npu's wrappers send
    them to the NPU."""
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    def on_device(factory):
        @functools.wraps(factory)
        def allocate(*args, **kwargs):
            if not str(kwargs.get("device", "")).startswith("cuda"):
                return factory(*args, **kwargs)
            kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return allocate

    for name in _FACTORIES:
        setattr(torch, name, on_device(getattr(torch, name)))


@dataclass
class TrainState:
    iteration: int  # steps completed
    exit_iteration: int
    consumed_samples: int
    global_batch_size: int


class DataIterator:
    """This rank's share of every global batch of a fixed token corpus; restarts at any step."""

    def __init__(self, corpus: torch.Tensor, state: TrainState) -> None:
        self.corpus = corpus
        self.rebuild(state.consumed_samples)

    def rebuild(self, consumed_samples: int) -> None:
        self.position = consumed_samples + dist.get_rank() * MICRO_BATCH_SIZE

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(self.position, self.position + MICRO_BATCH_SIZE) % len(self.corpus)
        self.position += MICRO_BATCH_SIZE * dist.get_world_size()
        sample = self.corpus[rows]
        return sample[:, :-1], sample[:, 1:]


# --- guarded collectives ----------------------------------------------------------------------------

_STEPPING = [False]  # inside a training step: collectives wait for every rank first
_all_reduce = dist.all_reduce


def _guarded_all_reduce(tensor, *args, **kwargs):
    if _STEPPING[0]:
        ttp.collective_guard()
    return _all_reduce(tensor, *args, **kwargs)


dist.all_reduce = _guarded_all_reduce


# --- training ----------------------------------------------------------------------------------------

_LAST_LOG = [time.time()]


def print_rank_0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def training_log(case: cases.Case, state: TrainState, loss: torch.Tensor, learning_rate: float) -> None:
    """Megatron's iteration line on the last rank, and every rank's own step line through logging."""
    now = time.time()
    elapsed, _LAST_LOG[0] = now - _LAST_LOG[0], now
    loss_value = loss.item()
    logging.getLogger("train").info(
        f"[rank {dist.get_rank()}] iteration {state.iteration}: local lm loss {loss_value:.4f}, "
        f"step time {elapsed:.3f}s, tokens {MICRO_BATCH_SIZE * SEQ_LENGTH}"
    )
    if dist.get_rank() == dist.get_world_size() - 1:
        print(
            f" [{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] iteration {state.iteration:8d}/{1000:8d} |"
            f" consumed samples: {state.consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {elapsed * 1000:.1f} |"
            f" learning rate: {learning_rate:.6E} | global batch size: {state.global_batch_size:5d} |"
            f" lm loss: {loss_value:.6E} | loss scale: {case.loss_scale_value():.1f} |"
            f" number of skipped iterations:   0 | number of nan iterations:   0 |",
            flush=True,
        )


def train(model, optimizer, data_iterator: DataIterator, state: TrainState, case: cases.Case) -> int:
    """Megatron's loop; MindIO calls it again after a recovery, with the same arguments."""
    while state.iteration < state.exit_iteration:
        iteration = state.iteration + 1
        _STEPPING[0] = True
        try:
            loss = case.train_step(model, optimizer, next(data_iterator), iteration)
            ttp.tft_end_updating_os(iteration)
            ttp.strike(iteration, "after-optimizer")
            case.after_step(model, iteration)
            state.iteration = iteration
            state.consumed_samples += state.global_batch_size
            training_log(case, state, loss, optimizer.param_groups[0]["lr"])
        finally:
            _STEPPING[0] = False
    return state.iteration


# --- the recovery adaptor ---------------------------------------------------------------------------

MODEL_INDEX, OPTIM_INDEX, DATA_INDEX, STATE_INDEX, CASE_INDEX = 0, 1, 2, 3, 4


def replicated_tensors(train_args) -> list[torch.Tensor]:
    """What the adaptor restores, in the same order on every rank."""
    model, optimizer, case = train_args[MODEL_INDEX], train_args[OPTIM_INDEX], train_args[CASE_INDEX]
    tensors = []
    for param in model.parameters():
        tensors.append(param.data)
        param_state = optimizer.state[param]
        tensors.extend(param_state[key] for key in sorted(param_state))  # Adam's step count too
    return tensors + case.repaired(model)


def stop_callback(train_args, ctx):
    import torch_npu

    torch_npu.npu.stop_device(torch_npu.npu.current_device())


def clean_callback(is_uce_error: bool, train_args, ctx) -> int:  # noqa: FBT001 - MindIO's handler, called positionally
    import torch_npu
    from torch_npu.npu._recovery import update_npu_tensor_to_safe

    started, device, rank = time.time(), torch_npu.npu.current_device(), dist.get_rank()
    if is_uce_error:
        result = torch_npu.npu.check_uce_in_memory(device)
        GENERATION.log("checked", rank=rank, result=result)
        if result == UCE_HIGH_LEVEL and not GENERATION.rebuilds:  # those that rebuild drop the old model
            for tensor in replicated_tensors(train_args):
                update_npu_tensor_to_safe(tensor)
    torch_npu.npu.restart_device(device)
    GENERATION.log("cleaned", rank=rank, cost=time.time() - started, ret=0)
    return 0


def rebuild_model_and_optimizer(train_args) -> None:
    """What MindSpeed-LLM 2.3, the legacy adaptor and taskd do on the faulty rank: the model and the
    optimizer are built anew, so all they own is fresh memory (new parameters, buffers, optimizer
    state and scalars), which the replica's copy then fills. The module objects stay, so that what
    holds them (the case, hooks) sees the rebuilt tensors."""
    model, optimizer, case = train_args[MODEL_INDEX], train_args[OPTIM_INDEX], train_args[CASE_INDEX]
    torch.manual_seed(1234)
    fresh = case.build_model()
    for old_module, new_module in zip(model.modules(), fresh.modules(), strict=True):
        for name, param in old_module.named_parameters(recurse=False):
            param.data = getattr(new_module, name).data
        for name in old_module._buffers:
            old_module._buffers[name] = new_module._buffers[name]
    rebuilt = case.build_optimizer(model)
    for param in model.parameters():  # the layout the replica sends (values arrive next)
        rebuilt.state[param] = {
            key: torch.zeros(value.shape, dtype=value.dtype, device=value.device) for key, value in optimizer.state[param].items()
        }
    train_args[OPTIM_INDEX] = rebuilt


def repair_callback(step: int, need_rebuild: bool, error_ranks: list, repair_info: dict, train_args, ctx):  # noqa: FBT001, PLR0917 - MindIO's handler, called positionally
    started, rank = time.time(), dist.get_rank()
    src_ranks, dest_ranks, rank_list = repair_info["src"], repair_info["dst"], repair_info["rank_list"]
    fields = dict(
        rank=rank,
        repair_type=repair_info["repair_type"],
        src=src_ranks,
        dst=dest_ranks,
        rank_list=rank_list,
        optim_idxs=repair_info["type"],
        step=step,
    )
    GENERATION.log(
        "repair",
        **fields,
        params=json.dumps({"scale-out-strategy": "DP"}),
        need_rebuild=need_rebuild,
        error_ranks=error_ranks,
        repair_info=repair_info,
    )
    GENERATION.log("repair_ranks", **fields)
    if repair_info["repair_type"] == RT_SEND:
        for dest_rank in dest_ranks:
            for tensor in replicated_tensors(train_args):
                dist.send(tensor, dst=dest_rank)
    else:
        rebuilding = time.time()
        if need_rebuild and GENERATION.rebuilds:
            rebuild_model_and_optimizer(train_args)
        receiving = time.time()
        for src_rank in src_ranks:
            for tensor in replicated_tensors(train_args):
                received = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
                dist.recv(received, src=src_rank)
                tensor.copy_(received)
        GENERATION.log("loaded", rank=rank, step=step)
        done = time.time()
        GENERATION.log(
            "received",
            rank=rank,
            total=done - started,
            group=rebuilding - started,
            rebuild=receiving - rebuilding,
            recv=done - receiving,
            load=0.0,
            optim=0.0,
            log_args=0.0,
        )
    GENERATION.log("repaired", rank=rank, total=time.time() - started)


def feature_rollback(case: cases.Case) -> None:
    """What every generation's feature_rollback resets, by the job's arguments (README.md)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")  # the adaptors import it; unused here if absent
    arguments = case.arguments()
    if parallel_state is not None:
        if hasattr(parallel_state, "destroy_global_memory_buffer") and hasattr(parallel_state, "_set_global_memory_buffer"):
            parallel_state.destroy_global_memory_buffer()
            parallel_state._set_global_memory_buffer()
        if arguments.get("num_experts"):
            parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER = {}  # the name of megatron-core <= 0.7 only
    if arguments.get("moe_permutation_async_comm"):
        importlib.import_module("mindspeed.core.transformer.moe.moe_utils").AG_SHARED_EXPERTS_INPUTS = []


def rollback_callback(step: int, train_args, ctx):
    started, rank = time.time(), dist.get_rank()
    state, case = train_args[STATE_INDEX], train_args[CASE_INDEX]
    GENERATION.log("rollback", step=step, params=json.dumps({"scale-out-strategy": "DP"}))
    state.consumed_samples = step * state.global_batch_size
    featured = time.time()
    if GENERATION.resets_features:
        feature_rollback(case)
    gathered = time.time()
    train_args[DATA_INDEX].rebuild(state.consumed_samples)
    GENERATION.log("gathered", rank=rank, step=step)
    case.rollback(step, state.iteration)
    state.iteration = step
    done = time.time()
    GENERATION.log(
        "rolled_back",
        rank=rank,
        total=done - started,
        feature=gathered - featured,
        gather=0.0,
        dataset=done - gathered,
        group=0.0,
        log=0.0,
    )


# --- the arguments dump ----------------------------------------------------------------------------


def print_arguments(case: cases.Case, world_size: int) -> None:
    """Rank 0's dump of every argument (Megatron-LM's `_print_args`, or MindSpeed-LLM's `print_args`
    under its own title), after Megatron's parallel-sizes line; the release's arguments at their
    defaults but the job's and the case's settings."""
    release = dumped_release()
    known = json.loads((ARGUMENTS / f"{release}.json").read_text())["arguments"]
    unknown = sorted(set(case.arguments()) - set(known))
    if unknown:
        raise ValueError(f"{release} has no argument {unknown}")
    job = {name: value for name, value in job_arguments(case, world_size).items() if name in known}
    values = {**known, **job, **case.arguments()}
    print(
        f"using world size: {world_size}, data-parallel size: {world_size}, context-parallel size: 1, "
        f"hierarchical context-parallel sizes: Nonetensor-model-parallel size: 1, encoder-tensor-model-parallel "
        f"size: 0, pipeline-model-parallel size: 1, encoder-pipeline-model-parallel size: 0",
        flush=True,
    )
    title = GENERATION.dump_title
    print(f"------------------------ {title} ------------------------", flush=True)
    lines = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in values.items()]
    for line in sorted(lines, key=str.lower):
        print(line, flush=True)
    print(f"-------------------- end of {title} ---------------------", flush=True)


def dumped_release() -> str:
    """The file of arguments/ the dump prints: the generation's release, or, for a Megatron-LM dump,
    the release the job runs when generate.py names it (`CORPUS_MEGATRON_ARGUMENTS`: megatron-core
    0.17 and newer ship Megatron-LM's own arguments.py)."""
    own = os.environ.get("CORPUS_MEGATRON_ARGUMENTS")
    return own if own and GENERATION.dump_title == "arguments" else GENERATION.arguments


def job_arguments(case: cases.Case, world_size: int) -> dict[str, object]:
    """What every corpus job runs with: the model's sizes, the batch, the schedule, the checkpoint."""
    precision = case.arguments()
    dtype = "torch.bfloat16" if precision.get("bf16") else "torch.float16" if precision.get("fp16") else "torch.float32"
    return {
        "num_layers": 2,
        "hidden_size": cases.HIDDEN_SIZE,
        "ffn_hidden_size": 4 * cases.HIDDEN_SIZE,
        "num_attention_heads": cases.NUM_HEADS,
        "kv_channels": cases.HEAD_DIM,
        "seq_length": SEQ_LENGTH,
        "max_position_embeddings": SEQ_LENGTH,
        "vocab_size": cases.VOCAB_SIZE,
        "micro_batch_size": MICRO_BATCH_SIZE,
        "global_batch_size": MICRO_BATCH_SIZE * world_size,
        "train_iters": 1000,
        "lr": 1.5e-4,
        "optimizer": "adam",
        "seed": 1234,
        "world_size": world_size,
        "data_parallel_size": world_size,
        "params_dtype": dtype,
        "load": f"/ckpt/{case.checkpoint}",
        "save": f"/ckpt/{case.checkpoint}",
        "enable_high_availability": True,
    }


# --- main --------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(cases.CASES), required=True)
    case = cases.CASES[parser.parse_args().case]()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    if GENERATION.arguments and os.environ.get("CORPUS_ARGUMENTS_DUMP") != "0" and int(os.environ["RANK"]) == 0:
        print_arguments(case, int(os.environ["WORLD_SIZE"]))
    corpus = torch.randint(0, cases.VOCAB_SIZE, (512, SEQ_LENGTH + 1), generator=torch.Generator().manual_seed(1234))
    torch_npu_standin.activate(host=(corpus,))  # before init_process_group (excepthook)
    cuda_on_cpu()
    case.install_excepthook()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    print_rank_0("> initializing torch distributed ...")
    case.initialize()
    torch_npu_standin.warn_internal_format()

    torch.manual_seed(1234)
    model = case.build_model()
    optimizer = case.build_optimizer(model)
    state = TrainState(
        START_ITERATION, EXIT_ITERATION, START_ITERATION * MICRO_BATCH_SIZE * world_size, MICRO_BATCH_SIZE * world_size
    )
    print_rank_0(f"  successfully loaded checkpoint from /ckpt/{case.checkpoint} at iteration {START_ITERATION}")

    ttp.tft_init_processor(rank, world_size)
    # the replica optimizer's step tells MindIO when the update ran (the first public release logs it)
    register_optimizer_step_pre_hook(lambda *_: ttp.tft_set_update_start_time())
    register_optimizer_step_post_hook(lambda *_: ttp.tft_set_update_end_time())
    ttp.tft_register_stop_handler(stop_callback)
    ttp.tft_register_clean_handler(clean_callback)
    ttp.tft_register_repair_handler(repair_callback)
    ttp.tft_register_rollback_handler(rollback_callback)
    model.register_forward_pre_hook(lambda *_: ttp.strike(state.iteration + 1, "forward"))
    data_iterator = DataIterator(corpus, state)
    print_rank_0(f"[before the start of training step] datetime: {datetime.datetime.now():%Y-%m-%d %H:%M:%S}")
    run = ttp.tft_exception_handler(train)
    run(model, optimizer, data_iterator, state, case)
    print_rank_0(f"[after training is done] datetime: {datetime.datetime.now():%Y-%m-%d %H:%M:%S}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
