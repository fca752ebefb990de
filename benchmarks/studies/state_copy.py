"""What a host copy of a GPU server's state would cost per update, beside what an update costs.

The state in memory (``--state-dir``) outlives a server process because its tensors *are* a
file on a memory filesystem: every update writes there in place, no copy. A shard on a GPU
lives in device memory, which dies with its process; the same guarantee would need the whole
state (parameters, buffers, optimizer moments) copied to that file after every update, before
the reply. This measures that copy, into pageable and into page-locked (``cudaHostRegister``)
file pages, beside the server's own exchange (``--step pushpull``: gradient in, update, flat
parameters out) and a local training step on the same device, in paired rounds (each round
times every leg, in a rotating order), so the choice rests on ratios of one run.

    python -m benchmarks state_copy --model resnet18 --batch-size 32 --device cuda:0
    python -m benchmarks state_copy --model mnist_cnn --device cpu --rounds 3   # the tool itself
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.report import write_result

log = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parents[1] / "results" / "state-copy"
LEGS = ("local_step", "exchange", "copy_pageable", "copy_registered")
"""What each round times, per step: a local loop's forward, backward and optimizer step; the
server's exchange; the state copied to the host file (pageable pages; page-locked pages, CUDA
only)."""


class HostCopy:
    """A state file on a memory filesystem, laid out as the state in memory lays it out, and
    the copy of ``tensors`` into it that one update would need."""

    def __init__(self, directory: Path, name: str, tensors: list, *, register: bool) -> None:
        import torch

        from psserver.server.state.arena import HEADER_BYTES, Arena, Journal, Slot

        self.tensors = tensors
        self.device = tensors[0].device
        self.arena, slots = Arena.create(directory / name, [t.detach().to("cpu", copy=True) for t in tensors],
                                         Journal(generation=1, begin=0, end=0, global_step=0, samples=0))
        self.views = [self.arena.view(s) for s in slots]
        self._payload = self.arena.view(Slot(HEADER_BYTES, "uint8", (self.arena.size - HEADER_BYTES,)))
        self.registered = False
        if register:
            rc = torch.cuda.cudart().cudaHostRegister(self._payload.data_ptr(), self._payload.numel(), 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {rc}")
            self.registered = True
        self.seq = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def copy(self) -> None:
        """One update's copy: the journal opened, every tensor copied, the device drained, closed."""
        import torch

        self.seq += 1
        self.arena.begin(self.seq, self.seq, self.seq, [])
        with torch.no_grad():
            for view, t in zip(self.views, self.tensors, strict=True):
                view.copy_(t, non_blocking=self.registered)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.arena.end(self.seq, self.seq, self.seq)

    def close(self) -> None:
        import torch

        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self._payload.data_ptr())
            self.registered = False
        self.views = []
        self._payload = None


def _timed(fn: Callable[[], None], steps: int, device) -> float:
    """Milliseconds per call of ``fn``, the device drained before and after."""
    import torch

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / steps * 1e3


def run(model: str, device_name: str, batch_size: int, rounds: int, steps: int, directory: Path) -> dict:
    """Every leg's milliseconds per step in each round, and the state's size."""
    import torch
    import torch.nn.functional as F

    from psserver.common.messages import JoinRequest
    from psserver.config import OptimizerConfig, ServerConfig
    from psserver.models import build_model, get_model_spec
    from psserver.server.engine.engine import StepEngine
    from psserver.server.state.memory import state_layout
    from psserver.server.steps.pushpull import PushPullServer

    device = torch.device(device_name)
    spec = get_model_spec(model, {})
    if spec.input_shape is None or not spec.input_dtype.is_floating_point or not spec.num_classes:
        raise ValueError(f"model {model!r} has no fixed image-like input; choose a classifier such as resnet18")
    optimizer = OptimizerConfig()  # the server's default, Adam
    cfg = ServerConfig(model=model, devices=[device_name], optimizer=optimizer)
    engine = StepEngine(cfg, [device])
    copies: list[HostCopy] = []
    try:
        engine.trainer_joined("t")
        half = PushPullServer(engine)
        transport = "device-map" if device.type == "cuda" else "cpu"
        half.join_info("t", JoinRequest(0, "t", "localhost", 0, None, None, "trainer", device=device_name,
                                        transport=transport))
        grads = [torch.randn(s.num_params, device=device) * 1e-3 for s in engine.shards]
        half.exchange("t", None, batch_size)
        for _ in range(3):  # the optimizer's state exists from its first step on
            half.exchange("t", grads, batch_size)
        tensors = state_layout(engine.live_state()[0])[1]
        copies.append(HostCopy(directory, "pageable", tensors, register=False))
        if device.type == "cuda":
            copies.append(HostCopy(directory, "registered", tensors, register=True))

        local = build_model(spec, 0).to(device)
        opt = torch.optim.Adam(local.parameters(), lr=optimizer.lr, fused=device.type == "cuda" or None)
        x = torch.randn(batch_size, *spec.input_shape, device=device)
        y = torch.randint(0, spec.num_classes, (batch_size,), device=device)

        def local_step() -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(local(x), y).backward()
            opt.step()

        legs: dict[str, Callable[[], None]] = {"local_step": local_step,
                                               "exchange": lambda: half.exchange("t", grads, batch_size)}
        for c in copies:
            legs[f"copy_{c.arena.path.name}"] = c.copy
        for fn in legs.values():  # warm-up: kernels chosen, pages touched
            _timed(fn, 3, device)
        names = list(legs)
        per_round: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                per_round[n].append(_timed(legs[n], steps, device))
            log.info("round %d/%d: %s", r + 1, rounds, ", ".join(f"{n} {per_round[n][-1]:.2f} ms" for n in names))
        return {"per_round_ms": per_round, "state_bytes": copies[0].nbytes, "state_tensors": len(tensors),
                "params": engine.num_params}
    finally:
        for c in copies:
            c.close()
        engine.close()


def summarize(measured: dict) -> dict:
    """Medians per leg, and each copy as a fraction of the local step and of the exchange (per
    round, then the median: the rounds are paired)."""
    ms = measured["per_round_ms"]
    out: dict[str, Any] = {"median_ms": {n: statistics.median(v) for n, v in ms.items()}}
    for leg in ("copy_pageable", "copy_registered"):
        if leg in ms:
            for base in ("local_step", "exchange"):
                out[f"{leg}_x_{base}"] = statistics.median(c / b for c, b in zip(ms[leg], ms[base], strict=True))
            out[f"{leg}_gb_per_s"] = measured["state_bytes"] / (out["median_ms"][leg] / 1e3) / 1e9
    return out


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [f"# A host copy of the server's state per update ({result['model']} b{result['batch_size']}, "
             f"{result['device']})", "",
             f"`{result['command']}` ({result['time']}; {result['device_name']}; {result['cores']} cores, load average "
             f"{result['load_avg_before'][0]:.2f} before, {result['load_avg_after'][0]:.2f} after; {result['rounds']} "
             f"paired rounds of {result['steps']} steps)", "",
             f"State: {result['state_bytes'] / 1e6:.1f} MB in {result['state_tensors']} tensors "
             f"({result['params']:,} parameters, Adam).", "",
             "| per step | median ms | x local step | x exchange | GB/s |", "|---|---|---|---|---|"]
    for leg in LEGS:
        if leg not in s["median_ms"]:
            continue
        row = f"| {leg.replace('_', ' ')} | {s['median_ms'][leg]:.2f} |"
        if leg.startswith("copy"):
            row += f" {s[f'{leg}_x_local_step']:.3f} | {s[f'{leg}_x_exchange']:.3f} | {s[f'{leg}_gb_per_s']:.1f} |"
        else:
            row += " | | |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks state_copy", allow_abbrev=False,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", help="model (default resnet18)")
    parser.add_argument("--batch-size", type=int, default=32, help="the local step's batch (default 32)")
    parser.add_argument("--device", default=None, help="default cuda:0 where CUDA is, else cpu")
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds (default 5)")
    parser.add_argument("--steps", type=int, default=50, help="steps of each leg per round (default 50)")
    parser.add_argument("--state-dir", type=Path, default=Path("/dev/shm"),
                        help="the memory filesystem the state files go to (default /dev/shm)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help=f"default {RESULTS}")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.rounds, args.steps) < 1:
        parser.error("--batch-size, --rounds and --steps must be >= 1")
    if not args.state_dir.is_dir():
        parser.error(f"--state-dir {args.state_dir}: not a directory")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        parser.error(f"--device {device!r}: not a device (cpu, cuda:N)")
    if kind not in ("cpu", "cuda"):
        parser.error(f"--device {device}: cpu or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: CUDA is not available here")
    load_before = os.getloadavg()
    directory = Path(tempfile.mkdtemp(prefix="psserver-state-copy-", dir=args.state_dir))
    try:
        measured = run(args.model, device, args.batch_size, args.rounds, args.steps, directory)
    except ValueError as e:
        parser.error(str(e))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {"model": args.model, "batch_size": args.batch_size, "device": device,
              "device_name": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU",
              "rounds": args.rounds, "steps": args.steps, "cores": os.cpu_count(), "load_avg_before": load_before,
              "load_avg_after": os.getloadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": (f"python -m benchmarks state_copy --model {args.model} --batch-size {args.batch_size} "
                          f"--device {device} --rounds {args.rounds} --steps {args.steps}"),
              **{k: measured[k] for k in ("state_bytes", "state_tensors", "params", "per_round_ms")},
              "summary": summarize(measured)}
    stem = f"state-copy-{args.model}-b{args.batch_size}-{device.replace(':', '')}"
    md = write_result(args.results_dir / stem, result, "state_copy", markdown)
    log.info("%s", md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
