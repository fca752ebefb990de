"""A model part of whose parameters a step does not train: a frozen first layer and an auxiliary
head that only every other forward uses (``tests/end_to_end/test_partial_gradients.py``). A torch
optimizer skips a parameter whose ``.grad`` is None, so neither moves in those steps, weight
decay and momentum included; psserver's server must skip them too."""

from __future__ import annotations

import torch
from torch import nn, optim
from torch.utils.data import TensorDataset

import psserver

STEPS, BATCH, LR, DECAY = 8, 16, 0.01, 0.1


class PartlyTrained(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(8, 16)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 3)
        self.calls = 0  # training forwards so far: the aux head takes part in every other one

    def forward(self, x):
        h = torch.relu(self.frozen(x))
        out = self.body(h)
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls % 2:
                out = out + self.aux(h)
        return out


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(STEPS)]


def splits() -> tuple[TensorDataset, TensorDataset]:
    """``psserver train --dataset``: the same batches, one after another."""
    xs, ys = zip(*batches(), strict=True)
    data = TensorDataset(torch.cat(xs), torch.cat(ys))
    return data, data


def local() -> dict[str, torch.Tensor]:
    """The reference: a plain local loop, AdamW with weight decay over every parameter."""
    model = PartlyTrained()
    opt = optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def through_step(ps, out: str) -> None:
    """``psserver train --entry``: the same loop through ``ps.step()``."""
    model = ps.replica(PartlyTrained())
    for x, y in batches():
        nn.functional.cross_entropy(model(x), y).backward()
        ps.step()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)


def read_back(ps, out: str) -> None:
    """The server's parameters, saved by a trainer that joins and leaves without a step."""
    model = ps.replica(PartlyTrained())
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)


__all__ = ["PartlyTrained", "local", "psserver", "read_back", "splits", "through_step"]
