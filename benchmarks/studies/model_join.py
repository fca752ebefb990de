"""What a server without ``--model`` costs a trainer's join: the first trainer brings the
model's layout and initial values (resnet18: 11.2M parameters, 44.7 MB), later ones only the
layout, checked against its fingerprint; a server with ``--model`` builds it itself.

    python -m benchmarks model_join --model resnet18 --rounds 5

Each round starts, in turn, a server without ``--model`` and one with it (the order rotates
round by round), joins two trainers to it one after the other (each a fresh process: RPC is
set up once per process) and records how long each one's join call took (``Session.join_seconds``:
from sending the request to the server's answer, the adoption of the model included). The
report gives the medians over the rounds, and the first join's cost over a pinned server's,
round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import measure
from benchmarks.harness.report import write_result

RESULTS = measure.RESULTS / "model-join"

_JOIN = r"""
import json, sys, time
from psserver.config import TrainerConfig
from psserver.trainer.session import Session
port, rank, model = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
t0 = time.perf_counter()
s = Session(TrainerConfig(rank=rank, server_port=port, num_trainers=2, model=model))
total = time.perf_counter() - t0
print(json.dumps({"join_s": s.join_seconds, "session_s": total, "brought_model": s.brought_model}), flush=True)
s.leave()
"""


def join_once(port: int, rank: int, model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _JOIN, str(port), str(rank), model], capture_output=True, text=True,
                         timeout=180, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"trainer {rank} failed to join: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_round(model: str, pinned: bool) -> list[dict]:
    port = measure.free_port()
    argv = [sys.executable, "-m", "psserver", "serve", "--port", str(port), "--no-control"]
    if pinned:
        argv += ["--model", model]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        assert server.stdout is not None
        for line in server.stdout:
            if " serving " in line:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
        return [join_once(port, rank, model) for rank in (0, 1)]
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks model_join", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rounds = []
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        got = {("pinned" if pinned else "agnostic"): one_round(args.model, pinned) for pinned in order}
        rounds.append(got)
        print(f"round {r + 1}: first join without --model {got['agnostic'][0]['join_s']:.3f}s "
              f"(second {got['agnostic'][1]['join_s']:.3f}s), with --model {got['pinned'][0]['join_s']:.3f}s",
              flush=True)
    first = [r["agnostic"][0]["join_s"] for r in rounds]
    later = [r["agnostic"][1]["join_s"] for r in rounds]
    pinned = [r["pinned"][0]["join_s"] for r in rounds]
    assert all(r["agnostic"][0]["brought_model"] and not r["agnostic"][1]["brought_model"] for r in rounds)
    summary = {
        "model": args.model, "rounds": args.rounds, "cores": os.cpu_count(),
        "first_join_without_model_s": statistics.median(first), "later_join_without_model_s": statistics.median(later),
        "join_with_model_s": statistics.median(pinned),
        "first_join_over_pinned": statistics.median(f / p for f, p in zip(first, pinned, strict=True)),
        "rounds_raw": rounds,
    }
    sys.stdout.write(write_result(args.out / args.model, summary, "model_join", markdown))
    return 0


def markdown(summary: dict) -> str:
    """The join-cost table of one run, from its JSON."""
    return "\n".join([
        f"# Join cost of a server without --model ({summary['model']}, {summary['rounds']} rounds, "
        f"{summary['cores']} cores)", "", "| join | median seconds |", "|---|---|",
        f"| first trainer, server without --model (brings layout + initial values) | "
        f"{summary['first_join_without_model_s']:.3f} |",
        f"| second trainer, server without --model (layout checked) | "
        f"{summary['later_join_without_model_s']:.3f} |",
        f"| first trainer, server with --model | {summary['join_with_model_s']:.3f} |", "",
        f"First join without --model over with it, per round, median: {summary['first_join_over_pinned']:.2f}x"]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
