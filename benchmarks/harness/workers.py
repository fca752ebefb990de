"""Child processes of the harness (``python -m benchmarks.harness.workers KIND ...``).

- ``local``: the plain local training loop, the physical ceiling: one process, the same model
  and batch, Adam, synthetic data in memory, torch threads = cores (or ``cuda:0``), the C
  library's allocator unless ``--allocator cached`` (the server's policy). Writes the
  same ``--stats-out`` JSON as ``psserver train`` (``step_ends``: monotonic end of each step).
- ``idle``: a real PS trainer that joins (``psserver.trainer.session.Session``: RPC group,
  ``DistributedOptimizer``, heartbeats) and then waits without stepping until SIGTERM, when
  it leaves cleanly. It is how the harness measures a server with trainers connected and idle.
- ``psserver --channels basic ARGS``: ``psserver ARGS`` with TensorPipe's channels restricted,
  so tensor payloads cross the socket as they do between hosts (see ``run_psserver``).
- ``collective``: ``benchmarks.harness.collective_overhead.measure_ddp`` / ``measure_fsdp`` (psserver's
  own collective loop, no hand-written baseline) in a process the harness can sample and kill.
- ``ddp``: one rank of a DDP job, started by the harness with torchrun's variables (RANK,
  WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), so every rank is a process of its own that the
  harness can throttle: psserver's collective loop (``CollectiveTrainer`` + ``Fit.step``, as
  ``psserver train --mode ddp --compute-threads 1``) for ``--steps`` steps on synthetic data,
  writing the ``--stats-out`` JSON of ``psserver train`` (``step_ends``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path


def run_local(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from psserver.config import DataConfig
    from psserver.data import load_dataset
    from psserver.models import build_model, get_model_spec
    from psserver.utils.memory import configure_host_allocator

    configure_host_allocator(args.allocator)
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    spec = get_model_spec(args.model)
    model = build_model(args.model, seed=0).to(device)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train, _ = load_dataset(DataConfig(dataset="synthetic"), spec.input_shape, spec.num_classes, spec.input_dtype)
    x_all, y_all = train.tensors
    gen = torch.Generator().manual_seed(0)
    bs = args.batch_size
    order = torch.randperm(len(x_all), generator=gen)
    pos = 0
    step_ends: list[float] = []
    t_start = time.monotonic()
    deadline = t_start + args.seconds
    samples = 0
    while time.monotonic() < deadline and (args.max_steps is None or len(step_ends) < args.max_steps):
        if pos + bs > len(order):
            order, pos = torch.randperm(len(x_all), generator=gen), 0
        idx = order[pos:pos + bs]
        pos += bs
        xb, yb = x_all[idx].to(device), y_all[idx].to(device)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        float(loss.detach())  # the PS trainer reads its loss every step too (and it syncs a GPU)
        step_ends.append(time.monotonic())
        samples += len(idx)
    Path(args.stats_out).write_text(json.dumps({
        "rank": 0, "batch_size": bs, "start": t_start, "step_ends": step_ends, "samples": samples,
        "device": str(device), "threads": torch.get_num_threads()}))
    return 0


def run_idle(args: argparse.Namespace) -> int:
    import torch

    from psserver.config import TrainerConfig
    from psserver.trainer.session import Session

    torch.set_num_threads(1)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    host, port = args.server.rsplit(":", 1)
    session = Session(TrainerConfig(rank=args.rank, server_host=host, server_port=int(port),
                                    num_trainers=args.num_trainers, connect_timeout=60.0))
    print(f"idle trainer {args.rank} joined", flush=True)
    try:
        stop.wait(args.max_seconds)
    finally:
        session.leave()
    print(f"idle trainer {args.rank} left", flush=True)
    return 0


def run_collective(args: argparse.Namespace) -> int:
    from benchmarks.harness.collective_overhead import measure_ddp, measure_fsdp

    fn = {"ddp": measure_ddp, "fsdp": measure_fsdp}[args.mode]
    t0 = time.monotonic()
    result = fn(args.model, args.batch_size, args.seconds, args.nproc, baseline=False, window_s=args.window,
                warmup_steps=args.warmup_steps)
    result["started_monotonic"] = t0
    result["ended_monotonic"] = time.monotonic()
    Path(args.out).write_text(json.dumps(result))
    return 0


def run_ddp(args: argparse.Namespace) -> int:
    import torch

    from psserver.collective.launcher import launch
    from psserver.collective.loop import CollectiveTrainer, Fit
    from psserver.config.collective import CollectiveConfig, LaunchConfig
    from psserver.config.common import DataConfig
    from psserver.config.control import ControlConfig

    world = int(os.environ["WORLD_SIZE"])
    config = CollectiveConfig(
        mode="ddp", model=args.model, batch_size=args.batch_size, data=DataConfig(dataset="synthetic"),
        compute_threads=args.threads, progress=False, control=ControlConfig(enabled=False),
        launch=LaunchConfig(master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
                            world_size=world, under_torchrun=True))

    def body(env) -> int:
        fit = Fit(CollectiveTrainer(config, env))
        fit.total = 10**12  # the harness decides when to stop
        x_all, y_all = fit.train_set.tensors
        gen = torch.Generator().manual_seed(1234 + env.rank)
        batches = [torch.randint(0, len(x_all), (args.batch_size,), generator=gen) for _ in range(64)]
        batches = [(x_all[i].contiguous(), y_all[i].contiguous()) for i in batches]
        print(f"ddp rank {env.rank} stepping", flush=True)  # the harness may hold a straggler from here on
        t_start = time.monotonic()
        step_ends: list[float] = []
        for i in range(args.steps):
            fit.step(*batches[i % len(batches)])
            step_ends.append(time.monotonic())
        Path(args.stats_out).write_text(json.dumps({
            "rank": env.rank, "batch_size": args.batch_size, "start": t_start, "step_ends": step_ends,
            "samples": args.steps * args.batch_size, "device": str(env.device), "threads": torch.get_num_threads(),
            "pid": os.getpid()}))
        return 0

    code = launch(config, body)
    # As psserver's own spawned workers do: no interpreter teardown racing gloo's threads.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_psserver(argv: list[str]) -> int:
    """``psserver ARGS`` with options of the harness first, then ``--``:

    - ``--channels basic,...``: TensorPipe's channels restricted. On one host TensorPipe moves
      tensor payloads with the ``cma`` channel (``process_vm_readv``), outside any socket;
      ``basic`` sends them through the uv connection as it must between hosts, so ``ss`` sees
      every byte. Only the server needs it: a pair uses the channels both sides offer.
    - ``--join-token T``: ``PSSERVER_JOIN_TOKEN=T`` (``-token`` setups).
    - ``--no-allowlist``: the RPC layer's own unpickler, as without psserver's allowlist (``-open`` setups,
      the baseline of what the protections cost). Never a psserver option.
    """
    usage = ("usage: python -m benchmarks.harness.workers psserver [--channels C] [--join-token T] [--no-allowlist] "
             "-- ARGS")
    channels: list[str] | None = None
    while argv and argv[0] != "--":
        if argv[0] == "--channels" and len(argv) > 1:
            channels, argv = [c for c in argv[1].split(",") if c], argv[2:]
        elif argv[0] == "--join-token" and len(argv) > 1:
            os.environ["PSSERVER_JOIN_TOKEN"], argv = argv[1], argv[2:]
        elif argv[0] == "--no-allowlist":
            from psserver.common import torch_rpc

            torch_rpc.restrict_unpickler = lambda: None
            argv = argv[1:]
        elif argv[0].startswith("--") and argv[0] in ("--channels", "--join-token"):
            sys.exit(usage)  # an option without its value
        else:
            break  # psserver's own arguments, without the "--"
    rest = argv[1:] if argv and argv[0] == "--" else argv
    if not rest:
        sys.exit(usage)
    if channels:
        import torch.distributed.rpc as rpc

        base = rpc.TensorPipeRpcBackendOptions

        class ChannelOptions(base):  # whatever else psserver passes is kept
            def __init__(self, *a, **kw):
                if kw.get("_channels") is None:  # psserver passes its own (PSSERVER_TP_CHANNELS), None by default
                    kw["_channels"] = channels
                super().__init__(*a, **kw)

        rpc.TensorPipeRpcBackendOptions = ChannelOptions
    from psserver.cli import main as psserver_main

    return psserver_main(rest)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "psserver":
        return run_psserver(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness.workers")
    sub = p.add_subparsers(dest="kind", required=True)
    lo = sub.add_parser("local", help="plain local training loop")
    lo.add_argument("--model", default="mnist_cnn")
    lo.add_argument("--batch-size", type=int, default=64)
    lo.add_argument("--seconds", type=float, required=True)
    lo.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (or --seconds)")
    lo.add_argument("--threads", type=int, default=0, help="torch threads (default: cores)")
    lo.add_argument("--allocator", choices=["system", "cached"], default="system",
                    help="host allocator policy (psserver.utils.memory; default: the C library's)")
    lo.add_argument("--device", default=None, help="default: cuda:0 when present, else cpu")
    lo.add_argument("--stats-out", required=True)
    idle = sub.add_parser("idle", help="a PS trainer that joins and waits")
    idle.add_argument("--server", required=True, help="HOST:PORT")
    idle.add_argument("--rank", type=int, required=True)
    idle.add_argument("--num-trainers", type=int, default=None)
    idle.add_argument("--max-seconds", type=float, default=600.0)
    co = sub.add_parser("collective", help="DDP / FSDP through benchmarks.harness.collective_overhead")
    co.add_argument("--mode", choices=["ddp", "fsdp"], required=True)
    co.add_argument("--model", default="mnist_cnn")
    co.add_argument("--batch-size", type=int, default=64)
    co.add_argument("--nproc", type=int, default=2)
    co.add_argument("--seconds", type=float, required=True)
    co.add_argument("--window", type=float, default=2.0)
    co.add_argument("--warmup-steps", type=int, default=5)
    co.add_argument("--out", required=True)
    dd = sub.add_parser("ddp", help="one DDP rank (torchrun's variables), step ends recorded")
    dd.add_argument("--model", default="mnist_cnn")
    dd.add_argument("--batch-size", type=int, default=64)
    dd.add_argument("--steps", type=int, required=True)
    dd.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    dd.add_argument("--stats-out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return {"local": run_local, "idle": run_idle, "collective": run_collective, "ddp": run_ddp}[args.kind](args)


if __name__ == "__main__":
    sys.exit(main())
