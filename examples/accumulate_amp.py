"""A Horovod-style loop on psserver: ``psserver.DistributedOptimizer`` with gradient
accumulation and mixed precision (bf16 autocast on the CPU, fp16 on a GPU, with a GradScaler).

    psserver serve --port 29500
    python examples/accumulate_amp.py --rank 0 --num-trainers 1

Each optimizer step is ``--accumulate`` micro-batches of ``--micro-batch`` (one update on the
server). The loop is the one Horovod documents for AMP (horovod#1089): synchronize, unscale,
clip, then ``scaler.step`` inside ``skip_synchronize``. It prints ``rank R accuracy A``
(about 0.94 with the defaults).
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn
from torch.utils.data import DataLoader

import psserver
from psserver.data import load_mnist

log = logging.getLogger("accumulate_amp")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default=None)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--num-trainers", type=int, default=None)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--max-norm", type=float, default=5.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    device = torch.device(args.device)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    train, held_out = load_mnist(args.data_dir, train_split=8000)
    loss_fn = nn.CrossEntropyLoss()
    with psserver.connect(args.server, rank=args.rank, num_trainers=args.num_trainers, device=args.device) as ps:
        model = ps.replica(mlp())
        opt = psserver.DistributedOptimizer(ps, model.named_parameters(), backward_passes_per_step=args.accumulate)
        scaler = torch.amp.GradScaler(device.type)
        loader = DataLoader(train, batch_size=args.micro_batch, sampler=ps.sampler(train), drop_last=True)
        for epoch in range(ps.epoch, args.epochs):
            loader.sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                x, y = x.to(device), y.to(device)
                with torch.autocast(device.type, dtype=amp_dtype):
                    loss = loss_fn(model(x), y) / args.accumulate
                scaler.scale(loss).backward()
                if (i + 1) % args.accumulate:
                    continue
                opt.synchronize()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
                with opt.skip_synchronize():
                    scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                if ps.steps % 25 == 0:
                    log.info("epoch %d update %d: loss %.3f, lr %g", epoch, ps.steps,
                             loss.item() * args.accumulate, opt.param_groups[0]["lr"])
        accuracy = ps.evaluate(held_out)
        print(f"rank {ps.rank} accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
