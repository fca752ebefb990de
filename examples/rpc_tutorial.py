"""PyTorch's parameter-server tutorial loop (RRefs, ``dist_autograd``, ``DistributedOptimizer``),
against psserver's server: its one shared optimizer, its membership, heartbeats and eviction.

The server runs the model (the tutorial's ``ParameterServer.forward``), so it holds its code:

    psserver serve --port 29500 --model mnist_cnn --optimizer sgd --lr 0.05
    python examples/rpc_tutorial.py --rank 0 --num-trainers 2 &
    python examples/rpc_tutorial.py --rank 1 --num-trainers 2

It prints ``rank R accuracy A`` (about 0.97 with the defaults).
"""

from __future__ import annotations

import argparse
import logging

import torch.distributed.autograd as dist_autograd
from torch import nn, optim
from torch.distributed.optim import DistributedOptimizer
from torch.utils.data import DataLoader

import psserver
from psserver.data import load_mnist

log = logging.getLogger("rpc_tutorial")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default=None)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--num-trainers", type=int, default=None)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    train, held_out = load_mnist(args.data_dir, train_split=8000)
    with psserver.connect(args.server, rank=args.rank, num_trainers=args.num_trainers) as ps:
        param_rrefs = ps.parameter_rrefs()
        # Any torch.optim class: the server's --optimizer (and --lr) is the one that applies.
        opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=args.lr)
        loader = DataLoader(train, batch_size=args.batch_size, sampler=ps.sampler(train))
        for epoch in range(ps.epoch, args.epochs):
            loader.sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                with dist_autograd.context() as context_id:
                    loss = nn.functional.cross_entropy(ps.forward(x), y)
                    dist_autograd.backward(context_id, [loss])
                    opt.step(context_id)
                if i % 50 == 0:
                    log.info("epoch %d step %d: loss %.3f", epoch, i, loss.item())
        accuracy = ps.evaluate(held_out)
        print(f"rank {ps.rank} accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
