"""Online-serving shape: a reader answers embedding-row lookups while the recommendation example
trains, each lookup the rows as the server holds them at that moment.

    openssl rand -hex 16 > read.token && chmod 600 read.token
    psserver serve --port 29500 --control-port 50051 --model dlrm_tiny --embedding-optimizer lazy_adam \\
        --embedding-lr 0.01 --lr 0.003 --read-token-file read.token
    python examples/recommendation.py --rank 0 --num-trainers 1 &
    python examples/serving_rows.py --read-token-file read.token --seconds 30

Requests are the ids of held-out clicks (the recommendation example's click log), ``--batch``
ids of every table per request, as a ranking service would look up a page of candidates. It
prints ``served N requests (B ids of T tables each): p50 X ms, p99 Y ms, R requests/s, at global
steps A to B``; and whether the rows of the first request changed while it served (they do
while training runs: the reads are fresh).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import psserver
from psserver.data.clicks import ClickLogSpec, make_click_log

TABLES = ("c0", "c1", "c2", "c3")  # dlrm_tiny's tables, one per id field of the click log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--control", default=None, help="the server's control plane HOST:PORT (default 127.0.0.1:50051)")
    p.add_argument("--read-token-file", default=None)
    p.add_argument("--seconds", type=float, default=30.0, help="serve for this long")
    p.add_argument("--batch", type=int, default=64, help="ids of each table per request")
    args = p.parse_args()

    ids = make_click_log(ClickLogSpec(vocab=5000, id_space=1 << 40), 20_000, sample_seed=99).tensors[0]
    latencies, steps = [], []
    with psserver.read(args.control, token_file=args.read_token_file, name="serving") as reader:
        first = [reader.rows(t, ids[: args.batch, i]).values for i, t in enumerate(TABLES)]
        end = time.monotonic() + args.seconds
        n = 0
        while time.monotonic() < end:
            batch = ids[(n * args.batch) % (len(ids) - args.batch):][: args.batch]
            t0 = time.perf_counter()
            for i, table in enumerate(TABLES):
                steps.append(reader.rows(table, batch[:, i]).step)
            latencies.append(time.perf_counter() - t0)
            n += 1
        last = [reader.rows(t, ids[: args.batch, i]).values for i, t in enumerate(TABLES)]
    ms = sorted(x * 1e3 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    print(f"served {n} requests ({args.batch} ids of {len(TABLES)} tables each): p50 {statistics.median(ms):.2f} ms, "
          f"p99 {p99:.2f} ms, {n / args.seconds:.0f} requests/s, at global steps {steps[0]} to {steps[-1]}",
          flush=True)
    changed = any(not torch.equal(a, b) for a, b in zip(first, last, strict=True))
    print(f"rows changed while serving: {'yes' if changed else 'no'}", flush=True)


if __name__ == "__main__":
    main()
