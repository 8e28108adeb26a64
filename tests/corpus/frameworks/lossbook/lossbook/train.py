import torch
import torch.distributed as dist
import torch.nn.functional as F

from lossbook import meters

LOG_INTERVAL = 4
Z_LOSS_WEIGHT = 1e-4


class LanguageModel(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab_size, hidden_size)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden_size, 4 * hidden_size), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden_size, hidden_size))
        self.head = torch.nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens):
        hidden = self.embedding(tokens)
        return self.head(hidden + self.mlp(hidden))


def build_model(vocab_size: int, hidden_size: int) -> torch.nn.Module:
    return LanguageModel(vocab_size, hidden_size)


def train_step(model, optimizer, batch, iteration: int) -> torch.Tensor:
    tokens, labels = batch
    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens)
    lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
    loss = lm_loss + Z_LOSS_WEIGHT * z_loss
    meters.add_loss("lm loss", lm_loss)
    meters.add_loss("z loss", z_loss)
    loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()
    optimizer.step()
    if iteration % LOG_INTERVAL == 0:
        meters.report_and_clear(iteration, LOG_INTERVAL)
    return loss.detach()
