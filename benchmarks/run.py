"""The benchmark harness: local loops, PS (async/sync/ssp, 1/2/4 trainers, server or trainer
compute, with a straggler), DDP and FSDP in one run.

    python -m benchmarks.run --quick                       # 2-3 minutes on 2 cores
    python -m benchmarks.run --model mnist_cnn --batch-size 64       # ~45 minutes on 2 cores
    python -m benchmarks.run --model resnet18 --batch-size 32 --setups local,ps-async-1
    psserver bench ...                                     # the same, as a CLI verb

Every setup runs real processes (``psserver serve`` + N ``psserver train``; DDP ranks started
one by one with torchrun's variables, ``benchmarks.workers ddp``; FSDP through
``benchmarks.collective_overhead``), one setup at a time, and reports samples/s
(median of windows after warm-up; PS: the total over trainers), step latency p50/p95, bytes
on the wire per step (``ss`` on the setup's TCP sockets), the server's CPU while idle (N
trainers joined and waiting) and while training, and the peak RSS of every process. The
local loop, the ceiling every ratio divides by, runs in bursts spread over the run (start,
middle, end) and its windows are pooled, so load that drifts during the run hits both sides.

Then come paired rounds (``benchmarks.paired``, ``--rounds``): the local loops, the PS
async and ssp setups of up to 2 trainers and DDP with up to 2 ranks, back to back, every
round; each ratio is taken against the best local loop of its own round (or, for trainer
compute, between two setups of the same round), and the throughput targets read the median of
those per-round ratios (the one-window ratio is recorded beside it). On a 2-core VM whose
speed drifts by 10-30% from minute to minute, one window per setup cannot hold a 0.90 ratio
steady; a pairing within seconds can.

Writes ``<results>/bench-<model>-b<batch>-<time>.{json,md,png}`` and ``latest.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import capacity, measure, paired, report, throttle
from benchmarks.setups import (
    READY,
    STRAGGLER_SHARE,
    check_devices,
    ddp_rank_argv,
    ddp_rank_env,
    is_ceiling,
    local_argv,
    parse_setup,
    parse_setups,
    process_env,
    server_argv,
    steps_for,
    straggler_index,
    trainer_argv,
)
from benchmarks.targets import lower_bound, ratios, trainer_compute_floor, trainer_compute_ratios

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"
FULL_SETUPS = ("local,local-1t,local-cached,local-1t-x2,ps-async-1,ps-async-2,ps-async-4,ps-sync-1,ps-sync-2,ps-sync-4,"
               "ps-chained-async-1,ps-chained-async-2,ps-chained-sync-2,ps-pushpull-async-1,ps-pushpull-async-2,"
               "ps-pushpull-async-4,ps-pushpull-async-2-straggler,ddp-2,ddp-2-straggler,fsdp-2")
QUICK_SETUPS = "local,local-1t-x2,ps-pushpull-async-2,ddp-2"
WARMUP_STEPS = 5  # collective runs: steps before their windows
MIN_PLANNED_STEPS = 40  # per PS trainer or DDP rank in the one-window pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="mnist_cnn", help="model name (mnist_cnn, mlp, resnet18, ...)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step and trainer (default 64)")
    p.add_argument("--seconds", type=float, default=None,
                   help="measured seconds per setup, after warm-up (default 10; --quick 4)")
    p.add_argument("--quick", action="store_true",
                   help=f"fewer setups ({QUICK_SETUPS}) and short windows: 2-3 minutes on 2 cores")
    p.add_argument("--setups", default=None, help=f"comma-separated (default {FULL_SETUPS})")
    p.add_argument("--warmup", type=float, default=None, help="seconds discarded per process (default 3; quick 1.5)")
    p.add_argument("--window", type=float, default=None, help="window length in seconds (default seconds/6)")
    p.add_argument("--idle-seconds", type=float, default=None,
                   help="seconds of server CPU measured with trainers joined and idle, async setups "
                        "(default 4; quick 2; 0: skip)")
    p.add_argument("--rounds", type=int, default=None,
                   help="paired rounds after the one-window pass, for the throughput targets "
                        "(default 6; quick 2; 0: none)")
    p.add_argument("--round-steps", type=int, default=None,
                   help="steps per trainer and paired run (default 80; quick 20)")
    p.add_argument("--round-skip", type=int, default=None,
                   help="warm-up steps left out of each paired run (default 20; quick 6)")
    p.add_argument("--tp-channels", default="basic",
                   help="TensorPipe channels of the PS server (default basic: tensors cross the socket as "
                        "between hosts, so ss counts them; 'default': TensorPipe's own choice, which on one "
                        "host moves tensors with cma outside any socket)")
    p.add_argument("--devices", default=None, help="server --devices (default: its own choice: GPUs, else cpu)")
    p.add_argument("--netns", default="auto", choices=("auto", "on", "off"),
                   help="paired rounds: run PS and DDP processes in a network namespace of the harness's own and "
                        "count bytes on its loopback (auto: where root and iproute2 allow, else ss; default auto)")
    p.add_argument("--throttle", default="auto", choices=throttle.METHODS,
                   help="how -straggler setups hold their last trainer or rank to half a core (auto: a CPU "
                        "cgroup where writable, else SIGSTOP/SIGCONT duty cycling; default auto)")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS,
                   help=f"output directory (default {DEFAULT_RESULTS})")
    p.add_argument("--keep-logs", action="store_true", help="keep every child's log under the results directory")


def round_settings(args: argparse.Namespace) -> tuple[int, int, int]:
    """Paired rounds, steps per run and warm-up steps skipped, after the --quick defaults."""
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 6)
    steps = args.round_steps or (20 if args.quick else 80)
    skip = args.round_skip if args.round_skip is not None else (6 if args.quick else 20)
    return rounds, steps, skip


class Run:
    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.args = args
        self.log_dir = log_dir
        self.quick = args.quick
        self.seconds = args.seconds or (4.0 if args.quick else 10.0)
        self.warmup = args.warmup if args.warmup is not None else (1.5 if args.quick else 3.0)
        self.window = args.window or max(1.0, self.seconds / 6)
        self.idle_s = args.idle_seconds if args.idle_seconds is not None else (2.0 if args.quick else 4.0)
        self.rounds, self.round_steps, self.round_skip = round_settings(args)
        self.local: dict[str, dict] = {}  # variant -> bursts, device, threads, peak RSS
        self.counter = 0

    def _name(self, base: str) -> str:
        self.counter += 1
        return f"{self.counter:02d}-{base}"

    # ---- local -------------------------------------------------------------------------

    def local_burst(self, setup: dict, seconds: float) -> None:
        """One burst of a local-loop variant (K loops side by side for ``local-Nt-xK``: their
        total over the interval in which all of them step); its windows join the variant's pool."""
        name = self._name(setup["name"])
        stats = [self.log_dir / f"{name}-{i}.json" for i in range(setup.get("procs", 1))]
        children = measure.Children(self.log_dir)
        sampler = measure.Sampler()
        try:
            loops = [children.start(local_argv(setup, model=self.args.model, batch_size=self.args.batch_size,
                                               seconds=seconds + self.warmup, stats_out=str(p)), p.stem,
                                    process_env(setup)) for p in stats]
            for i, c in enumerate(loops):  # ss on its (absent) sockets: same sampling cost as PS
                sampler.track("local" if i == 0 else f"local{i}", c.pid, wire=True)
            sampler.start()
            for c in loops:
                if c.wait(seconds + self.warmup + 120) != 0:
                    raise RuntimeError(f"local loop failed ({c.popen.returncode}):\n{c.tail()}")
        finally:
            sampler.stop()
            children.stop_all()
        runs = [json.loads(p.read_text()) for p in stats]
        data = runs[0]
        a = measure.analyze_steps([d["step_ends"] for d in runs], self.args.batch_size, warmup_s=self.warmup,
                                  window_s=self.window)
        pool = self.local.setdefault(setup["name"], {"bursts": [], "rss": 0.0})
        pool["bursts"].append({**a.to_dict(), "latencies": a.latencies_s})
        pool["device"], pool["threads"] = data.get("device"), data.get("threads")
        pool["rss"] = max([pool["rss"], *(v / 2**20 for v in sampler.peak_rss.values())])
        side = f" x {len(runs)} side by side" if len(runs) > 1 else ""
        print(f"  {setup['name']} ({data.get('threads')} threads{side}): {a.samples_per_s:.0f} samples/s", flush=True)

    def local_result(self, name: str) -> dict:
        pool = self.local[name]
        bursts = pool["bursts"]
        windows = [w for b in bursts for w in b["samples_per_s_windows"]]
        lat = [x for b in bursts for x in b["latencies"]]
        return {
            "samples_per_s": statistics.median(windows),
            "samples_per_s_windows": windows,
            "samples_per_s_bursts": [b["samples_per_s"] for b in bursts],
            "steps_measured": sum(b["steps_measured"] for b in bursts),
            "step_p50_ms": 1e3 * measure.percentile(lat, 0.5),
            "step_p95_ms": 1e3 * measure.percentile(lat, 0.95),
            "bytes_per_step": 0,
            "bytes_method": "none: one process",
            "peak_rss_mb": {"local": pool["rss"]},
            "devices": [pool["device"]],
            "torch_threads": pool["threads"],
        }

    def local_steps_per_s(self) -> float:
        """The best local variant so far, in steps/s (sizes the PS and DDP runs)."""
        best = max(statistics.median(b["samples_per_s"] for b in p["bursts"]) for p in self.local.values())
        return best / self.args.batch_size

    def _hold_straggler(self, setup: dict, procs: list[measure.Child], out: dict):
        """The last trainer (rank) of a ``-straggler`` setup held to half a core, or None."""
        idx = straggler_index(setup)
        if idx is None:
            return None
        procs[idx].wait_for(READY[setup["kind"]], 300)
        held = throttle.start(procs[idx].pid, STRAGGLER_SHARE, self.args.throttle)
        out["straggler"] = {"index": idx, "share": STRAGGLER_SHARE, "method": held.method}
        return held

    # ---- parameter server --------------------------------------------------------------

    def ps(self, setup: dict) -> dict:
        n, update, bs = setup["trainers"], setup["update"], self.args.batch_size
        name = self._name(setup["name"])
        port = measure.free_port()
        children = measure.Children(self.log_dir)
        sampler = measure.Sampler(ss_every=1 if self.quick else 2)
        out: dict = {}
        held = None
        try:
            server = children.start(server_argv(setup, model=self.args.model, port=port, devices=self.args.devices,
                                                tp_channels=self.args.tp_channels), f"{name}-server")
            server.wait_for(r"serving \S+ on", 180)
            m = re.search(r"stage\(s\) on (.+?)(?:, resumed.*)?$", server.output(), re.M)
            out["devices"] = [d.strip() for d in m.group(1).split(",")] if m else []
            sampler.track("server", server.pid, wire=True)
            sampler.start()
            # Idle is idle whatever the update mode: async setups only (--quick: 2 trainers, the target).
            if self.idle_s > 0 and update == "async" and (not self.quick or n == 2):
                out.update(self._idle(server, port, n, name, children, sampler))
            steps = self._planned_steps(n)
            stats = [self.log_dir / f"{name}-trainer{r}.json" for r in range(n)]
            trainers = []
            for r in range(n):
                t = children.start(trainer_argv(setup, r, port=port, batch_size=bs, steps=steps_for(setup, r, steps),
                                                stats_out=str(stats[r])), f"{name}-trainer{r}", process_env(setup))
                sampler.track(f"trainer{r}", t.pid, wire=True)
                trainers.append(t)
            held = self._hold_straggler(setup, trainers, out)
            self._wait_all(trainers, steps * n)
            sampler.stop()
        finally:
            if held is not None:
                held.close()
            sampler.stop()
            children.stop_all()
        ends = [json.loads(p.read_text())["step_ends"] for p in stats]
        a = measure.analyze_steps(ends, bs, warmup_s=self.warmup, window_s=self.window)
        samples = sampler.snapshot()
        out.update(a.to_dict())
        wire = measure.wire_bytes_per_step(samples, ends, a.start, a.end)
        slopes = per_step(samples, ends, a.start, a.end, cpu_role="server")
        out["bytes_per_step"] = slopes.get("bytes_per_step", wire["bytes_per_step"] if wire else None)
        out["bytes_method"] = ("measured: ss bytes_sent of the server's and trainers' sockets, slope against time "
                               "over the trainers' step rate")
        out["server_cpu_ms_per_step"] = slopes.get("server_cpu_ms_per_step")  # psutil: the process and its threads
        out["bytes_window"] = wire
        out["server_train_cpu_pct"] = measure.cpu_percent(samples, "server", a.start, a.end)
        out["trainer_train_cpu_pct"] = [measure.cpu_percent(samples, f"trainer{r}", a.start, a.end) for r in range(n)]
        out["peak_rss_mb"] = {k: v / 2**20 for k, v in sampler.peak_rss.items() if "/" not in k}
        out["max_steps_per_trainer"] = steps
        return out

    def _wait_all(self, procs: list[measure.Child], total_steps: int) -> None:
        expected = total_steps / max(1e-6, self.local_steps_per_s())
        limit = 4 * expected + 120
        deadline = time.monotonic() + limit
        for t in procs:
            code = t.wait(max(1.0, deadline - time.monotonic()))
            if code is None:
                raise RuntimeError(f"{t.name} still running after {limit:.0f}s:\n{t.tail()}")
            if code != 0:
                raise RuntimeError(f"{t.name} exited with {code}:\n{t.tail()}")

    def _planned_steps(self, n: int) -> int:
        """Steps per trainer so that all N overlap for about warm-up + seconds (plus start-up skew);
        at least ``MIN_PLANNED_STEPS``: one-thread trainers and ranks can outrun a local loop of
        all cores that other load slows down (OpenMP barriers)."""
        rate = self.local_steps_per_s() * 1.15  # PS totals rarely beat the local loop
        return max(MIN_PLANNED_STEPS, math.ceil(rate * (self.seconds + self.warmup + 2.0) / n) + 5)

    def _idle(self, server: measure.Child, port: int, n: int, name: str, children: measure.Children,
              sampler: measure.Sampler) -> dict:
        """Server CPU alone, then with N real trainers joined and waiting (they leave afterwards)."""
        time.sleep(1.0)
        # Samples taken at the window's edges: the sampler's own (every 0.5 s) may leave fewer
        # than two inside a short window on a loaded machine.
        a = sampler.sample_now(False)
        time.sleep(self.idle_s)
        alone = measure.cpu_between(a, sampler.sample_now(False), "server")
        idle = []
        for r in range(n):
            c = children.start(measure.worker_argv("idle", "--server", f"127.0.0.1:{port}", "--rank", str(r),
                                                   "--num-trainers", str(n)), f"{name}-idle{r}")
            sampler.track(f"idle{r}", c.pid)
            idle.append(c)
        for c in idle:
            c.wait_for(r"idle trainer \d+ joined", 120)
        time.sleep(1.5)  # past the joins' own work
        a = sampler.sample_now(False)
        time.sleep(self.idle_s)
        b = sampler.sample_now(False)
        with_trainers = measure.cpu_between(a, b, "server")
        trainers_cpu = [measure.cpu_between(a, b, f"idle{r}") for r in range(n)]
        for r, c in enumerate(idle):
            c.stop(timeout=30)
            sampler.untrack(f"idle{r}")
        return {"server_idle_alone_cpu_pct": alone, "server_idle_cpu_pct": with_trainers,
                "idle_trainer_cpu_pct": trainers_cpu, "idle_seconds": self.idle_s}

    # ---- collectives -------------------------------------------------------------------

    def ddp(self, setup: dict) -> dict:
        """``ddp-N``: N rank processes started here (torchrun's variables), one torch thread
        each, for the planned steps; measured like the PS trainers (step ends, windows, ss)."""
        n, bs = setup["trainers"], self.args.batch_size
        name = self._name(setup["name"])
        children = measure.Children(self.log_dir)
        sampler = measure.Sampler(ss_every=1 if self.quick else 2)
        out: dict = {}
        held = None
        steps = self._planned_steps(n)
        stats = [self.log_dir / f"{name}-rank{r}.json" for r in range(n)]
        port = measure.free_port()
        try:
            ranks = [children.start(ddp_rank_argv(setup, model=self.args.model, batch_size=bs, steps=steps,
                                                  stats_out=str(stats[r])), f"{name}-rank{r}",
                                    ddp_rank_env(setup, r, master_port=port)) for r in range(n)]
            for r, c in enumerate(ranks):
                sampler.track(f"rank{r}", c.pid, wire=True)
            sampler.start()
            held = self._hold_straggler(setup, ranks, out)
            self._wait_all(ranks, steps * n)
            sampler.stop()
        finally:
            if held is not None:
                held.close()
            sampler.stop()
            children.stop_all()
        runs = [json.loads(p.read_text()) for p in stats]
        ends = [d["step_ends"] for d in runs]
        a = measure.analyze_steps(ends, bs, warmup_s=self.warmup, window_s=self.window)
        out.update(a.to_dict())
        samples = sampler.snapshot()
        wire = measure.wire_bytes_per_step(samples, ends, a.start, a.end)
        out["bytes_per_step"] = per_step(samples, ends, a.start, a.end).get(
            "bytes_per_step", wire["bytes_per_step"] if wire else None)
        out["bytes_method"] = "measured: ss bytes_sent of the ranks' sockets, slope against time over the step rate"
        out["bytes_window"] = wire
        out["peak_rss_mb"] = {k: v / 2**20 for k, v in sampler.peak_rss.items() if "/" not in k}
        out["devices"] = sorted({d.get("device", "cpu") for d in runs})
        out["torch_threads"] = [d.get("threads") for d in runs]
        out["max_steps_per_rank"] = steps
        return out

    def collective(self, setup: dict) -> dict:
        name = self._name(setup["name"])
        result_path = self.log_dir / f"{name}.json"
        children = measure.Children(self.log_dir)
        sampler = measure.Sampler(interval=0.25, ss_every=2)  # bytes are totals: sample often
        seconds = self.seconds
        try:
            c = children.start(measure.worker_argv(
                "collective", "--mode", setup["kind"], "--model", self.args.model, "--batch-size",
                str(self.args.batch_size), "--nproc", str(setup["trainers"]), "--seconds", str(seconds),
                "--window", str(self.window), "--warmup-steps", str(WARMUP_STEPS), "--out", str(result_path)), name)
            sampler.track("launcher", c.pid, wire=True)
            sampler.start()
            code = c.wait(6 * seconds + 180)
            if code != 0:
                raise RuntimeError(f"{setup['kind']} run failed ({code}):\n{c.tail()}")
        finally:
            sampler.stop()
            children.stop_all()
        r = json.loads(result_path.read_text())
        v = r["variants"]["psserver"]
        samples = sampler.snapshot()
        # Every rank step of the run: warm-up, 5 timing steps, the windows (no baseline variant).
        rank_steps = r["nproc"] * (WARMUP_STEPS + 5 + r["windows"] * r["window_steps"])
        total = measure.wire_total_bytes(samples)
        busy = [s.t for s in samples if s.sockets]
        return {
            "samples_per_s": v["samples_per_s"],
            "samples_per_s_windows": v.get("samples_per_s_windows"),
            "step_p50_ms": v["step_latency_p50_ms"],
            "step_p95_ms": v["step_latency_p95_ms"],
            "bytes_per_step": total / rank_steps if total else r["bytes_per_step_estimate"],
            "bytes_method": ("measured: ss bytes_sent of all ranks over the whole run (set-up included, "
                             "last <0.5 s missed) / rank steps" if total else
                             "estimate: benchmarks.collective_overhead (per rank sent)"),
            "bytes_per_step_estimate": r["bytes_per_step_estimate"],
            "bytes_total": total,
            "rank_steps": rank_steps,
            "cpu_total_pct": measure.cpu_percent(samples, "launcher", busy[0], busy[-1]) if len(busy) > 1 else None,
            "peak_rss_mb": {f"rank{i}": mb for i, mb in enumerate(r["peak_rss_mb_per_process"])},
            "peak_rss_mb_sampled": {k: val / 2**20 for k, val in sampler.peak_rss.items()},
            "devices": [r.get("device", "cpu")],
            "backend": r.get("backend"),
            "windows": r.get("windows"),
            "window_steps": r.get("window_steps"),
        }


def per_step(samples: list[measure.Sample], ends: list[list[float]], t0: float, t1: float,
             cpu_role: str | None = None) -> dict:
    """``measure.per_step`` (bytes and CPU time per step, least-squares slopes) on the
    sampler's snapshots: ``ss`` socket bytes and the CPU time of ``cpu_role``."""
    probe = [measure.ProbeSample(s.t, s.cpu.get(cpu_role) if cpu_role else None, s.sockets) for s in samples]
    return measure.per_step(probe, ends, t0, t1)


def machine_info() -> dict:
    import psutil
    import torch

    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cores_logical": os.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "cpu_model": cpu_model,
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": gpus,
        "load_avg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def run(argv: list[str] | None = None, prog: str = "python -m benchmarks.run") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        setups = check_args(args)
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="  %(message)s")  # paired rounds' progress
    return run_args(args, setups, command=" ".join([prog, *map(shlex.quote, sys.argv[1:] if argv is None else argv)]))


MAX_FLAG_VALUE = 86400
"""The most seconds (or rounds) a timing flag takes: a day of measuring is past any benchmark."""


def check_args(args: argparse.Namespace) -> list[dict]:
    """The setups to run; ValueError names what is wrong with the flags."""
    from psserver.models import check_model_name

    check_model_name(args.model)
    setups = parse_setups(args.setups or (QUICK_SETUPS if args.quick else FULL_SETUPS))
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    for flag in ("seconds", "warmup", "window", "idle_seconds", "rounds", "round_skip"):
        v = getattr(args, flag)
        # NaN passed a v < 0 check; inf, and 1e308, never ended
        if v is not None and not (math.isfinite(v) and 0 <= v <= MAX_FLAG_VALUE):
            raise ValueError(f"--{flag.replace('_', '-')} must be a number in 0..{MAX_FLAG_VALUE}, got {v}")
    check_devices(args.devices)
    _, steps, skip = round_settings(args)
    if steps < skip + 6:
        raise ValueError(f"--round-steps must be at least --round-skip + 6 ({skip + 6})")
    problem = paired.check_machine_flags(getattr(args, "netns", "auto"), getattr(args, "throttle", "auto"), setups)
    if problem:
        raise ValueError(problem)
    return setups


def paired_setups(setups: list[dict], failed: set[str]) -> list[dict]:
    """What the paired rounds measure: the local loops, PS async and ssp setups of 1-2 trainers
    and DDP of up to 2 ranks (the throughput targets, stragglers included), minus any that
    failed in the one-window pass."""
    return [s for s in setups if s["name"] not in failed and (
        s["kind"] == "local" or (s["kind"] == "ps" and s["update"] in ("async", "ssp") and s["trainers"] <= 2)
        or (s["kind"] == "ddp" and s["trainers"] <= 2))]


def run_args(args: argparse.Namespace, setups: list[dict], command: str) -> int:
    """Run ``setups`` (``check_args(args)``, which the caller reports as its usage error)."""
    with paired.exit_on_sigterm():  # children stopped, namespace and cgroups removed on SIGTERM too
        return _run_args(args, command, setups)


def _run_args(args: argparse.Namespace, command: str, setups: list[dict]) -> int:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    throttle.cleanup_stale()
    results_dir = args.results_dir
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = f"bench-{args.model}-b{args.batch_size}-{stamp}"
    log_ctx = tempfile.TemporaryDirectory(prefix="psserver-bench-") if not args.keep_logs else None
    log_dir = Path(log_ctx.name) if log_ctx else results_dir / f"{base}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    bench = Run(args, log_dir)
    t_start = time.monotonic()
    machine = machine_info()
    locals_ = [s for s in setups if s["kind"] == "local"]
    if not any(is_ceiling(s) for s in locals_):
        locals_ = [parse_setup("local"), *locals_]  # the ceiling is always measured
    others = [s for s in setups if s["kind"] != "local"]
    bursts = 2 if args.quick or len(others) < 3 else 3
    burst_s = max(bench.window * 3, bench.seconds * (1.0 if args.quick else 1.5) / bursts)
    burst_at = {0, len(others)} | ({len(others) // 2} if bursts == 3 else set())
    results: dict[str, dict] = {}
    try:
        for i in range(len(others) + 1):
            if i in burst_at:
                order = locals_ if i % 2 == 0 else locals_[::-1]
                for loc in order:
                    print(f"[{time.monotonic() - t_start:5.0f}s] {loc['name']} burst ({burst_s:.0f}s)", flush=True)
                    bench.local_burst(loc, burst_s)
            if i == len(others):
                break
            s = others[i]
            print(f"[{time.monotonic() - t_start:5.0f}s] {s['name']}", flush=True)
            try:
                res = bench.ps(s) if s["kind"] == "ps" else bench.ddp(s) if s["kind"] == "ddp" else bench.collective(s)
                print(f"  {res['samples_per_s']:.0f} samples/s", flush=True)
            except Exception as e:  # noqa: BLE001 - one failed setup must not lose the others
                traceback.print_exc()
                res = {"error": f"{type(e).__name__}: {e}"}
                if log_ctx is not None:  # keep the failed setup's logs
                    kept = results_dir / f"{base}-logs"
                    kept.mkdir(exist_ok=True)
                    for f in log_dir.glob(f"{bench.counter:02d}-*"):
                        shutil.copy(f, kept / f.name)
                    res["logs"] = str(kept)
            results[s["name"]] = res
        pairs = paired_setups([*locals_, *others], {n for n, r in results.items() if r.get("error")})
        paired_result = None
        if bench.rounds and any(s["kind"] == "ps" for s in pairs):
            print(f"[{time.monotonic() - t_start:5.0f}s] paired rounds: {bench.rounds} x "
                  f"{', '.join(s['name'] for s in pairs)}", flush=True)
            try:
                paired_result = paired.measure_rounds(
                    pairs, rounds=bench.rounds, model=args.model, batch_size=args.batch_size,
                    steps=bench.round_steps, skip=bench.round_skip, devices=args.devices, tp_channels=args.tp_channels,
                    use_netns=getattr(args, "netns", "auto"), throttle_method=getattr(args, "throttle", "auto"),
                    warm_up_steps=0 if args.quick else None)  # --quick: no unmeasured run per server
            except Exception as e:  # noqa: BLE001 - the one-window results stand without it
                traceback.print_exc()
                paired_result = {"error": f"{type(e).__name__}: {e}"}
    finally:
        if log_ctx is not None:
            log_ctx.cleanup()
    for loc in locals_:
        results[loc["name"]] = bench.local_result(loc["name"])
    # The ceiling: the best local loop measured (threads = cores unless fewer did better; the
    # server's allocator policy when that did better), so no server setting is left out of it.
    ceiling_name = max((loc["name"] for loc in locals_ if is_ceiling(loc)), key=lambda n: results[n]["samples_per_s"])
    local = results[ceiling_name]
    if not any(is_ceiling(s) for s in setups):
        setups = [*[s for s in locals_ if s not in setups], *setups]
    lb = lower_bound(args.model, args.batch_size)
    rows = []
    for s in setups:
        r = {**s, **results.get(s["name"], {"error": "not run"})}
        if not r.get("error"):
            r["ratio_to_local"] = r["samples_per_s"] / local["samples_per_s"]
            if r["kind"] == "ps" and r.get("bytes_per_step") is not None:
                # Trainer compute: the floor is the gradient up and the parameters down in the wire dtype.
                floor = trainer_compute_floor(args.model, r["wire"]) if r.get("compute") == "trainer" else lb["total"]
                r["bytes_vs_lower_bound"] = r["bytes_per_step"] / floor
            pr = (paired_result or {}).get("setups", {}).get(s["name"])
            if pr:
                r["paired_samples_per_s"] = pr["median_samples_per_s"]
                r["paired_x_local"] = pr.get("median_x_local")
        rows.append(r)
    devices_used = {}
    for r in rows:
        if r.get("devices"):
            devices_used[r["name"]] = ",".join(map(str, r["devices"]))
    machine["load_avg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    result = {
        "schema": 1,
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "machine": machine,
        "devices_used": devices_used,
        "config": {"model": args.model, "batch_size": args.batch_size, "seconds": bench.seconds, "quick": args.quick,
                   "warmup_s": bench.warmup, "window_s": bench.window, "idle_seconds": bench.idle_s,
                   "local_bursts": bursts, "ceiling": ceiling_name, "setups": [s["name"] for s in setups],
                   "server_devices": args.devices, "tp_channels": args.tp_channels, "rounds": bench.rounds,
                   "round_steps": bench.round_steps, "round_skip": bench.round_skip},
        "lower_bound": lb,
        "setups": rows,
        "paired": paired_result,
        "wall_s": time.monotonic() - t_start,
    }
    result["ratios"] = ratios(result)
    result["trainer_compute_targets"] = trainer_compute_ratios(paired_result, args.model, args.batch_size)
    result["server_capacity"] = capacity.from_paired(paired_result, args.model, args.batch_size)
    md = report.markdown(result)
    files = {}
    (results_dir / f"{base}.json").write_text(json.dumps(result, indent=2, default=str))
    (results_dir / f"{base}.md").write_text(md)
    files["json"], files["md"] = results_dir / f"{base}.json", results_dir / f"{base}.md"
    if report.chart(result, results_dir / f"{base}.png"):
        files["png"] = results_dir / f"{base}.png"
    else:
        print("matplotlib is missing: no chart (pip install matplotlib)", file=sys.stderr)
    for kind, path in files.items():
        (results_dir / f"latest.{kind}").write_bytes(path.read_bytes())
    print(md)
    print(f"wrote {', '.join(str(p) for p in files.values())} (and latest.*) in {result['wall_s']:.0f}s")
    return 1 if any(r.get("error") for r in rows) or (paired_result or {}).get("error") else 0


def main(argv: list[str] | None = None) -> int:
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
