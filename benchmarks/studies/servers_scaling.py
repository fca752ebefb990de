"""Aggregate push/pull bandwidth against the number of server processes, across rate-limited links.

    python -m benchmarks servers_scaling                                      # 1, 2 and 4 servers
    python -m benchmarks servers_scaling --quick --results-dir /tmp/scaling   # 1 and 2 servers, ~1 min
    timeout 15m python -m benchmarks servers_scaling --timeout 840            # ~9 min

Results go to ``--results-dir`` (default ``benchmarks/results/servers-scaling``).

Every server and every trainer is a host of its own (``benchmarks.harness.multihost``: a network
namespace behind a veth link to one bridge, limited with ``tc`` to ``--rate`` Mbit/s each way),
so one server process has one link's bandwidth, as on a real cluster. The model is ``mlp_wide``
(1.9M parameters, little compute): a trainer step (``--step pushpull``) moves ~7.5 MB up and
~7.5 MB down, split over the servers, so the step rate is set by the links.

Setups: S server processes (``--servers``, default 1,2,4; ``psserver serve --num-servers S``,
server 0 coordinating) and the same ``--trainers`` trainers, ``--update sync`` by default. A
trainer's step is sequential (its gradient goes up, then the parameters come down), so its own
link carries one direction at a time: >= 2 x 7.5 MB / rate per step whatever S is. With sync
every trainer pushes at once and pulls at once, so each server link carries T x 7.5 MB / S up,
then as much down, per step: the servers' links are the bottleneck while T >= S, and the step
time is set by the bytes over the busiest link alone. The default 8 trainers (T = 2 x the most
servers) keep the trainers' links at half the load of the servers' even with 4 servers.
(``--update async`` lets the trainers' phases drift: a server link is used in both directions
at once when some trainers push while others pull, and in one when they move in step, so the
step time wanders between those two bounds from run to run, and T >= 2 S is needed.)

Paired rounds, as ``benchmarks.harness.paired``: every server group stays up for the whole run (one
unmeasured warm-up run of the trainers against each first); each round runs every setup once,
back to back, in an order that rotates by one each round, ``--steps`` steps per trainer of
which the first ``--skip`` of every trainer are warm-up. A run's interval is the one in which
every trainer steps (``paired_stats.leg_rate``). Within it, the bytes over the server links (both
directions, Ethernet/IP/TCP headers included; read from the bridge side of each link every
0.1 s) give, by least squares against time, the aggregate push/pull bandwidth, and over the
trainers' step rate, the bytes per trainer step summed over all servers. Each is divided by
the 1-server setup's **of the same round**; the reported value is the median over rounds.
Targets: bandwidth 2 servers >= 1.8x one, 4 >= 3.2x; bytes per step <= 1.05x.

The PS servers run TensorPipe's ``basic`` channel only (``benchmarks.harness.workers psserver
--channels basic``): between namespaces of one host TensorPipe could still use ``cma``
(process_vm_readv), which would move the tensors outside the links; between hosts it cannot.
Trainers and servers run one torch thread (``OMP_NUM_THREADS=1``, ``--compute-threads 1``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import measure, multihost, paired, paired_stats
from benchmarks.harness.report import write_result

log = logging.getLogger(__name__)

SERVER_PORT = 29500
SERVER_WRAPPER = ("-m", "benchmarks.harness.workers", "psserver", "--channels", "basic", "--")
"""How a server starts: psserver with TensorPipe's ``basic`` channel only (tensors in the sockets)."""
READY_RANK0 = r"serving \S+ on"
READY_OTHER = r"\bserving\b"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TARGETS = {2: 1.8, 4: 3.2}
BYTES_TARGET = 1.05
DEFAULT_RESULTS = measure.RESULTS / "servers-scaling"
LEG_TIMEOUT_S = 600.0


# ---- command lines ---------------------------------------------------------------------------


def server_args(rank: int, num_servers: int, *, host: str, coordinator: str, port: int = SERVER_PORT,
                model: str = "mlp_wide", update: str = "async", trainers: int = 1,
                threads: int | None = 1) -> list[str]:
    """``psserver serve`` arguments of server ``rank`` of ``num_servers`` bound to ``host``
    (server 0 at ``coordinator:port``); no control plane; ``--update sync`` waits for the
    gradients of all ``trainers`` every step."""
    args = ["serve", "--host", host, "--model", model, "--update", update, "--no-control"]
    if update == "sync":
        args += ["--sync-trainers", str(trainers)]
    if threads:
        args += ["--compute-threads", str(threads)]
    if num_servers > 1:
        args += ["--num-servers", str(num_servers), "--server-rank", str(rank)]
    if rank == 0:
        args += ["--port", str(port)]
    else:
        args += ["--coordinator", f"{coordinator}:{port}"]
    return args


def trainer_args(rank: int, trainers: int, *, server: str, port: int = SERVER_PORT, batch_size: int, steps: int,
                 stats_out: str | Path) -> list[str]:
    """``psserver train`` arguments: trainer compute (``--step pushpull``), synthetic data,
    ``steps`` steps, each step's end written to ``stats_out``."""
    return ["train", "--server", f"{server}:{port}", "--rank", str(rank), "--num-trainers", str(trainers),
            "--epochs", "1000000", "--batch-size", str(batch_size), "--max-steps", str(steps), "--dataset",
            "synthetic", "--no-progress", "--step", "pushpull", "--stats-out", str(stats_out)]


def server_command(args: list[str]) -> list[str]:
    return [sys.executable, *SERVER_WRAPPER, *args]


def trainer_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "psserver", *args]


@dataclass(frozen=True)
class Layout:
    """Which node hosts what: every server group its own nodes (all groups stay up), the
    trainers theirs (one setup runs at a time, so every setup's trainers share them)."""

    servers: dict[int, list[int]]
    trainers: list[int]

    @property
    def nodes(self) -> int:
        return sum(len(v) for v in self.servers.values()) + len(self.trainers)


def layout(server_counts: list[int], trainers: int) -> Layout:
    groups, k = {}, 0
    for s in server_counts:
        groups[s] = list(range(k, k + s))
        k += s
    return Layout(groups, list(range(k, k + trainers)))


# ---- analysis ---------------------------------------------------------------------------------


def summarize(server_counts: list[int], runs: dict[int, list[dict]]) -> dict:
    """Per round, each setup's aggregate bandwidth, bytes per trainer step and samples/s over
    the 1-server setup's (or the fewest servers measured); the medians over rounds."""
    base = min(server_counts)
    rounds = len(runs[base])
    out: dict = {"baseline_servers": base, "setups": {}}
    for s in server_counts:
        legs = runs[s]
        row: dict = {"servers": s}
        for key in ("bytes_per_s", "bytes_per_step", "samples_per_s", "step_ms"):
            values = [leg.get(key) for leg in legs]
            row[key] = values
            present = [v for v in values if v is not None]
            row[f"median_{key}"] = statistics.median(present) if present else None
            ratios = [a / b if a is not None and b else None
                      for a, b in zip(values, (leg.get(key) for leg in runs[base]), strict=True)]
            if key != "step_ms":
                row[f"x_{key}"] = ratios
                good = [r for r in ratios if r is not None]
                row[f"median_x_{key}"] = statistics.median(good) if good else None
        row["link_utilization"] = [leg.get("link_utilization") for leg in legs]
        shares = [leg["server_link_shares"] for leg in legs if leg.get("server_link_shares")]
        row["server_link_shares"] = [statistics.median(x) for x in zip(*shares, strict=True)] if shares else None
        out["setups"][s] = row
    out["rounds"] = rounds
    return out


def targets(summary: dict) -> list[dict]:
    """The performance targets of several server processes, from the medians over rounds (None where not measured)."""
    rows = []
    base = summary["baseline_servers"]
    for s, row in summary["setups"].items():
        if s == base:
            continue
        if s in TARGETS and base == 1:
            v = row["median_x_bytes_per_s"]
            rows.append({"name": f"aggregate push/pull bandwidth, {s} servers / 1", "value": v, "op": ">=",
                         "target": TARGETS[s], "per_round": row["x_bytes_per_s"],
                         "met": None if v is None else v >= TARGETS[s]})
        v = row["median_x_bytes_per_step"]
        rows.append({"name": f"bytes per trainer step over all server links, {s} servers / {base}", "value": v,
                     "op": "<=", "target": BYTES_TARGET, "per_round": row["x_bytes_per_step"],
                     "met": None if v is None else v <= BYTES_TARGET})
    return rows


def _f(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def markdown(result: dict) -> str:
    from benchmarks.harness import report

    cfg, summary = result["config"], result.get("summary")
    lines = [f"## Servers scaling: {cfg['model']}, {cfg['trainers']} trainers, links of {cfg['rate_mbit']:g} Mbit/s",
             "", f"`{result['command']}` ({result['time']}, {result['wall_s'] / 60:.1f} min)", ""]
    if result.get("link_check"):
        lc = result["link_check"]
        lines += [f"Link check (one TCP stream, trainer node to trainer node): {lc['rate_mbit']:.1f} Mbit/s "
                  "payload.", ""]
    if summary:
        rows = []
        for s, row in summary["setups"].items():
            per = " ".join(_f(x, "{:.2f}") for x in row.get("x_bytes_per_s", []))
            per_b = " ".join(_f(x, "{:.3f}") for x in row.get("x_bytes_per_step", []))
            mbps = row["median_bytes_per_s"]
            util = [u for u in row["link_utilization"] if u is not None]
            rows.append([str(s), _f(None if mbps is None else mbps * 8 / 1e6, "{:.0f}"),
                         _f(statistics.median(util) if util else None, "{:.0%}"),
                         _f(row.get("median_x_bytes_per_s"), "{:.2f}"), per,
                         _f(None if row["median_bytes_per_step"] is None else row["median_bytes_per_step"] / 1e6,
                            "{:.2f}"),
                         _f(row.get("median_x_bytes_per_step"), "{:.3f}"), per_b,
                         _f(row["median_samples_per_s"], "{:.1f}"), _f(row["median_step_ms"], "{:.0f}"),
                         " / ".join(f"{x:.0%}" for x in row["server_link_shares"]) if row["server_link_shares"]
                         else "-"])
        lines += [report.md_table(["servers", "aggregate Mbit/s (median)", "of the server links' capacity",
                                   "x 1 server (median)", "x 1 server, per round", "MB per trainer step, all servers",
                                   "x 1 server (median)", "per round", "samples/s", "step ms (median)",
                                   "each server link's share of the bytes"], rows), ""]
        trows = [[t["name"], _f(t["value"], "{:.3f}"), " ".join(_f(x, "{:.2f}") for x in t["per_round"]),
                  f"{t['op']} {t['target']:g}", "-" if t["met"] is None else ("yes" if t["met"] else "NO")]
                 for t in result.get("targets", [])]
        if trows:
            lines += ["### Targets: several server processes (medians over paired rounds)", "",
                      report.md_table(["ratio", "measured", "per round", "target", "met"], trows), ""]
    if result.get("error"):
        lines += [f"**Stopped early:** {result['error']}", ""]
    lines += [result["method"], ""]
    return "\n".join(lines).rstrip() + "\n"


# ---- running ----------------------------------------------------------------------------------


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def left(self, cap: float = LEG_TIMEOUT_S) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the global timeout (--timeout {self.seconds:.0f} s) ran out")
        return min(cap, left)


def wait_all(procs: list, deadline: Deadline) -> None:
    """Wait for every trainer of a run to exit 0 (``RuntimeError`` with its log's tail when one
    fails or outlives the run; the deadline's own error when the global timeout ran out)."""
    for p in procs:
        code = p.wait(deadline.left())
        if code is None:
            deadline.left()  # raises when the global timeout is what ran out
            raise RuntimeError(f"{p.name} still running after {LEG_TIMEOUT_S:.0f} s:\n{p.tail()}")
        if code != 0:
            raise RuntimeError(f"{p.name} exited with {code}:\n{p.tail()}")


class Scaling:
    """The topology, the long-lived server groups and the runs of trainers (``close`` stops
    every process and removes the namespaces)."""

    def __init__(self, *, server_counts: list[int], trainers: int, rate_mbit: float, model: str, batch_size: int,
                 steps: int, skip: int, warm_up_steps: int, work: Path, deadline: Deadline,
                 qdisc: str = "tbf", update: str = "sync") -> None:
        self.counts, self.trainers, self.rate_mbit, self.update = server_counts, trainers, rate_mbit, update
        self.model, self.batch_size, self.steps, self.skip = model, batch_size, steps, skip
        self.warm_up_steps, self.work, self.deadline = warm_up_steps, work, deadline
        self.layout = layout(server_counts, trainers)
        self.children = measure.Children(work)
        self.servers: dict[int, list[measure.Child]] = {}
        multihost.cleanup_stale()
        self.topo = multihost.Topology(self.layout.nodes, rate_mbit, qdisc=qdisc)

    def close(self) -> None:
        try:
            self.children.stop_all()
        finally:
            self.topo.close()

    def link_check(self, seconds: float = 2.0) -> dict:
        nodes = self.layout.trainers if len(self.layout.trainers) >= 2 else [0, self.layout.nodes - 1]
        return multihost.measure_tcp(self.topo, nodes[0], nodes[1], seconds)

    def _start(self, node: int, argv: list[str], name: str) -> measure.Child:
        return self.children.start(self.topo.wrap(node, argv), name, ONE_THREAD)

    def start_group(self, s: int) -> None:
        """Server group ``s`` (S processes on its nodes), up until ``close``; its warm-up run."""
        nodes = self.layout.servers[s]
        head = self.topo.address(nodes[0])
        procs = [self._start(nodes[0], server_command(server_args(0, s, host=head, coordinator=head, model=self.model,
                                                                  update=self.update, trainers=self.trainers)),
                             f"s{s}-server0")]
        procs[0].wait_for(READY_RANK0, self.deadline.left(180))
        for rank, node in enumerate(nodes[1:], start=1):
            procs.append(self._start(node, server_command(server_args(rank, s, host=self.topo.address(node),
                                                                      coordinator=head, model=self.model,
                                                                      update=self.update, trainers=self.trainers)),
                                     f"s{s}-server{rank}"))
        for p in procs[1:]:
            p.wait_for(READY_OTHER, self.deadline.left(180))
        self.servers[s] = procs
        if self.warm_up_steps:
            log.info("[%5.0fs] %d server(s) up; warm-up run (%d steps per trainer, not measured)", self.elapsed(), s,
                     self.warm_up_steps)
            self.run_leg(s, f"warm-up-s{s}", self.warm_up_steps, measure_it=False)

    def elapsed(self) -> float:
        return time.monotonic() - (self.deadline.end - self.deadline.seconds)

    def run_leg(self, s: int, tag: str, steps: int | None = None, measure_it: bool = True) -> dict:
        """One run of the trainers against server group ``s``."""
        steps = steps or self.steps
        head = self.topo.address(self.layout.servers[s][0])
        stats = [self.work / f"{tag}-trainer{r}.json" for r in range(self.trainers)]
        for p in self.servers[s]:
            if not p.running():
                raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
        server_nodes = self.layout.servers[s]
        before = self.topo.counters()
        probe = measure.Probe(None, lambda: self.topo.bytes_of(server_nodes), 0.1).start() if measure_it else None
        procs = [self._start(node, trainer_command(trainer_args(r, self.trainers, server=head,
                                                                batch_size=self.batch_size, steps=steps,
                                                                stats_out=stats[r])), f"{tag}-trainer{r}")
                 for r, node in enumerate(self.layout.trainers)]
        try:
            wait_all(procs, self.deadline)
        finally:
            samples = probe.stop() if probe is not None else []
            for p in procs:
                p.stop()
            self.children.items = [c for c in self.children.items if c not in procs]
        if not measure_it:
            return {}
        ends = [json.loads(f.read_text())["step_ends"] for f in stats]
        leg = paired_stats.leg_rate(ends, self.batch_size, self.skip)
        leg.update(measure.per_step(samples, ends, leg["start"], leg["end"]))
        after = self.topo.counters()
        moved = [after[k].total - before[k].total for k in server_nodes]
        leg["server_link_shares"] = [b / sum(moved) for b in moved] if sum(moved) else None
        if leg.get("bytes_per_s") is not None:
            leg["link_utilization"] = leg["bytes_per_s"] / (s * 2 * self.rate_mbit * 1e6 / 8)
        return leg


def _leg_line(leg: dict) -> str:
    bw, b = leg.get("bytes_per_s"), leg.get("bytes_per_step")
    return (f"{leg['samples_per_s']:7.1f} samples/s, step {leg['step_ms']:6.0f} ms, "
            f"server links {_f(None if bw is None else bw * 8 / 1e6, '{:.0f}')} Mbit/s "
            f"({_f(leg.get('link_utilization'), '{:.0%}')} of capacity), "
            f"{_f(None if b is None else b / 1e6, '{:.2f}')} MB per trainer step")


def measure_rounds(args: argparse.Namespace, deadline: Deadline, progress: dict) -> None:
    """Fills ``progress`` (runs, orders, link check) as it goes, so a timeout keeps what was measured."""
    counts = args.servers
    runs: dict[int, list[dict]] = {s: [] for s in counts}
    progress.update(runs=runs, order_per_round=[])
    with tempfile.TemporaryDirectory(prefix="psserver-scaling-") as tmp:
        sc = Scaling(server_counts=counts, trainers=args.trainers, rate_mbit=args.rate, model=args.model,
                     batch_size=args.batch_size, steps=args.steps, skip=args.skip, warm_up_steps=args.warm_up_steps,
                     work=Path(tmp), deadline=deadline, qdisc=args.qdisc, update=args.update)
        try:
            log.info("[%5.0fs] %d nodes on %s, every link %g Mbit/s each way (%s)", sc.elapsed(), sc.layout.nodes,
                     sc.topo.subnet, args.rate, args.qdisc)
            progress["link_check"] = sc.link_check()
            log.info("[%5.0fs] link check: %.1f Mbit/s payload over one TCP stream", sc.elapsed(),
                     progress["link_check"]["rate_mbit"])
            for s in counts:
                sc.start_group(s)
                log.info("[%5.0fs] %d server process(es) serving", sc.elapsed(), s)
            for r in range(args.rounds):
                order = counts[r % len(counts):] + counts[:r % len(counts)]
                progress["order_per_round"].append(order)
                for s in order:
                    leg = sc.run_leg(s, f"r{r}-s{s}")
                    runs[s].append(leg)
                    log.info("[%5.0fs] round %d/%d, %d server(s): %s", sc.elapsed(), r + 1, args.rounds, s,
                             _leg_line(leg))
                progress["rounds_done"] = r + 1
        finally:
            sc.close()


METHOD = ("Method: every server and trainer in a network namespace of its own, behind a veth link to one bridge "
          "limited with tc to the rate each way (benchmarks/harness/multihost.py); servers with TensorPipe's basic "
          "channel "
          "(tensors in the sockets). Bandwidth: bytes over the server links, both directions, headers included, "
          "least-squares slope against time inside the interval in which every trainer steps (after --skip steps "
          "of each); bytes per trainer step: that slope over the trainers' step rate. Ratios to the 1-server setup "
          "of the same round; medians over rounds (benchmarks/studies/servers_scaling.py).")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks servers_scaling", description=__doc__.splitlines()[0])
    p.add_argument("--servers", default=None, help="comma-separated server counts, 1 first (default 1,2,4)")
    p.add_argument("--trainers", type=int, default=None,
                   help="trainers, each on its own link (default 8: twice the most servers, so the servers' links "
                        "bound the run; --quick: 2)")
    p.add_argument("--rate", type=float, default=200.0, help="Mbit/s of every link, each way (default 200)")
    p.add_argument("--qdisc", choices=multihost.QDISCS, default="tbf", help="tc shaper (default tbf)")
    p.add_argument("--update", choices=("sync", "async"), default="sync",
                   help="the servers' --update (default sync: every trainer's push and pull of a step happen "
                        "together, so the step time is set by the bytes over the busiest link; async: by how the "
                        "trainers' phases drift as well)")
    p.add_argument("--model", default="mlp_wide", help="model (default mlp_wide: 1.9M parameters, little compute)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per trainer step (default 8)")
    p.add_argument("--rounds", type=int, default=None, help="paired rounds (default 3; --quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="steps per trainer and run (default 12; --quick: 10)")
    p.add_argument("--skip", type=int, default=None,
                   help="warm-up steps of each trainer left out (default 3)")
    p.add_argument("--warm-up-steps", type=int, default=None,
                   help="steps per trainer of one unmeasured run against each new server group (default 2; --quick 0)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds for the whole run; past it, everything is stopped and what was measured is written "
                        "(default 1800)")
    p.add_argument("--quick", action="store_true", help="1 and 2 servers, 2 trainers, 1 round of 10 steps (~1 min)")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS, help="where the JSON and Markdown go")
    args = p.parse_args(argv)
    q = args.quick
    args.servers = args.servers or ("1,2" if q else "1,2,4")
    try:
        args.servers = sorted({int(x) for x in args.servers.split(",") if x.strip()})
    except ValueError:
        p.error(f"--servers: comma-separated integers, got {args.servers!r}")
    for name, full, quick in (("trainers", 8, 2), ("rounds", 3, 1), ("steps", 12, 10), ("skip", 3, 3),
                              ("warm_up_steps", 2, 0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if not args.servers or args.servers[0] < 1 or args.servers[-1] > 64:
        p.error("--servers: counts in 1..64")
    if args.trainers < 1 or args.rounds < 1 or args.skip < 0 or args.steps < args.skip + 6 or args.batch_size < 1 \
            or args.warm_up_steps < 0 or args.rate <= 0 or args.timeout <= 0:
        p.error("need --trainers, --rounds, --batch-size >= 1, --skip >= 0, --steps >= --skip + 6, "
                "--warm-up-steps >= 0, --rate > 0 and --timeout > 0")
    if sum(args.servers) + args.trainers > 250:
        p.error("too many nodes (servers of every setup + trainers > 250)")
    return args


def command_line(args: argparse.Namespace) -> str:
    cmd = (f"python -m benchmarks servers_scaling --servers {','.join(map(str, args.servers))} --trainers "
           f"{args.trainers} --rate {args.rate:g} --model {args.model} --batch-size {args.batch_size} --rounds "
           f"{args.rounds} --steps {args.steps} --skip {args.skip} --warm-up-steps {args.warm_up_steps}")
    return (cmd + f" --update {args.update}" + (f" --qdisc {args.qdisc}" if args.qdisc != "tbf" else "")
            + (" --quick" if args.quick else ""))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    reason = multihost.available()
    if reason:
        log.error("cannot build the namespaces this benchmark needs: %s", reason)
        return 2
    t0 = time.monotonic()
    deadline = Deadline(args.timeout)
    progress: dict = {}
    error = None
    log.info("servers scaling: %s server(s), %d trainers, %g Mbit/s links, %d round(s) of %d steps (%d skipped)",
             ",".join(map(str, args.servers)), args.trainers, args.rate, args.rounds, args.steps, args.skip)
    with paired.exit_on_sigterm():
        try:
            measure_rounds(args, deadline, progress)
        except (TimeoutError, RuntimeError, OSError) as e:
            error = f"{type(e).__name__}: {e}"
            log.error("stopped: %s", error)
        except SystemExit as e:  # SIGTERM: everything is stopped; write what was measured
            error = f"stopped by SIGTERM (exit {e.code})"
    result: dict = {"command": command_line(args), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "wall_s": time.monotonic() - t0,
                    "config": {"servers": args.servers, "trainers": args.trainers, "rate_mbit": args.rate,
                               "qdisc": args.qdisc, "update": args.update, "model": args.model,
                               "batch_size": args.batch_size,
                               "rounds": args.rounds, "steps": args.steps, "skip": args.skip,
                               "warm_up_steps": args.warm_up_steps, "cores": os.cpu_count(),
                               "load_avg": os.getloadavg()},
                    "method": METHOD, "link_check": progress.get("link_check"), "error": error,
                    "order_per_round": progress.get("order_per_round", []), "runs": progress.get("runs", {})}
    done = progress.get("rounds_done", 0)
    if done:
        runs = {s: legs[:done] for s, legs in progress["runs"].items()}
        result["summary"] = summarize(args.servers, runs)
        result["targets"] = targets(result["summary"])
    stem = args.results_dir / f"servers-scaling-{args.model}-t{args.trainers}-{args.rate:g}mbit"
    sys.stdout.write(write_result(stem, result, "servers_scaling", markdown))
    return 0 if error is None else 3


if __name__ == "__main__":
    sys.exit(main())
