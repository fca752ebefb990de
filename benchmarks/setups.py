"""Setup names of the harness (``local``, ``ps-chained-async-2``, ``ddp-2``, ...) and the
command line of the PS server every PS setup trains against."""

from __future__ import annotations

import re

from benchmarks import measure


def parse_setup(name: str) -> dict:
    if name == "local":  # torch threads = cores, as the issue defines the ceiling
        return {"name": name, "kind": "local", "trainers": 1, "update": None, "threads": 0, "allocator": "system"}
    if name == "local-cached":  # the server's host allocator policy (psserver serve --allocator cached)
        return {"name": name, "kind": "local", "trainers": 1, "update": None, "threads": 0, "allocator": "cached"}
    m = re.fullmatch(r"local-(\d+)t", name)
    if m:  # fewer threads: on a loaded machine one thread can beat all cores (OpenMP barriers)
        return {"name": name, "kind": "local", "trainers": 1, "update": None, "threads": int(m.group(1)),
                "allocator": "system"}
    m = re.fullmatch(r"ps-(?:(chained|pull|pushpull)-)?(async|sync)-(\d+)", name)
    if m:  # the trainer's --step (psserver.config.ps.STEP_MODES); plain, the reference, when not named
        return {"name": name, "kind": "ps", "trainers": int(m.group(3)), "update": m.group(2),
                "step": m.group(1) or "plain"}
    m = re.fullmatch(r"(ddp|fsdp)-(\d+)", name)
    if m:
        return {"name": name, "kind": m.group(1), "trainers": int(m.group(2)), "update": None}
    raise ValueError(f"unknown setup {name!r}: use local, local-Nt, local-cached, "
                     "ps-[chained-|pull-|pushpull-]async-N, ps-[chained-|pull-|pushpull-]sync-N, ddp-N, fsdp-N")


def parse_setups(names: str) -> list[dict]:
    """A comma-separated list of setup names, each once."""
    out = [parse_setup(n.strip()) for n in names.split(",") if n.strip()]
    seen = [s["name"] for s in out]
    dup = sorted({n for n in seen if seen.count(n) > 1})
    if dup:
        raise ValueError(f"setup named twice: {', '.join(dup)}")
    if not out:
        raise ValueError("no setup named")
    return out


def server_argv(setup: dict, *, model: str, port: int, devices: str | None, tp_channels: str) -> list[str]:
    """``psserver serve`` for a PS setup: 127.0.0.1, no control plane, the setup's update mode.

    ``tp_channels`` other than ``default`` restricts TensorPipe's channels (``basic``: tensors
    cross the socket as between hosts, so ``ss`` counts them; see ``benchmarks.workers``)."""
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--model", model, "--update", setup["update"],
            "--sync-trainers", str(setup["trainers"]), "--no-control"]
    if devices:
        argv += ["--devices", devices]
    if tp_channels != "default":
        return measure.worker_argv("psserver", "--channels", tp_channels, "--", *argv)
    return measure.psserver_argv(*argv)


def trainer_argv(setup: dict, rank: int, *, port: int, batch_size: int, steps: int, stats_out: str) -> list[str]:
    """``psserver train`` for rank ``rank`` of a PS setup: synthetic data, ``steps`` steps."""
    return measure.psserver_argv(
        "train", "--server", f"127.0.0.1:{port}", "--rank", str(rank), "--num-trainers", str(setup["trainers"]),
        "--epochs", "1000000", "--batch-size", str(batch_size), "--max-steps", str(steps), "--dataset", "synthetic",
        "--no-progress", "--stats-out", stats_out, "--step", setup["step"])


def local_argv(setup: dict, *, model: str, batch_size: int, seconds: float, stats_out: str,
               steps: int | None = None) -> list[str]:
    """The local loop of a ``local*`` setup, for ``seconds`` (or ``steps`` steps, whichever ends first)."""
    argv = ["local", "--model", model, "--batch-size", str(batch_size), "--seconds", f"{seconds:.2f}", "--threads",
            str(setup["threads"]), "--allocator", setup["allocator"], "--stats-out", stats_out]
    if steps is not None:
        argv += ["--max-steps", str(steps)]
    return measure.worker_argv(*argv)
