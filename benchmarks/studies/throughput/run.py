"""The benchmark harness: local loops, PS (async/sync/ssp, 1/2/4 trainers, server or trainer
compute, with a straggler), DDP and FSDP in one run.

    python -m benchmarks.run --quick                       # a smoke run: 5-8 minutes on 2 loaded cores
    python -m benchmarks.run --model mnist_cnn --batch-size 64       # ~45 minutes on 2 cores
    python -m benchmarks.run --model resnet18 --batch-size 32 --setups local,ps-async-1
    psserver bench ...                                     # the same, as a CLI verb

Every setup runs real processes (``psserver serve`` + N ``psserver train``; DDP ranks started
one by one with torchrun's variables, ``benchmarks.harness.workers ddp``; FSDP through
``benchmarks.harness.collective_overhead``), one setup at a time, and reports samples/s
(median of windows after warm-up; PS: the total over trainers), step latency p50/p95, bytes
on the wire per step (``ss`` on the setup's TCP sockets), the server's CPU while idle (N
trainers joined and waiting) and while training, and the peak RSS of every process. The
local loop, the ceiling every ratio divides by, runs in bursts spread over the run (start,
middle, end) and its windows are pooled, so load that drifts during the run hits both sides.

Then come paired rounds (``benchmarks.harness.paired``, ``--rounds``): the local loops, the PS
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
import logging
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.harness import capacity, measure, paired, throttle
from benchmarks.harness.report import write_result
from benchmarks.harness.setups import Setup, check_devices, is_ceiling, parse_setup, parse_setups
from benchmarks.harness.targets import lower_bound, ratios, trainer_compute_floor, trainer_compute_ratios
from benchmarks.studies.throughput import report
from benchmarks.studies.throughput.passes import Run, machine_info, round_settings

DEFAULT_RESULTS = measure.RESULTS
log = logging.getLogger(__name__)
FULL_SETUPS = ("local,local-1t,local-cached,local-1t-x2,ps-async-1,ps-async-2,ps-async-4,ps-sync-1,ps-sync-2,ps-sync-4,"
               "ps-chained-async-1,ps-chained-async-2,ps-chained-sync-2,ps-pushpull-async-1,ps-pushpull-async-2,"
               "ps-pushpull-async-4,ps-pushpull-async-2-straggler,ddp-2,ddp-2-straggler,fsdp-2")
QUICK_SETUPS = "local,local-1t-x2,ps-pushpull-async-2,ddp-2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="mnist_cnn", help="model name (mnist_cnn, mlp, resnet18, ...)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step and trainer (default 64)")
    p.add_argument("--seconds", type=float, default=None,
                   help="measured seconds per setup, after warm-up (default 10; --quick 4)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run, no claim: fewer setups ({QUICK_SETUPS}), short windows, one paired round")
    p.add_argument("--setups", default=None, help=f"comma-separated (default {FULL_SETUPS})")
    p.add_argument("--warmup", type=float, default=None, help="seconds discarded per process (default 3; quick 1.5)")
    p.add_argument("--window", type=float, default=None, help="window length in seconds (default seconds/6)")
    p.add_argument("--idle-seconds", type=float, default=None,
                   help="seconds of server CPU measured with trainers joined and idle, async setups "
                        "(default 4; --quick 0: skip)")
    p.add_argument("--rounds", type=int, default=None,
                   help="paired rounds after the one-window pass, for the throughput targets "
                        "(default 6; quick 1: a smoke run, no claim; 0: none)")
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


def paired_setups(setups: list[Setup], failed: set[str]) -> list[dict]:
    """What the paired rounds measure: the local loops, PS async and ssp setups of 1-2 trainers
    and DDP of up to 2 ranks (the throughput targets, stragglers included), minus any that
    failed in the one-window pass."""
    return [s for s in setups if s.name not in failed and (
        s.kind == "local" or (s.kind == "ps" and s.update in ("async", "ssp") and s.trainers <= 2)
        or (s.kind == "ddp" and s.trainers <= 2))]


def run_args(args: argparse.Namespace, setups: list[Setup], command: str) -> int:
    """Run ``setups`` (``check_args(args)``, which the caller reports as its usage error)."""
    with paired.exit_on_sigterm():  # children stopped, namespace and cgroups removed on SIGTERM too
        return _run_args(args, command, setups)


def _run_args(args: argparse.Namespace, command: str, setups: list[Setup]) -> int:
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
    locals_ = [s for s in setups if s.kind == "local"]
    if not any(is_ceiling(s) for s in locals_):
        locals_ = [parse_setup("local"), *locals_]  # the ceiling is always measured
    others = [s for s in setups if s.kind != "local"]
    # --quick: one burst of each local loop, before the others (a smoke run: no drift to spread over)
    bursts = 1 if args.quick else 2 if len(others) < 3 else 3
    burst_s = max(bench.window * 3, bench.seconds * (1.0 if args.quick else 1.5) / bursts)
    burst_at = {0} | ({len(others)} if bursts >= 2 else set()) | ({len(others) // 2} if bursts == 3 else set())
    results: dict[str, dict] = {}
    try:
        for i in range(len(others) + 1):
            if i in burst_at:
                order = locals_ if i % 2 == 0 else locals_[::-1]
                for loc in order:
                    print(f"[{time.monotonic() - t_start:5.0f}s] {loc.name} burst ({burst_s:.0f}s)", flush=True)
                    bench.local_burst(loc, burst_s)
            if i == len(others):
                break
            s = others[i]
            print(f"[{time.monotonic() - t_start:5.0f}s] {s.name}", flush=True)
            try:
                res = bench.ps(s) if s.kind == "ps" else bench.ddp(s) if s.kind == "ddp" else bench.collective(s)
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
            results[s.name] = res
        pairs = paired_setups([*locals_, *others], {n for n, r in results.items() if r.get("error")})
        paired_result = None
        if bench.rounds and any(s.kind == "ps" for s in pairs):
            print(f"[{time.monotonic() - t_start:5.0f}s] paired rounds: {bench.rounds} x "
                  f"{', '.join(s.name for s in pairs)}", flush=True)
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
        results[loc.name] = bench.local_result(loc.name)
    # The ceiling: the best local loop measured (threads = cores unless fewer did better; the
    # server's allocator policy when that did better), so no server setting is left out of it.
    ceiling_name = max((loc.name for loc in locals_ if is_ceiling(loc)), key=lambda n: results[n]["samples_per_s"])
    local = results[ceiling_name]
    if not any(is_ceiling(s) for s in setups):
        setups = [*[s for s in locals_ if s not in setups], *setups]
    lb = lower_bound(args.model, args.batch_size)
    rows = []
    for s in setups:
        r = {**s.to_dict(), **results.get(s.name, {"error": "not run"})}
        if not r.get("error"):
            r["ratio_to_local"] = r["samples_per_s"] / local["samples_per_s"] if local["samples_per_s"] > 0 else None
            if r["kind"] == "ps" and r.get("bytes_per_step") is not None:
                # Trainer compute: the floor is the gradient up and the parameters down in the wire dtype.
                floor = trainer_compute_floor(args.model, r["wire"]) if r.get("compute") == "trainer" else lb["total"]
                r["bytes_vs_lower_bound"] = r["bytes_per_step"] / floor
            pr = (paired_result or {}).get("setups", {}).get(s.name)
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
                   "local_bursts": bursts, "ceiling": ceiling_name, "setups": [s.name for s in setups],
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
    md = write_result(results_dir / base, result, "throughput", report.markdown)
    files = {"json": results_dir / f"{base}.json", "md": results_dir / f"{base}.md"}
    if report.chart(result, results_dir / f"{base}.png"):
        files["png"] = results_dir / f"{base}.png"
    else:
        log.warning("matplotlib is missing: no chart (pip install matplotlib)")
    for kind, path in files.items():
        (results_dir / f"latest.{kind}").write_bytes(path.read_bytes())
    sys.stdout.write(md)
    log.info("wrote %s (and latest.*) in %.0fs", ", ".join(str(p) for p in files.values()), result["wall_s"])
    return 1 if any(r.get("error") for r in rows) or (paired_result or {}).get("error") else 0


def main(argv: list[str] | None = None) -> int:
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
