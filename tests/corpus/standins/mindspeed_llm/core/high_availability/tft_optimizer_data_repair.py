"""Stand-in for the corpus at MindSpeed-LLM's import path (not its code): what the adaptor keeps
of every step for the training log it replays after a repair."""


class LogArgs:
    losses_reduced_ = None


def tft_set_losses_reduced(losses_reduced):
    LogArgs.losses_reduced_ = losses_reduced


def average_losses_across_microbatches(losses_reduced):
    averaged = {}
    for key in losses_reduced[0]:
        losses_reduced_for_key = [x[key] for x in losses_reduced]
        total_loss = sum(t[0] for t in losses_reduced_for_key)
        averaged[key] = total_loss / len(losses_reduced_for_key)
    return averaged
