"""Readers of the weights while training runs: how fresh their versions are, and what reading
costs training and the server.

    python -m benchmarks readers --model mnist_cnn --readers 8 --rounds 4
    python -m benchmarks readers --model resnet18 --readers 8 --share --rounds 4
    python -m benchmarks readers --model mnist_cnn --readers 64 --share --rounds 2 --window 30

One ``psserver serve --model M`` and two trainers (synthetic data) train throughout. Each round
has two windows of ``--window`` seconds, seconds apart, in an order that alternates round by
round: training alone, and training while ``--readers`` reader processes (``psserver.read``,
each in a process of its own) read every new version as fast as they can. The readers start
before their window (importing torch takes seconds of CPU each) and read only inside it.

Measured: training throughput (the server's samples over each window, from its status) with
readers over alone, round by round; the age of every version a reader had whole (from the
step's application on the server to the end of the read: the freshness), its p50/p99; bytes the
server sent per version copied (the status's counters), in copies of the model; with
``--share``, the readers of this host share one copy (one fetches each version, the others read
it from shared memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import measure
from benchmarks.harness.report import md_table, write_result

RESULTS = measure.RESULTS / "readers"
STARTUP_PER_READER_S = 1.5
"""Time a reader process is given to import torch and connect before its window, per reader
(they start together and share the cores)."""

_READER = r"""
import json, sys, time
import psserver
address, name, dtype, share, start, end = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", \
    float(sys.argv[5]), float(sys.argv[6])
files = sys.argv[7] == "1"
ages, steps = [], []
with psserver.read(address, name=name, dtype=dtype or None, share=share, timeout=10, server_files=files) as reader:
    version = reader.latest()
    time.sleep(max(0.0, start - time.time()))
    while time.time() < end:
        newer = reader.wait(version.step, timeout=max(0.05, end - time.time()))
        if newer is None:
            break
        version = newer
        if time.time() <= end:
            ages.append(version.age)
            steps.append(version.step)
print(json.dumps({"ages": ages, "steps": steps}), flush=True)
"""


_ROWS = r"""
import json, sys, time
import psserver
from psserver.data.clicks import ClickLogSpec, make_click_log
address, name, batch, start, end = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
ids = make_click_log(ClickLogSpec(), 20_000, sample_seed=99).tensors[0]
latencies = []
with psserver.read(address, name=name, timeout=10) as reader:
    reader.rows("c0", ids[:batch, 0])
    time.sleep(max(0.0, start - time.time()))
    n = 0
    while time.time() < end:
        request = ids[(n * batch) % (len(ids) - batch):][:batch]
        t0 = time.perf_counter()
        reader.rows("c%d" % (n % 4), request[:, n % 4])
        latencies.append(time.perf_counter() - t0)
        n += 1
print(json.dumps({"ages": latencies, "steps": []}), flush=True)
"""
"""A serving reader (``--rows``): lookups of ``batch`` ids of one table after another, as fast as
it can; its latencies go where a version reader's ages go."""


def _status(address: str) -> dict:
    from psserver.control.client import ControlClient

    with ControlClient(address, timeout=10) as client:
        s = client.get_status()
    return {"samples": s.samples_seen, "step": s.global_step, "copies": s.versions_copied,
            "bytes": s.weights_bytes_sent, "time": time.time(), "params": s.num_params}


def _cpu(roles: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each role's processes, summed (a process gone counts 0)."""
    return {role: sum(measure.proc_cpu_seconds(pid) or 0.0 for pid in pids) for role, pids in roles.items()}


def _cpu_per_s(before: dict, after: dict) -> dict[str, float]:
    """Cores each role kept busy between two statuses that carry ``_cpu`` readings."""
    took = after["time"] - before["time"]
    return {role: (after["cpu"][role] - before["cpu"][role]) / took for role in before["cpu"]}


def _readers_window(children: measure.Children, address: str, n: int, window: float, dtype: str,
                    share: bool, round_no: int, rows: int = 0, roles: dict[str, list[int]] | None = None,
                    server_files: bool = True) -> tuple[dict, dict, list[dict]]:
    """``n`` readers read through one window (``rows``: serving readers, looking up that many
    ids a request): the status at its ends (with the CPU seconds of ``roles`` and of the
    readers) and each reader's report."""
    start = time.time() + 10.0 + STARTUP_PER_READER_S * n
    end = start + window
    if rows:
        procs = [children.start([sys.executable, "-c", _ROWS, address, f"serving-{i}", str(rows), str(start), str(end)],
                                f"serving-r{round_no}-{i}") for i in range(n)]
    else:
        procs = [children.start([sys.executable, "-c", _READER, address, f"reader-{i}", dtype, "1" if share else "0",
                                 str(start), str(end), "1" if server_files else "0"], f"reader-r{round_no}-{i}")
                 for i in range(n)]
    roles = {**(roles or {}), "readers": [p.pid for p in procs]}
    time.sleep(max(0.0, start - time.time()))
    before = {**_status(address), "cpu": _cpu(roles)}
    time.sleep(max(0.0, end - time.time()))
    after = {**_status(address), "cpu": _cpu(roles)}
    reports = []
    for p in procs:
        code = p.wait(60 + window)
        if code != 0:
            raise RuntimeError(f"{p.name} exited {code}:\n{p.tail()}")
        reports.append(json.loads(p.output().strip().splitlines()[-1]))
        p.stop()
    return before, after, reports


def _alone_window(address: str, window: float, roles: dict[str, list[int]]) -> tuple[dict, dict]:
    before = {**_status(address), "cpu": _cpu(roles)}
    time.sleep(window)
    return before, {**_status(address), "cpu": _cpu(roles)}


def _rate(before: dict, after: dict) -> float:
    return (after["samples"] - before["samples"]) / (after["time"] - before["time"])


def run(args: argparse.Namespace, log_dir: Path) -> dict:
    children = measure.Children(log_dir)
    port, control = measure.free_port(), measure.free_port()
    address = f"127.0.0.1:{control}"
    try:
        server = children.start(measure.psserver_argv("serve", "--port", str(port), "--control-port", str(control),
                                                      "--model", args.model, "--publish-interval",
                                                      str(args.publish_interval)), "server")
        server.wait_for(r"serving \S+ on", timeout=180)
        roles = {"server": [server.pid], "trainers": []}
        for rank in range(2):
            roles["trainers"].append(children.start(measure.psserver_argv(
                "train", "--server", f"127.0.0.1:{port}", "--rank", str(rank), "--num-trainers", "2", "--epochs",
                "1000000", "--max-steps", "100000000", "--batch-size", str(args.batch_size), "--dataset",
                "synthetic_clicks" if args.rows else "synthetic",
                "--no-progress"), f"trainer-{rank}").pid)
        deadline = time.monotonic() + 180
        while _status(address)["step"] < 20:  # past the first steps' warm-up
            if time.monotonic() > deadline:
                raise RuntimeError(f"training did not start:\n{server.tail()}")
            time.sleep(1.0)
        rounds = []
        for r in range(args.rounds):
            got: dict = {}
            for kind in (("alone", "readers") if r % 2 == 0 else ("readers", "alone")):
                if kind == "alone":
                    before, after = _alone_window(address, args.window, roles)
                    got["alone"] = {"samples_per_s": _rate(before, after), "cores_busy": _cpu_per_s(before, after)}
                else:
                    before, after, reports = _readers_window(children, address, args.readers, args.window,
                                                             args.dtype, args.share, r, args.rows, roles,
                                                             not args.no_server_files)
                    copies = after["copies"] - before["copies"]
                    got["readers"] = {
                        "samples_per_s": _rate(before, after), "versions_copied": copies,
                        "cores_busy": _cpu_per_s(before, after),
                        "bytes_sent": after["bytes"] - before["bytes"],
                        "ages": [a for rep in reports for a in rep["ages"]],
                        "reads": [len(rep["ages"]) for rep in reports],
                    }
            got["ratio"] = got["readers"]["samples_per_s"] / got["alone"]["samples_per_s"]
            rounds.append(got)
            ages = got["readers"]["ages"]
            print(f"round {r + 1}: training with {args.readers} readers {got['ratio']:.3f}x alone; "
                  f"{'lookup latency' if args.rows else 'version age'} p99 "
                  f"{measure.percentile(ages, 0.99) or float('nan'):.3f}s over {len(ages)} reads; cores busy alone "
                  f"{_cores(got['alone']['cores_busy'])}, with readers {_cores(got['readers']['cores_busy'])}",
                  flush=True)
        model_bytes = _status(address)["params"] * (2 if args.dtype in ("bfloat16", "float16") else 4)
    finally:
        children.stop_all()
    ages = [a for r in rounds for a in r["readers"]["ages"]]
    copies = sum(r["readers"]["versions_copied"] for r in rounds)
    sent = sum(r["readers"]["bytes_sent"] for r in rounds)
    load = os.getloadavg()
    return {
        "model": args.model, "readers": args.readers, "share": args.share, "dtype": args.dtype or "float32",
        "server_files": not args.no_server_files,
        "publish_interval_s": args.publish_interval, "rows": args.rows,
        "lookups_per_s": (sum(len(r["readers"]["ages"]) for r in rounds) / (args.window * args.rounds)
                          if args.rows else None),
        "rounds": args.rounds, "window_s": args.window, "batch_size": args.batch_size, "cores": os.cpu_count(),
        "load_average": list(load),
        "throughput_ratio": statistics.median(r["ratio"] for r in rounds),
        "throughput_ratios": [r["ratio"] for r in rounds],
        "age_p50_s": measure.percentile(ages, 0.5), "age_p99_s": measure.percentile(ages, 0.99),
        "reads": len(ages), "versions_copied": copies,
        "cores_busy_alone": _median_cores(rounds, "alone"), "cores_busy_with_readers": _median_cores(rounds, "readers"),
        "copies_sent_per_version": sent / copies / model_bytes if copies and model_bytes else None,
        "model_bytes": model_bytes, "rounds_raw": [{**r, "readers": {**r["readers"], "ages": None}} for r in rounds],
        "command": "python -m benchmarks readers " + " ".join(args.argv),
    }


def _cores(busy: dict[str, float]) -> str:
    return " ".join(f"{role} {cores:.2f}" for role, cores in busy.items())


def _median_cores(rounds: list[dict], kind: str) -> dict[str, float]:
    roles = rounds[0][kind]["cores_busy"]
    return {role: statistics.median(r[kind]["cores_busy"][role] for r in rounds) for role in roles}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks readers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mnist_cnn")
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--share", action="store_true", help="the readers of this host share one copy")
    p.add_argument("--dtype", default="", choices=["", "float32", "bfloat16", "float16"])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--window", type=float, default=20.0, help="seconds of each window")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--publish-interval", type=float, default=0.25, help="the server's --publish-interval")
    p.add_argument("--rows", type=int, default=0, metavar="IDS",
                   help="serving readers instead: row lookups of IDS ids of one table each (a model with tables)")
    p.add_argument("--no-server-files", action="store_true",
                   help="readers take every version's bytes from the server, never its file in shared memory "
                        "(as readers on other hosts do)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.readers < 1 or args.rounds < 1 or args.window <= 0:
        p.error("--readers and --rounds must be at least 1, --window positive")
    with tempfile.TemporaryDirectory(prefix="psserver-readers-bench-") as logs:
        result = run(args, Path(logs))
    stem = args.out / (f"{args.model}-{args.readers}{'-shared' if args.share else ''}{'-rows' if args.rows else ''}"
                       f"{'-bytes' if args.no_server_files else ''}")
    sys.stdout.write(write_result(stem, result, "readers", markdown))
    return 0


def markdown(result: dict) -> str:
    """The readers' table of one run, from its JSON."""
    if result.get("rows"):
        return _rows_markdown(result)
    copies = result["copies_sent_per_version"]
    rows = [[result["model"], str(result["readers"]), "yes" if result["share"] else "no",
             "the server's file" if result.get("server_files") else "bytes", result["dtype"],
             f"{result['throughput_ratio']:.3f}", " ".join(f"{x:.3f}" for x in result["throughput_ratios"]),
             f"{result['age_p50_s']:.3f}", f"{result['age_p99_s']:.3f}", str(result["reads"]),
             "-" if copies is None else f"{copies:.2f}"]]
    return "\n".join([
        f"# Readers of the weights while 2 trainers train ({result['rounds']} paired rounds of "
        f"{result['window_s']:g} s, {result['cores']} cores, load {result['load_average'][0]:.1f})", "",
        md_table(["model", "readers", "shared copy", "a version crosses as", "dtype",
                  "training with readers / alone (median)",
                  "per round", "version age p50 (s)", "p99 (s)", "reads", "model copies sent per version"], rows),
        *_cores_lines(result), "", f"Command: `{result.get('command') or 'python -m benchmarks readers'}`"]) + "\n"


def _cores_lines(result: dict) -> list[str]:
    """Where the cores went (median of the rounds; absent from runs before it was measured)."""
    if "cores_busy_alone" not in result:
        return []
    return ["", f"Cores kept busy (CPU seconds a second, median of the rounds): training alone: "
                f"{_cores(result['cores_busy_alone'])}; with the readers: {_cores(result['cores_busy_with_readers'])}."]


def _rows_markdown(result: dict) -> str:
    rows = [[result["model"], str(result["readers"]), str(result["rows"]), f"{result['throughput_ratio']:.3f}",
             " ".join(f"{x:.3f}" for x in result["throughput_ratios"]), f"{result['age_p50_s'] * 1e3:.2f}",
             f"{result['age_p99_s'] * 1e3:.2f}", f"{result['lookups_per_s']:.0f}"]]
    return "\n".join([
        f"# Row lookups of serving readers while 2 trainers train ({result['rounds']} paired rounds of "
        f"{result['window_s']:g} s, {result['cores']} cores, load {result['load_average'][0]:.1f})", "",
        md_table(["model", "serving readers", "ids a lookup", "training with them / alone (median)", "per round",
                  "lookup p50 (ms)", "p99 (ms)", "lookups/s (all readers)"], rows),
        "", f"Command: `{result.get('command') or 'python -m benchmarks readers'}`"]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
