import torch
import torch.distributed as dist
import torch.nn.functional as F

from packer.buffers import get_pack_buffer

PAD_TOKEN = 0


class PackedModel(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab_size, hidden_size)
        self.mixer = torch.nn.Linear(hidden_size, hidden_size)
        self.head = torch.nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens):
        hidden = self.embedding(tokens)
        return self.head(hidden + torch.relu(self.mixer(pack(hidden, tokens != PAD_TOKEN))))


def pack(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Padding positions zeroed in the reusable buffer, the kept ones copied in."""
    buffer = get_pack_buffer(hidden.numel(), hidden.device)
    buffer.zero_()
    packed = buffer[: hidden.numel()].view(hidden.shape)
    return torch.where(keep.unsqueeze(-1), hidden, packed)


def build_model(vocab_size: int, hidden_size: int) -> torch.nn.Module:
    return PackedModel(vocab_size, hidden_size)


def train_step(model, optimizer, batch, iteration: int) -> torch.Tensor:
    tokens, labels = batch
    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    grads = torch.cat([param.grad.reshape(-1) for param in model.parameters()])
    dist.all_reduce(grads)
    offset = 0
    for param in model.parameters():
        param.grad.copy_(grads[offset:offset + param.numel()].view_as(param) / dist.get_world_size())
        offset += param.numel()
    optimizer.step()
    return loss.detach()
