"""Training loops of a user's own, written against the library (``import psserver``): the
tests run them with ``psserver train --entry tests.trainer.loops:NAME`` or as a script
(``python -m tests.trainer.loops NAME PORT ...``), against a server the test started.

Each writes what the test checks (the trained ``state_dict``, the samples it trained on) to
the file ``out`` names, and prints its counters.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import torch
import torch.distributed.autograd as dist_autograd
from torch import nn, optim
from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer
from torch.utils.data import DataLoader, TensorDataset

import psserver

LR = 0.01
STEPS = 20
BATCH = 16


def tiny_net() -> nn.Module:
    """The model of the equality tests: seeded, so the server (``--model``), the trainer and
    the local loop build the same initial values."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def batches(steps: int = STEPS, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(steps)]


def local_adam(steps: int = STEPS, batch: int = BATCH, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The reference: a plain local loop, Adam at ``LR``, on ``device`` (its state on the CPU)."""
    model = tiny_net().to(device)
    opt = optim.Adam(model.parameters(), lr=LR)
    for x, y in batches(steps, batch):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def local_with(name: str, args: dict, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The reference for an optimizer of ``--optimizer NAME --optimizer-args ARGS`` at ``LR``."""
    from psserver.config.optimizer import OptimizerConfig, make_optimizer

    model = tiny_net()
    opt = make_optimizer(list(model.parameters()), OptimizerConfig(name, LR, args=args))
    for x, y in batches(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _save(model_or_state, out: str, **counters) -> None:
    state = model_or_state if isinstance(model_or_state, dict) else model_or_state.state_dict()
    torch.save({k: v.detach().clone() for k, v in state.items()}, out)
    print(json.dumps(counters), flush=True)


def through_step(ps, out: str, optimizer: dict | None = None) -> None:
    """``ps.step()`` after each backward; ``optimizer`` (``{"name": torch.optim class, "args":
    {...}}``): the optimizer this trainer hands the server, as a Horovod user builds it."""
    model = tiny_net()
    opt = None
    if optimizer is not None:
        opt = getattr(torch.optim, optimizer["name"])(model.parameters(), lr=LR, **optimizer["args"])
    model = ps.replica(model, optimizer=opt)
    device = next(model.parameters()).device  # the connection's (connect(device=...)): the batches go there
    for x, y in batches():
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        ps.step()
    _save(model, out, steps=ps.steps, global_step=ps.global_step, lr=ps.lr, staleness=ps.staleness)


def compiled_steps(ps, out: str) -> None:
    """``ps.step()`` with a replica made by ``torch.compile`` (``backend``: the default, inductor)."""
    compiled = torch.compile(tiny_net())
    model = ps.replica(compiled)
    assert model is compiled, type(model)
    for x, y in batches(steps=5):
        nn.functional.cross_entropy(model(x), y).backward()
        ps.step()
    _save(compiled, out, steps=ps.steps, samples=ps.samples)


def through_wrapper(ps, out: str, accumulate: int = 1) -> None:
    """``psserver.DistributedOptimizer``; with ``accumulate`` K, each batch of the reference
    loop goes as K micro-batches (the loss divided by K) and one step."""
    model = ps.replica(tiny_net())
    opt = psserver.DistributedOptimizer(ps, model.named_parameters(), backward_passes_per_step=accumulate)
    for x, y in batches(batch=BATCH * accumulate):
        opt.zero_grad()
        for xm, ym in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
            (nn.functional.cross_entropy(model(xm), ym) / accumulate).backward()
        opt.step()
    _save(model, out, steps=ps.steps, lr=opt.param_groups[0]["lr"], samples=ps.samples)


def through_local_sgd(ps, out: str, every: int = 5, explicit: bool = False, hooked: bool | None = None) -> None:
    """DiLoCo against a server of ``--update diloco``: the loop's own Adam at ``LR`` is the inner
    optimizer, and every ``every`` of its steps sync, through ``ps.local_sgd`` (``hooked``, by
    default when not ``explicit``) and/or the loop's own ``ps.sync()`` (``explicit``)."""
    model = ps.replica(tiny_net())
    inner = optim.Adam(model.parameters(), lr=LR)
    if (not explicit) if hooked is None else hooked:
        ps.local_sgd(inner, every=every)
    outer = []
    for i, (x, y) in enumerate(batches(), start=1):
        inner.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        inner.step()
        if explicit and i % every == 0:
            outer.append(ps.sync())
    _save(model, out, steps=ps.steps, global_step=ps.global_step, samples=ps.samples, outer=outer)


def through_rrefs(ps, out: str) -> None:
    """PyTorch's RPC tutorial loop: RRefs to the server's parameters, ``dist_autograd`` and
    torch's own ``DistributedOptimizer``."""
    rrefs = ps.parameter_rrefs()
    opt = TorchDistributedOptimizer(optim.Adam, rrefs, lr=LR)
    for x, y in batches():
        with dist_autograd.context() as ctx:
            loss = nn.functional.cross_entropy(ps.forward(x), y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
    names = [n for n, _ in tiny_net().named_parameters()]
    _save({n: r.to_here() for n, r in zip(names, rrefs, strict=True)}, out, steps=ps.steps)


def slow_steps(ps, steps: int = 1000, delay: float = 0.05, validate_s: float = 0.0, validate_after: int = 3) -> None:
    """Steps at ``delay`` s each (a trainer to be killed, stopped or signalled mid-loop); after
    ``validate_after`` steps, ``validate_s`` seconds of the loop's own CPU-bound validation."""
    model = ps.replica(tiny_net())
    data = batches(steps=8)
    for i in range(steps):
        x, y = data[i % len(data)]
        nn.functional.cross_entropy(model(x), y).backward()
        ps.step()
        print(f"step {ps.steps} global {ps.global_step}", flush=True)
        if i + 1 == validate_after and validate_s:
            print("validating", flush=True)
            deadline = time.monotonic() + validate_s
            with torch.no_grad():
                while time.monotonic() < deadline:
                    model(torch.randn(256, 8)).argmax(1)
            print("validated", flush=True)
        time.sleep(delay)


def shard_epochs(ps, out: str, epochs: int = 2, samples: int = 256, delay: float = 0.05,
                 record: str = "after") -> None:
    """Epochs over ``ps.sampler`` of a data set of ``samples`` numbered samples, from
    ``ps.epoch`` (a rejoined process continues there): the ids it trains on go to ``out``,
    appended, one line per step, ``after`` its ``ps.step()`` returned (a step made again after
    a rejoin is written once) or ``before`` it (a step that ends in leaving on a signal, which
    the server applied, is written too)."""
    ids = torch.arange(samples)
    data = TensorDataset(torch.randn(samples, 8, generator=torch.Generator().manual_seed(2)), ids % 3, ids)
    model = ps.replica(tiny_net())
    sampler = ps.sampler(data, seed=3)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    for epoch in range(ps.epoch, epochs):
        sampler.set_epoch(epoch)
        for x, y, seen in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            line = json.dumps({"epoch": epoch, "ids": seen.tolist(), "pid": __import__("os").getpid()}) + "\n"
            if record == "before":
                with open(out, "a") as f:
                    f.write(line)
            ps.step()
            if record == "after":
                with open(out, "a") as f:
                    f.write(line)
            time.sleep(delay)
    print(f"done: {ps.steps} steps, resumed {ps.resumed}", flush=True)


def averaged(ps) -> None:
    """Horovod's ``metric_average``: each rank's own number and a tensor of it, averaged over
    the live trainers (printed as one JSON line)."""
    ps.replica(tiny_net())
    rank = ps.rank
    mean = ps.allreduce(float(rank), name="avg_loss")
    total = ps.allreduce(torch.full((2,), rank + 1, dtype=torch.float32), name="counts", op="sum")
    print(json.dumps({"mean": mean, "total": total.tolist(), "dtype": str(total.dtype)}), flush=True)


class DictNet(nn.Module):
    """A Hugging Face style model: its output is a dict (``{"logits": ...}``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.net(x)}


def dict_loss(outputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs["logits"], targets)


def dict_accuracy(outputs: dict[str, torch.Tensor], targets: torch.Tensor) -> float:
    return float((outputs["logits"].argmax(1) == targets).double().mean())


def tiny_splits(samples: int = 96) -> tuple[TensorDataset, TensorDataset]:
    """``(train, held_out)`` of ``tiny_net``'s inputs, for ``psserver train --dataset``."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(samples, 8, generator=g), torch.randint(0, 3, (samples,), generator=g)
    return TensorDataset(x, y), TensorDataset(x[:40], y[:40])


def _number(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv: list[str]) -> int:
    """As a script: ``NAME PORT [reconnect] KEY=VALUE...``, connecting with the library's own
    arguments (rank 0, one shard unless ``$RANK``/``$WORLD_SIZE`` say otherwise)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name, port, *rest = argv
    reconnect = "reconnect" in rest
    kwargs = {k: _number(v) for k, v in (a.split("=", 1) for a in rest if "=" in a)}
    with psserver.connect(f"127.0.0.1:{port}", reconnect=reconnect) as ps:
        globals()[name](ps, **kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
