"""Embedding tables on the parameter servers: their bytes per step and their rows per second.

    python -m benchmarks embedding_tables --quick --results-dir /tmp/tables                  # ~35 s
    timeout 14m python -m benchmarks embedding_tables --timeout 780                         # ~7 min
    python -m benchmarks embedding_tables --skip-rates                                      # (A) only

Two measurements, each on hosts of its own (``benchmarks.harness.multihost``: every server
process and every trainer in a network namespace behind a ``tc``-limited veth link to one bridge;
servers with TensorPipe's ``basic`` channel, as in ``benchmarks.studies.servers_scaling``):

(A) **Bytes per trainer step against the ideal, with 10^4 and with 10^7 rows per table.** ``mf``
on MovieLens-100k (tables ``user`` and ``item``, rows of ``--embedding-dim`` 8 + 1 bias column; the
dense part is one float, the global mean), one server process per prefill (``--embedding-prefill``
10^4 and 10^7 rows per table; both stay up for the whole measurement), ``--bytes-trainers``
trainers. The ideal of a step is what its tables' traffic needs at least: each unique id of the
batch once (8 bytes), its row down and its gradient up (row width x 4 bytes each). The trainers
count it (``row_payload_bytes`` of ``--stats-out``) only for a whole run, so the benchmark
computes it for every step from the same data, sampler, seed and batch size (each trainer's
batches are those of ``DistributedSampler``), checks that the sum over the run equals what the
trainer counted, and sums it over the steps that end inside the measured window. The bytes are
those over the server's link in the same window (both directions, Ethernet/IP/TCP headers
included: the bridge ports' counters, read every 0.1 s); the window is the interval in which
every trainer steps, after ``--bytes-skip`` steps of each, from the first to the last reading
inside it. The ratio bytes / ideal is taken per run; the runs of the two prefills (and of a
smaller batch, ``--small-batch``) alternate in paired rounds, and the ratio 10^7 / 10^4 is taken
round by round; the medians over rounds are reported. Packets are counted too: 66 bytes of
headers each (Ethernet 14, IPv4 20, TCP 20 + 12 of timestamps), which splits the overhead into
headers and TCP payload beyond the ideal (RPC framing, pickled arguments, the dense part,
heartbeats). ``--packets mtu`` (default) sets ``gso_max_segs 1`` on every node's interface: each
TCP segment crosses as a frame of at most 1514 bytes with its own headers, as a NIC with TSO puts
it on the wire and counts it; ``--packets gso`` keeps veth's default, where one counted packet may
carry up to 64 KB behind one set of headers (the multi-host benchmark's counters).

(B) **Row lookups and updates per second per server process, 1, 2 and 4 of them.** ``dlrm_tiny``
on ``synthetic_clicks`` (4 tables of ``--embedding-dim`` 16), ``--trainers`` trainers, every link
``--rate`` Mbit/s each way. Every server group stays up for the whole run (one unmeasured warm-up
run each); each round runs every group once, in an order that rotates. Server 0 of each group
serves the control plane on its own namespace's loopback, and a poller there reads its status
every 0.5 s (``tables``: one entry per table per server process, cumulative ``lookups`` and
``updates``; server 0 has the others' counters as of its last watch of them, every second, and
says how old they are). A server's lookups/s and updates/s are the deltas of its counters between
its first and last readings inside the run's window (as in (A)) over the time between them;
the totals are their sums, divided by the 1-server run's of the same round (medians over rounds).
Each server process's CPU time over the window (``/proc/PID/stat``) gives the lookups per
CPU-second, what one server process would do on a core of its own. The default rate (25 Mbit/s)
makes one server's link, not the machine's cores, bound the 1-server run; the machine's busy
fraction (``/proc/stat``) over the window shows where the cores bound the others.

Trainers and servers run one torch thread (``OMP_NUM_THREADS=1``, ``--compute-threads 1``),
``--step pushpull``, ``--update async``. Results: ``--results-dir`` (default
``benchmarks/results/embedding-tables/``), ``embedding-tables.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import measure, multihost, paired
from benchmarks.harness.report import write_result
from benchmarks.studies import servers_scaling as scaling
from benchmarks.studies.embedding.hosts import CONTROL_PORT, Hosts
from benchmarks.studies.embedding.measure import (
    Sampler,
    _rss_mb,
    bytes_window,
    mf_columns,
    movielens_ids,
    poll_lines,
    rates_window,
    rpc_pickle_sizes,
    step_ideals,
)
from benchmarks.studies.embedding.report import (
    METHOD,
    _bytes_line,
    _f,
    _rates_line,
    markdown,
    summarize_bytes,
    summarize_rates,
    targets,
)

log = logging.getLogger(__name__)

DEFAULT_RESULTS = measure.RESULTS / "embedding-tables"
MAX_ROWS_SLACK = 1_000_000
"""Rows a table may hold beyond its prefill: nothing is evicted while the runs create rows."""


# ---- command lines ---------------------------------------------------------------------------


def server_args(rank: int, num_servers: int, *, host: str, coordinator: str, model: str, dim: int, prefill: int = 0,
                max_rows: int | None = None) -> list[str]:
    """``psserver serve`` arguments (``servers_scaling.server_args``, async) with the tables'
    flags; server 0 serves the control plane on its namespace's loopback."""
    args = scaling.server_args(rank, num_servers, host=host, coordinator=coordinator, model=model)
    if rank == 0:
        args.remove("--no-control")
        args += ["--control-port", str(CONTROL_PORT)]
    args += ["--embedding-dim", str(dim), "--embedding-max-rows", str(max_rows or prefill + MAX_ROWS_SLACK)]
    if prefill:
        args += ["--embedding-prefill", str(prefill)]
    return args


def trainer_args(rank: int, trainers: int, *, server: str, batch_size: int, steps: int, dataset: str,
                 stats_out: str | Path, extra: tuple[str, ...] = ()) -> list[str]:
    """``psserver train`` arguments: ``--step pushpull``, one torch thread, ``steps`` steps,
    each step's end and the tables' ideal bytes written to ``stats_out``."""
    return ["train", "--server", f"{server}:{scaling.SERVER_PORT}", "--rank", str(rank), "--num-trainers",
            str(trainers), "--epochs", "1000000", "--batch-size", str(batch_size), "--max-steps", str(steps),
            "--dataset", dataset, "--no-progress", "--step", "pushpull", "--compute-threads", "1", "--stats-out",
            str(stats_out), *extra]


# ---- running -------------------------------------------------------------------------------------


def elapsed(deadline: scaling.Deadline) -> float:
    return time.monotonic() - (deadline.end - deadline.seconds)


def bytes_setups(args: argparse.Namespace) -> list[dict]:
    """(A)'s setups: one per prefill at ``--bytes-batch`` (role ``rows``), then the smallest
    prefill at ``--small-batch`` (role ``batch``): the same fixed cost per step over fewer ids."""
    def label(n: int) -> str:
        e = len(str(n)) - 1
        return f"10^{e} rows" if n == 10 ** e else f"{n:,} rows"

    out = [{"name": f"rows{n}-b{args.bytes_batch}", "role": "rows", "prefill": n, "batch_size": args.bytes_batch,
            "label": label(n)} for n in args.rows]
    if args.small_batch:
        n = args.rows[0]
        out.append({"name": f"rows{n}-b{args.small_batch}", "role": "batch", "prefill": n,
                    "batch_size": args.small_batch, "label": f"{label(n)}, batch {args.small_batch}"})
    return out


def measure_bytes(args: argparse.Namespace, deadline: scaling.Deadline, progress: dict) -> None:
    """(A): fills ``progress`` (setups, runs, servers) as it goes."""
    setups = bytes_setups(args)
    prefills = list(args.rows)
    trainers = args.bytes_trainers
    runs: dict[str, list[dict]] = {s["name"]: [] for s in setups}
    try:
        pickles = rpc_pickle_sizes(args.bytes_dim)
    except (ImportError, AttributeError, TypeError) as e:  # torch's private pickler moved: only the breakdown goes
        log.warning("cannot size the pickled exchange: %s", e)
        pickles = None
    progress.update(setups=setups, runs=runs, order_per_round=[], servers={}, rpc_pickles=pickles)
    ids = movielens_ids()
    columns = mf_columns(args.bytes_dim)
    trainer_nodes = list(range(len(prefills), len(prefills) + trainers))
    with tempfile.TemporaryDirectory(prefix="psserver-tables-a-") as tmp:
        hosts = Hosts(len(prefills) + trainers, args.bytes_rate, Path(tmp), deadline, packets=args.packets)
        try:
            log.info("[%5.0fs] (A) %d nodes, links of %g Mbit/s, packets %s; prefilling %s rows per table",
                     elapsed(deadline), len(hosts.topo), args.bytes_rate, args.packets,
                     " and ".join(f"{n:,}" for n in prefills))
            servers: dict[int, measure.Child] = {}
            for k, n in enumerate(prefills):  # all prefill at once; each waits below
                head = hosts.topo.address(k)
                servers[n] = hosts.start(k, scaling.server_command(server_args(
                    0, 1, host=head, coordinator=head, model="mf", dim=args.bytes_dim, prefill=n)), f"rows{n}-server0")
            for n, p in servers.items():
                p.wait_for(scaling.READY_RANK0, deadline.left(600))
                log.info("[%5.0fs] (A) server with %s rows per table serving", elapsed(deadline), f"{n:,}")

            def run(setup: dict, tag: str, steps: int, measure_it: bool = True) -> dict:
                k = prefills.index(setup["prefill"])
                server = servers[setup["prefill"]]
                head = hosts.topo.address(k)
                stats = [hosts.work / f"{tag}-trainer{r}.json" for r in range(trainers)]
                jobs = [(node, trainer_args(r, trainers, server=head, batch_size=setup["batch_size"], steps=steps,
                                            dataset="movielens100k", stats_out=stats[r]))
                        for r, node in enumerate(trainer_nodes)]
                sampler = Sampler(hosts.topo, [server.pid]).start()
                try:
                    hosts.run_trainers(tag, jobs, [server])
                finally:
                    readings = sampler.stop()
                if not measure_it:
                    return {}
                got = [json.loads(f.read_text()) for f in stats]
                ends = [g["step_ends"] for g in got]
                ideals = [step_ideals(ids, rank=r, trainers=trainers, batch_size=setup["batch_size"],
                                      steps=len(ends[r]), columns=columns) for r in range(trainers)]
                counted = [g.get("row_payload_bytes") for g in got]
                computed = [sum(u + d for u, d in i) for i in ideals]
                if counted != computed:
                    raise RuntimeError(f"the ideal computed per step ({computed}) is not what the trainers counted "
                                       f"({counted}): the benchmark's batches are not the trainers'")
                leg = bytes_window(readings, k, ends, ideals, setup["batch_size"], args.bytes_skip)
                whole = readings[-1].links[k].bytes - readings[0].links[k].bytes
                leg.update(whole_run_bytes=whole, row_payload_bytes=sum(counted),
                           whole_run_ratio=whole / sum(counted) if sum(counted) else None)
                return leg

            for setup in setups:
                if args.warm_up_steps and setup["role"] == "rows":
                    run(setup, f"warm-up-{setup['name']}", args.warm_up_steps, measure_it=False)
            for r in range(args.bytes_rounds):
                order = setups[r % len(setups):] + setups[:r % len(setups)]
                progress["order_per_round"].append([s["name"] for s in order])
                for setup in order:
                    leg = run(setup, f"a-r{r}-{setup['name']}", args.bytes_steps)
                    runs[setup["name"]].append(leg)
                    log.info("[%5.0fs] (A) round %d/%d, %s: %s", elapsed(deadline), r + 1, args.bytes_rounds,
                             setup["label"], _bytes_line(leg))
                progress["rounds_done"] = r + 1
            for n, p in servers.items():  # what the tables held: the prefill and the rows the runs created
                status = hosts.status_once(prefills.index(n), f"rows{n}-status")
                rows = None if status is None else {t["table"]: t["rows"] for t in status["tables"]}
                progress["servers"][n] = {"rows": rows, "rss_mb": _rss_mb(p.pid)}
                log.info("[%5.0fs] (A) server prefilled with %s rows: rows per table %s, RSS %s MB", elapsed(deadline),
                         f"{n:,}", rows, _f(_rss_mb(p.pid), "{:,.0f}"))
        finally:
            hosts.close()


def measure_rates(args: argparse.Namespace, deadline: scaling.Deadline, progress: dict) -> None:
    """(B): fills ``progress`` (runs per server count) as it goes."""
    counts = args.servers
    lay = scaling.layout(counts, args.trainers)
    runs: dict[int, list[dict]] = {s: [] for s in counts}
    progress.update(runs=runs, order_per_round=[])
    extra = ("--train-samples", str(args.train_samples), "--eval-samples", str(args.eval_samples))
    with tempfile.TemporaryDirectory(prefix="psserver-tables-b-") as tmp:
        hosts = Hosts(lay.nodes, args.rate, Path(tmp), deadline, qdisc=args.qdisc)
        try:
            log.info("[%5.0fs] (B) %d nodes, links of %g Mbit/s", elapsed(deadline), lay.nodes, args.rate)
            groups: dict[int, list[measure.Child]] = {}
            pollers: dict[int, measure.Child] = {}

            def run(s: int, tag: str, steps: int, measure_it: bool = True) -> dict:
                nodes = lay.servers[s]
                head = hosts.topo.address(nodes[0])
                stats = [hosts.work / f"{tag}-trainer{r}.json" for r in range(args.trainers)]
                jobs = [(node, trainer_args(r, args.trainers, server=head, batch_size=args.batch_size, steps=steps,
                                            dataset="synthetic_clicks", stats_out=stats[r], extra=extra))
                        for r, node in enumerate(lay.trainers)]
                sampler = Sampler(hosts.topo, [p.pid for p in groups[s]]).start()
                try:
                    hosts.run_trainers(tag, jobs, groups[s])
                finally:
                    readings = sampler.stop()
                if not measure_it:
                    return {}
                ends = [json.loads(f.read_text())["step_ends"] for f in stats]
                return rates_window(readings, poll_lines(pollers[s].output()), ends, servers=s, server_nodes=nodes,
                                    server_pids=[p.pid for p in groups[s]], batch_size=args.batch_size,
                                    skip=args.skip, rate_mbit=args.rate)

            for s in counts:
                groups[s] = hosts.start_group(lay.servers[s], lambda rank, host, head, s=s: server_args(
                    rank, s, host=host, coordinator=head, model="dlrm_tiny", dim=args.dim), f"s{s}")
                pollers[s] = hosts.poller(lay.servers[s][0], f"s{s}-status", deadline.left(1e9))
                log.info("[%5.0fs] (B) %d server process(es) serving", elapsed(deadline), s)
                if args.warm_up_steps:
                    run(s, f"warm-up-s{s}", args.warm_up_steps, measure_it=False)
            for r in range(args.rounds):
                order = counts[r % len(counts):] + counts[:r % len(counts)]
                progress["order_per_round"].append(order)
                for s in order:
                    leg = run(s, f"b-r{r}-s{s}", args.steps)
                    runs[s].append(leg)
                    log.info("[%5.0fs] (B) round %d/%d, %d server(s): %s", elapsed(deadline), r + 1, args.rounds, s,
                             _rates_line(leg))
                progress["rounds_done"] = r + 1
        finally:
            hosts.close()


# ---- command line --------------------------------------------------------------------------------


def _ints(text: str, flag: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        return sorted({int(float(x)) for x in text.split(",") if x.strip()})
    except ValueError:
        p.error(f"{flag}: comma-separated integers, got {text!r}")
        raise  # unreachable: p.error exits


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks embedding_tables", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="(A) 10^4 and 10^5 rows, 1 round; (B) 1 and 2 servers, 4 trainers, 1 round (< 90 s)")
    p.add_argument("--timeout", type=float, default=780.0,
                   help="seconds for the whole run; past it everything is stopped and what was measured is written "
                        "(default 780)")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS, help="where the JSON and Markdown go")
    p.add_argument("--skip-bytes", action="store_true", help="leave (A) out")
    p.add_argument("--skip-rates", action="store_true", help="leave (B) out")
    a = p.add_argument_group("(A) bytes per step (mf, MovieLens-100k, 1 server process per prefill)")
    a.add_argument("--rows", default=None, help="rows per table to prefill, comma-separated, smallest first "
                                                "(default 1e4,1e7; --quick 1e4,1e5)")
    a.add_argument("--bytes-batch", type=int, default=1024, help="samples per trainer step (default 1024)")
    a.add_argument("--small-batch", type=int, default=None,
                   help="also the smallest prefill at this batch: the fixed cost per step (default 128; --quick 0: "
                        "none)")
    a.add_argument("--bytes-dim", type=int, default=8, help="--embedding-dim (default 8: rows of 9 floats)")
    a.add_argument("--bytes-trainers", type=int, default=2, help="trainers (default 2)")
    a.add_argument("--bytes-steps", type=int, default=None, help="steps per trainer and run (default 400; --quick 150)")
    a.add_argument("--bytes-skip", type=int, default=20, help="warm-up steps of each trainer left out (default 20)")
    a.add_argument("--bytes-rounds", type=int, default=None, help="paired rounds (default 3; --quick 1)")
    a.add_argument("--bytes-rate", type=float, default=200.0,
                   help="Mbit/s of every link, each way (default 200: the links do not bound these runs)")
    a.add_argument("--packets", choices=("mtu", "gso"), default="mtu",
                   help="mtu: every TCP segment its own frame with its own headers, as on a wire (default); gso: "
                        "veth's default, one counted packet for up to 64 KB")
    b = p.add_argument_group("(B) lookups and updates per second (dlrm_tiny, synthetic_clicks)")
    b.add_argument("--servers", default=None, help="server counts, comma-separated (default 1,2,4; --quick 1,2)")
    b.add_argument("--trainers", type=int, default=None, help="trainers, each on its own link (default 8; --quick 4)")
    b.add_argument("--rate", type=float, default=25.0,
                   help="Mbit/s of every link, each way (default 25: one server's link bounds the 1-server run)")
    b.add_argument("--qdisc", choices=multihost.QDISCS, default="tbf", help="tc shaper (default tbf)")
    b.add_argument("--dim", type=int, default=16, help="--embedding-dim (default 16, dlrm_tiny's)")
    b.add_argument("--batch-size", type=int, default=512, help="samples per trainer step (default 512)")
    b.add_argument("--steps", type=int, default=None, help="steps per trainer and run (default 100; --quick 45)")
    b.add_argument("--skip", type=int, default=5, help="warm-up steps of each trainer left out (default 5)")
    b.add_argument("--rounds", type=int, default=None, help="paired rounds (default 3; --quick 1)")
    b.add_argument("--train-samples", type=int, default=50_000, help="synthetic_clicks samples (default 50000)")
    b.add_argument("--eval-samples", type=int, default=2_000,
                   help="held-out samples each trainer evaluates after its run (default 2000)")
    p.add_argument("--warm-up-steps", type=int, default=None,
                   help="steps per trainer of one unmeasured run against each server (default 20; --quick 0)")
    args = p.parse_args(argv)
    q = args.quick
    args.rows = _ints(args.rows or ("1e4,1e5" if q else "1e4,1e7"), "--rows", p)
    args.servers = _ints(args.servers or ("1,2" if q else "1,2,4"), "--servers", p)
    for name, full, quick in (("small_batch", 128, 0), ("bytes_steps", 400, 150), ("bytes_rounds", 3, 1),
                              ("trainers", 8, 4), ("steps", 100, 45), ("rounds", 3, 1), ("warm_up_steps", 20, 0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if not args.rows or args.rows[0] < 0 or args.rows[-1] > 100_000_000:
        p.error("--rows: counts in 0..1e8")
    if not args.servers or args.servers[0] < 1 or args.servers[-1] > 64:
        p.error("--servers: counts in 1..64")
    if min(args.bytes_batch, args.bytes_dim, args.bytes_trainers, args.bytes_rounds, args.trainers, args.dim,
           args.batch_size, args.rounds, args.train_samples, args.eval_samples) < 1 \
            or args.small_batch < 0 or args.warm_up_steps < 0 or args.bytes_skip < 0 or args.skip < 0:
        p.error("batch sizes, dims, trainers, rounds and samples must be >= 1; skips and warm-up steps >= 0")
    if args.bytes_steps < args.bytes_skip + 6 or args.steps < args.skip + 6:
        p.error("need --bytes-steps >= --bytes-skip + 6 and --steps >= --skip + 6")
    if args.rate <= 0 or args.bytes_rate <= 0 or args.timeout <= 0:
        p.error("need --rate, --bytes-rate and --timeout > 0")
    if sum(args.servers) + args.trainers > 250 or len(args.rows) + args.bytes_trainers > 250:
        p.error("too many nodes (at most 250 per topology)")
    if args.skip_bytes and args.skip_rates:
        p.error("--skip-bytes and --skip-rates leave nothing to measure")
    return args


def command_line(args: argparse.Namespace) -> str:
    cmd = ["python -m benchmarks embedding_tables"]
    if not args.skip_bytes:
        cmd.append(f"--rows {','.join(str(n) for n in args.rows)} --bytes-batch {args.bytes_batch} --small-batch "
                   f"{args.small_batch} --bytes-dim {args.bytes_dim} --bytes-trainers {args.bytes_trainers} "
                   f"--bytes-steps {args.bytes_steps} --bytes-skip {args.bytes_skip} --bytes-rounds "
                   f"{args.bytes_rounds} --bytes-rate {args.bytes_rate:g} --packets {args.packets}")
    if not args.skip_rates:
        cmd.append(f"--servers {','.join(map(str, args.servers))} --trainers {args.trainers} --rate {args.rate:g} "
                   f"--dim {args.dim} --batch-size {args.batch_size} --steps {args.steps} --skip {args.skip} "
                   f"--rounds {args.rounds}" + (f" --qdisc {args.qdisc}" if args.qdisc != "tbf" else ""))
    cmd.append(f"--warm-up-steps {args.warm_up_steps} --timeout {args.timeout:g}")
    for flag in ("quick", "skip_bytes", "skip_rates"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    return " ".join(cmd)


def _config(args: argparse.Namespace) -> dict:
    return {"cores": os.cpu_count(), "load_avg_at_start": os.getloadavg(), "quick": args.quick,
            "bytes": {"rows": args.rows, "batch_size": args.bytes_batch, "small_batch": args.small_batch,
                      "dim": args.bytes_dim, "trainers": args.bytes_trainers, "steps": args.bytes_steps,
                      "skip": args.bytes_skip, "rounds": args.bytes_rounds, "rate_mbit": args.bytes_rate,
                      "packets": args.packets},
            "rates": {"servers": args.servers, "trainers": args.trainers, "rate_mbit": args.rate, "dim": args.dim,
                      "batch_size": args.batch_size, "steps": args.steps, "skip": args.skip, "rounds": args.rounds,
                      "train_samples": args.train_samples, "qdisc": args.qdisc},
            "warm_up_steps": args.warm_up_steps}


def _run_part(fn, args: argparse.Namespace, deadline: scaling.Deadline, progress: dict) -> str | None:
    """``fn``, its failure as one line (what it measured stays in ``progress``)."""
    try:
        fn(args, deadline, progress)
    except (TimeoutError, RuntimeError, OSError, ValueError) as e:
        log.error("stopped: %s: %s", type(e).__name__, e)
        return f"{type(e).__name__}: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    reason = multihost.available()
    if reason:
        log.error("cannot build the namespaces this benchmark needs: %s", reason)
        return 2
    t0 = time.monotonic()
    deadline = scaling.Deadline(args.timeout)
    a: dict = {}
    b: dict = {}
    errors: dict[str, str | None] = {"bytes": None, "rates": None}
    error = None
    with paired.exit_on_sigterm():
        try:
            if not args.skip_bytes:
                errors["bytes"] = _run_part(measure_bytes, args, deadline, a)
            if not args.skip_rates and not (errors["bytes"] or "").startswith("TimeoutError"):
                errors["rates"] = _run_part(measure_rates, args, deadline, b)
        except SystemExit as e:  # SIGTERM: everything is stopped; write what was measured
            error = f"stopped by SIGTERM (exit {e.code})"
    result: dict = {"command": command_line(args), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "wall_s": time.monotonic() - t0, "config": _config(args), "method": METHOD, "error": error}
    if not args.skip_bytes:
        part: dict = {"error": errors["bytes"], "order_per_round": a.get("order_per_round", []),
                      "runs": a.get("runs", {}), "servers": a.get("servers", {}), "rpc_pickles": a.get("rpc_pickles")}
        done = a.get("rounds_done", 0)
        if done:
            summary = summarize_bytes(a["setups"], {k: v[:done] for k, v in a["runs"].items()})
            for row in summary["setups"].values():
                server = a["servers"].get(row["prefill"], {})
                row["rows_in_table"] = min(server["rows"].values()) if server.get("rows") else None
                row["server_rss_mb"] = server.get("rss_mb")
            part["summary"] = summary
            result["targets"] = targets(summary)
        result["bytes"] = part
    if not args.skip_rates:
        part = {"error": errors["rates"], "order_per_round": b.get("order_per_round", []), "runs": b.get("runs", {})}
        done = b.get("rounds_done", 0)
        if done:
            part["summary"] = summarize_rates(args.servers, {k: v[:done] for k, v in b["runs"].items()})
        result["rates"] = part
    sys.stdout.write(write_result(args.results_dir / "embedding-tables", result, "embedding_tables", markdown))
    return 0 if error is None and not any(errors.values()) else 3


if __name__ == "__main__":
    sys.exit(main())
