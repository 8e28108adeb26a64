"""Sample worker: Megatron-style MoE pretraining under emulated MindIO and torch_npu.

Run with torchrun (``samples/make_logs.py`` does). ``SAMPLE_FAULT`` says where the hardware
fault strikes (see ``emulated_mindio.FaultPlan``). The run resumes "from a checkpoint" at
iteration 116 so that the fault lands at iteration 121 after a few logged iterations.
"""

import datetime
import logging
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron.core import parallel_state as mpu

import emulated_mindio as ttp
import megatron_adaptor
import megatron_training
import torch_npu_standin
from megatron_training import print_rank_0

START_ITERATION = 116
MICRO_BATCH_SIZE = 2
SEQ_LENGTH = 8


class DataIterator:
    """Samples of a fixed synthetic corpus, this rank's share of each global batch."""

    def __init__(self, corpus: torch.Tensor, consumed_samples: int) -> None:
        self.corpus = corpus
        self.rebuild(consumed_samples)

    def rebuild(self, consumed_samples: int) -> None:
        self.position = consumed_samples + dist.get_rank() * MICRO_BATCH_SIZE

    def __next__(self) -> torch.Tensor:
        rows = torch.arange(self.position, self.position + MICRO_BATCH_SIZE) % len(self.corpus)
        self.position += MICRO_BATCH_SIZE * dist.get_world_size()
        return self.corpus[rows]


def forward_step(data_iterator, model):
    tokens = next(data_iterator)
    return model(tokens[:, :-1], tokens[:, 1:])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    corpus = torch.randint(0, 64, (512, SEQ_LENGTH + 1), generator=torch.Generator().manual_seed(1234))
    npu = torch_npu_standin.activate(host=(corpus,))  # before init_process_group (excepthook)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    print_rank_0("> initializing torch distributed ...")
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    print_rank_0("> initialized tensor model parallel with size 1")
    print_rank_0("> initialized pipeline model parallel with size 1")
    torch_npu_standin.warn_internal_format()

    import tiny_moe
    torch.manual_seed(1234)
    config = tiny_moe.transformer_config()
    model = [tiny_moe.TinyMoEModel(config)]
    optimizer = megatron_training.Optimizer(model[0].parameters(), lr=1.5e-4)
    npu.mark_host(optimizer.get_loss_scale())  # torch.tensor([1.0]) with no device: host memory on an NPU
    global_batch_size = MICRO_BATCH_SIZE * world_size
    scheduler = megatron_training.OptimizerParamScheduler(optimizer, 1.5e-4, START_ITERATION * global_batch_size)
    args = SimpleNamespace(rank=rank, iteration=START_ITERATION, train_iters=1000, exit_iteration=130,
                           global_batch_size=global_batch_size, num_layers=tiny_moe.NUM_LAYERS,
                           num_experts=tiny_moe.NUM_EXPERTS,
                           consumed_train_samples=START_ITERATION * global_batch_size)
    megatron_training.set_args(args)
    print_rank_0(f"  successfully loaded checkpoint from /ckpt/moe_tiny at iteration {START_ITERATION}")

    ttp.tft_init_processor(rank, world_size)
    ttp.tft_register_stop_handler(megatron_adaptor.stop_callback)
    ttp.tft_register_clean_handler(megatron_adaptor.clean_callback)
    ttp.tft_register_repair_handler(megatron_adaptor.repair_callback)
    ttp.tft_register_rollback_handler(megatron_adaptor.rollback_callback)

    train_data_iterator = DataIterator(corpus, args.consumed_train_samples)
    print_rank_0(f"[before the start of training step] datetime: {datetime.datetime.now():%Y-%m-%d %H:%M:%S}")
    train = ttp.tft_exception_handler(megatron_training.train)
    train(forward_step, model, optimizer, scheduler, train_data_iterator, None, None, config)


if __name__ == "__main__":
    main()
