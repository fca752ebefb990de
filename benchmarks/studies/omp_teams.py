"""Why the server runs its tensor work on one thread: the same training step, in fresh
processes, on the main thread only, on one other thread only, and on the main thread while a
second thread that has run steps waits (as an RPC handler thread does).

    python -m benchmarks omp_teams --rounds 4      # about a minute on 2 cores

libgomp keeps a worker team per thread that ever started an OpenMP region; once the teams
hold more threads than there are CPUs it throttles the spin-wait of idle workers (300,000
iterations down to 100), so every region wakes its workers through the kernel. The third
mode shows the cost: the step slows down and uses fewer cores, although only one thread
computes at a time. Ratios are taken round by round (modes back to back), then the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("main", "one-thread", "second-thread-first")


def _child(mode: str, steps: int, model: str, batch_size: int) -> dict:
    import threading

    import torch
    import torch.nn.functional as F

    from psserver.models import build_model, get_model_spec
    from psserver.utils.memory import configure_host_allocator

    configure_host_allocator("cached")
    spec = get_model_spec(model)
    net = build_model(model, seed=0)
    net.train()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(batch_size, *spec.input_shape)
    y = torch.randint(0, spec.num_classes, (batch_size,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()

    times: list[float] = []

    def loop() -> None:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)

    idle = threading.Event()
    if mode == "second-thread-first":  # another thread has run steps and now waits, as an RPC thread does
        ran = threading.Event()

        def other() -> None:
            for _ in range(5):
                step()
            ran.set()
            idle.wait()  # alive: a thread that exits takes its team with it

        waiting = threading.Thread(target=other)
        waiting.start()
        ran.wait()
    c0 = time.process_time()
    if mode != "one-thread":
        loop()
    else:
        t = threading.Thread(target=loop)
        t.start()
        t.join()
    cpu = time.process_time() - c0
    idle.set()
    if mode == "second-thread-first":
        waiting.join()
    skip = min(10, steps // 3)
    return {"step_ms": 1e3 * statistics.median(times[skip:]), "cores": cpu / sum(times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks omp_teams", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="rounds of the three modes (default 4)")
    p.add_argument("--steps", type=int, default=60, help="steps per process (default 60)")
    p.add_argument("--model", default="mnist_cnn")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 15 or args.batch_size < 1:
        p.error("need --rounds >= 1, --steps >= 15 and --batch-size >= 1")
    if args.child:
        sys.stdout.write(json.dumps(_child(args.child, args.steps, args.model, args.batch_size)) + "\n")
        return 0
    root = Path(__file__).resolve().parents[2]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            out = subprocess.run([sys.executable, "-m", "benchmarks.studies.omp_teams", "--child", mode, "--steps",
                                  str(args.steps), "--model", args.model, "--batch-size", str(args.batch_size)],
                                 cwd=root, capture_output=True, text=True, timeout=600, check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    lines = [f"## OpenMP teams: {args.model}, batch {args.batch_size}, {args.rounds} rounds of {args.steps} steps", "",
             "| mode | step ms (median over rounds) | x main (median over rounds) | cores used | per round ms |",
             "|---|---|---|---|---|"]
    base = [x["step_ms"] for x in runs["main"]]
    for mode in MODES:
        ms = [x["step_ms"] for x in runs[mode]]
        ratio = statistics.median(a / b for a, b in zip(ms, base, strict=True))
        lines.append(f"| {mode} | {statistics.median(ms):.1f} | {ratio:.3f} | "
                     f"{statistics.median(x['cores'] for x in runs[mode]):.2f} | {' '.join(f'{m:.1f}' for m in ms)} |")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
