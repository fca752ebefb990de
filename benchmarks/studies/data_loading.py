"""A user's ``Dataset`` through the DataLoader against psserver's in-memory path.

    python -m benchmarks data_loading                                   # the issue's measurement: 5 rounds, ~10 min
    python -m benchmarks data_loading --trainer-allocator cached        # trainers with the server's allocator policy
    python -m benchmarks data_loading --setups in-memory,user-png-w1,user-png-w2 --rounds 3
    python -m benchmarks data_loading --quick --results-dir /tmp/dl     # 1 round of 60 steps, no load wait: ~1 min

The target: a user ``Dataset`` with ``--data-workers 1`` reaches >= 0.95 of the
in-memory path's samples/s (mnist_cnn, 2 trainers): loading hidden behind the step. One
``psserver serve --model mnist_cnn --no-control`` stays up for the whole measurement (after one
unmeasured warm-up run: a server's first session is slow); each round runs every setup once (2
trainers, ``--max-steps`` each, ``--compute-threads 1``, psserver's defaults otherwise), back to
back, in an order that rotates by one each round, because the speed of the 2-core VM drifts by
10-30% from one minute to the next. A run's samples/s is that of both trainers together over
the interval in which both step, after ``--skip`` warm-up steps of each; the samples of every
step are counted (the last batch of an epoch is short). A setup's ratio is its samples/s over
``in-memory``'s of the same round; the result is the median over rounds.

Setups (``SETUPS``):

- ``in-memory``: ``--dataset mnist --train-split 8000`` (a ``TensorDataset``, one gather per
  batch in the trainer's process, ``--data-workers 0``, its default).
- ``user-dataset-w1``: a user's own map-style ``Dataset`` class, written by the harness into a
  package on the trainers' ``PYTHONPATH`` only, over the same 8,000 MNIST tensors decoded once
  into a file it loads (one ``(x, y)`` per ``__getitem__``, collated by the DataLoader);
  ``--data-workers 1``.
- ``user-png-w1`` (``-w2``): a user's ``Dataset`` reading the same images as PNG files with PIL
  (``benchmarks.harness.userproject.PNG_DATASET``, the issue's must-show project), 1 (2) workers.

Why ``--compute-threads 1`` (``--trainer-threads``; 0: the trainer's default): the default is a
share of the host's CPUs among the trainers the server knows there, re-asked every second (every
10 s when these runs were measured); the first trainer to join sees itself alone and runs two
threads on the shared cores (~400 ms steps instead of ~80) until its next look, which moves a
run's rate by when the second one joined.

The machine is shared: before each round the harness waits (at most ``--load-wait`` s) until
the 1-minute load average is below ``--max-load`` and records whether it got there. Per run it
records the load average before and after and, over the measured interval (``/proc``, every
0.25 s), how many cores were busy in all (``/proc/stat``), how many the server, the trainers'
own processes and their DataLoader workers used, the rest (other users), and the trainers'
minor page faults per step (``--trainer-allocator``: see ``allocator_env``).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness import measure
from benchmarks.harness.report import write_result
from benchmarks.harness.userproject import MNIST_TRAIN_SPLIT, PNG_DATASET, write_mnist_pngs, write_package

log = logging.getLogger(__name__)

BASELINE = "in-memory"
SETUPS: dict[str, dict] = {
    "in-memory": {"dataset": "mnist", "workers": 0, "files": None},
    "user-dataset-w1": {"dataset": "user_digits.tensors:splits", "workers": 1, "files": "tensors"},
    "user-png-w1": {"dataset": "user_digits.pngs:splits", "workers": 1, "files": "pngs"},
    "user-png-w2": {"dataset": "user_digits.pngs:splits", "workers": 2, "files": "pngs"},
}
"""``--dataset`` and ``--data-workers`` of each setup, and the files of the user's project it reads."""
DEFAULT_SETUPS = "in-memory,user-dataset-w1,user-png-w1"
"""The issue's setups; ``user-png-w2`` only when asked for (a fourth run per round: past 12 minutes)."""
TARGET = 0.95
PACKAGE = "user_digits"
DEFAULT_DATA_DIR = measure.ROOT.parent / "shared" / "data" / "mnist"
DEFAULT_RESULTS = measure.RESULTS / "data-loading"
RUN_TIMEOUT_S = 300.0

TENSOR_DATASET = '''
    """A user's own Dataset over MNIST already decoded: the tensors are read once, a sample is
    one index into them (nothing of psserver)."""

    import torch
    from torch.utils.data import Dataset


    class Digits(Dataset):
        def __init__(self, x, y):
            self.x, self.y = x, y

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return self.x[i], int(self.y[i])


    def splits(path):
        data = torch.load(path)
        return Digits(data["train_x"], data["train_y"]), Digits(data["val_x"], data["val_y"])
'''
"""Source of ``user_digits.tensors``: ``splits(path)`` gives the train and held-out ``Digits``."""


def parse_setups(text: str) -> list[str]:
    """Setup names in order, the baseline first (the ratios divide by it); ``ValueError`` of one line."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        raise ValueError(f"unknown setup(s) {', '.join(unknown)}; known: {', '.join(SETUPS)}")
    if len(set(names)) != len(names):
        raise ValueError("a setup is named twice")
    if BASELINE not in names or len(names) < 2:
        raise ValueError(f"name {BASELINE} (the ratios divide by it) and at least one other setup")
    return [BASELINE, *(n for n in names if n != BASELINE)]


def needs_pngs(names: list[str]) -> bool:
    return any(SETUPS[n]["files"] == "pngs" for n in names)


@dataclasses.dataclass(frozen=True)
class Project:
    """The user's project the harness writes: ``path`` goes on the trainers' ``PYTHONPATH``."""

    path: Path
    tensors: Path
    pngs: Path | None
    data_dir: Path
    train_split: int


def write_project(root: Path, data_dir: Path, train_split: int, *, pngs: bool) -> Project:
    """The package ``user_digits`` (``tensors``, ``pngs``) under ``root/src``, the decoded
    tensors of the same split as ``--dataset mnist --train-split`` (``root/digits.pt``), and,
    with ``pngs``, those images as PNG files (``root/pngs/{train,val}/<label>/<i>.png``)."""
    import torch

    from psserver.data.idx import load_mnist

    root = Path(root)
    src = write_package(root / "src", PACKAGE, {"tensors": TENSOR_DATASET, "pngs": PNG_DATASET})
    train, held_out = load_mnist(data_dir, train_split=train_split)
    tensors = root / "digits.pt"
    torch.save({"train_x": train.tensors[0].contiguous(), "train_y": train.tensors[1].contiguous(),
                "val_x": held_out.tensors[0].contiguous(), "val_y": held_out.tensors[1].contiguous()}, tensors)
    png_root = None
    if pngs:
        if train_split != MNIST_TRAIN_SPLIT:
            raise ValueError(f"the PNG setups write the split of benchmarks.harness.userproject: --train-split "
                             f"{MNIST_TRAIN_SPLIT}")
        png_root = write_mnist_pngs(root / "pngs", train_split, len(held_out), data_dir)
    return Project(src, tensors, png_root, Path(data_dir), train_split)


def server_argv(port: int, model: str) -> list[str]:
    return measure.psserver_argv("serve", "--port", str(port), "--model", model, "--no-control")


def dataset_flags(name: str, project: Project) -> list[str]:
    """``psserver train``'s data flags of setup ``name`` (``--data-workers`` always named)."""
    setup = SETUPS[name]
    flags = ["--dataset", setup["dataset"]]
    if setup["files"] is None:
        flags += ["--data-dir", str(project.data_dir), "--train-split", str(project.train_split)]
    elif setup["files"] == "tensors":
        flags += ["--dataset-args", json.dumps({"path": str(project.tensors)})]
    else:
        if project.pngs is None:
            raise ValueError(f"setup {name} reads PNG files: write the project with pngs=True")
        flags += ["--dataset-args", json.dumps({"root": str(project.pngs)})]
    return [*flags, "--data-workers", str(setup["workers"])]


def trainer_argv(name: str, project: Project, *, rank: int, port: int, steps: int, batch_size: int,
                 stats_out: Path, threads: int = 1, trainers: int = 2) -> list[str]:
    """``psserver train`` of rank ``rank``: the trainers' defaults (``--step``, ...) but for the
    data and ``--compute-threads threads`` (0: the default, a share of the host's CPUs)."""
    argv = ["train", "--server", f"127.0.0.1:{port}", "--rank", str(rank), "--num-trainers", str(trainers),
            "--epochs", "1000000", "--max-steps", str(steps), "--batch-size", str(batch_size), "--no-progress",
            "--stats-out", str(stats_out), *dataset_flags(name, project)]
    if threads:
        argv += ["--compute-threads", str(threads)]
    return measure.psserver_argv(*argv)


ALLOCATORS = ("system", "cached")


def allocator_env(policy: str) -> dict[str, str]:
    """glibc's settings of psserver's ``cached`` host allocator policy (``psserver.utils.memory``,
    which ``psserver serve`` and, since these runs were measured, ``psserver train`` apply to
    themselves) as environment variables, for the trainers; none for ``system``. Why: glibc
    raises its mmap threshold when a large block is freed, so a trainer whose data loading freed
    one (``load_mnist``'s temporaries) reuses its step buffers while one that did not maps and
    faults them in again each step."""
    if policy not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {policy!r}")
    if policy == "system":
        return {}
    from psserver.utils import memory

    return {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(memory.MMAP_THRESHOLD),
            "MALLOC_TRIM_THRESHOLD_": str(memory.TRIM_THRESHOLD), "MALLOC_TOP_PAD_": str(memory.TOP_PAD)}


def trainer_env(project: Project, allocator: str = "system") -> dict[str, str]:
    """The user's package on the trainers' ``PYTHONPATH`` (after this checkout), for every
    setup, so the runs differ only in their data flags; ``allocator_env(allocator)``."""
    return {"PYTHONPATH": os.pathsep.join([str(measure.ROOT), str(project.path),
                                           *filter(None, [os.environ.get("PYTHONPATH")])]),
            **allocator_env(allocator)}


def step_samples(steps: int, shard: int, batch_size: int) -> list[int]:
    """Samples in each of a trainer's ``steps`` steps: its shard of ``shard`` samples is read
    ``batch_size`` at a time, epoch after epoch, the last batch of an epoch short."""
    per_epoch = math.ceil(shard / batch_size)
    last = shard - (per_epoch - 1) * batch_size
    return [last if (i + 1) % per_epoch == 0 else batch_size for i in range(steps)]


def run_rate(step_ends: list[list[float]], samples: list[list[int]], skip: int) -> dict:
    """Throughput of one run: the samples of every trainer's steps after its first ``skip``,
    over the interval in which all of them step (a trainer that finishes first would leave the
    other alone and fast)."""
    ends = [e[skip:] for e in step_ends]
    if any(len(e) < 6 for e in ends):
        raise RuntimeError(f"a run has {min(len(e) for e in ends)} steps after the {skip} skipped: too few "
                           "(raise --steps)")
    start, end = max(e[0] for e in ends), min(e[-1] for e in ends)
    inside = [[i for i, t in enumerate(e, skip) if start < t <= end] for e in ends]
    count = sum(len(i) for i in inside)
    if end <= start or count < 5:  # a loaded machine ran them one after another: the whole run, flagged
        start, end = min(e[0] for e in ends), max(e[-1] for e in ends)
        inside = [list(range(skip + 1, skip + len(e))) for e in ends]
        count = sum(len(i) for i in inside)
        total = sum(s[i] for s, idx in zip(samples, inside, strict=True) for i in idx)
        gaps = [b - a for e in ends for a, b in itertools.pairwise(e)]
        return {"samples_per_s": total / (end - start), "steps": count, "samples": total, "seconds": end - start,
                "start": start, "end": end, "step_ms": 1000 * statistics.median(gaps),
                "steps_per_process": [len(i) for i in inside],
                "disturbed": "the trainers never stepped together after their warm-up (a loaded machine): the "
                             "whole run's samples over its whole span"}
    total = sum(s[i] for s, idx in zip(samples, inside, strict=True) for i in idx)
    gaps = [b - a for e in ends for a, b in itertools.pairwise(e) if start < b <= end]
    return {"samples_per_s": total / (end - start), "steps": count, "samples": total, "seconds": end - start,
            "start": start, "end": end, "step_ms": 1000 * statistics.median(gaps),
            "steps_per_process": [len(i) for i in inside]}


# ---- CPU over a run -------------------------------------------------------------------------


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores so far (``/proc/stat``; idle and iowait are not busy)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(fields[:8])  # guest time is already in user
    return total - fields[3] - fields[4], total


def proc_minor_faults(pid: int) -> int | None:
    """Minor page faults of process ``pid`` so far (``/proc/PID/stat`` field 10; None once gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[7])


def children_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of every descendant of ``pid`` (its DataLoader workers), by pid."""
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for k in kids:
        s = measure.proc_cpu_seconds(k.pid)
        if s is not None:
            out[k.pid] = s
    return out


@dataclasses.dataclass
class CpuSample:
    t: float
    busy: int
    total: int
    server: float | None
    trainers: list[float | None]
    workers: list[dict[int, float]]
    faults: list[int | None] = dataclasses.field(default_factory=list)
    """Minor page faults of each trainer's own process so far."""


class CpuProbe:
    """Samples, every ``interval`` s from a thread, the machine's busy jiffies and the CPU
    seconds of the server, of each trainer's own process and of its descendants."""

    def __init__(self, server_pid: int, trainer_pids: list[int], interval: float = 0.25) -> None:
        self.server_pid, self.trainer_pids, self.interval = server_pid, trainer_pids, interval
        self.samples: list[CpuSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu", daemon=True)

    def sample(self) -> CpuSample:
        busy, total = machine_jiffies()
        return CpuSample(time.monotonic(), busy, total, measure.proc_cpu_seconds(self.server_pid),
                         [measure.proc_cpu_seconds(p) for p in self.trainer_pids],
                         [children_cpu_seconds(p) for p in self.trainer_pids],
                         [proc_minor_faults(p) for p in self.trainer_pids])

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.interval)

    def start(self) -> CpuProbe:
        self._thread.start()
        return self

    def stop(self) -> list[CpuSample]:
        self._stop.set()
        self._thread.join(10)
        return self.samples


def cpu_between(samples: list[CpuSample], t0: float, t1: float, steps: int, cores: int) -> dict | None:
    """Cores busy between the first and last sample inside [t0, t1]: the machine, the server,
    the trainers' processes, their DataLoader workers and everything else (other users); and
    the trainers' and workers' CPU ms per trainer step (None: fewer than 2 samples inside)."""
    inside = [s for s in samples if t0 <= s.t <= t1 and s.server is not None and None not in s.trainers]
    if len(inside) < 2 or steps <= 0:
        return None
    a, b = inside[0], inside[-1]
    dt = b.t - a.t
    machine = cores * (b.busy - a.busy) / max(1, b.total - a.total)
    server = (b.server - a.server) / dt
    trainers = sum(y - x for x, y in zip(a.trainers, b.trainers, strict=True)) / dt
    workers = sum(s - wa.get(pid, 0.0) for wa, wb in zip(a.workers, b.workers, strict=True)
                  for pid, s in wb.items()) / dt
    # The steps inside [a.t, b.t] are about steps * dt / (t1 - t0).
    per = steps * dt / (t1 - t0)
    faults = None
    if a.faults and b.faults and None not in a.faults + b.faults:
        faults = sum(y - x for x, y in zip(a.faults, b.faults, strict=True)) / per
    return {"machine_cores": machine, "server_cores": server, "trainer_cores": trainers, "worker_cores": workers,
            "other_cores": max(0.0, machine - server - trainers - workers),
            "trainer_cpu_ms_per_step": 1000 * trainers * dt / per, "worker_cpu_ms_per_step": 1000 * workers * dt / per,
            "trainer_minor_faults_per_step": faults}


# ---- load -----------------------------------------------------------------------------------


def wait_for_quiet(max_load: float, wait_s: float, poll_s: float = 5.0) -> dict:
    """Wait (at most ``wait_s``) until the 1-minute load average is below ``max_load``; what was
    seen: the load before and at the end, the seconds waited, and whether it got there."""
    t0 = time.monotonic()
    first = os.getloadavg()
    load = first
    while load[0] >= max_load and time.monotonic() - t0 < wait_s:
        time.sleep(min(poll_s, max(0.0, wait_s - (time.monotonic() - t0))))
        load = os.getloadavg()
    quiet = load[0] < max_load
    if not quiet:
        log.warning("load average %.2f still >= %.2f after %.0f s: going on (recorded as busy)", load[0], max_load,
                    time.monotonic() - t0)
    return {"load_seen": list(first), "load_at_start": list(load), "waited_s": time.monotonic() - t0, "quiet": quiet}


# ---- the rounds -----------------------------------------------------------------------------


class Rounds:
    """The long-lived server and the trainers of each run (stopped in ``close``)."""

    def __init__(self, *, project: Project, model: str, batch_size: int, steps: int, skip: int, work: Path,
                 threads: int = 1, allocator: str = "system") -> None:
        self.project, self.model, self.batch_size, self.steps, self.skip = project, model, batch_size, steps, skip
        self.threads, self.env = threads, trainer_env(project, allocator)
        self.work = work
        self.cores = os.cpu_count() or 1
        self.children = measure.Children(work)
        self.port = measure.free_port()
        self.server = self.children.start(server_argv(self.port, model), "server")
        self.server.wait_for(r"serving \S+ on", 180)

    def close(self) -> None:
        self.children.stop_all()

    def run(self, name: str, tag: str, steps: int | None = None, measured: bool = True) -> dict | None:
        """Two trainers of setup ``name`` to their end; the run's rate, CPU and load (None: not ``measured``)."""
        steps = self.steps if steps is None else steps
        stats = [self.work / f"{tag}-trainer{r}.json" for r in range(2)]
        load_before = os.getloadavg()
        procs = [self.children.start(trainer_argv(name, self.project, rank=r, port=self.port, steps=steps,
                                                  batch_size=self.batch_size, stats_out=stats[r],
                                                  threads=self.threads),
                                     stats[r].stem, self.env) for r in range(2)]
        probe = CpuProbe(self.server.pid, [p.pid for p in procs]).start()
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            for p in procs:
                code = p.wait(max(1.0, deadline - time.monotonic()))
                if code != 0:
                    raise RuntimeError(f"{p.name} {'timed out' if code is None else f'exited with {code}'}:\n"
                                       f"{p.tail()}")
        finally:
            samples = probe.stop()
            for p in procs:
                p.stop()
            self.children.items = [c for c in self.children.items if c not in procs]
        if not measured:
            return None
        ends = [json.loads(s.read_text())["step_ends"] for s in stats]
        shard = math.ceil(self.project.train_split / 2)
        out = run_rate(ends, [step_samples(len(e), shard, self.batch_size) for e in ends], self.skip)
        out["cpu"] = cpu_between(samples, out["start"], out["end"], out["steps"], self.cores)
        out["load_before"], out["load_after"] = list(load_before), list(os.getloadavg())
        return out


def rotate(names: list[str], r: int) -> list[str]:
    k = r % len(names)
    return names[k:] + names[:k]


def measure_rounds(names: list[str], *, rounds: int, project: Project, model: str, batch_size: int, steps: int,
                   skip: int, warm_up_steps: int, max_load: float, load_wait_s: float, threads: int = 1,
                   allocator: str = "system") -> dict:
    """Every setup once per round, in an order that rotates by one each round."""
    runs: dict[str, list[dict]] = {n: [] for n in names}
    per_round: list[dict] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="psserver-data-loading-") as tmp:
        rr = Rounds(project=project, model=model, batch_size=batch_size, steps=steps, skip=skip, work=Path(tmp),
                    threads=threads, allocator=allocator)
        try:
            if warm_up_steps:
                log.info("warming up the server (%s, %d steps per trainer, not measured)", BASELINE, warm_up_steps)
                rr.run(BASELINE, "warm-up", steps=warm_up_steps, measured=False)
            for r in range(rounds):
                quiet = wait_for_quiet(max_load, load_wait_s)
                order = rotate(names, r)
                per_round.append({**quiet, "order": order})
                log.info("[%5.0fs] round %d/%d: load %.2f (waited %.0f s)%s", time.monotonic() - t0, r + 1, rounds,
                         quiet["load_at_start"][0], quiet["waited_s"], "" if quiet["quiet"] else ", BUSY")
                for name in order:
                    run = rr.run(name, f"{name}-{r}")
                    runs[name].append(run)
                    cpu = run["cpu"] or {}
                    log.info("[%5.0fs] round %d/%d %-16s %6.0f samples/s, step %.1f ms, cores busy %.2f (other %.2f, "
                             "workers %.2f)", time.monotonic() - t0, r + 1, rounds, name, run["samples_per_s"],
                             run["step_ms"], cpu.get("machine_cores", math.nan), cpu.get("other_cores", math.nan),
                             cpu.get("worker_cores", math.nan))
        finally:
            rr.close()
    out = summarize(names, runs)
    out.update(rounds=rounds, per_round=per_round, runs=runs, wall_s=time.monotonic() - t0, cores=rr.cores)
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(names: list[str], runs: dict[str, list[dict]]) -> dict:
    """Each setup's samples/s over the baseline's of the same round, per round and the median;
    the medians of its CPU figures."""
    base = [run["samples_per_s"] for run in runs[BASELINE]]
    out: dict = {"baseline": BASELINE, "target": TARGET, "setups": {}}
    for name in names:
        rates = [run["samples_per_s"] for run in runs[name]]
        ratios = [a / b for a, b in zip(rates, base, strict=True)]
        row = {"samples_per_s": rates, "median_samples_per_s": statistics.median(rates),
               "x_baseline": ratios, "median_x_baseline": statistics.median(ratios),
               "rounds_at_or_above_target": sum(x >= TARGET for x in ratios),
               "median_step_ms": statistics.median(run["step_ms"] for run in runs[name])}
        for key in ("machine_cores", "other_cores", "server_cores", "trainer_cores", "worker_cores",
                    "trainer_cpu_ms_per_step", "worker_cpu_ms_per_step", "trainer_minor_faults_per_step"):
            row[f"median_{key}"] = _median([(run.get("cpu") or {}).get(key) for run in runs[name]])
        out["setups"][name] = row
    return out


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def markdown(result: dict) -> str:
    """The report: ratios, per-round ratios, CPU and the load of each round."""
    s = result["summary"]
    n = s["rounds"]
    allocator = result["config"].get("trainer_allocator", "system")
    lines = [f"## A user Dataset through the DataLoader against the in-memory path: {result['config']['model']}, "
             f"2 trainers, batch {result['config']['batch_size']}"
             + ("" if allocator == "system" else f", trainers with the {allocator} allocator policy"), "",
             f"`{result['command']}` ({result['time']}, {result['wall_s'] / 60:.1f} min, {s['cores']} cores; "
             f"{n} rounds of {result['config']['steps']} steps per trainer, {result['config']['skip']} skipped)", "",
             f"| setup | samples/s (median) | x {BASELINE} (median) | rounds >= {TARGET} | x {BASELINE}, per round "
             "| step ms (median) | cores busy: all / other users / server / trainers / workers (medians) "
             "| trainer + worker CPU ms per step (medians) | trainer minor faults per step (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in s["setups"].items():
        per = " ".join(f"{x:.3f}" for x in row["x_baseline"])
        cores = " / ".join(_f(row[f"median_{k}"], "{:.2f}") for k in ("machine_cores", "other_cores", "server_cores",
                                                                        "trainer_cores", "worker_cores"))
        ms = (f"{_f(row['median_trainer_cpu_ms_per_step'], '{:.1f}')} + "
              f"{_f(row['median_worker_cpu_ms_per_step'], '{:.1f}')}")
        lines.append(f"| {name} | {row['median_samples_per_s']:.0f} | {row['median_x_baseline']:.3f} | "
                     f"{row['rounds_at_or_above_target']}/{n} | {per} | {row['median_step_ms']:.1f} | {cores} | "
                     f"{ms} | {_f(row.get('median_trainer_minor_faults_per_step'), '{:.0f}')} |")
    lines += ["", "| round | order | 1-min load at start (waited s) | quiet | each run: 1-min load before/after, "
              "cores other users took while it was measured |", "|---|---|---|---|---|"]
    for r, info in enumerate(s["per_round"]):
        runs = [(name, s["runs"][name][r]) for name in info["order"]]
        loads = ", ".join(f"{name} {run['load_before'][0]:.2f}/{run['load_after'][0]:.2f} "
                          f"({_f((run.get('cpu') or {}).get('other_cores'), '{:.2f}')})" for name, run in runs)
        lines.append(f"| {r + 1} | {' '.join(info['order'])} | {info['load_at_start'][0]:.2f} ({info['waited_s']:.0f}) "
                     f"| {'yes' if info['quiet'] else 'no'} | {loads} |")
    lines += ["", f"Load average before the measurement {result['load_before']}, after {result['load_after']} "
              "(1, 5, 15 min)."]
    return "\n".join(lines) + "\n"


def command_line(args: argparse.Namespace) -> str:
    return (f"python -m benchmarks data_loading --setups {','.join(args.setups)} --rounds {args.rounds} "
            f"--steps {args.steps} --skip {args.skip} --warm-up-steps {args.warm_up_steps} "
            f"--trainer-threads {args.trainer_threads} --trainer-allocator {args.trainer_allocator} "
            f"--max-load {args.max_load:g} --load-wait {args.load_wait:g} --model {args.model} "
            f"--batch-size {args.batch_size}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks data_loading", description=__doc__.splitlines()[0])
    p.add_argument("--setups", default=DEFAULT_SETUPS, help=f"comma-separated, {BASELINE} among them "
                   f"(default {DEFAULT_SETUPS})")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every setup (default 5)")
    p.add_argument("--steps", type=int, default=200, help="steps per trainer and run (default 200)")
    p.add_argument("--skip", type=int, default=40, help="warm-up steps of each trainer left out (default 40)")
    p.add_argument("--warm-up-steps", type=int, default=40,
                   help="steps per trainer of one unmeasured run first (a server's first session is slow; default 40)")
    p.add_argument("--trainer-threads", type=int, default=1,
                   help="each trainer's --compute-threads (default 1, its share of 2 cores with 2 trainers; 0: the "
                        "trainer's default, which the first trainer to join sets to all cores until its next look)")
    p.add_argument("--trainer-allocator", choices=ALLOCATORS, default="system",
                   help="system: the trainers' own malloc (psserver's as it is); cached: every setup's trainers run "
                        "with psserver's cached host allocator policy (glibc environment variables), so the "
                        "setups differ in loading only (default system)")
    p.add_argument("--model", default="mnist_cnn", help="the server's model (default mnist_cnn)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step and trainer (default 64)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="MNIST IDX files (default %(default)s)")
    p.add_argument("--train-split", type=int, default=8000, help="training images (default 8000)")
    p.add_argument("--max-load", type=float, default=1.0,
                   help="wait before each round until the 1-minute load average is below this (default 1.0)")
    p.add_argument("--load-wait", type=float, default=120.0, help="at most this many seconds (default 120)")
    p.add_argument("--quick", action="store_true", help="1 round of 60 steps (20 skipped), no load wait")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS, help="where the JSON and Markdown go")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.skip, args.warm_up_steps, args.load_wait = 1, 60, 20, 20, 0.0
    try:
        args.setups = parse_setups(args.setups)
    except ValueError as e:
        p.error(f"--setups: {e}")
    if args.rounds < 1 or args.skip < 0 or args.steps < args.skip + 6 or args.batch_size < 1 \
            or args.warm_up_steps < 0 or args.load_wait < 0 or args.trainer_threads < 0 or args.train_split < 2:
        p.error("need --rounds >= 1, --skip >= 0, --steps >= --skip + 6, --batch-size >= 1, --warm-up-steps >= 0, "
                "--load-wait >= 0, --train-split >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    from benchmarks.harness.paired import exit_on_sigterm

    with exit_on_sigterm():
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="psserver-user-project-") as tmp:
        log.info("writing the user's project (%s)", "tensors and PNG files" if needs_pngs(args.setups) else "tensors")
        project = write_project(Path(tmp), args.data_dir, args.train_split, pngs=needs_pngs(args.setups))
        summary = measure_rounds(args.setups, rounds=args.rounds, project=project, model=args.model,
                                 batch_size=args.batch_size, steps=args.steps, skip=args.skip,
                                 warm_up_steps=args.warm_up_steps, max_load=args.max_load,
                                 load_wait_s=args.load_wait, threads=args.trainer_threads,
                                 allocator=args.trainer_allocator)
    result = {"command": command_line(args), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "wall_s": time.monotonic() - t0, "load_before": [round(v, 2) for v in load_before],
              "load_after": [round(v, 2) for v in os.getloadavg()],
              "config": {"model": args.model, "batch_size": args.batch_size, "steps": args.steps, "skip": args.skip,
                         "warm_up_steps": args.warm_up_steps, "trainer_threads": args.trainer_threads,
                         "trainer_allocator": args.trainer_allocator,
                         "trainer_env": allocator_env(args.trainer_allocator),
                         "train_split": args.train_split,
                         "max_load": args.max_load, "load_wait_s": args.load_wait,
                         "setups": {n: SETUPS[n] for n in args.setups}, "cores": os.cpu_count()},
              "summary": summary}
    stem = args.results_dir / f"data_loading-{args.model}-b{args.batch_size}"
    if args.trainer_allocator != "system":
        stem = stem.with_name(f"{stem.name}-allocator-{args.trainer_allocator}")
    md = write_result(stem, result, "data_loading", markdown)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
