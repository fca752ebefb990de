"""What the RPC allow-list costs per message: torch's own unpickling against psserver's
restricted one (``psserver.common.torch_rpc.restrict_unpickler``), in-process, in paired rounds.

The messages are those of a ``pushpull`` step: the trainer's call (``calls.call`` of
``exchange`` with the flat gradient) read by the server, and the server's reply (the flat
parameters and the notices) read by the trainer. Each round times both unpicklers over the same
messages, alternating which goes first; the ratio is taken per round, then the median.

    python -m benchmarks allowlist_cost [--model mnist_cnn] [--rounds 9] [--reps 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed.rpc.internal as rpc_internal

from psserver.common import calls, rpc_allowlist, torch_rpc
from psserver.models import build_model


def messages(model: str) -> list[tuple[bytes, list[torch.Tensor]]]:
    flat = torch.cat([p.detach().reshape(-1) for p in build_model(model).parameters()])
    pickler = rpc_internal._internal_rpc_pickler
    call = rpc_internal.PythonUDF(calls.call, ("trainer_0_1", "exchange", [flat.clone()], 64), {})
    reply = ([flat.clone()], ["notice"])
    return [pickler.serialize(call), pickler.serialize(reply)]


def time_per_message(deserialize, msgs, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        for data, tensors in msgs:
            deserialize(data, tensors)
    return (time.perf_counter() - t0) / (reps * len(msgs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks allowlist_cost", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mnist_cnn")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--reps", type=int, default=2000, help="messages of each kind per timing (default 2000)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    msgs = messages(args.model)
    original = rpc_internal._InternalRPCPickler.deserialize.__get__(rpc_internal._internal_rpc_pickler)
    restricted = torch_rpc._restricted_deserialize
    for fn in (original, restricted):  # both read what they should
        call, reply = (fn(d, t) for d, t in msgs)
        assert call.func is calls.call and torch.equal(reply[0][0], msgs[1][1][0])
    before = dict(rpc_allowlist.refused_counts())
    rows = []
    for r in range(args.rounds):
        order = [("torch", original), ("psserver", restricted)]
        if r % 2:
            order.reverse()
        t = {name: time_per_message(fn, msgs, args.reps) for name, fn in order}
        rows.append({"torch_us": t["torch"] * 1e6, "psserver_us": t["psserver"] * 1e6,
                     "extra_us": (t["psserver"] - t["torch"]) * 1e6})
    assert rpc_allowlist.refused_counts() == before, "a pushpull message was refused"
    extra = statistics.median(r["extra_us"] for r in rows)
    out = {"model": args.model, "rounds": rows, "median_torch_us": statistics.median(r["torch_us"] for r in rows),
           "median_psserver_us": statistics.median(r["psserver_us"] for r in rows), "median_extra_us": extra,
           "extra_per_step_us": 2 * extra}
    json.dump(out, sys.stdout, indent=1)
    print(f"\nper message: torch {out['median_torch_us']:.1f} us, psserver {out['median_psserver_us']:.1f} us "
          f"(+{extra:.1f} us); a pushpull step reads 2 messages (one per side): +{2 * extra:.1f} us per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
