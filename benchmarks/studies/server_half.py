"""The server's own cost of one trainer-compute step, without RPC: ``--step pushpull``'s
``exchange`` (gradient in, update, flat parameters out) driven in-process, as the endpoint
calls it. Beside the benchmark's measured server CPU per trainer step, the difference is what
the RPC layer costs (receiving and sending the buffers, pickling, dispatch).

    python -m benchmarks server_half --model mnist_cnn --steps 200     # a few seconds
    python -m benchmarks server_half --optimizer sgd --momentum 0.9 --unfused-rounds 5
        # the fused step against torch's default one, in alternating rounds of one run
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

log = logging.getLogger(__name__)


def measure(model: str, steps: int, wire_dtype: str, threads: int, optimizer: dict | None = None,
            fused: bool = True) -> tuple[float, float]:
    """Mean wall and CPU milliseconds per ``exchange`` after a short warm-up (``fused=False``:
    the server's optimizer built as torch builds it by default, for a comparison)."""
    import torch

    from psserver.common.devices import resolve_devices
    from psserver.common.messages import JoinRequest
    from psserver.common.transport import WIRE_DTYPES
    from psserver.config import OptimizerConfig, ServerConfig
    from psserver.server.engine import shard
    from psserver.server.engine.engine import StepEngine
    from psserver.server.steps.pushpull import PushPullServer

    torch.set_num_threads(threads)
    cfg = ServerConfig(model=model, devices=["cpu"], optimizer=OptimizerConfig(**(optimizer or {})))
    fused_names, shard.FUSED = shard.FUSED, shard.FUSED if fused else ()
    try:
        engine = StepEngine(cfg, resolve_devices(cfg.devices))
        engine.agree_optimizer(cfg.optimizer, "t")
    finally:
        shard.FUSED = fused_names
    try:
        engine.trainer_joined("t")
        half = PushPullServer(engine)
        half.join_info("t", JoinRequest(0, "t", "localhost", 0, None, None, "trainer", wire_dtype))
        grads = [torch.randn(s.num_params).to(WIRE_DTYPES[wire_dtype]) for s in engine.shards]
        half.exchange("t", None, 64)
        for _ in range(10):
            half.exchange("t", grads, 64)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            half.exchange("t", grads, 64)
        return (time.perf_counter() - wall) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks server_half", allow_abbrev=False,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mnist_cnn", help="model (default mnist_cnn)")
    parser.add_argument("--steps", type=int, default=200, help="measured exchanges (default 200)")
    parser.add_argument("--wire-dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="default fp32")
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads (default 2)")
    parser.add_argument("--optimizer", choices=("adam", "adamw", "sgd", "adagrad", "rmsprop"), default="adam",
                        help="the server's optimizer (default adam)")
    parser.add_argument("--momentum", type=float, default=0.0, help="sgd and rmsprop (default 0)")
    parser.add_argument("--unfused-rounds", type=int, default=0,
                        help="also measure the optimizer as torch builds it by default (not fused), in this many "
                             "rounds alternating with the server's: the ratio per round (default 0: the server's only)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.threads < 1 or args.unfused_rounds < 0:
        parser.error("--steps and --threads must be >= 1, --unfused-rounds >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    optimizer = {"name": args.optimizer, "momentum": args.momentum}
    what = f"{args.model}, {args.optimizer}, wire {args.wire_dtype}"
    if args.unfused_rounds == 0:
        wall, cpu = measure(args.model, args.steps, args.wire_dtype, args.threads, optimizer)
        log.info("pushpull exchange in-process, %s: %.2f ms wall, %.2f ms CPU per trainer step", what, wall, cpu)
        return 0
    ratios = []
    for r in range(args.unfused_rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        walls = {fused: measure(args.model, args.steps, args.wire_dtype, args.threads, optimizer, fused)[0]
                 for fused in order}
        ratios.append(walls[True] / walls[False])
        log.info("round %d: %s: server's %.2f ms, torch's default %.2f ms per exchange: %.2f", r + 1, what,
                 walls[True], walls[False], ratios[-1])
    log.info("server's / torch's default optimizer step, per exchange: median %.2f over %d rounds",
             statistics.median(ratios), len(ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
