"""Paired rounds: setups run back to back with the local loop, ratios taken round by round.

    python -m benchmarks.paired --rounds 10        # the local loops and PS 1 and 2 trainers, plain and chained
    python -m benchmarks.paired --setups local-cached,ps-async-2,ps-chained-async-2 --rounds 6
    python -m benchmarks.paired --model resnet18 --batch-size 32 --steps 30 --skip 6 --rounds 4
    python -m benchmarks.paired --setups trainer-compute --rounds 6  # trainer compute, DDP, stragglers, bytes, cost
    python -m benchmarks.paired --setups memory-state --rounds 8     # the state in /dev/shm against in the process

Why: the PS step variants differ by a round trip or two (1-3 ms of a ~50 ms step), while the
speed of the 2-core VM drifts by 10-30% from one minute to the next, so one window per setup,
each at its own moment, cannot rank them or hold a 0.90 ratio steady. Here every PS server
(one per update mode and step variant) stays up for the whole measurement; each round runs
every setup once for ``--steps`` steps, back to back in a rotating order, and each run's
samples/s is its throughput after ``--skip`` warm-up steps of every process (PS: all
trainers together, DDP: all ranks, side-by-side local loops: all loops, over the interval in
which they all step). A setup's ratio is its samples/s over the best single local loop's *of
the same round*; the result is the median of those ratios over the rounds. Ratios between two
setups (2 trainers over 1, PS over DDP, ...) are taken the same way, round by round.

Bytes on the wire: the PS servers, trainers and DDP ranks run in a network namespace of the
harness's own (``benchmarks.harness.netns``; root and iproute2), whose loopback carries their traffic
and nothing else; a run's bytes per step are the loopback's transmitted bytes over its measured
interval divided by the trainer (rank) steps in it. Without a namespace, ``ss`` counts the bytes
sent on the run's sockets. The PS server's CPU time (``/proc/PID/stat``, every thread) over the
same interval, divided by the trainer steps, is its cost per trainer step. ``-straggler``
setups hold their last trainer (rank) to half a core (``benchmarks.harness.throttle``: a CPU cgroup
where one is writable, else SIGSTOP/SIGCONT duty cycling).

``benchmarks.studies.throughput`` runs the same rounds after its one-window pass (``--rounds``) and takes
the issue's targets from them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness import capacity, measure, netns, targets, throttle
from benchmarks.harness.paired_stats import leg_rate, summarize
from benchmarks.harness.report import paired_markdown, write_result
from benchmarks.harness.setups import (
    READY,
    STRAGGLER_SHARE,
    Setup,
    check_devices,
    counts_bytes,
    ddp_rank_argv,
    ddp_rank_env,
    is_ceiling,
    local_argv,
    parse_setups,
    process_env,
    server_argv,
    server_key,
    steps_for,
    straggler_index,
    trainer_argv,
)

log = logging.getLogger(__name__)

DEFAULT_SETUPS = "local,local-cached,ps-async-1,ps-chained-async-1,ps-async-2,ps-chained-async-2"
TRAINER_COMPUTE_SETUPS = ("local-cached,local-1t,local-1t-x2,ddp-2,ps-pushpull-async-1,ps-pushpull-async-2,"
                  "ps-pushpull-bf16-async-1,ps-pushpull-bf16-async-2,ps-pull-async-1,ps-pull-async-2,"
                  "ddp-2-straggler,ps-pushpull-async-2-straggler,ps-pushpull-ssp4-2-straggler,"
                  "ps-pushpull-async-2-sock,ps-pushpull-bf16-async-2-sock")
"""The trainer-compute targets (``--setups trainer-compute``): trainer compute against the side-by-side local
loops and DDP, with a straggler, the reference ``pull``; the bytes of each wire dtype and the
server's cost per step from the ``-sock`` setups, whose tensors cross the sockets as between
hosts."""
PROTECTION_SETUPS = "local-1t,ps-pushpull-async-2-token,ps-pushpull-async-2-open,ps-async-2-token,ps-async-2-open"
"""The protection target (``--setups protection``): the join token's and the allow-list's cost,
trainer and server compute."""
MEMORY_STATE_SETUPS = "local-1t,ps-pushpull-async-2,ps-pushpull-async-2-shm"
"""The state in shared memory's target (``--setups memory-state``): steps/s with the server's state
in ``/dev/shm`` against the same setup without, 2 pushpull trainers."""
GPU_SETUPS = ("local,ps-pushpull-async-1,ps-pushpull-async-1-no-overlap,ps-pushpull-bf16-async-1,"
              "ps-pushpull-async-1-staged,ps-pushpull-async-1-hostcopy,ps-pushpull-async-4,ps-pushpull-sync-1")
"""The GPU paths (``--setups gpu``, with ``--devices cuda:0 --trainer-device cuda:0``): one pushpull
trainer device to device (the default there, overlapped), the same without overlap, in bf16,
through pinned and through pageable host memory, 4 trainers sharing the GPU, and sync (never
overlapped); against the local loop on the same GPU."""
SETUP_ALIASES = {"trainer-compute": TRAINER_COMPUTE_SETUPS, "protection": PROTECTION_SETUPS,
                 "memory-state": MEMORY_STATE_SETUPS, "gpu": GPU_SETUPS}
DEFAULT_RESULTS = measure.RESULTS
LEG_TIMEOUT_S = 600.0


def pairable(setup: Setup) -> bool:
    """Local loops, PS setups and DDP; FSDP is left out."""
    return setup.kind in ("local", "ps", "ddp")


class Rounds:
    """The servers and child processes of one paired measurement (stopped in ``close``), in a
    network namespace of its own where one can be made (``use_netns``: auto, on, off)."""

    def __init__(self, *, model: str, batch_size: int, steps: int, skip: int, work: Path,
                 devices: str | None = None, tp_channels: str = "default", use_netns: str = "auto",
                 throttle_method: str = "auto", warm_up_steps: int | None = None,
                 trainer_device: str | None = None, qdisc: str | None = None) -> None:
        self.model, self.batch_size, self.steps, self.skip = model, batch_size, steps, skip
        self.warm_up_steps = skip + 10 if warm_up_steps is None else warm_up_steps
        self.work, self.devices, self.tp_channels = work, devices, tp_channels
        self.trainer_device = trainer_device
        self.throttle_method = throttle_method
        self.children = measure.Children(work)
        self.servers: dict[tuple, tuple[int, measure.Child]] = {}  # server_key -> (port, server)
        self.ns: netns.NetNamespace | None = None
        self.throttles_used: set[str] = set()
        throttle.cleanup_stale()  # cgroups a killed harness left behind
        if use_netns != "off":
            reason = netns.available()
            if reason is None:
                netns.cleanup_stale()
                try:
                    self.ns = netns.NetNamespace.create()
                except OSError as e:
                    reason = str(e)
            if self.ns is None:
                if use_netns == "on":
                    raise OSError(f"--netns on: {reason}")
                log.info("no network namespace (%s): bytes from ss on the runs' sockets", reason)
        if qdisc:
            if self.ns is None:
                raise OSError("--qdisc needs the harness's network namespace (--netns on)")
            try:
                self.ns.shape(qdisc.split())
            except OSError:
                self.ns.close()
                raise
            log.info("the namespace's loopback goes through tc qdisc %s (every packet, both ways)", qdisc)
        self.bytes_method = ("loopback tx bytes of the harness's network namespace (headers included)" if self.ns
                             else "ss: bytes sent on the TCP sockets of the run's processes")

    def close(self) -> None:
        try:
            self.children.stop_all()
        finally:
            if self.ns is not None:
                self.ns.close()
                self.ns = None

    def _wrap(self, argv: list[str]) -> list[str]:
        return self.ns.wrap(argv) if self.ns is not None else argv

    def _server(self, setup: Setup) -> tuple[int, measure.Child]:
        # One server per step variant too: in a deployment a job's trainers share one --step,
        # and dist_autograd's backward (plain) gives the server more OpenMP teams, which
        # slows every later step of that server (psserver.server.engine.compute).
        key = server_key(setup)
        if key not in self.servers:
            port = measure.free_port()
            server = self.children.start(self._wrap(server_argv(setup, model=self.model, port=port,
                                                                devices=self.devices, tp_channels=self.tp_channels)),
                                         "server-" + "-".join(map(str, key)))
            server.wait_for(r"serving \S+ on", 180)
            self.servers[key] = (port, server)
            if self.warm_up_steps > 0:
                self._warm_up(setup, port)
        return self.servers[key]

    def _warm_up(self, setup: Setup, port: int) -> None:
        """One unmeasured run of the setup's trainers (no straggler) against a new server. A
        trainer-compute server's first trainer session runs at a fraction of the later ones'
        speed (measured, one pushpull trainer: 62 against 6 server CPU ms per step, 620 against
        1,150 samples/s; while its compute thread holds the only OpenMP team, libgomp spins
        long: benchmarks/README.md), which would bias round 1 by the order of the setups."""
        plain = dataclasses.replace(setup, straggler=False)
        steps, tag = self.warm_up_steps, "warm-up-" + "-".join(map(str, server_key(setup)))
        log.info("warming up the server of %s (%d steps per trainer, not measured)", setup.name, steps)
        argvs = [trainer_argv(plain, r, port=port, batch_size=self.batch_size, steps=steps, device=self.trainer_device,
                              stats_out=str(self.work / f"{tag}-{r}.json")) for r in range(setup.trainers)]
        procs = [self.children.start(self._wrap(a), f"{tag}-{r}", process_env(setup)) for r, a in enumerate(argvs)]
        try:
            for p in procs:
                code = p.wait(LEG_TIMEOUT_S)
                if code != 0:
                    raise RuntimeError(f"{p.name} {'timed out' if code is None else f'exited with {code}'}:\n"
                                       f"{p.tail()}")
        finally:
            for p in procs:
                p.stop()
            self.children.items = [c for c in self.children.items if c not in procs]

    def _start(self, setup: Setup, tag: str) -> tuple[list[Path], list[measure.Child], measure.Child | None]:
        kind, n = setup.kind, setup.trainers
        env = process_env(setup)
        if kind == "local":
            stats = [self.work / f"{tag}-{i}.json" for i in range(setup.procs or 1)]
            procs = [self.children.start(local_argv(setup, model=self.model, batch_size=self.batch_size,
                                                    seconds=LEG_TIMEOUT_S / 2, steps=self.steps,
                                                    stats_out=str(p)), p.stem, env) for p in stats]
            return stats, procs, None
        stats = [self.work / f"{tag}-{'trainer' if kind == 'ps' else 'rank'}{r}.json" for r in range(n)]
        if kind == "ps":
            port, server = self._server(setup)
            procs = [self.children.start(self._wrap(trainer_argv(setup, r, port=port, batch_size=self.batch_size,
                                                                 steps=steps_for(setup, r, self.steps),
                                                                 stats_out=str(stats[r]),
                                                                 device=self.trainer_device)),
                                         stats[r].stem, env) for r in range(n)]
            return stats, procs, server
        if kind == "ddp":
            port = measure.free_port()
            procs = [self.children.start(self._wrap(ddp_rank_argv(setup, model=self.model, batch_size=self.batch_size,
                                                                  steps=self.steps, stats_out=str(stats[r]))),
                                         stats[r].stem, ddp_rank_env(setup, r, master_port=port)) for r in range(n)]
            return stats, procs, None
        raise ValueError(f"{setup.name}: only local, PS and DDP setups run in paired rounds")

    def run_leg(self, setup: Setup, tag: str) -> dict:
        """One run of ``setup`` for ``steps`` steps (per trainer, rank or loop)."""
        stats, procs, server = self._start(setup, tag)
        probe = held = None
        try:
            idx = straggler_index(setup)
            if idx is not None:
                procs[idx].wait_for(READY[setup.kind], LEG_TIMEOUT_S / 2)
                held = throttle.start(procs[idx].pid, STRAGGLER_SHARE, self.throttle_method)
                self.throttles_used.add(held.method)
            if setup.kind != "local":
                if self.ns is not None:
                    wire, interval = self.ns.tx_bytes, 0.1
                else:
                    pids = [p.pid for p in procs] + ([server.pid] if server else [])
                    wire, interval = (lambda: measure.socket_snapshot(pids)), 0.5
                probe = measure.Probe(server.pid if server else None, wire, interval).start()
            deadline = time.monotonic() + LEG_TIMEOUT_S
            for p in procs:
                code = p.wait(max(1.0, deadline - time.monotonic()))
                if code != 0:
                    raise RuntimeError(f"{p.name} {'timed out' if code is None else f'exited with {code}'}:\n"
                                       f"{p.tail()}")
        finally:
            if held is not None:
                held.close()
            samples = probe.stop() if probe is not None else []
            for p in procs:
                p.stop()  # exited: closes its log
            self.children.items = [c for c in self.children.items if c not in procs]
        written = [json.loads(s.read_text()) for s in stats]
        ends = [w["step_ends"] for w in written]
        leg = leg_rate(ends, self.batch_size, self.skip)
        if setup.kind == "ps":
            leg["transports"] = check_transports(setup, [w.get("transport") for w in written])
        if samples:
            leg.update(measure.per_step(samples, ends, leg["start"], leg["end"]))
            if setup.kind == "ps" and not counts_bytes(setup, self.tp_channels):
                for key in ("bytes_per_step", "bytes_per_s", "bytes_seconds", "bytes_samples"):
                    leg.pop(key, None)  # the tensors crossed outside the sockets (cma)
        if held is not None:
            leg["throttle"] = held.method
        return leg


def check_transports(setup: Setup, used: list[dict | None]) -> list[str]:
    """The paths the trainers' buffers took (``--stats-out``'s ``transport``), sorted; a leg whose
    trainers did not take the path asked for, or fell back from a device map that failed its
    probe, is an error: its figures would be of another path than its name says."""
    kinds = sorted({u["kind"] for u in used if u})
    fell = [u["fell_back"] for u in used if u and u.get("fell_back")]
    if fell:
        raise RuntimeError(f"{setup.name}: a trainer's device map failed its probe ({fell[0]}): it went staged")
    if setup.transport and kinds != [setup.transport]:
        raise RuntimeError(f"{setup.name}: asked --transport {setup.transport}, the trainers took {', '.join(kinds)}")
    return kinds


def _leg_line(leg: dict) -> str:
    extra = ""
    if leg.get("bytes_per_step") is not None:
        extra += f", {leg['bytes_per_step'] / 1e6:.2f} MB/step"
    if leg.get("server_cpu_ms_per_step") is not None:
        extra += f", server {leg['server_cpu_ms_per_step']:.1f} CPU ms/step"
    if leg.get("throttle"):
        per = ", ".join("-" if ms is None else f"{ms:.0f}" for ms in leg["step_ms_per_process"])
        extra += f", straggler held by {leg['throttle']} (step ms per process: {per})"
    return f"{leg['samples_per_s']:6.0f} samples/s, step {leg['step_ms']:.1f} ms{extra}"


def round_order(setups: list[Setup], r: int) -> list[Setup]:
    """Round ``r``'s order: the list rotated by ``r``, so that every setup leads one round and
    none always runs on the machine the one before it warmed."""
    k = r % len(setups)
    return setups[k:] + setups[:k]


def measure_rounds(setups: list[Setup], *, rounds: int, use_netns: str = "auto", throttle_method: str = "auto",
                   **kwargs) -> dict:
    """Every setup once per round, in an order that rotates by one each round. ``kwargs``: those
    of ``Rounds`` (model, batch_size, steps, skip, devices, tp_channels, warm_up_steps, trainer_device, qdisc)."""
    bad = [s.name for s in setups if not pairable(s)]
    if bad:
        raise ValueError(f"not measurable in paired rounds: {', '.join(bad)}")
    runs: dict[str, list[dict]] = {s.name: [] for s in setups}
    orders = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="psserver-paired-") as tmp:
        rr = Rounds(work=Path(tmp), use_netns=use_netns, throttle_method=throttle_method, **kwargs)
        try:
            for r in range(rounds):
                order = round_order(setups, r)
                orders.append([s.name for s in order])
                for s in order:
                    leg = rr.run_leg(s, f"{s.name}-{r}")
                    runs[s.name].append(leg)
                    log.info("[%5.0fs] round %d/%d %-30s %s", time.monotonic() - t0, r + 1, rounds, s.name,
                             _leg_line(leg))
        finally:
            rr.close()
    out = summarize(setups, runs)
    out.update(rounds=rounds, steps=kwargs["steps"], skip=kwargs["skip"], order_per_round=orders, runs=runs,
               tp_channels=kwargs.get("tp_channels", "default"), qdisc=kwargs.get("qdisc"),
               bytes_method=rr.bytes_method if any(s.kind != "local" for s in setups) else None,
               throttle_methods=sorted(rr.throttles_used), wall_s=time.monotonic() - t0)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.paired", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mnist_cnn", help="model the server hosts (default mnist_cnn)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step and trainer (default 64)")
    p.add_argument("--setups", default=DEFAULT_SETUPS,
                   help=f"comma-separated local, PS and DDP setups, or trainer-compute ({TRAINER_COMPUTE_SETUPS}), or "
                        f"protection ({PROTECTION_SETUPS}), or memory-state ({MEMORY_STATE_SETUPS}) "
                        f"(default {DEFAULT_SETUPS})")
    p.add_argument("--rounds", type=int, default=6, help="rounds of every setup (default 6)")
    p.add_argument("--steps", type=int, default=80, help="steps per run and trainer (default 80)")
    p.add_argument("--skip", type=int, default=20, help="warm-up steps left out of each run (default 20)")
    p.add_argument("--warm-up-steps", type=int, default=None,
                   help="steps per trainer of one unmeasured run against each new PS server (a server's first trainer "
                        "session is slow; default --skip + 10; 0: none)")
    p.add_argument("--devices", default=None, help="server --devices (default: its own choice)")
    p.add_argument("--trainer-device", default=None,
                   help="the PS trainers' --device, for example cuda:0 (default: theirs, the CPU)")
    p.add_argument("--tp-channels", default="default",
                   help="TensorPipe channels of the servers (default: TensorPipe's own choice, as psserver runs; on "
                        "one host it moves tensors with cma, outside the sockets, so only -sock setups count bytes; "
                        "basic: every setup's tensors cross the sockets)")
    p.add_argument("--netns", default="auto", choices=("auto", "on", "off"),
                   help="run PS and DDP processes in a network namespace of the harness's own and count the bytes "
                        "on its loopback (auto: where root and iproute2 allow, else ss; default auto)")
    p.add_argument("--qdisc", default=None, metavar="ARGS",
                   help="shape the namespace's loopback with tc qdisc ARGS, as hosts apart (for example 'tbf rate "
                        "1gbit burst 256kb latency 100ms'; for -sock setups, whose tensors cross the sockets); needs "
                        "--netns on")
    p.add_argument("--throttle", default="auto", choices=throttle.METHODS,
                   help="how -straggler setups hold their last trainer to half a core (auto: a CPU cgroup where "
                        "writable, else SIGSTOP/SIGCONT; default auto)")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS, help="where the JSON and Markdown go")
    args = p.parse_args(argv)
    try:
        args.setups = parse_setups(SETUP_ALIASES.get(args.setups.strip(), args.setups))
    except ValueError as e:
        p.error(f"--setups: {e}")
    bad = [s.name for s in args.setups if not pairable(s)]
    if bad:
        p.error(f"--setups: only local, PS and DDP setups run in paired rounds, not {', '.join(bad)}")
    if not any(is_ceiling(s) for s in args.setups):
        p.error("--setups: name at least one single local loop (local, local-cached, local-Nt): the ratios divide "
                "by it")
    if args.rounds < 1 or args.skip < 0 or args.steps < args.skip + 6 or args.batch_size < 1 \
            or (args.warm_up_steps is not None and args.warm_up_steps < 0):
        p.error("need --rounds >= 1, --batch-size >= 1, --skip >= 0, --steps >= --skip + 6 and --warm-up-steps >= 0")
    try:
        check_devices(args.devices, args.trainer_device)
    except ValueError as e:
        p.error(str(e))
    staged = [s.name for s in args.setups if s.transport]
    if staged and not (args.trainer_device or "").startswith("cuda"):
        p.error(f"--setups: {', '.join(staged)}: -staged and -hostcopy choose a GPU trainer's transport; give "
                "--trainer-device cuda:N")
    if args.qdisc is not None and (args.netns != "on" or not args.qdisc.strip()):
        p.error("--qdisc needs --netns on and a qdisc (for example 'tbf rate 1gbit burst 256kb latency 100ms')")
    problem = check_machine_flags(args.netns, args.throttle, args.setups)
    if problem:
        p.error(problem)
    return args


def check_machine_flags(use_netns: str, throttle_method: str, setups: list[Setup]) -> str | None:
    """What this machine cannot do of ``--netns on`` and a ``--throttle`` cgroup kind (for the
    setups that need it), in one line; None when all is well."""
    if use_netns == "on" and netns.available():
        return f"--netns on: {netns.available()}"
    if throttle_method in ("cgroup", "cgroup1", "cgroup2") and any(s.straggler for s in setups):
        have = [v for v, _ in throttle.cgroup_parents()]
        if not have or (throttle_method != "cgroup" and throttle_method not in have):
            return f"--throttle {throttle_method}: no writable CPU cgroup of that kind here (use auto or sigstop)"
    return None


@contextlib.contextmanager
def exit_on_sigterm():
    """While inside: SIGTERM (``timeout``, a CI runner) raises SystemExit, so every ``finally``
    runs: child processes stopped, the network namespace deleted, straggler cgroups removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = []

    def stop(signum, frame) -> None:  # noqa: ARG001
        if stopping:  # a second SIGTERM would cut the cleanup the first one started short
            log.warning("SIGTERM again: already stopping")
            return
        stopping.append(signum)
        log.warning("SIGTERM: stopping the runs and cleaning up")
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    with exit_on_sigterm():
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    names = ",".join(s.name for s in args.setups)
    log.info("paired rounds: %d x %s (%d steps, %d skipped)", args.rounds, names, args.steps, args.skip)
    paired = measure_rounds(args.setups, rounds=args.rounds, model=args.model, batch_size=args.batch_size,
                            steps=args.steps, skip=args.skip, devices=args.devices, tp_channels=args.tp_channels,
                            use_netns=args.netns, throttle_method=args.throttle, warm_up_steps=args.warm_up_steps,
                            trainer_device=args.trainer_device, qdisc=args.qdisc)
    command = (f"python -m benchmarks.paired --model {args.model} --batch-size {args.batch_size} --setups {names} "
               f"--rounds {args.rounds} --steps {args.steps} --skip {args.skip}")
    for flag, value, default in (("--warm-up-steps", args.warm_up_steps, None), ("--tp-channels", args.tp_channels,
                                 "default"), ("--netns", args.netns, "auto"), ("--throttle", args.throttle, "auto"),
                                 ("--devices", args.devices, None), ("--trainer-device", args.trainer_device, None),
                                 ("--qdisc", args.qdisc, None)):
        if value != default:
            command += f" {flag} {shlex.quote(str(value))}"
    result = {"command": command, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": time.monotonic() - t0,
              "config": {"model": args.model, "batch_size": args.batch_size, "setups": names,
                         "tp_channels": args.tp_channels, "devices": args.devices,
                         "trainer_device": args.trainer_device, "netns": args.netns, "qdisc": args.qdisc,
                         "throttle": args.throttle, "cores": os.cpu_count(), "load_avg": os.getloadavg()},
              "paired": paired}
    result["trainer_compute_targets"] = targets.trainer_compute_ratios(paired, args.model, args.batch_size)
    result["protection_targets"] = targets.protection_ratios(paired)
    result["memory_state_targets"] = targets.memory_state_ratios(paired)
    result["server_capacity"] = capacity.from_paired(paired, args.model, args.batch_size)
    md = write_result(args.results_dir / f"paired-{args.model}-b{args.batch_size}", result, "paired",
                      paired_markdown)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
