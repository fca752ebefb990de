"""PyTorch's parameter-server tutorial (pytorch/examples ``distributed/rpc/parameter_server``),
ported to psserver: its model, loss, loop and optimizer, against psserver's server (its one
shared optimizer, its membership, heartbeats and eviction).

The server runs the model (the tutorial's ``ParameterServer.forward``), so it holds its code,
this file's ``Net``; the trainers' ``DistributedOptimizer`` sets the server's optimizer:

    PYTHONPATH=examples psserver serve --port 29500 --model rpc_tutorial:Net
    python examples/rpc_tutorial.py --rank 0 --num-trainers 2 &
    python examples/rpc_tutorial.py --rank 1 --num-trainers 2

It prints ``rank R accuracy A`` (0.93-0.94 after one epoch over 8,000 MNIST images).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn, optim
from torch.distributed.optim import DistributedOptimizer
from torch.utils.data import DataLoader, Dataset

import psserver
from psserver.data import load_mnist


class Net(nn.Module):
    """The tutorial's model, as it is there but for its device placement (psserver's server
    places it): two convolutions, two linear layers, log-probabilities out."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout2d(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.conv2(F.relu(self.conv1(x))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.fc2(self.dropout2(F.relu(self.fc1(x))))
        return F.log_softmax(x, dim=1)


def run_training_loop(ps: psserver.Connection, train: Dataset, epochs: int) -> None:
    """The tutorial's loop: ``ps.forward`` is its ``TrainerNet`` (the server's model on the batch)."""
    param_rrefs = ps.parameter_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=0.03)
    train_loader = DataLoader(train, batch_size=32, sampler=ps.sampler(train))
    for epoch in range(ps.epoch, epochs):
        train_loader.sampler.set_epoch(epoch)
        for i, (data, target) in enumerate(train_loader):
            with dist_autograd.context() as cid:
                model_output = ps.forward(data)
                loss = F.nll_loss(model_output, target)
                if i % 50 == 0:
                    print(f"Rank {ps.rank} training batch {i} loss {loss.item()}", flush=True)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
    print("Training complete!", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default=None, help="HOST:PORT of psserver serve (default: psserver.connect's)")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--num-trainers", type=int, default=None)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args()

    train, held_out = load_mnist(args.data_dir, train_split=8000)
    with psserver.connect(args.server, rank=args.rank, num_trainers=args.num_trainers) as ps:
        run_training_loop(ps, train, args.epochs)
        accuracy = ps.evaluate(held_out)  # the tutorial's get_accuracy, on the server's final parameters
        print(f"rank {ps.rank} accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
