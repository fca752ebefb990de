"""Paired rounds: setups run back to back with the local loop, ratios taken round by round.

    python -m benchmarks.paired --rounds 10        # the local loops and PS 1 trainer, every --step
    python -m benchmarks.paired --setups local-cached,ps-async-2,ps-chained-async-2 --rounds 6
    python -m benchmarks.paired --model resnet18 --batch-size 32 --steps 30 --skip 6 --rounds 4

Why: the PS step variants differ by a round trip or two (1-3 ms of a ~50 ms step), while the
speed of the 2-core VM drifts by 10-30% from one minute to the next, so one window per setup,
each at its own moment, cannot rank them or hold a 0.90 ratio steady. Here every PS server
(one per update mode and step variant) stays up for the whole measurement; each round runs
every setup once for ``--steps`` steps, back to back in a rotating order, and each run's
samples/s is its throughput after ``--skip`` warm-up steps of every process (PS: all
trainers together, over the interval in which they all step). A setup's ratio is its
samples/s over the best local loop's *of the same round*; the result is the median of those
ratios over the rounds. ``benchmarks.run`` runs the same
rounds after its one-window pass (``--rounds``) and takes the issue's targets from them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import measure
from benchmarks.setups import local_argv, parse_setups, server_argv, trainer_argv

log = logging.getLogger(__name__)

DEFAULT_SETUPS = "local,local-cached,ps-async-1,ps-chained-async-1,ps-async-2,ps-chained-async-2"
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"
LEG_TIMEOUT_S = 600.0


def pairable(setup: dict) -> bool:
    """Local loops and PS setups; DDP/FSDP start a process group per run and are left out."""
    return setup["kind"] in ("local", "ps")


def leg_rate(step_ends: list[list[float]], batch_size: int, skip: int) -> dict:
    """Throughput of one run: step ends of every process after its first ``skip`` steps, over
    the interval in which all of them step (a trainer that finishes early would otherwise
    leave the other one alone and fast)."""
    ends = [sorted(e)[skip:] for e in step_ends]
    if any(len(e) < 6 for e in ends):
        raise RuntimeError(f"a run has {min(len(e) for e in ends)} steps after the {skip} skipped: too few to time "
                           "(raise --steps)")
    start, end = max(e[0] for e in ends), min(e[-1] for e in ends)
    count = sum(1 for e in ends for t in e if start < t <= end)
    if end <= start or count < 5:
        raise RuntimeError("the processes of a run never stepped together after their warm-up (raise --steps)")
    gaps = [b - a for e in ends for a, b in itertools.pairwise(e) if start < b <= end]
    return {"samples_per_s": count * batch_size / (end - start), "step_ms": 1000 * statistics.median(gaps),
            "steps": count, "seconds": end - start}


def summarize(setups: list[dict], runs: dict[str, list[dict]]) -> dict:
    """Per-round ratios to the best local loop of the round, and their medians."""
    locals_ = [s["name"] for s in setups if s["kind"] == "local"]
    rounds = len(next(iter(runs.values())))
    out: dict = {"ceiling_per_round": [], "setups": {}}
    best = []
    for r in range(rounds):
        if locals_:
            name = max(locals_, key=lambda n: runs[n][r]["samples_per_s"])
            out["ceiling_per_round"].append(name)
            best.append(runs[name][r]["samples_per_s"])
    for s in setups:
        rates = [leg["samples_per_s"] for leg in runs[s["name"]]]
        row = {"samples_per_s": rates, "step_ms": [leg["step_ms"] for leg in runs[s["name"]]],
               "median_samples_per_s": statistics.median(rates)}
        if best:
            row["x_local"] = [a / b for a, b in zip(rates, best, strict=True)]
            row["median_x_local"] = statistics.median(row["x_local"])
            row["rounds_at_or_above_0.90"] = sum(x >= 0.90 for x in row["x_local"])
        out["setups"][s["name"]] = row
    return out


class Rounds:
    """The servers and child processes of one paired measurement (stopped in ``close``)."""

    def __init__(self, *, model: str, batch_size: int, steps: int, skip: int, work: Path,
                 devices: str | None = None, tp_channels: str = "basic") -> None:
        self.model, self.batch_size, self.steps, self.skip = model, batch_size, steps, skip
        self.work, self.devices, self.tp_channels = work, devices, tp_channels
        self.children = measure.Children(work)
        self.servers: dict[tuple, int] = {}  # (update, sync trainers, step) -> port

    def close(self) -> None:
        self.children.stop_all()

    def _server(self, setup: dict) -> int:
        # One server per step variant too: in a deployment a job's trainers share one --step,
        # and dist_autograd's backward (plain) gives the server more OpenMP teams, which
        # slows every later step of that server (psserver.ps.compute).
        key = (setup["update"], setup["trainers"] if setup["update"] == "sync" else 0, setup["step"])
        if key not in self.servers:
            port = measure.free_port()
            server = self.children.start(server_argv(setup, model=self.model, port=port, devices=self.devices,
                                                     tp_channels=self.tp_channels), "server-" + "-".join(map(str, key)))
            server.wait_for(r"serving \S+ on", 180)
            self.servers[key] = port
        return self.servers[key]

    def run_leg(self, setup: dict, tag: str) -> dict:
        """One run of ``setup`` for ``steps`` steps (per trainer)."""
        if setup["kind"] == "local":
            stats = [self.work / f"{tag}.json"]
            procs = [self.children.start(local_argv(setup, model=self.model, batch_size=self.batch_size,
                                                    seconds=LEG_TIMEOUT_S / 2, steps=self.steps,
                                                    stats_out=str(stats[0])), tag)]
        elif setup["kind"] == "ps":
            port = self._server(setup)
            stats = [self.work / f"{tag}-trainer{r}.json" for r in range(setup["trainers"])]
            procs = [self.children.start(trainer_argv(setup, r, port=port, batch_size=self.batch_size,
                                                      steps=self.steps, stats_out=str(stats[r])), f"{tag}-trainer{r}")
                     for r in range(setup["trainers"])]
        else:
            raise ValueError(f"{setup['name']}: only local and PS setups run in paired rounds")
        deadline = time.monotonic() + LEG_TIMEOUT_S
        for p in procs:
            code = p.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"{p.name} {'timed out' if code is None else f'exited with {code}'}:\n{p.tail()}")
        for p in procs:
            p.stop()  # exited: closes its log
        self.children.items = [c for c in self.children.items if c not in procs]
        return leg_rate([json.loads(s.read_text())["step_ends"] for s in stats], self.batch_size, self.skip)


def measure_rounds(setups: list[dict], *, rounds: int, **kwargs) -> dict:
    """Every setup once per round, in an order that rotates by one each round."""
    bad = [s["name"] for s in setups if not pairable(s)]
    if bad:
        raise ValueError(f"not measurable in paired rounds: {', '.join(bad)}")
    runs: dict[str, list[dict]] = {s["name"]: [] for s in setups}
    orders = []
    with tempfile.TemporaryDirectory(prefix="psserver-paired-") as tmp:
        rr = Rounds(work=Path(tmp), **kwargs)
        try:
            for r in range(rounds):
                order = setups[r % len(setups):] + setups[:r % len(setups)]
                orders.append([s["name"] for s in order])
                for s in order:
                    leg = rr.run_leg(s, f"{s['name']}-{r}")
                    runs[s["name"]].append(leg)
                    log.info("round %d/%d %-20s %6.0f samples/s, step %.1f ms", r + 1, rounds, s["name"],
                             leg["samples_per_s"], leg["step_ms"])
        finally:
            rr.close()
    out = summarize(setups, runs)
    out.update(rounds=rounds, steps=kwargs["steps"], skip=kwargs["skip"], order_per_round=orders, runs=runs)
    return out


def markdown_rows(paired: dict) -> list[str]:
    lines = ["| setup | samples/s (median over rounds) | x best local (median over rounds) | rounds >= 0.90 "
             "| x best local, per round | step ms (median over rounds) |",
             "|---|---|---|---|---|---|"]
    for name, row in paired["setups"].items():
        per = " ".join(f"{x:.3f}" for x in row.get("x_local", []))
        lines.append(f"| {name} | {row['median_samples_per_s']:.0f} | {row.get('median_x_local', float('nan')):.3f} | "
                     f"{row.get('rounds_at_or_above_0.90', '-')}/{paired['rounds']} | {per} | "
                     f"{statistics.median(row['step_ms']):.1f} |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.paired", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mnist_cnn", help="model the server hosts (default mnist_cnn)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step and trainer (default 64)")
    p.add_argument("--setups", default=DEFAULT_SETUPS,
                   help=f"comma-separated local and PS setups (default {DEFAULT_SETUPS})")
    p.add_argument("--rounds", type=int, default=6, help="rounds of every setup (default 6)")
    p.add_argument("--steps", type=int, default=80, help="steps per run and trainer (default 80)")
    p.add_argument("--skip", type=int, default=20, help="warm-up steps left out of each run (default 20)")
    p.add_argument("--devices", default=None, help="server --devices (default: its own choice)")
    p.add_argument("--tp-channels", default="basic", help="TensorPipe channels of the servers (default basic)")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS, help="where the JSON and Markdown go")
    args = p.parse_args(argv)
    try:
        args.setups = parse_setups(args.setups)
    except ValueError as e:
        p.error(f"--setups: {e}")
    bad = [s["name"] for s in args.setups if not pairable(s)]
    if bad:
        p.error(f"--setups: only local and PS setups run in paired rounds, not {', '.join(bad)}")
    if not any(s["kind"] == "local" for s in args.setups):
        p.error("--setups: name at least one local loop (local, local-cached, local-Nt): the ratios divide by it")
    if args.rounds < 1 or args.skip < 0 or args.steps < args.skip + 6 or args.batch_size < 1:
        p.error("need --rounds >= 1, --batch-size >= 1, --skip >= 0 and --steps >= --skip + 6")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    t0 = time.monotonic()
    paired = measure_rounds(args.setups, rounds=args.rounds, model=args.model, batch_size=args.batch_size,
                            steps=args.steps, skip=args.skip, devices=args.devices, tp_channels=args.tp_channels)
    names = ",".join(s["name"] for s in args.setups)
    command = (f"python -m benchmarks.paired --model {args.model} --batch-size {args.batch_size} --setups {names} "
               f"--rounds {args.rounds} --steps {args.steps} --skip {args.skip}")
    result = {"command": command, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": time.monotonic() - t0,
              "config": {"model": args.model, "batch_size": args.batch_size, "setups": names,
                         "tp_channels": args.tp_channels, "devices": args.devices}, "paired": paired}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / f"paired-{args.model}-b{args.batch_size}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    md = "\n".join([f"## Paired rounds: {args.model}, batch {args.batch_size}", "", f"`{command}` ({result['time']})",
                    "", *markdown_rows(paired)]) + "\n"
    stem.with_suffix(".md").write_text(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
