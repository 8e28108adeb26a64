import torch
import torch.distributed as dist
import torch.nn.functional as F

from postable import positions

MAX_LENGTH = 512


class PositionalModel(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab_size, hidden_size)
        self.mixer = torch.nn.Linear(hidden_size, hidden_size)
        self.head = torch.nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens):
        hidden = positions.add_positions(self.embedding(tokens))
        return self.head(hidden + torch.tanh(self.mixer(hidden)))


def build_model(vocab_size: int, hidden_size: int) -> torch.nn.Module:
    model = PositionalModel(vocab_size, hidden_size)
    positions.build_position_table(MAX_LENGTH, hidden_size, model.head.weight.device)
    return model


def train_step(model, optimizer, batch, iteration: int) -> torch.Tensor:
    tokens, labels = batch
    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()
    optimizer.step()
    return loss.detach()
