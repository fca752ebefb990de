"""What a server process's death costs with its state in shared memory: the pause, and that no
applied update is lost.

    python -m benchmarks restart --kills 5

A server runs under ``--supervise`` with ``--state-dir`` (in ``/dev/shm``) and two pushpull
trainers (``--reconnect``) train on synthetic data. Every kill: the trainers are stopped
(SIGSTOP) until the server's step stands still, its global step and samples are read, the
server process is SIGKILLed and the trainers let go at once. Recorded from the kill: when the
restarted process logged that it found the state (and at which step), when its control plane
serves again, and when its global step first moves past the step at the kill (the first update
applied after it: supervisor restart, imports, map, the trainers' rejoin). Medians over the
kills; the cores and the load they ran under are written beside them.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness import measure
from benchmarks.harness.report import write_result

RESULTS = measure.RESULTS / "memory-state"
FOUND = re.compile(r"found the state of run \S+ in memory: \S+, generation \d+, global step (\d+), (\d+) samples")


class Output:
    """A process's output lines with the time each arrived (read on a thread)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._lock:
                self.lines.append((time.monotonic(), line))

    def after(self, t: float, rx: re.Pattern, timeout: float) -> tuple[float, re.Match]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                for when, line in self.lines:
                    m = rx.search(line)
                    if when >= t and m:
                        return when, m
            time.sleep(0.01)
        raise RuntimeError(f"no /{rx.pattern}/ within {timeout}s")


def status(client) -> tuple[int, int]:
    s = client.get_status()
    return s.global_step, s.samples_seen


def one_kill(sup: subprocess.Popen, port: int, out: Output, trainers: list[subprocess.Popen], client) -> dict:
    import psutil

    from psserver.control.client import ControlError

    for t in trainers:
        t.send_signal(signal.SIGSTOP)
    before, last = None, None
    while before is None:
        now = status(client)
        before = now if now == last else None
        last = now
        time.sleep(0.2)
    (child,) = [c for c in psutil.Process(sup.pid).children()  # the server, not the standby
                if any(x.status == psutil.CONN_LISTEN and x.laddr.port == port for x in c.net_connections("tcp"))]
    t0 = time.monotonic()
    child.kill()
    for t in trainers:
        t.send_signal(signal.SIGCONT)
    found_at, m = out.after(t0, FOUND, 120)
    serving_at, _ = out.after(t0, re.compile(r"control plane health: SERVING"), 120)
    while True:
        try:
            step, _ = status(client)
        except ControlError:
            step = -1
        if step > before[0]:
            break
        if time.monotonic() - t0 > 120:
            raise RuntimeError("no update within 120 s of the kill")
        time.sleep(0.02)
    first_update = time.monotonic() - t0
    return {"t0": t0, "step_at_kill": before[0], "samples_at_kill": before[1], "step_found": int(m[1]),
            "samples_found": int(m[2]), "state_found_s": found_at - t0, "serving_s": serving_at - t0,
            "first_update_s": first_update}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks restart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mnist_cnn")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    from psserver.control.client import ControlClient

    port, ctl = measure.free_port(), measure.free_port()
    state_dir = Path(tempfile.mkdtemp(prefix="psserver-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    load_before = os.getloadavg()
    sup = subprocess.Popen([sys.executable, "-m", "psserver", "serve", "--port", str(port), "--model", args.model,
                            "--supervise", "--max-restarts", str(args.kills + 1), "--state-dir", str(state_dir),
                            "--control-port", str(ctl)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    out = Output(sup)
    trainers: list[subprocess.Popen] = []
    kills = []
    try:
        out.after(0, re.compile(r"serving \S+ on"), 120)
        trainers = [subprocess.Popen([sys.executable, "-m", "psserver", "train", "--server", f"127.0.0.1:{port}",
                                      "--rank", str(r), "--num-trainers", "2", "--dataset", "synthetic",
                                      "--epochs", "100000", "--reconnect", "--no-progress"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                    for r in (0, 1)]
        with ControlClient(f"127.0.0.1:{ctl}", timeout=5) as client:
            for k in range(args.kills):
                # The supervisor's standby (started STANDBY_DELAY_S after each start) is in place.
                out.after(kills[-1]["t0"] if kills else 0.0, re.compile(r"standby server ready"), 120)
                deadline = time.monotonic() + 120
                start = status(client)[0]
                while status(client)[0] < start + 50:  # training, both trainers in
                    if time.monotonic() > deadline:
                        raise RuntimeError("the trainers do not train")
                    time.sleep(0.2)
                kill = one_kill(sup, port, out, trainers, client)
                kills.append(kill)
                print(f"kill {k + 1}: at step {kill['step_at_kill']} ({kill['samples_at_kill']} samples), state found "
                      f"at step {kill['step_found']} ({kill['samples_found']} samples) after "
                      f"{kill['state_found_s']:.2f}s, serving after {kill['serving_s']:.2f}s, first update after "
                      f"{kill['first_update_s']:.2f}s", flush=True)
    finally:
        for proc in (*trainers, sup):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in (*trainers, sup):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(state_dir)], check=False)
    lost = [k for k in kills if (k["step_found"], k["samples_found"]) != (k["step_at_kill"], k["samples_at_kill"])]
    summary = {"model": args.model, "kills": len(kills), "cores": os.cpu_count(), "load_avg_before": load_before,
               "load_avg_after": os.getloadavg(), "kills_that_lost_updates": len(lost),
               "median_state_found_s": statistics.median(k["state_found_s"] for k in kills),
               "median_serving_s": statistics.median(k["serving_s"] for k in kills),
               "median_first_update_s": statistics.median(k["first_update_s"] for k in kills),
               "max_first_update_s": max(k["first_update_s"] for k in kills), "raw": kills,
               "command": f"python -m benchmarks restart --model {args.model} --kills {args.kills}",
               "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    sys.stdout.write(write_result(args.out / f"restart-{args.model}", summary, "restart", markdown))
    return 1 if summary["kills_that_lost_updates"] else 0


def markdown(summary: dict) -> str:
    """The kill-to-serving table of one run, from its JSON."""
    kills = summary["raw"]
    return "\n".join([
        f"# A server process SIGKILLed under --supervise with --state-dir ({summary['model']}, 2 pushpull trainers, "
        f"{len(kills)} kills)", "",
        f"`{summary['command']}` ({summary['time']}; {summary['cores']} cores, load average "
        f"{summary['load_avg_before'][0]:.2f} before, {summary['load_avg_after'][0]:.2f} after)", "",
        "| from the kill to | median s | max s |", "|---|---|---|",
        f"| the restarted process found its state | {summary['median_state_found_s']:.2f} | "
        f"{max(k['state_found_s'] for k in kills):.2f} |",
        f"| its control plane serves | {summary['median_serving_s']:.2f} | "
        f"{max(k['serving_s'] for k in kills):.2f} |",
        f"| the first update applied after the kill | {summary['median_first_update_s']:.2f} | "
        f"{summary['max_first_update_s']:.2f} |", "",
        f"Kills whose restart did not continue at the step and samples of the kill: "
        f"{summary['kills_that_lost_updates']} of {len(kills)}."]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
