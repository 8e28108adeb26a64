import torch
import torch.distributed as dist
import torch.nn.functional as F

from amaxscale import fp8


class Fp8MLP(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab_size, hidden_size)
        self.up = torch.nn.Linear(hidden_size, 2 * hidden_size)
        self.down = torch.nn.Linear(2 * hidden_size, hidden_size)
        self.head = torch.nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens):
        hidden = self.embedding(tokens)
        activation = fp8.fake_quantize(torch.relu(self.up(hidden)))
        return self.head(hidden + self.down(activation))


def build_model(vocab_size: int, hidden_size: int) -> torch.nn.Module:
    model = Fp8MLP(vocab_size, hidden_size)
    fp8.init_amax(model.up.weight.device)
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
