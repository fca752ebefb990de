"""The one-window pass of the throughput study: each setup once, for a window of seconds
(``Run``: local bursts, PS, DDP, FSDP), and the machine it ran on."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import time
from pathlib import Path

from benchmarks.harness import measure, throttle
from benchmarks.harness.setups import (
    READY,
    STRAGGLER_SHARE,
    Setup,
    ddp_rank_argv,
    ddp_rank_env,
    local_argv,
    process_env,
    server_argv,
    steps_for,
    straggler_index,
    trainer_argv,
)

WARMUP_STEPS = 5  # collective runs: steps before their windows
MIN_PLANNED_STEPS = 40  # per PS trainer or DDP rank in the one-window pass


def round_settings(args: argparse.Namespace) -> tuple[int, int, int]:
    """Paired rounds, steps per run and warm-up steps skipped, after the --quick defaults."""
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 6)
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
        self.idle_s = args.idle_seconds if args.idle_seconds is not None else (0.0 if args.quick else 4.0)
        self.rounds, self.round_steps, self.round_skip = round_settings(args)
        self.local: dict[str, dict] = {}  # variant -> bursts, device, threads, peak RSS
        self.counter = 0

    def _name(self, base: str) -> str:
        self.counter += 1
        return f"{self.counter:02d}-{base}"

    # ---- local -------------------------------------------------------------------------

    def local_burst(self, setup: Setup, seconds: float) -> None:
        """One burst of a local-loop variant (K loops side by side for ``local-Nt-xK``: their
        total over the interval in which all of them step); its windows join the variant's pool."""
        name = self._name(setup.name)
        stats = [self.log_dir / f"{name}-{i}.json" for i in range(setup.procs or 1)]
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
        pool = self.local.setdefault(setup.name, {"bursts": [], "rss": 0.0})
        pool["bursts"].append({**a.to_dict(), "latencies": a.latencies_s})
        if a.disturbed:
            pool["disturbed"] = a.disturbed
        pool["device"], pool["threads"] = data.get("device"), data.get("threads")
        pool["rss"] = max([pool["rss"], *(v / 2**20 for v in sampler.peak_rss.values())])
        side = f" x {len(runs)} side by side" if len(runs) > 1 else ""
        print(f"  {setup.name} ({data.get('threads')} threads{side}): {a.samples_per_s:.0f} samples/s", flush=True)

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
            **({"disturbed": pool["disturbed"]} if pool.get("disturbed") else {}),
        }

    def local_steps_per_s(self) -> float:
        """The best local variant so far, in steps/s (sizes the PS and DDP runs)."""
        best = max(statistics.median(b["samples_per_s"] for b in p["bursts"]) for p in self.local.values())
        return best / self.args.batch_size

    def _hold_straggler(self, setup: Setup, procs: list[measure.Child], out: dict):
        """The last trainer (rank) of a ``-straggler`` setup held to half a core, or None."""
        idx = straggler_index(setup)
        if idx is None:
            return None
        procs[idx].wait_for(READY[setup.kind], 300)
        held = throttle.start(procs[idx].pid, STRAGGLER_SHARE, self.args.throttle)
        out["straggler"] = {"index": idx, "share": STRAGGLER_SHARE, "method": held.method}
        return held

    # ---- parameter server --------------------------------------------------------------

    def ps(self, setup: Setup) -> dict:
        n, update, bs = setup.trainers, setup.update, self.args.batch_size
        name = self._name(setup.name)
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

    def ddp(self, setup: Setup) -> dict:
        """``ddp-N``: N rank processes started here (torchrun's variables), one torch thread
        each, for the planned steps; measured like the PS trainers (step ends, windows, ss)."""
        n, bs = setup.trainers, self.args.batch_size
        name = self._name(setup.name)
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

    def collective(self, setup: Setup) -> dict:
        name = self._name(setup.name)
        result_path = self.log_dir / f"{name}.json"
        children = measure.Children(self.log_dir)
        sampler = measure.Sampler(interval=0.25, ss_every=2)  # bytes are totals: sample often
        seconds = self.seconds
        try:
            c = children.start(measure.worker_argv(
                "collective", "--mode", setup.kind, "--model", self.args.model, "--batch-size",
                str(self.args.batch_size), "--nproc", str(setup.trainers), "--seconds", str(seconds),
                "--window", str(self.window), "--warmup-steps", str(WARMUP_STEPS), "--out", str(result_path)), name)
            sampler.track("launcher", c.pid, wire=True)
            sampler.start()
            code = c.wait(6 * seconds + 180)
            if code != 0:
                raise RuntimeError(f"{setup.kind} run failed ({code}):\n{c.tail()}")
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
                             "estimate: benchmarks.harness.collective_overhead (per rank sent)"),
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


