import torch
import torch.distributed as dist
import torch.nn.functional as F

from maskcache.masks import causal_mask


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(hidden_size, 3 * hidden_size)
        self.out = torch.nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden):
        query, key, value = self.qkv(hidden).chunk(3, dim=-1)
        scores = query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5
        scores = scores.masked_fill(causal_mask(scores.shape[-1], scores.device), float("-inf"))
        return self.out(scores.softmax(dim=-1) @ value)


class Transformer(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab_size, hidden_size)
        self.attention = CausalSelfAttention(hidden_size)
        self.head = torch.nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens):
        hidden = self.embedding(tokens)
        return self.head(hidden + self.attention(hidden))


def build_model(vocab_size: int, hidden_size: int) -> torch.nn.Module:
    return Transformer(vocab_size, hidden_size)


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
