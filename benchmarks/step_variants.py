"""Step variants of one PS trainer, interleaved against one server and the local loop.

    python -m benchmarks.step_variants --rounds 6                 # ~6 minutes on 2 cores
    python -m benchmarks.step_variants --variants plain,chained,local-cached --rounds 10
    python -m benchmarks.step_variants --model resnet18 --batch-size 32 --steps 30 --rounds 4

Why a second harness: the variants differ by a round trip or two (2-3 ms of a ~90 ms step),
while the speed of the 2-core VM drifts by 20-30% from one minute to the next, so one window
per setup cannot tell them apart. Here one server stays up; each round runs one short trainer
per variant, back to back in a rotating order, and each trainer's step time is the median of
its steps after ``--skip`` warm-up steps. The result is the median over rounds of each
variant's step time divided by the plain one's *in the same round*, and of the best local
loop's step time (``local``: all cores; ``local-cached``: the server's allocator policy; the
loop of ``benchmarks.workers local``) divided by each variant's: its samples/s as a fraction
of the ceiling, paired round by round.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import measure

log = logging.getLogger(__name__)

VARIANTS = {v: ["--step", v] for v in ("plain", "fold", "chained", "fused")}
LOCAL = {"local": "system", "local-cached": "cached"}  # local loop -> its host allocator policy
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_variants", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mnist_cnn", help="model the server hosts (default mnist_cnn)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step (default 64)")
    p.add_argument("--rounds", type=int, default=6, help="rounds of every variant (default 6)")
    p.add_argument("--steps", type=int, default=80, help="steps per trainer run (default 80)")
    p.add_argument("--skip", type=int, default=20, help="warm-up steps left out of each run (default 20)")
    p.add_argument("--variants", default="plain,fold,chained,fused,local,local-cached",
                   help="comma-separated: plain, fold, chained, fused, local, local-cached (default all)")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS, help="where the JSON and Markdown go")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS and v not in LOCAL]
    if bad or "plain" not in args.variants:
        p.error(f"--variants: use plain plus any of fold, chained, fused, local, local-cached (got {','.join(args.variants)})")
    if args.rounds < 1 or args.steps <= args.skip + 5 or args.skip < 0 or args.batch_size < 1:
        p.error("need --rounds >= 1, --batch-size >= 1 and --steps > --skip + 5")
    return args


def step_ms(stats_path: Path, skip: int) -> float:
    ends = json.loads(stats_path.read_text())["step_ends"]
    ends = [e[0] if isinstance(e, (list, tuple)) else e for e in ends][skip:]
    if len(ends) < 5:
        raise RuntimeError(f"{stats_path.name}: {len(ends)} steps after the {skip} skipped, too few to time")
    return 1000 * statistics.median(b - a for a, b in zip(ends, ends[1:]))


def measure_variants(args: argparse.Namespace, work: Path) -> dict:
    children = measure.Children(work)
    port = measure.free_port()
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    try:
        server = children.start(measure.psserver_argv("serve", "--port", str(port), "--control-port", "0",
                                                      "--model", args.model), "server")
        server.wait_for(r"serving \S+ on", 180)
        for r in range(args.rounds):
            order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
            for v in order:
                stats = work / f"{v}-{r}.json"
                if v in LOCAL:
                    # As many steps as a trainer run, at the speed of the last plain run.
                    # (20% more: the speed drifts, and extra steps only sharpen the median).
                    seconds = 1.2 * args.steps * (times["plain"][-1] if times["plain"] else 100.0) / 1000
                    t = children.start(measure.worker_argv(
                        "local", "--model", args.model, "--batch-size", str(args.batch_size),
                        "--seconds", f"{seconds:.2f}", "--threads", "0", "--allocator", LOCAL[v],
                        "--stats-out", str(stats)), f"{v}-{r}")
                else:
                    t = children.start(measure.psserver_argv(
                        "train", "--server", f"127.0.0.1:{port}", "--rank", "0", "--num-trainers", "1",
                        "--epochs", "1000000", "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
                        "--dataset", "synthetic", "--no-progress", "--stats-out", str(stats), *VARIANTS[v]),
                        f"{v}-{r}")
                code = t.wait(600)
                if code != 0:
                    raise RuntimeError(f"trainer {v} round {r} exited with {code}:\n{t.tail()}")
                times[v].append(step_ms(stats, args.skip))
                log.info("round %d/%d %-5s %.1f ms/step", r + 1, args.rounds, v, times[v][-1])
    finally:
        children.stop_all()
    out = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "step_ms": times, "variants": {}}
    locals_ = [v for v in args.variants if v in LOCAL]
    best_local = [min(times[v][r] for v in locals_) for r in range(args.rounds)] if locals_ else None
    for v in args.variants:
        per_round = [a / b for a, b in zip(times[v], times["plain"])]
        row = {"median_step_ms": statistics.median(times[v]), "ratio_to_plain_per_round": per_round,
               "median_ratio_to_plain": statistics.median(per_round)}
        if best_local is not None:
            of_local = [b / a for a, b in zip(times[v], best_local)]
            row.update(x_local_per_round=of_local, median_x_local=statistics.median(of_local))
        out["variants"][v] = row
    return out


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"## PS step variants: {c['model']}, batch {c['batch_size']}, 1 trainer", "",
             f"`python -m benchmarks.step_variants --model {c['model']} --batch-size {c['batch_size']} "
             f"--rounds {c['rounds']} --steps {c['steps']}` ({result['time']})", "",
             "| variant | median step ms | step time / plain (median over rounds) | per round "
             "| samples/s / best local (median over rounds) | per round |",
             "|---|---|---|---|---|---|"]
    for v, r in result["variants"].items():
        rounds = " ".join(f"{x:.3f}" for x in r["ratio_to_plain_per_round"])
        local = (f"{r['median_x_local']:.3f} | " + " ".join(f"{x:.3f}" for x in r["x_local_per_round"])
                 if "median_x_local" in r else "- | -")
        lines.append(f"| {v} | {r['median_step_ms']:.1f} | {r['median_ratio_to_plain']:.3f} | {rounds} | {local} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="psserver-variants-") as tmp:
        result = measure_variants(args, Path(tmp))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / f"step_variants-{args.model}-b{args.batch_size}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    stem.with_suffix(".md").write_text(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
