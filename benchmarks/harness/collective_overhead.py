"""Overhead of psserver's collective path against a hand-written loop, measured in one run.

    python -m benchmarks collective_overhead --quick          # ~1 minute on 2 cores
    python -m benchmarks collective_overhead --seconds 60 --nproc 2 --model mnist_cnn

Each of ``nproc`` gloo/NCCL workers holds two copies of the same model with the same initial
weights: one set up by psserver (``CollectiveTrainer`` + the loop's per-step bookkeeping,
``Fit.step``: status, loss batching, the sync all-gather every 10 steps) and one wrapped by
hand (``DistributedDataParallel(model)``, Adam, ``zero_grad/forward/backward/step``). They
take turns in short windows (alternating which goes first), on the same in-memory batches.
Samples/s is the median window of each; the overhead is the median over adjacent window
pairs of ``1 - psserver / hand-written``, so load from other processes hits both alike
(the ratio of the medians and of the best windows are reported too).

Bytes per step are an estimate from the gradient size and the algorithm, per rank, sent:
DDP's ring all-reduce sends ``2 (N-1)/N x G`` (``G`` = gradient bytes, halved by the
fp16/bf16 hooks); FSDP sends ``(N-1)/N x P`` per parameter all-gather (one in forward, one
more in backward when it reshards after forward) plus ``(N-1)/N x G`` for the gradient
reduce-scatter. The sync all-gather of the loop (48 bytes per rank every 10 steps) is
negligible and left out.

``measure_ddp`` and ``measure_fsdp`` are the functions a harness (``benchmarks/studies/throughput.py``)
calls; both return plain dicts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

log = logging.getLogger(__name__)

DEFAULT_OUT = Path("benchmarks/results/collective_overhead.json")


def estimate_bytes_per_step(mode: str, num_params: int, world: int, *, hook: str = "none",
                            reshard_after_forward: bool = True, param_bytes: int = 4) -> int:
    """Bytes each rank sends per step (see the module docstring for the model)."""
    if world <= 1:
        return 0
    frac = (world - 1) / world
    grad = num_params * param_bytes
    if mode == "ddp":
        if hook in ("fp16", "bf16"):
            grad //= 2
        return int(2 * frac * grad)
    gathers = 2 if reshard_after_forward else 1
    return int(gathers * frac * num_params * param_bytes + frac * grad)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


class _HandWritten:
    """The plain DDP (or FSDP2) loop people write by hand."""

    def __init__(self, mode: str, model_name: str, seed: int, device: torch.device, lr: float) -> None:
        from psserver.models import build_model

        model = build_model(model_name, seed).to(device)
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            for block in model.children():
                if any(True for _ in block.parameters()):
                    fully_shard(block, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.device = device

    def step(self, xb: torch.Tensor, yb: torch.Tensor) -> None:
        xb, yb = xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True)
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(xb), yb)
        loss.backward()
        self.opt.step()


def _worker(env, config, spec: dict[str, Any]) -> int:
    """Runs in every rank (through psserver's own launcher); rank 0 writes the result file."""
    from psserver.collective.loop import CollectiveTrainer, Fit

    trainer = CollectiveTrainer(config, env)
    fit = Fit(trainer)
    fit.total = 10**12  # the benchmark decides when to stop
    hand = _HandWritten(config.mode, config.model, config.seed, env.device, config.optimizer.lr) \
        if spec["baseline"] else None
    x_all, y_all = fit.train_set.tensors
    bs = config.batch_size
    gen = torch.Generator().manual_seed(1234 + env.rank)
    n_batches = 64
    batches = [torch.randint(0, len(x_all), (bs,), generator=gen) for _ in range(n_batches)]
    batches = [(x_all[i].contiguous(), y_all[i].contiguous()) for i in batches]
    cursor = [0]

    def next_batch():
        b = batches[cursor[0] % n_batches]
        cursor[0] += 1
        return b

    runners = {"psserver": lambda xb, yb: fit.step(xb, yb)}
    if hand is not None:
        runners["hand-written"] = hand.step

    def sync() -> None:
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    # Warm up both, then size the windows from the measured step time (same on every rank).
    for _ in range(spec["warmup_steps"]):
        for run in runners.values():
            run(*next_batch())
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        runners["psserver"](*next_batch())
    sync()
    step_s = torch.tensor([(time.perf_counter() - t0) / 5], dtype=torch.float64, device=env.device)
    dist.broadcast(step_s, 0)
    window_steps = max(10, int(spec["window_s"] / max(float(step_s), 1e-4)))
    window_steps = (window_steps + 9) // 10 * 10  # whole sync periods
    reps = max(1, int(spec["seconds"] / (spec["window_s"] * len(runners))))

    rates: dict[str, list[float]] = {k: [] for k in runners}
    lat: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}  # rank 0's CPU seconds per step
    names = list(runners)
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            run = runners[name]
            sync()
            start, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(window_steps):
                t = time.perf_counter()
                run(*next_batch())
                lat[name].append(time.perf_counter() - t)
            sync()
            rates[name].append(window_steps * bs * fit.strategy.dp_size / (time.perf_counter() - start))
            cpu[name].append((time.process_time() - cpu0) / window_steps)
    rss_kb = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss], dtype=torch.float64,
                          device=env.device)
    all_rss = [torch.zeros_like(rss_kb) for _ in range(env.world_size)]
    dist.all_gather(all_rss, rss_kb)
    if env.rank == 0:
        out = {}
        for name in names:
            out[name] = {
                "samples_per_s": statistics.median(rates[name]),
                "samples_per_s_windows": rates[name],
                "step_latency_p50_ms": 1e3 * _percentile(lat[name], 0.50),
                "step_latency_p95_ms": 1e3 * _percentile(lat[name], 0.95),
                "cpu_ms_per_step": 1e3 * statistics.median(cpu[name]),
            }
        result = {
            "mode": config.mode,
            "model": config.model,
            "batch_size": bs,
            "nproc": env.world_size,
            "backend": env.backend,
            "device": str(env.device),
            "windows": reps,
            "window_steps": window_steps,
            "num_params": trainer.num_params,
            "bytes_per_step_estimate": estimate_bytes_per_step(
                config.mode, trainer.num_params, env.world_size, hook=config.ddp.comm_hook,
                reshard_after_forward=config.fsdp.reshard_after_forward),
            "peak_rss_mb_per_process": [float(r) / 1024 for r in torch.stack(all_rss).flatten().tolist()],
            "variants": out,
        }
        if "hand-written" in out:
            # Paired: each psserver window against the hand-written window next to it in time,
            # so load from other processes cancels out; median of the pairs.
            pairs = [1 - a / b for a, b in zip(rates["psserver"], rates["hand-written"], strict=True)]
            result["overhead_pct"] = 100.0 * statistics.median(pairs)
            result["overhead_pct_of_medians"] = 100.0 * (1 - out["psserver"]["samples_per_s"] /
                                                         out["hand-written"]["samples_per_s"])
            result["overhead_pct_best_windows"] = 100.0 * (1 - max(rates["psserver"]) / max(rates["hand-written"]))
        Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


def _measure(mode: str, model: str, batch_size: int, seconds: float, nproc: int, *, baseline: bool,
             window_s: float = 1.0, warmup_steps: int = 5, extra: dict[str, Any] | None = None) -> dict:
    import functools
    import tempfile

    from psserver.collective.launcher import launch
    from psserver.config.collective import CollectiveConfig, DDPOptions, FSDPOptions, LaunchConfig
    from psserver.config.common import DataConfig
    from psserver.config.control import ControlConfig

    extra = dict(extra or {})
    fsdp_opts = FSDPOptions(**extra.pop("fsdp", {})) if mode == "fsdp" else FSDPOptions()
    ddp_opts = DDPOptions(**extra.pop("ddp", {})) if mode == "ddp" else DDPOptions()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        config = CollectiveConfig(
            mode=mode, model=model, batch_size=batch_size, data=DataConfig(dataset="synthetic"),
            launch=LaunchConfig(nproc_per_node=nproc, master_port=0, world_size=nproc),
            ddp=ddp_opts, fsdp=fsdp_opts, control=ControlConfig(enabled=False), progress=False, **extra,
        )
        spec = {"baseline": baseline, "seconds": seconds, "window_s": window_s, "warmup_steps": warmup_steps,
                "result_path": result_path}
        code = launch(config, functools.partial(_worker, config=config, spec=spec))
        if code:
            raise RuntimeError(f"benchmark workers failed with exit code {code}")
        return json.loads(Path(result_path).read_text())


def measure_ddp(model: str = "mnist_cnn", batch_size: int = 64, seconds: float = 20.0, nproc: int = 2,
                *, baseline: bool = True, **kwargs: Any) -> dict:
    """psserver DDP (and, with ``baseline``, a hand-written DDP loop) in one run.

    Returns ``variants[name]`` with samples/s (median window), step latency p50/p95 (ms);
    ``bytes_per_step_estimate``, ``peak_rss_mb_per_process`` and ``overhead_pct``.
    ``kwargs``: ``window_s``, ``warmup_steps``, ``extra={"ddp": {"comm_hook": "fp16"}}``.
    """
    return _measure("ddp", model, batch_size, seconds, nproc, baseline=baseline, **kwargs)


def measure_fsdp(model: str = "mnist_cnn", batch_size: int = 64, seconds: float = 20.0, nproc: int = 2,
                 *, baseline: bool = True, **kwargs: Any) -> dict:
    """psserver FSDP2 (and a hand-written ``fully_shard`` loop); same result shape as :func:`measure_ddp`."""
    return _measure("fsdp", model, batch_size, seconds, nproc, baseline=baseline, **kwargs)


def _table(results: list[dict]) -> str:
    rows = [("mode", "variant", "samples/s", "p50 ms", "p95 ms", "CPU ms/step", "MB/step sent", "peak RSS MB",
             "overhead (paired / medians / best)")]
    for r in results:
        for name, v in r["variants"].items():
            rows.append((r["mode"], name, f"{v['samples_per_s']:.0f}", f"{v['step_latency_p50_ms']:.1f}",
                         f"{v['step_latency_p95_ms']:.1f}", f"{v['cpu_ms_per_step']:.1f}",
                         f"{r['bytes_per_step_estimate'] / 1e6:.2f}",
                         "/".join(f"{m:.0f}" for m in r["peak_rss_mb_per_process"]),
                         f"{r['overhead_pct']:+.1f}% / {r['overhead_pct_of_medians']:+.1f}% / "
                         f"{r['overhead_pct_best_windows']:+.1f}%"
                         if name == "psserver" and "overhead_pct" in r else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks collective_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short windows (about a minute in all)")
    p.add_argument("--model", default="mnist_cnn")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seconds", type=float, default=None, help="measuring time per mode (default 40, quick 20)")
    p.add_argument("--window", type=float, default=None, help="seconds per window (default 2, quick 1)")
    p.add_argument("--modes", default="ddp,fsdp", help="comma-separated: ddp, fsdp")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    seconds = args.seconds or (20.0 if args.quick else 40.0)
    window = args.window or (1.0 if args.quick else 2.0)
    results = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        fn = {"ddp": measure_ddp, "fsdp": measure_fsdp}[mode]
        results.append(fn(args.model, args.batch_size, seconds, args.nproc, window_s=window))
    print(_table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"time": time.time(), "torch": torch.__version__, "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
