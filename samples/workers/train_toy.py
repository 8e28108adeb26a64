"""Sample worker: toytrain (``samples/framework``) on emulated torch_npu.

``--case ema``: under emulated MindIO with toytrain's own recovery adaptor; the fault planned in
``SAMPLE_FAULT`` strikes, recovery restores parameters and optimizer state, and the first step
after it reads ``toytrain.state._EMA_GRAD_NORM``. C++ stack traces are on, as with
``TORCH_SHOW_CPP_STACKTRACES=1``. ``SAMPLE_TRAIN_ITERS`` ends the job sooner than its 1,000 steps (a
test needs only the steps past the recovery).

``--case hccl-timeout``: no MindIO; at step ``HANG_STEP`` every rank but ``TIMEOUT_RANK`` hangs
before the gradient all-reduce, and ``TIMEOUT_RANK``'s all-reduce times out. The timeout is a
real gloo one; it is re-raised as a ``DistBackendError`` worded like a process group watchdog's
timeout (ProcessGroupNCCL's message with "HCCL"), with torch_npu's DIST error code.
"""

import argparse
import datetime
import logging
import os
import time

import torch
import torch.distributed as dist

import toytrain.train
import torch_npu_standin
from toytrain import recovery, state
from toytrain.train import DataIterator, TrainConfig
from unsafe_doctor.npu.messages import ERR_HCCL, pta_error

HANG_STEP = 37
TIMEOUT_RANK = 2
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=2)


def with_mindio(model, optimizer, data_iterator, config) -> None:
    import emulated_mindio as ttp

    ttp.tft_init_processor(dist.get_rank(), dist.get_world_size())
    ttp.tft_register_stop_handler(recovery.stop_callback)
    ttp.tft_register_clean_handler(recovery.clean_callback)
    ttp.tft_register_repair_handler(recovery.repair_callback)
    ttp.tft_register_rollback_handler(recovery.rollback_callback)
    model.register_forward_pre_hook(lambda *_: ttp.strike(config.iteration + 1, "forward"))
    optimizer.register_step_post_hook(lambda *_: ttp.tft_end_updating_os(config.iteration + 1))

    allreduce_gradients = toytrain.train.allreduce_gradients

    def guarded_allreduce_gradients(model):
        ttp.collective_guard()
        allreduce_gradients(model)

    toytrain.train.allreduce_gradients = guarded_allreduce_gradients
    train = ttp.tft_exception_handler(toytrain.train.train)
    train(model, optimizer, data_iterator, config)


def with_hccl_timeout(model, optimizer, data_iterator, config) -> None:
    timeout_group = dist.new_group(timeout=COLLECTIVE_TIMEOUT)
    allreduce_gradients = toytrain.train.allreduce_gradients

    def hccl_allreduce_gradients(model):
        if config.iteration + 1 < HANG_STEP:
            return allreduce_gradients(model)
        if dist.get_rank() != TIMEOUT_RANK:
            while True:  # this rank's link is down: its collective never starts
                time.sleep(1)
        started = time.time()
        grads = torch.cat([param.grad.reshape(-1) for param in model.parameters()])
        try:
            dist.all_reduce(grads, group=timeout_group)
        except RuntimeError as error:  # gloo reports its timeout as a plain RuntimeError
            elapsed_ms = int((time.time() - started) * 1000)
            raise dist.DistBackendError(
                f"[Rank {dist.get_rank()}] Watchdog caught collective operation timeout: "
                f"WorkHCCL(SeqNum={HANG_STEP}, OpType=ALLREDUCE, NumelIn={grads.numel()}, "
                f"NumelOut={grads.numel()}, Timeout(ms)={int(COLLECTIVE_TIMEOUT.total_seconds() * 1000)}) "
                f"ran for {elapsed_ms} milliseconds before timing out."
                + pta_error(ERR_HCCL, torch_npu_standin.device_index())) from error

    toytrain.train.allreduce_gradients = hccl_allreduce_gradients
    toytrain.train.train(model, optimizer, data_iterator, config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["ema", "hccl-timeout"], required=True)
    case = parser.parse_args().case
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    generator = torch.Generator().manual_seed(7)
    features = torch.randn(256, 8, generator=generator)
    labels = torch.randint(0, 4, (256,), generator=generator)
    torch_npu_standin.activate(cpp_stacktrace=case == "ema", host=(features, labels))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))

    torch.manual_seed(0)
    model = toytrain.train.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    state.init_state("cpu")
    config = TrainConfig(iteration=0, train_iters=int(os.environ.get("SAMPLE_TRAIN_ITERS", "1000")))
    data_iterator = DataIterator(features, labels, config)
    if case == "ema":
        with_mindio(model, optimizer, data_iterator, config)
    else:
        with_hccl_timeout(model, optimizer, data_iterator, config)


if __name__ == "__main__":
    main()
