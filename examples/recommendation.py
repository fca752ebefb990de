"""A recommendation model whose embedding tables live on the parameter servers, trained from
a loop of your own: the trainer holds the dense part (a small DLRM), the servers hold the
tables' rows and update them sparsely (each step touches only the rows its batch used).

    psserver serve --port 29500 --model dlrm_tiny --embedding-optimizer lazy_adam --embedding-lr 0.01 --lr 0.003
    python examples/recommendation.py --rank 0 --num-trainers 2 &
    python examples/recommendation.py --rank 1 --num-trainers 2

The data is psserver's synthetic click log (4 id fields over 2^40, dense features, a click
drawn from a hidden model). Each trainer prints ``rank R auc A`` on held-out clicks (about
0.77 with the defaults; the hidden model itself scores about 0.89).
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn
from torch.utils.data import DataLoader

import psserver
from psserver.data import ClickLogSpec, make_synthetic_clicks
from psserver.models import build_model

log = logging.getLogger("recommendation")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default=None)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--num-trainers", type=int, default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--samples", type=int, default=100_000)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    train, held_out = make_synthetic_clicks(ClickLogSpec(vocab=5000, id_space=1 << 40), args.samples, 20_000)
    loss_fn = nn.BCEWithLogitsLoss()
    with psserver.connect(args.server, rank=args.rank, num_trainers=args.num_trainers) as ps:
        model = ps.replica(build_model("dlrm_tiny"))  # the dense part; its rows come from the servers
        log.info("tables on the servers: %s", ", ".join(ps.tables))
        loader = DataLoader(train, batch_size=args.batch_size, sampler=ps.sampler(train))
        for epoch in range(ps.epoch, args.epochs):
            loader.sampler.set_epoch(epoch)
            for i, (ids, dense, clicked) in enumerate(loader):
                rows = ps.rows(ids)  # this batch's rows of every table (column t of ids: table t)
                loss = loss_fn(model(rows, dense), clicked)
                loss.backward()
                ps.step(loss=loss)  # dense gradient and row gradients, one update
                if i % 50 == 0:
                    log.info("epoch %d step %d: loss %.4f", epoch, i, loss.item())
        batches = (((ids, dense), clicked) for ids, dense, clicked in DataLoader(held_out, batch_size=4096))
        auc = ps.evaluate(batches, metric="auc")
        print(f"rank {ps.rank} auc {auc:.4f}", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
