import torch
import torch.distributed as dist
import torch.nn.functional as F

from tokencount import throughput

PAD_TOKEN = 0


def build_model(vocab_size: int, hidden_size: int) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Embedding(vocab_size, hidden_size), torch.nn.Linear(hidden_size, hidden_size),
                                torch.nn.GELU(), torch.nn.Linear(hidden_size, vocab_size))
    throughput.init_counter(model[1].weight.device)
    return model


def train_step(model, optimizer, batch, iteration: int) -> torch.Tensor:
    tokens, labels = batch
    optimizer.zero_grad(set_to_none=True)
    throughput.count_tokens(tokens, PAD_TOKEN)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()
    optimizer.step()
    throughput.log_throughput(iteration)
    return loss.detach()
