"""Measuring tools of the harness: child processes, a sampler (CPU, RSS, socket bytes) and
the step-time analysis shared by every setup.

Everything here is plain functions and small classes so ``tests/benchmarks`` can check the
analysis on fabricated data without starting anything.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from psserver.utils.ports import free_port  # noqa: F401 (the harness's, for its studies)

ROOT = Path(__file__).resolve().parents[2]
"""The repository checkout the harness runs in (its children import psserver and benchmarks from it)."""
RESULTS = ROOT / "benchmarks" / "results"
"""Where results go by default: committed JSON and the tables made from it."""


# ---- child processes ------------------------------------------------------------------------


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every process the harness starts."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    env.update(extra or {})
    return env


class Child:
    """A process in its own process group (so its children die with it), output to a log file."""

    def __init__(self, argv: list[str], name: str, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=child_env(env), cwd=ROOT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _exited(self) -> bool:
        """Whether the leader has exited, without reaping it: while it is an unreaped zombie
        its process-group id cannot be reused, so signalling the group stays safe."""
        if self.popen.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def running(self) -> bool:
        return not self._exited()

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 25) -> str:
        return "\n".join(self.output().splitlines()[-n:])

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.output())
            if m:
                return m
            if not self.running():
                code = self.wait(5)
                raise RuntimeError(f"{self.name} exited with {code} before /{pattern}/:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no /{pattern}/ within {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> int | None:
        """Exit code once the leader exits (None on timeout); leftovers of its group are killed
        before the leader is reaped."""
        deadline = time.monotonic() + timeout
        while not self._exited():
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        if self.popen.returncode is None:
            self._signal_group(signal.SIGKILL)
        return self.popen.wait()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the group, wait, then SIGKILL it. Safe to call twice."""
        if self.running():
            self._signal_group(signal.SIGTERM)
            self.wait(timeout)
        if self.running():
            self._signal_group(signal.SIGKILL)
        code = self.wait(10)
        self._log.close()
        return code

    def _signal_group(self, sig: int) -> None:
        if self.popen.returncode is not None:
            return  # reaped: the group id may belong to someone else now
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Children:
    """Every child of one setup; ``stop_all`` runs in a ``finally``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.items: list[Child] = []

    def start(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> Child:
        c = Child(argv, name, self.log_dir, env)
        self.items.append(c)
        return c

    def stop_all(self) -> None:
        for c in reversed(self.items):
            if c.running():
                c._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for c in reversed(self.items):
            c.wait(max(0.1, deadline - time.monotonic()))
        for c in reversed(self.items):
            c.stop(timeout=1)


def psserver_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "psserver", "--log-level", "INFO", *args]


def worker_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.harness.workers", *args]


# ---- socket bytes (ss) ----------------------------------------------------------------------

_SS_PID = re.compile(r"pid=(\d+)")
_SS_BYTES = re.compile(r"\b(bytes_sent|bytes_received):(\d+)")


def parse_ss(text: str) -> dict[tuple[str, str], dict]:
    """``ss -tinpH`` output -> {(local, peer): {"pids": set, "sent": int, "received": int}}."""
    conns: dict[tuple[str, str], dict] = {}
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            parts = line.split()
            # State Recv-Q Send-Q Local Peer [users:(...)]
            if len(parts) < 5:
                current = None
                continue
            current = {"pids": {int(p) for p in _SS_PID.findall(line)}, "sent": 0, "received": 0}
            conns[(parts[3], parts[4])] = current
        elif current is not None:
            for key, value in _SS_BYTES.findall(line):
                current["sent" if key == "bytes_sent" else "received"] = int(value)
    return conns


def socket_snapshot(pids: Iterable[int]) -> dict[tuple[str, str], int] | None:
    """Bytes sent so far on each TCP connection owned by one of ``pids`` (None: no ``ss``)."""
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    wanted = set(pids)
    return {key: c["sent"] for key, c in parse_ss(out).items() if c["pids"] & wanted}


def bytes_between(a: dict[tuple[str, str], int], b: dict[tuple[str, str], int]) -> int:
    """Bytes sent between two snapshots (connections opened in between count from zero).

    Summing what each process *sent* counts every byte on the wire once, whichever side
    sent it."""
    return sum(max(0, sent - a.get(key, 0)) for key, sent in b.items())


# ---- the sampler ----------------------------------------------------------------------------


@dataclass
class Sample:
    t: float
    cpu: dict[str, float]
    """Cumulative CPU seconds (user + system) per role."""
    rss: dict[str, int]
    sockets: dict[tuple[str, str], int] | None = None


@dataclass
class Sampler:
    """Samples CPU time and RSS of named processes (with their descendants) every ``interval``
    seconds and the socket bytes of the ``wire`` roles every ``ss_every`` samples."""

    interval: float = 0.5
    ss_every: int = 2
    roles: dict[str, int] = field(default_factory=dict)
    wire: set[str] = field(default_factory=set)
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._procs: dict[int, object] = {}
        self.peak_rss: dict[str, int] = {}

    def track(self, role: str, pid: int, wire: bool = False) -> None:
        with self._lock:
            self.roles[role] = pid
            if wire:
                self.wire.add(role)

    def untrack(self, role: str) -> None:
        with self._lock:
            self.roles.pop(role, None)
            self.wire.discard(role)

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _proc(self, pid: int):
        import psutil

        p = self._procs.get(pid)
        if p is None:
            p = self._procs[pid] = psutil.Process(pid)
        return p

    def _tree(self, pid: int) -> list:
        import psutil

        try:
            top = self._proc(pid)
            return [top, *top.children(recursive=True)]
        except psutil.Error:
            return []

    def sample_now(self, with_sockets: bool) -> Sample:
        import psutil

        with self._lock:
            roles = dict(self.roles)
            wire = set(self.wire)
        cpu: dict[str, float] = {}
        rss: dict[str, int] = {}
        wire_pids: list[int] = []
        for role, pid in roles.items():
            total_cpu, total_rss = 0.0, 0
            for p in self._tree(pid):
                try:
                    t = p.cpu_times()
                    total_cpu += t.user + t.system
                    m = p.memory_info().rss
                    total_rss += m
                    key = f"{role}/{p.pid}" if p.pid != pid else role
                    self.peak_rss[key] = max(self.peak_rss.get(key, 0), m)
                except psutil.Error:
                    continue
                if role in wire:
                    wire_pids.append(p.pid)
            cpu[role] = total_cpu
            rss[role] = total_rss
        sockets = socket_snapshot(wire_pids) if with_sockets and wire_pids else None
        return Sample(time.monotonic(), cpu, rss, sockets)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            s = self.sample_now(with_sockets=i % self.ss_every == 0)
            with self._lock:
                self.samples.append(s)
            i += 1
            self._stop.wait(self.interval)

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)


def cpu_percent(samples: list[Sample], role: str, t0: float, t1: float) -> float | None:
    """Mean CPU use of ``role`` between ``t0`` and ``t1``, in percent of one core."""
    inside = [s for s in samples if t0 <= s.t <= t1 and role in s.cpu]
    if len(inside) < 2 or inside[-1].t - inside[0].t <= 0:
        return None
    return 100.0 * (inside[-1].cpu[role] - inside[0].cpu[role]) / (inside[-1].t - inside[0].t)


def cpu_between(a: Sample, b: Sample, role: str) -> float | None:
    """CPU use of ``role`` between two samples, in percent of one core (None: not in both)."""
    if role not in a.cpu or role not in b.cpu or b.t <= a.t:
        return None
    return 100.0 * (b.cpu[role] - a.cpu[role]) / (b.t - a.t)


def measure_cpu(pid: int, seconds: float) -> float:
    """CPU use of one process (and its descendants) over ``seconds``, percent of one core."""
    s = Sampler(interval=seconds)
    s.track("p", pid)
    a = s.sample_now(False)
    time.sleep(seconds)
    b = s.sample_now(False)
    return 100.0 * (b.cpu["p"] - a.cpu["p"]) / max(1e-6, b.t - a.t)


# ---- step analysis --------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class StepAnalysis:
    start: float
    end: float
    samples_per_s: float
    """Median over the windows."""
    windows: list[float]
    mean_samples_per_s: float
    steps: int
    latencies_s: list[float]
    disturbed: str | None = None
    """Why the figure is not what the method measures (a loaded machine), when it is not."""

    def steps_between(self, ends: list[list[float]], t0: float, t1: float) -> int:
        return sum(1 for e in ends for t in e if t0 < t <= t1)

    def to_dict(self) -> dict:
        return {
            "samples_per_s": self.samples_per_s,
            "samples_per_s_windows": self.windows,
            "samples_per_s_mean": self.mean_samples_per_s,
            "steps_measured": self.steps,
            "measured_s": self.end - self.start,
            "step_p50_ms": 1e3 * percentile(self.latencies_s, 0.5) if self.latencies_s else None,
            "step_p95_ms": 1e3 * percentile(self.latencies_s, 0.95) if self.latencies_s else None,
            **({"disturbed": self.disturbed} if self.disturbed else {}),
        }


def analyze_steps(step_ends: list[list[float]], batch_size: int, *, warmup_s: float, warmup_steps: int = 3,
                  window_s: float = 2.0, min_windows: int = 3) -> StepAnalysis:
    """Throughput of processes that step concurrently, from the end time of each step.

    The measured interval is when *every* process is past its warm-up (``warmup_steps`` steps
    and ``warmup_s`` seconds after its first step) and none has finished; it is cut into
    equal windows of about ``window_s`` (at least ``min_windows``), each window's rate is
    (step ends in it, all processes) x batch / length, and the median window is reported.
    """
    ends = [sorted(e) for e in step_ends if e]
    if not ends or len(ends) != len(step_ends):
        raise ValueError("a process recorded no steps")
    if any(len(e) < 2 for e in ends):
        raise ValueError("a process recorded fewer than two steps")
    if any(len(e) <= warmup_steps + 1 for e in ends):  # a loaded machine: the whole run, flagged
        return _whole_run(ends, batch_size, f"only {min(len(e) for e in ends)} steps recorded, fewer than the "
                                            "warm-up: the whole run's rate")
    starts = []
    for e in ends:
        i = warmup_steps
        while i < len(e) - 1 and e[i] - e[0] < warmup_s:
            i += 1
        starts.append(e[i])
    start, end = max(starts), min(e[-1] for e in ends)
    if end <= start:
        return _whole_run(ends, batch_size, "the processes never stepped at the same time after warm-up: each "
                                            "one's whole-run rate, summed")
    n = max(min_windows, int((end - start) / window_s))
    length = (end - start) / n
    windows = []
    for k in range(n):
        a, b = start + k * length, start + (k + 1) * length
        count = sum(1 for e in ends for t in e if a < t <= b)
        windows.append(count * batch_size / length)
    total = sum(1 for e in ends for t in e if start < t <= end)
    lat = [b - a for e in ends for a, b in itertools.pairwise(e) if start < b <= end]
    mean = total * batch_size / (end - start)
    if statistics.median(windows) == 0:  # steps longer than a window (a loaded machine): the interval's mean
        return StepAnalysis(start, end, mean, [mean], mean, total, lat,
                            disturbed="steps longer than the windows: the measured interval's mean rate")
    return StepAnalysis(start, end, statistics.median(windows), windows, mean, total, lat)


def _whole_run(ends: list[list[float]], batch_size: int, why: str) -> StepAnalysis:
    """A run too short or too disturbed for windows: each process's rate over its own steps,
    summed, marked (the report shows it; the run does not fail)."""
    rate = sum((len(e) - 1) * batch_size / (e[-1] - e[0]) for e in ends if e[-1] > e[0])
    lat = [b - a for e in ends for a, b in itertools.pairwise(e)]
    start, end = min(e[0] for e in ends), max(e[-1] for e in ends)
    return StepAnalysis(start, end, rate, [rate], rate, sum(len(e) - 1 for e in ends), lat, disturbed=why)


def wire_bytes_per_step(samples: list[Sample], step_ends: list[list[float]], t0: float, t1: float) -> dict | None:
    """Bytes on the wire per step between two socket snapshots: the first and last inside
    [t0, t1], or (a short window with fewer than two inside) the pair just around it."""
    snaps = [s for s in samples if s.sockets is not None]
    inside = [s for s in snaps if t0 <= s.t <= t1]
    if len(inside) >= 2:
        a, b = inside[0], inside[-1]
    else:
        before = [s for s in snaps if s.t <= t0]
        after = [s for s in snaps if s.t >= t1]
        if not before or not after:
            return None
        a, b = before[-1], after[0]
    steps = sum(1 for e in step_ends for t in e if a.t < t <= b.t)
    if steps == 0:
        return None
    total = bytes_between(a.sockets, b.sockets)
    return {"bytes_per_step": total / steps, "bytes": total, "steps": steps, "seconds": b.t - a.t}


def wire_total_bytes(samples: list[Sample]) -> int:
    """Bytes sent over the whole sampled run: each connection's largest count seen, summed
    (connections close when their processes exit, so the last snapshot may lack some)."""
    best: dict[tuple[str, str], int] = {}
    for s in samples:
        for key, sent in (s.sockets or {}).items():
            best[key] = max(best.get(key, 0), sent)
    return sum(best.values())


def wire_byte_rate(samples: list[Sample]) -> float | None:
    """Steady-state bytes/s on the wire: the median over snapshot intervals while traffic
    flows (those above a fifth of the busiest one), for runs without per-step times."""
    snaps = [s for s in samples if s.sockets is not None]
    rates = []
    for a, b in itertools.pairwise(snaps):
        if b.t > a.t:
            rates.append(bytes_between(a.sockets, b.sockets) / (b.t - a.t))
    if not rates or max(rates) <= 0:
        return None
    busy = [r for r in rates if r >= 0.2 * max(rates)]
    return statistics.median(busy)


# ---- per-run probes: server CPU time and bytes on the wire ---------------------------------


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of process ``pid`` (every thread, live and exited) from ``/proc/PID/stat``,
    in seconds; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class ProbeSample:
    t: float
    cpu_s: float | None
    """The server's CPU seconds so far (None: no server, or gone)."""
    wire: int | dict | None
    """Bytes on the wire so far: a namespace's loopback counter (int) or an ``ss`` snapshot."""


class Probe:
    """Samples, every ``interval`` seconds from a thread, the CPU time of one process (the PS
    server) and a byte counter (``wire()``: the namespace's loopback tx bytes, or
    ``socket_snapshot`` of the run's processes); ``per_step`` turns two samples inside a run's
    measured interval into CPU and bytes per step."""

    def __init__(self, cpu_pid: int | None, wire=None, interval: float = 0.1) -> None:
        self.cpu_pid, self.wire, self.interval = cpu_pid, wire, interval
        self.samples: list[ProbeSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-probe", daemon=True)

    def sample(self) -> ProbeSample:
        cpu = proc_cpu_seconds(self.cpu_pid) if self.cpu_pid is not None else None
        try:
            wire = self.wire() if self.wire is not None else None
        except OSError:
            wire = None
        return ProbeSample(time.monotonic(), cpu, wire)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.interval)

    def start(self) -> Probe:
        self._thread.start()
        return self

    def stop(self) -> list[ProbeSample]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        return self.samples


def wire_delta(a: int | dict, b: int | dict) -> int:
    """Bytes between two readings of one counter (loopback counter or ``ss`` snapshots)."""
    if isinstance(a, dict):
        return bytes_between(a, b)
    return b - a


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` against ``xs`` (None: fewer than 3 points or no spread)."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def per_step(samples: list[ProbeSample], step_ends: list[list[float]], t0: float, t1: float) -> dict:
    """Server CPU and bytes per step (all processes' steps) inside [t0, t1]: the slope of the
    cumulative reading against time over the slope of the cumulative step count against time
    (least squares, every sample and every step end inside). A step's traffic does not happen
    at its end, so one difference of two readings over the step ends between them is off by
    up to a step per process at each end (+-5% over 40 steps), and a regression of the readings
    on the step count is biased low (the count is a noisy stand-in for progress); against
    time, neither."""
    ends = sorted(t for e in step_ends for t in e if t0 <= t <= t1)
    rate = slope(ends, [float(i) for i in range(len(ends))]) if len(ends) >= 3 else None
    out: dict = {}
    if not rate:
        return out
    for key in ("cpu_s", "wire"):
        inside = [s for s in samples if getattr(s, key) is not None and t0 <= s.t <= t1]
        if len(inside) < 3:
            continue
        ts = [s.t for s in inside]
        if key == "cpu_s":
            k = slope(ts, [s.cpu_s for s in inside])
            if k is not None:
                out["server_cpu_ms_per_step"] = 1e3 * k / rate
                out["server_cpu_cores"] = k
        else:
            first = inside[0].wire
            k = slope(ts, [float(wire_delta(first, s.wire)) for s in inside])
            if k is not None:
                out["bytes_per_step"] = k / rate
                out["bytes_per_s"] = k
                out["bytes_seconds"] = ts[-1] - ts[0]
                out["bytes_samples"] = len(inside)
    return out
