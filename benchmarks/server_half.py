"""The server's own cost of one trainer-compute step, without RPC: ``--step pushpull``'s
``exchange`` (gradient in, update, flat parameters out) driven in-process, as the endpoint
calls it. Beside the benchmark's measured server CPU per trainer step, the difference is what
the RPC layer costs (receiving and sending the buffers, pickling, dispatch).

    python -m benchmarks.server_half --model mnist_cnn --steps 200     # a few seconds
"""

from __future__ import annotations

import argparse
import logging
import time

log = logging.getLogger(__name__)


def measure(model: str, steps: int, wire_dtype: str, threads: int) -> tuple[float, float]:
    """Mean wall and CPU milliseconds per ``exchange`` after a short warm-up."""
    import torch

    from psserver.config import OptimizerConfig, ServerConfig
    from psserver.ps.engine.devices import resolve_devices
    from psserver.ps.engine.engine import StepEngine
    from psserver.ps.protocols.pushpull import PushPullServer
    from psserver.ps.protocols.trainer_compute import WIRE_DTYPES
    from psserver.ps.rpc.messages import JoinRequest

    torch.set_num_threads(threads)
    cfg = ServerConfig(model=model, devices=["cpu"], optimizer=OptimizerConfig())
    engine = StepEngine(cfg, resolve_devices(cfg.devices))
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
    parser = argparse.ArgumentParser(prog="python -m benchmarks.server_half", allow_abbrev=False,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mnist_cnn", help="model (default mnist_cnn)")
    parser.add_argument("--steps", type=int, default=200, help="measured exchanges (default 200)")
    parser.add_argument("--wire-dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="default fp32")
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads (default 2)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        parser.error("--steps and --threads must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    wall, cpu = measure(args.model, args.steps, args.wire_dtype, args.threads)
    log.info("pushpull exchange in-process, %s, wire %s: %.2f ms wall, %.2f ms CPU per trainer step",
             args.model, args.wire_dtype, wall, cpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
