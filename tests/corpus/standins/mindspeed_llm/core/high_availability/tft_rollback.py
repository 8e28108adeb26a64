"""Stand-in for the corpus at MindSpeed-LLM's import path (not its code): the rollback's replay of
the training log of the step that finished before the fault."""

import logging

from mindspeed_llm.core.high_availability.tft_optimizer_data_repair import LogArgs, average_losses_across_microbatches

ttp_logger = logging.getLogger(__name__)


def training_log_repair(iteration, logged_iteration):
    if iteration == logged_iteration or LogArgs.losses_reduced_ is None:
        ttp_logger.info(f"Skip the train log repair. repair_step:{iteration} args.iteration:{logged_iteration}.")
        return
    ttp_logger.info(f"repair training log at iteration: {iteration}")
    loss_dict = average_losses_across_microbatches(LogArgs.losses_reduced_)
    print(f" iteration {iteration:8d}/{1000:8d} | lm loss: {float(loss_dict['lm loss']):.6E} |", flush=True)
