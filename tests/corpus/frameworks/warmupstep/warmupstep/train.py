import torch
import torch.distributed as dist
import torch.nn.functional as F

from warmupstep import schedule

RESUMED_STEP = 116


def build_model(vocab_size: int, hidden_size: int) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Embedding(vocab_size, hidden_size), torch.nn.Linear(hidden_size, hidden_size),
                                torch.nn.SiLU(), torch.nn.Linear(hidden_size, vocab_size))
    schedule.init_step_count(RESUMED_STEP, model[1].weight.device)
    return model


def train_step(model, optimizer, batch, iteration: int) -> torch.Tensor:
    tokens, labels = batch
    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    lr_scale = schedule.warmup_factor()
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad.mul_(lr_scale / dist.get_world_size())
    optimizer.step()
    schedule.advance()
    return loss.detach()
