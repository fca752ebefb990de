"""A model of your own and a training loop of your own, on psserver.

Start a server (it learns the model from the first trainer), then one process per trainer:

    psserver serve --port 29500
    python examples/custom_cnn.py --rank 0 --num-trainers 2 &
    python examples/custom_cnn.py --rank 1 --num-trainers 2

Each trainer trains its shard of MNIST (the first 8,000 images of --data-dir) for --epochs,
then evaluates the server's final parameters on the other 2,000; it prints
``rank R accuracy A`` (about 0.97 with the defaults).
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn
from torch.utils.data import DataLoader

import psserver
from psserver.data import load_mnist

log = logging.getLogger("custom_cnn")


class SmallCNN(nn.Module):
    """Not one of psserver's models: the server never sees this code, only its tensors."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default=None, help="HOST:PORT (default as psserver.connect's: $PSSERVER_SERVER, ...)")
    p.add_argument("--rank", type=int, default=None, help="default $RANK, else 0")
    p.add_argument("--num-trainers", type=int, default=None, help="default $WORLD_SIZE")
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    train, held_out = load_mnist(args.data_dir, train_split=8000)
    loss_fn = nn.CrossEntropyLoss()
    with psserver.connect(args.server, rank=args.rank, num_trainers=args.num_trainers) as ps:
        model = ps.replica(SmallCNN())
        loader = DataLoader(train, batch_size=args.batch_size, sampler=ps.sampler(train))
        for epoch in range(ps.epoch, args.epochs):
            loader.sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                loss = loss_fn(model(x), y)
                loss.backward()
                ps.step(loss=loss)
                if i % 50 == 0:
                    log.info("epoch %d step %d: loss %.3f (server step %d, lr %g, staleness %d)",
                             epoch, i, loss.item(), ps.global_step, ps.lr, ps.staleness)
        accuracy = ps.evaluate(held_out)
        print(f"rank {ps.rank} accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
