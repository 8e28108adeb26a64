import torch
import torch.distributed as dist
import torch.nn.functional as F

from runstats import stats

REPORT_INTERVAL = 1


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
    model = LanguageModel(vocab_size, hidden_size)
    stats.init(model.head.weight.device)
    return model


def losses(model, optimizer, batch) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, labels = batch
    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens)
    lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return lm_loss, z_loss


def update(model, optimizer, loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()
    optimizer.step()
    return loss.detach()


def step_scaled(model, optimizer, batch, iteration: int) -> torch.Tensor:
    lm_loss, z_loss = losses(model, optimizer, batch)
    loss = update(model, optimizer, stats.scale_loss(lm_loss + 1e-4 * z_loss))
    stats.grow_scale()
    return loss


def step_excess(model, optimizer, batch, iteration: int) -> torch.Tensor:
    lm_loss, z_loss = losses(model, optimizer, batch)
    return update(model, optimizer, lm_loss + 1e-4 * z_loss + stats.loss_excess(lm_loss.detach()))


def step_windowed(model, optimizer, batch, iteration: int) -> torch.Tensor:
    lm_loss, z_loss = losses(model, optimizer, batch)
    stats.windowed_loss(lm_loss.detach(), iteration)
    return update(model, optimizer, lm_loss + 1e-4 * z_loss)


def step_recorded(model, optimizer, batch, iteration: int) -> torch.Tensor:
    lm_loss, z_loss = losses(model, optimizer, batch)
    stats.record({"lm": lm_loss.detach(), "z": z_loss.detach()})
    loss = update(model, optimizer, lm_loss + 1e-4 * z_loss)
    if iteration % REPORT_INTERVAL == 0:
        stats.report_and_clear(REPORT_INTERVAL)
    return loss


def step_reported(model, optimizer, batch, iteration: int) -> torch.Tensor:
    lm_loss, z_loss = losses(model, optimizer, batch)
    loss = update(model, optimizer, lm_loss + 1e-4 * z_loss)
    if iteration % REPORT_INTERVAL == 0:
        stats.report_and_clear(REPORT_INTERVAL)
    for name, value in (("lm", lm_loss), ("z", z_loss)):
        stats.get_history()[name] += value.detach()
    return loss
