"""Training over slow links: DDP, pushpull and DiLoCo (sync and async, H local steps) to a target loss.

    python -m benchmarks diloco                                   # every setup, byte_lm on pysource
    python -m benchmarks diloco --quick --results-dir /tmp/diloco # 3 setups, 24 steps each: ~4 min
    python -m benchmarks diloco --setups ddp-4,diloco-sync-H100 --steps 400 --steps-of ddp-4=200
    python -m benchmarks diloco --model mnist_cnn --setups ddp-4,diloco-sync-H50 --steps 300 --batch-size 32

Results go to ``--results-dir`` (default ``benchmarks/results/diloco``): JSON, a Markdown table
and a PNG of held-out loss against samples and against wall time (``diloco.*`` for byte_lm,
``diloco-mnist_cnn.*`` for ``--model mnist_cnn``, trained on 8,000 of ``--data-dir``'s MNIST
images and held out on the others).

Hosts: one server and ``--trainers`` trainers (default 4), each a network namespace behind its
own link to one switch (``benchmarks.harness.multihost``), every link held to ``--rate`` Mbit/s
each way with ``--delay-ms`` of one-way delay on each side of it, so a round trip between two
hosts crosses four delays (the default 5 ms: 20 ms RTT). DDP's ranks sit on the trainers' hosts
(rank 0's address is the rendezvous); the server's host is idle then.

Setups (``--setups``, comma-separated):

- ``ddp-4``: ``psserver train --mode ddp``, gloo over the links, AdamW at ``--lr``;
- ``pushpull-async-4``: a psserver server with AdamW at ``--lr``, trainers ``--step pushpull``;
- ``diloco-sync-H<h>`` / ``diloco-async-H<h>``: ``--update diloco --outer sync|async`` (the
  server's defaults: Nesterov SGD lr 0.7 momentum 0.9, or delayed Nesterov), trainers
  ``--local-steps h`` with AdamW at ``--lr`` as their inner optimizer; async with
  ``--dynamic-local-steps``;
- ``-F<n>`` after a DiLoCo setup: streaming DiLoCo, ``--fragments n`` (each fragment's sync
  runs under one inner step, merged with alpha 0.5: the trainer's defaults); an async one runs
  without ``--dynamic-local-steps`` (each fragment keeps its place in the window);
- ``-bf16``, ``-int8``, ``-int4`` after a DiLoCo setup: its pseudo-gradients in bf16
  (``--wire-dtype bf16``) or quantized with error feedback (``--compress``);
- a ``-faults`` suffix (DiLoCo): the server runs ``--supervise`` with its state in memory and
  trainers ``--reconnect``; at ``--fault-at`` seconds trainer 1 is SIGKILLed and started again by
  hand, then the server process (``benchmarks.harness.faults``); the result records what the
  server applied (its status: outer steps, samples, each trainer's windows) and what the logs
  say of the faults;
- ``-outer<lr>-m<momentum>`` last (DiLoCo): the outer optimizer at that lr and momentum,
  Nesterov where the momentum is above 0 (async: delayed Nesterov), plain SGD at 0 (``-outer1-m0``:
  the pseudo-gradients averaged into the global weights, Local SGD); else the server's default;
- a ``-straggler`` suffix holds the last trainer to ``--straggler-share`` of a core (a CPU
  cgroup quota, ``benchmarks.harness.throttle``); its measured step rate against the others' is
  in the result.

Every trainer takes ``--steps`` steps of ``--batch-size`` samples (128 bytes each), or the
steps ``--steps-of`` gives its setup (a slow setup can stop early: its time to a target it has
not reached is then "more than" its seconds trained). A straggler setup ends when the other
trainers have taken their steps (the straggler is stopped then: async goes on without it, sync
waits for it, which is the point), and any setup ends at ``--time-limit`` seconds of training.
Snapshots of the global weights (the server's checkpoints every
``--snapshot-s`` seconds and at the end; DDP's every ``steps / 12`` steps) are evaluated after
the run, on ``--eval-samples`` held-out samples, none of it while training runs: held-out loss
against samples seen and against seconds since the trainers started. Time to target: the first
moment (linear between snapshots) the loss is at or below ``--target-loss`` (default: DDP's
final loss where DDP ran, else the highest final loss of the setups without a straggler). At
equal samples: each setup's loss at the samples DDP trained (linear between snapshots). Bytes:
what every host sent (``tc`` counters of the links, headers included) over the samples trained.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import measure, multihost, report, throttle
from benchmarks.harness.faults import fault_counts, inject_faults
from psserver.utils.cpus import share, usable_cpus

log = logging.getLogger(__name__)

DEFAULT_RESULTS = measure.RESULTS / "diloco"
SERVER_PORT = 29500
DDP_PORT = 29600
CONTROL_PORT = 50051
MODELS = ("byte_lm", "mnist_cnn")
UNITS = {"byte_lm": "nats a byte", "mnist_cnn": "nats an image"}
MNIST_TRAIN_SPLIT = 8000
"""Of ../shared/data/mnist's one split of 10,000 images, those that train; the rest are held out."""
SETUPS = ("ddp-4", "pushpull-async-4", "diloco-sync-H10", "diloco-sync-H50", "diloco-sync-H100", "diloco-sync-H500",
          "diloco-async-H10", "diloco-async-H50", "diloco-async-H100", "diloco-async-H500",
          "diloco-sync-H100-int8", "diloco-sync-H100-int4", "diloco-async-H100-straggler", "diloco-sync-H100-straggler")
QUICK_SETUPS = ("ddp-4", "pushpull-async-4", "diloco-sync-H8")
_SETUP = re.compile(r"^(ddp-(\d+)|pushpull-async-(\d+)|diloco-(sync|async)-H(\d+)(-F(\d+))?(-(bf16|int8|int4))?)"
                    r"(-straggler|-faults)?(-outer(\d+(?:\.\d+)?)-m(\d+(?:\.\d+)?))?$")


@dataclass(frozen=True)
class Setup:
    name: str
    kind: str  # ddp, pushpull, diloco
    outer: str | None = None
    local_steps: int | None = None
    straggler: bool = False
    compress: str | None = None
    """DiLoCo's pseudo-gradients on the wire: bf16 (``--wire-dtype``), int8 or int4 (``--compress``)."""
    fragments: int | None = None
    """Streaming DiLoCo's fragments (``--fragments``; None: the whole model each sync)."""
    faults: bool = False
    """A trainer and the server process SIGKILLed during the run (``benchmarks.harness.faults``)."""
    outer_opt: tuple[float, float] | None = None
    """DiLoCo's outer optimizer's (lr, momentum) (``-outer<lr>-m<momentum>``; None: the server's default)."""


def parse_setup(name: str) -> Setup:
    m = _SETUP.match(name.strip())
    if m is None:
        raise ValueError(f"unknown setup {name!r}: ddp-4, pushpull-async-4, diloco-sync-H<h>, diloco-async-H<h> "
                         "(then -F<fragments>, then -bf16, -int8 or -int4), each with an optional -straggler "
                         "(DiLoCo: or -faults), DiLoCo's then -outer<lr>-m<momentum>")
    straggler, faults = m.group(10) == "-straggler", m.group(10) == "-faults"
    outer_opt = (float(m.group(12)), float(m.group(13))) if m.group(11) else None
    if m.group(2) or m.group(3):
        if faults or outer_opt:
            raise ValueError(f"{name}: {'-faults' if faults else '-outer'} is for a DiLoCo setup")
        return Setup(name.strip(), "ddp" if m.group(2) else "pushpull", straggler=straggler)
    return Setup(name.strip(), "diloco", m.group(4), int(m.group(5)), straggler, m.group(9),
                 int(m.group(7)) if m.group(7) else None, faults, outer_opt)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks diloco", description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", help=f"comma-separated (default {','.join(SETUPS)}; --quick {','.join(QUICK_SETUPS)})")
    p.add_argument("--trainers", type=int, default=4)
    p.add_argument("--steps", type=int, help="steps of every trainer (default 600; --quick 24)")
    p.add_argument("--steps-of", default="", metavar="SETUP=N,...", help="other steps for some setups")
    p.add_argument("--time-limit", type=float, help="seconds of training of one setup at most (then its trainers "
                   "are stopped)")
    p.add_argument("--model", choices=MODELS, default="byte_lm", help="byte_lm on pysource (the language model of "
                   "the claims), or mnist_cnn on MNIST from --data-dir")
    p.add_argument("--data-dir", type=Path, default=measure.ROOT.parent / "shared" / "data" / "mnist",
                   help="MNIST's IDX files (--model mnist_cnn; default ../shared/data/mnist)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's: DDP's, pushpull's server, DiLoCo's inner")
    p.add_argument("--train-samples", type=int, default=32768)
    p.add_argument("--eval-samples", type=int, help="held-out samples of each snapshot's loss (default 256; quick 32)")
    p.add_argument("--rate", type=float, default=100.0, help="Mbit/s of every link, each way")
    p.add_argument("--delay-ms", type=float, default=5.0, help="one-way delay on each side of every link")
    p.add_argument("--snapshot-s", type=float, help="seconds between the server's snapshots (default 20; quick 4)")
    p.add_argument("--straggler-share", type=float, default=0.1, help="of a core, for the last trainer")
    p.add_argument("--target-loss", type=float, help="the held-out loss to time (default: DDP's final one, else the "
                   "highest final loss of the setups without a straggler); with --render, the result is compared "
                   "at it and records it")
    p.add_argument("--fault-at", default="60,150", metavar="TRAINER_S,SERVER_S",
                   help="-faults setups: seconds after the start at which trainer 1, then the server process, is "
                        "SIGKILLed (default 60,150)")
    p.add_argument("--quick", action="store_true", help="a smoke run, no claim")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds of one setup at most")
    p.add_argument("--render", type=Path, metavar="RESULT.json", help="run nothing: write the summary, the "
                   "Markdown and the plot of an earlier result again")
    p.add_argument("--plot-setups", metavar="SETUP,...", help="with --render: the setups the plot draws (default "
                   "all; the table has every one); recorded with the result")
    p.add_argument("--rerun-into", type=Path, metavar="RESULT.json",
                   help="an earlier result whose runs of these setups this run replaces (one disturbed, or "
                        "stopped too early); the result is written again with them, each run's command kept")
    args = p.parse_args(argv)
    if args.plot_setups is not None and args.render is None:
        p.error("--plot-setups is for --render (a run plots every setup it runs)")
    args.setups = [parse_setup(s) for s in (args.setups.split(",") if args.setups else
                                            QUICK_SETUPS if args.quick else SETUPS)]
    args.steps = args.steps or (24 if args.quick else 600)
    try:
        args.steps_of = {k.strip(): int(v) for k, v in (kv.split("=") for kv in args.steps_of.split(",") if kv)}
    except ValueError:
        p.error(f"--steps-of: SETUP=N,... expected, not {args.steps_of!r}")
    unknown = set(args.steps_of) - {s.name for s in args.setups}
    if unknown:
        p.error(f"--steps-of names setups not run: {', '.join(sorted(unknown))}")
    try:
        args.fault_at = tuple(float(v) for v in args.fault_at.split(","))
        if len(args.fault_at) != 2 or not 0 < args.fault_at[0] < args.fault_at[1]:
            raise ValueError
    except ValueError:
        p.error(f"--fault-at: TRAINER_S,SERVER_S, the first sooner, not {args.fault_at!r}")
    args.eval_samples = args.eval_samples or (32 if args.quick else 256)
    args.snapshot_s = args.snapshot_s or (4.0 if args.quick else 20.0)
    return args


# ---- command lines ---------------------------------------------------------------------------


def _why(error: str) -> str:
    """A failure's first line and, where a process's output follows, that output's last line (its error)."""
    lines = [x.strip() for x in error.strip().splitlines() if x.strip()]
    return " ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)


def steps(setup: Setup, args: argparse.Namespace) -> int:
    return args.steps_of.get(setup.name, args.steps)


def data_args(setup: Setup, args: argparse.Namespace) -> list[str]:
    # The trainers' own final evaluation: a few samples (the study evaluates the snapshots); MNIST's
    # is its held-out split (--train-split), which --eval-samples does not size.
    data = ["--dataset", "pysource", "--train-samples", str(args.train_samples), "--eval-samples", "16"] \
        if args.model == "byte_lm" else \
        ["--dataset", "mnist", "--data-dir", str(args.data_dir), "--train-split", str(MNIST_TRAIN_SPLIT)]
    return ["--model", args.model, *data, "--batch-size", str(args.batch_size), "--max-steps", str(steps(setup, args)),
            "--epochs", "1000", "--no-progress"]


def server_args(setup: Setup, args: argparse.Namespace, host: str, ckpt: Path) -> list[str]:
    out = ["serve", "--host", host, "--port", str(SERVER_PORT), "--model", args.model, "--no-control",
           "--compute-threads", "1", "--checkpoint-dir", str(ckpt), "--checkpoint-interval", str(args.snapshot_s),
           "--keep-checkpoints", "100000", "--trainer-timeout", "60", "--rpc-timeout", "600"]
    # --rpc-timeout: a sync round waits on the server for a straggler's window (minutes at a tenth
    # of a core); the server's default 60 s would fail the others' syncs.
    if setup.kind == "pushpull":
        return [*out, "--update", "async", "--optimizer", "adamw", "--lr", str(args.lr)]
    if setup.faults:  # its status at the end (in the server's namespace); a dead trainer evicted in 10 s
        out = [a for a in out if a != "--no-control"] + ["--control-port", str(CONTROL_PORT), "--supervise",
                                                          "--state-dir", str(ckpt.parent / "state")]
        out[out.index("--trainer-timeout") + 1] = "10"
    out += ["--update", "diloco", "--outer", setup.outer, "--sync-trainers", str(args.trainers)]
    if setup.outer_opt is not None:  # Nesterov SGD (async: delayed Nesterov) at this lr and momentum
        lr, momentum = setup.outer_opt
        name = "delayed_nesterov" if momentum and setup.outer == "async" else "sgd"
        out += ["--optimizer", name, "--lr", f"{lr:g}", "--momentum", f"{momentum:g}"]
        if name == "sgd" and momentum:
            out += ["--optimizer-args", '{"nesterov": true}']
    return out + (["--dynamic-local-steps"] if setup.outer == "async" and not setup.fragments else [])


def trainer_args(setup: Setup, args: argparse.Namespace, rank: int, server: str, stats: Path) -> list[str]:
    out = ["train", "--server", f"{server}:{SERVER_PORT}", "--rank", str(rank), "--num-trainers", str(args.trainers),
           *data_args(setup, args), "--stats-out", str(stats), "--rpc-timeout", "600"]
    if setup.kind == "pushpull":
        return [*out, "--step", "pushpull"]
    out += ["--local-steps", str(setup.local_steps), "--inner-optimizer", "adamw", "--inner-lr", str(args.lr)]
    if setup.fragments:
        out += ["--fragments", str(setup.fragments)]
    if setup.faults:
        out += ["--reconnect"]  # a sync that lost the server process: rejoin its successor
    if setup.compress == "bf16":
        return [*out, "--wire-dtype", "bf16"]
    return [*out, "--compress", setup.compress] if setup.compress else out


def ddp_args(setup: Setup, args: argparse.Namespace, ckpt: Path) -> list[str]:
    every = max(1, steps(setup, args) // 12)
    # Each rank's share of the host's cores, as psserver's trainers take theirs (``share``): every namespace
    # says LOCAL_WORLD_SIZE=1, so the default would give each rank all the cores (OpenMP teams of
    # four ranks spinning on two cores: steps 10x slower than the compute).
    threads = share(usable_cpus(), args.trainers)
    return ["train", "--mode", "ddp", *data_args(setup, args), "--optimizer", "adamw", "--lr", str(args.lr),
            "--compute-threads", str(threads), "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every),
            "--keep-checkpoints", "100000"]


def ddp_env(rank: int, world: int, master: str) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": master, "MASTER_PORT": str(DDP_PORT), "GLOO_SOCKET_IFNAME": multihost.NODE_IF,
            "OMP_NUM_THREADS": "1"}


# ---- one setup --------------------------------------------------------------------------------


def run_setup(setup: Setup, args: argparse.Namespace, work: Path) -> dict:
    """Train ``setup`` across a fresh topology; its snapshots, bytes and step rates."""
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "snapshots"
    children = measure.Children(work)
    multihost.cleanup_stale()
    topo = _topology(args)
    held = None
    try:
        trainer_nodes = list(range(1, 1 + args.trainers))
        one = {"OMP_NUM_THREADS": "1"}
        if setup.kind != "ddp":
            # TensorPipe's basic channel only: between namespaces of one host it could still move
            # tensors with cma (process_vm_readv), outside the links. (A -faults server's
            # supervisor starts its process afresh: the variable carries it there.)
            server = children.start(topo.wrap(0, measure.worker_argv("psserver", "--channels", "basic", "--",
                                                                     *server_args(setup, args, topo.address(0),
                                                                                  ckpt))), "server",
                                    {**one, "PSSERVER_TP_CHANNELS": "basic"} if setup.faults else one)
            server.wait_for(r"serving \S+ on", 180)
        before = topo.counters()
        start = time.time()
        stats = [work / f"trainer{r}.json" for r in range(args.trainers)]
        if setup.kind == "ddp":
            master = topo.address(trainer_nodes[0])
            procs = [children.start(topo.wrap(node, measure.psserver_argv(*ddp_args(setup, args, ckpt))), f"rank{r}",
                                    ddp_env(r, args.trainers, master)) for r, node in enumerate(trainer_nodes)]
        else:
            procs = [children.start(topo.wrap(node, measure.psserver_argv(
                *trainer_args(setup, args, r, topo.address(0), stats[r]))), f"trainer{r}", one)
                for r, node in enumerate(trainer_nodes)]
        if setup.straggler:
            procs[-1].wait_for(r"joined psserver|rank \d+ of \d+", 180)
            held = throttle.start(procs[-1].pid, args.straggler_share)
        faults = None
        if setup.faults:
            def again(r: int, path: Path) -> list[str]:
                return topo.wrap(1 + r, measure.psserver_argv(*trainer_args(setup, args, r, topo.address(0), path)))

            faults = inject_faults(args.fault_at, procs, children, again, work, start)
        stopped = wait_trainers(procs, setup, args, start)
        trained_s = time.time() - start
        after = topo.counters()
        if faults is not None:
            faults.update(fault_counts(topo, children.items[0], procs, CONTROL_PORT))
        if setup.kind != "ddp":
            code = children.items[0].stop(120)  # the final snapshot
            if code != 0:
                raise RuntimeError(f"{setup.name}: the server exited with {code}:\n{children.items[0].tail()}")
        sent = sum(after[k].tx - before[k].tx for k in after)
    finally:
        if held is not None:
            held.close()
        children.stop_all()
        topo.close()
    rows = snapshots(setup, ckpt, start, args)
    # The samples trained: every step's where every trainer took them, else the server's count at its
    # final snapshot (a stopped trainer's last window may not have reached it).
    samples = steps(setup, args) * args.batch_size * args.trainers
    if (stopped or faults) and rows:
        samples = rows[-1]["samples"]
    return {"setup": setup.name, "start": start, "trained_s": trained_s, "samples": samples, "bytes_sent": sent,
            "bytes_per_sample": sent / samples if samples else None, "stopped": stopped,
            "step_rates": step_rates(stats) if setup.kind != "ddp" else None,
            "throttle": None if held is None else getattr(held, "method", type(held).__name__), "snapshots": rows,
            **({"faults": faults} if faults is not None else {})}


def wait_trainers(procs: list, setup: Setup, args: argparse.Namespace, start: float) -> list[str]:
    """Wait for the trainers to take their steps; the names of those stopped before (a straggler
    once the others are done, anyone at ``--time-limit``). A trainer that fails is an error."""
    stopped: list[str] = []
    limit = start + (args.time_limit or args.timeout)
    pending = list(procs)
    while pending:
        for p in list(pending):
            if p.running():
                continue
            pending.remove(p)
            code = p.wait(10)
            if code != 0 and p.name not in stopped:
                raise RuntimeError(f"{setup.name}: {p.name} exited with {code}:\n{p.tail()}")
        others_done = setup.straggler and pending == [procs[-1]]
        if pending and (others_done or time.time() >= limit):
            if time.time() >= start + args.timeout and not args.time_limit:
                raise RuntimeError(f"{setup.name}: not done within --timeout {args.timeout:.0f}s")
            log.info("%s: stopping %s (%s)", setup.name, ", ".join(p.name for p in pending),
                     "the others are done" if others_done else f"--time-limit {args.time_limit:g}s")
            for p in pending:
                stopped.append(p.name)
                p.stop(120)  # SIGTERM: the step in flight ends, the trainer leaves
            pending = []
        time.sleep(0.5)
    return stopped


def _topology(args: argparse.Namespace) -> multihost.Topology:
    """The hosts; without ``tc``'s netem in the kernel (no ``sch_netem``), the links carry no
    delay, which the result says (``args.delay_ms`` becomes 0)."""
    try:
        return multihost.Topology(1 + args.trainers, args.rate, delay_ms=args.delay_ms)
    except OSError as e:
        if not args.delay_ms or "netem" not in str(e):
            raise
        multihost.cleanup_stale()
        log.warning("no netem qdisc in this kernel (%s): the links carry no delay", str(e).splitlines()[0])
        args.delay_ms, args.delay_note = 0.0, "no netem qdisc in this kernel: the links carried no delay"
        return multihost.Topology(1 + args.trainers, args.rate)


def step_rates(paths: list[Path]) -> list[float | None]:
    """Each trainer's steps per second over its run (``--stats-out``), or for one stopped before
    it wrote them (a straggler), over the progress lines of its log beside them."""
    rates = []
    for path in paths:
        try:
            ends = json.loads(path.read_text())["step_ends"]
        except (OSError, ValueError, KeyError):
            rates.append(logged_rate(path.with_suffix(".log")))
            continue
        rates.append((len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else None)
    return rates


_PROGRESS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*: step (\d+)/\d+ ", re.M)


def logged_rate(log_path: Path) -> float | None:
    """Steps per second between the first and the last progress line of a trainer's log."""
    try:
        found = _PROGRESS.findall(log_path.read_text(errors="replace"))
    except OSError:
        return None
    if len(found) < 2:
        return None
    (t0, ms0, s0), (t1, ms1, s1) = found[0], found[-1]
    seconds = (time.mktime(time.strptime(t1, "%Y-%m-%d %H:%M:%S")) + int(ms1) / 1000
               - time.mktime(time.strptime(t0, "%Y-%m-%d %H:%M:%S")) - int(ms0) / 1000)
    return (int(s1) - int(s0)) / seconds if seconds > 0 else None


# ---- evaluation of the snapshots --------------------------------------------------------------


def snapshots(setup: Setup, ckpt: Path, start: float, args: argparse.Namespace) -> list[dict]:
    """Held-out loss of every snapshot, with its samples and its seconds since ``start``."""
    import torch

    from psserver.models import build_model, get_model_spec
    from psserver.models.losses import get_loss

    torch.set_num_threads(os.cpu_count() or 1)
    x, y = held_out(args)
    loss_fn = get_loss(get_model_spec(args.model).loss)
    rows = []
    for when, samples, state in _states(setup, ckpt, args):
        model = build_model(args.model)
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            losses = [float(loss_fn(model(x[i:i + 32]), y[i:i + 32])) * len(x[i:i + 32])
                      for i in range(0, len(x), 32)]
        rows.append({"seconds": when - start, "samples": samples, "loss": sum(losses) / len(x)})
    return sorted(rows, key=lambda r: r["samples"])


def held_out(args: argparse.Namespace) -> tuple:
    """``--eval-samples`` held-out inputs and targets of the model's dataset."""
    if args.model == "byte_lm":
        from psserver.data.text import load_pysource

        _, held = load_pysource(128, 1, args.eval_samples)
    else:
        from psserver.data.idx import load_mnist

        _, held = load_mnist(args.data_dir, train_split=MNIST_TRAIN_SPLIT)
    x, y = held.tensors
    return x[:args.eval_samples], y[:args.eval_samples]


def _states(setup: Setup, ckpt: Path, args: argparse.Namespace):
    """(time written, samples, model state) of each snapshot."""
    import torch

    if setup.kind == "ddp":
        import torch.distributed.checkpoint as dcp

        from psserver.collective.checkpoint import MARKER, AppState, complete_checkpoints
        from psserver.models import build_model

        for step, path in complete_checkpoints(ckpt):
            marker = json.loads((path / MARKER).read_text())
            model = build_model(args.model)
            state = {"app": AppState(model, torch.optim.AdamW(model.parameters()))}
            dcp.load(state, checkpoint_id=str(path))
            yield marker["time"], step * args.batch_size * args.trainers, model.state_dict()
        return
    from psserver.checkpoint import list_checkpoints
    from psserver.server.checkpoints.export import export

    with tempfile.TemporaryDirectory() as tmp:
        for path in list_checkpoints(ckpt):
            out = Path(tmp) / "model.pt"
            done = export(path, out)
            written = path.stat().st_mtime
            info = json.loads(done.metadata.read_text())
            yield written, info["samples_seen"], torch.load(out, weights_only=True)


# ---- summary, report --------------------------------------------------------------------------


def time_to(rows: list[dict], target: float, key: str) -> float | None:
    """The first ``key`` (seconds or samples) at which the loss is <= ``target``, linear between snapshots."""
    prev = None
    for r in sorted(rows, key=lambda r: r[key]):
        if r["loss"] <= target:
            if prev is None:
                return r[key]
            frac = (prev["loss"] - target) / (prev["loss"] - r["loss"])
            return prev[key] + frac * (r[key] - prev[key])
        prev = r
    return None


def loss_at(rows: list[dict], samples: float) -> float | None:
    """The held-out loss at ``samples``, linear between snapshots (None past the last one)."""
    rows = sorted(rows, key=lambda r: r["samples"])
    for a, b in itertools.pairwise(rows):
        if a["samples"] <= samples <= b["samples"]:
            if b["samples"] == a["samples"]:
                return b["loss"]
            return a["loss"] + (samples - a["samples"]) / (b["samples"] - a["samples"]) * (b["loss"] - a["loss"])
    return rows[-1]["loss"] if rows and rows[-1]["samples"] == samples else None


def summarize(runs: list[dict], target: float | None) -> dict:
    """Per setup: its final loss, time and samples to ``target`` (default: DDP's final loss, else
    the highest final loss without a straggler), its loss at DDP's samples, and how many times
    sooner than DDP and pushpull it reached the target ("at least" where one of them never did:
    then its seconds trained stand for its time to target). A run that took all of DDP's steps of
    DDP's batches is compared by its final loss: its server counted each epoch's short last batch
    as it was (95,992 samples where DDP, counting full batches, says 96,000)."""
    finals = {r["setup"]: r["snapshots"][-1]["loss"] for r in runs if r["snapshots"]}
    ddp = next((r for r in runs if r["setup"].startswith("ddp-") and r["snapshots"]), None)
    pushpull = next((r for r in runs if r["setup"].startswith("pushpull-") and r["snapshots"]), None)
    plain = [v for k, v in finals.items() if not k.endswith("-straggler")]
    if target is None:
        target = finals[ddp["setup"]] if ddp else max(plain) if plain else None
    reached = {r["setup"]: time_to(r["snapshots"], target, "seconds") if target is not None else None for r in runs}

    def sooner(r: dict, ref: dict | None) -> dict | None:
        if ref is None or ref is r or reached[r["setup"]] is None:
            return None
        mine = max(reached[r["setup"]], 1e-9)
        theirs = reached[ref["setup"]]
        if theirs is None and ref["trained_s"] < mine:
            return None  # it stopped sooner than this one reached the target: no bound
        return {"ratio": (theirs if theirs is not None else ref["trained_s"]) / mine, "at_least": theirs is None}

    rows = {}
    for r in runs:
        equal = loss_at(r["snapshots"], ddp["samples"]) if ddp and r["snapshots"] else None
        if equal is None and ddp and r["snapshots"] and not r.get("stopped") and r["samples"] == ddp["samples"]:
            equal = r["snapshots"][-1]["loss"]
        rows[r["setup"]] = {"final_loss": finals.get(r["setup"]), "trained_s": r["trained_s"],
                            "samples": r["samples"], "stopped": r.get("stopped") or [],
                            "bytes_per_sample": r["bytes_per_sample"],
                            "seconds_to_target": reached[r["setup"]],
                            "samples_to_target": time_to(r["snapshots"], target, "samples") if target else None,
                            "loss_at_ddp_samples": equal,
                            "vs_ddp_loss": equal / finals[ddp["setup"]] - 1 if equal is not None else None,
                            "sooner_than_ddp": sooner(r, ddp), "sooner_than_pushpull": sooner(r, pushpull),
                            "fewer_bytes_than_pushpull": (pushpull["bytes_per_sample"] / r["bytes_per_sample"]
                                                          if pushpull and pushpull is not r and r["bytes_per_sample"]
                                                          else None),
                            "ddp_to_its_loss": ddp_to_its_loss(r, ddp),
                            "step_rates": r["step_rates"], "load": r.get("load")}
    return {"target_loss": target, "ddp_samples": ddp["samples"] if ddp else None, "setups": rows,
            "stragglers": stragglers(runs)}


def stragglers(runs: list[dict]) -> dict:
    """Each straggler setup against the same setup of equal trainers: the time each took to the
    higher of their two final losses (a target both reached) and the straggler's over the
    equal trainers' (async keeps going without it; sync waits for it)."""
    by_name = {r["setup"]: r for r in runs if r["snapshots"]}
    out = {}
    for name, r in by_name.items():
        equal = by_name.get(name.replace("-straggler", ""))
        if "-straggler" not in name or equal is None:
            continue
        target = max(r["snapshots"][-1]["loss"], equal["snapshots"][-1]["loss"])
        mine, theirs = time_to(r["snapshots"], target, "seconds"), time_to(equal["snapshots"], target, "seconds")
        out[name] = {"equal": equal["setup"], "target_loss": target, "seconds": mine, "equal_seconds": theirs,
                     "ratio": mine / max(theirs, 1e-9) if mine is not None and theirs is not None else None}
    return out


def ddp_to_its_loss(r: dict, ddp: dict | None) -> float | None:
    """How many times as long DDP took as ``r`` to reach the loss ``r`` ended at (a comparison
    that needs no common target: None when DDP never reached it, or ``r`` is DDP)."""
    if ddp is None or ddp is r or not r["snapshots"]:
        return None
    final = r["snapshots"][-1]["loss"]
    mine, theirs = time_to(r["snapshots"], final, "seconds"), time_to(ddp["snapshots"], final, "seconds")
    return theirs / max(mine, 1e-9) if mine is not None and theirs is not None else None


def rerun_into(earlier: dict, rerun: dict) -> dict:
    """``earlier`` with its runs of ``rerun``'s setups replaced (in their places), the rerun's
    command, time and load kept beside them; refused where the two ran other configurations."""
    keys = ("trainers", "batch_size", "lr", "rate", "train_samples", "eval_samples", "snapshot_s", "straggler_share",
            "model")
    # (a result from before --model was one of byte_lm)
    differ = [k for k in keys if earlier["config"].get(k, "byte_lm" if k == "model" else None)
              != rerun["config"].get(k, "byte_lm" if k == "model" else None)]
    if differ:
        raise SystemExit(f"python -m benchmarks diloco: --rerun-into: {earlier['command']!r} ran another "
                         f"configuration ({', '.join(differ)})")
    new = {r["setup"]: r for r in rerun["runs"]}
    runs = [new.pop(r["setup"], r) for r in earlier["runs"]] + list(new.values())
    # Each setup run again took the steps of its rerun: its own --steps-of, else the rerun's --steps.
    steps_of = dict(earlier["config"].get("steps_of", {}))
    for r in rerun["runs"]:
        took = rerun["config"].get("steps_of", {}).get(r["setup"], rerun["config"]["steps"])
        if took == earlier["config"]["steps"]:
            steps_of.pop(r["setup"], None)
        else:
            steps_of[r["setup"]] = took
    reruns = [*earlier.get("reruns", []), {k: rerun[k] for k in ("command", "time", "wall_s", "load_before")}]
    failed = {k: v for k, v in earlier.get("failed", {}).items() if k not in {r["setup"] for r in rerun["runs"]}}
    return {**earlier, "config": {**earlier["config"], "steps_of": steps_of}, "runs": runs, "reruns": reruns,
            "failed": {**failed, **rerun.get("failed", {})}}


def _f(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def markdown(result: dict) -> str:
    """The result's table, its summary made again from its runs (``python -m benchmarks tables``
    renders a committed result with this code, not with the summary stored beside it)."""
    cfg = result["config"]
    summary = summarize(result["runs"], cfg.get("target_loss"))
    rtt = f"{4 * cfg['delay_ms']:g} ms RTT" if cfg["delay_ms"] else "no added delay"
    model = cfg.get("model", "byte_lm")
    data = "pysource" if model == "byte_lm" else "MNIST"
    lines = [f"## Over slow links: {model} on {data}, {cfg['trainers']} trainers, links of {cfg['rate']:g} Mbit/s, "
             f"{rtt}", "", f"`{result['command']}` ({result['time']}, "
             f"{result['wall_s'] / 60:.1f} min; {result['cpus']} cores, load average before {result['load_before']})",
             "", f"Target held-out loss: {_f(summary['target_loss'], '{:.3f}')} {UNITS[model]}.", ""]
    kept = {run.get("command") for run in result["runs"]}
    for again in result.get("reruns", []):
        gone = "" if again["command"] in kept else " Every run of it was replaced by a later run."
        lines += [f"Run again: `{again['command']}` ({again['time']}, {again['wall_s'] / 60:.1f} min, load average "
                  f"before {again['load_before']}).{gone}", ""]
    if cfg.get("delay_note"):
        lines += [f"Delay: {cfg['delay_note']} (asked: {cfg.get('delay_asked_ms', 0):g} ms each way).", ""]
    def times(x: dict | None) -> str:
        return "-" if x is None else f"{'>= ' if x['at_least'] else ''}{x['ratio']:.1f}x"

    rows = []
    for name, row in summary["setups"].items():
        rates = [x for x in (row["step_rates"] or []) if x]
        rows.append([name, _f(row["final_loss"], "{:.3f}"), _f(row["loss_at_ddp_samples"], "{:.3f}"),
                     _f(row["vs_ddp_loss"], "{:+.1%}"),
                     f"{row['trained_s']:.0f}" + (" (stopped)" if row["stopped"] else ""),
                     _f(row["seconds_to_target"], "{:.0f}"), times(row["sooner_than_ddp"]),
                     _f(row.get("ddp_to_its_loss"), "{:.1f}x"),
                     times(row["sooner_than_pushpull"]), _f(row["bytes_per_sample"], "{:,.0f}"),
                     _f(row["fewer_bytes_than_pushpull"], "{:.1f}x"),
                     " / ".join(f"{x:.2f}" for x in rates) if rates else "-",
                     " -> ".join(f"{x:.1f}" for x in row.get("load") or []) or "-"])
    lines += [report.md_table(["setup", "final held-out loss", "loss at DDP's samples", "vs DDP", "seconds trained",
                               "seconds to target", "sooner than DDP", "DDP's time to its final loss",
                               "sooner than pushpull",
                               "bytes sent per sample", "fewer bytes than pushpull", "steps/s of each trainer",
                               "load average"], rows), ""]
    for name, row in summary["stragglers"].items():
        lines += [f"**{name}** against {row['equal']} (four equal trainers): to a held-out loss of "
                  f"{row['target_loss']:.3f} (the higher of their final losses) in {_f(row['seconds'], '{:.0f}')} s "
                  f"against {_f(row['equal_seconds'], '{:.0f}')} s: {_f(row['ratio'], '{:.2f}x')} the time.", ""]
    for name, why in result.get("failed", {}).items():
        lines += [f"**{name} failed**: `{_why(why)[:300]}`", ""]
    for run in result["runs"]:
        f = run.get("faults")
        if f:
            windows = ", ".join(f"{k} {v}" for k, v in sorted(f["windows"].items()))
            lines += [f"**{run['setup']}**: trainer 1 SIGKILLed at {f['trainer_killed_s']:.0f} s and started again "
                      f"by hand; the server process SIGKILLed at {f['server_killed_s']:.0f} s, its successor "
                      f"continuing from outer step {f['restarted_at_step']} (its state in memory); "
                      f"{f['rejoined']} rejoin(s). At the end: {f['outer_steps']} outer steps, "
                      f"{f['samples_seen']:,} samples; windows applied per trainer since the restart: {windows}; "
                      + (f"windows sent again by a trainer's new process image: {f['sent_again']}, "
                         if "sent_again" in f else "")
                      + f"of them not applied again (applied before): {f['sent_again_not_applied']}.", ""]
    other = "".join(f", {k} {v}" for k, v in cfg.get("steps_of", {}).items())
    lines += [f"Every trainer took {cfg['steps']} steps of {cfg['batch_size']} samples{other}; "
              f"AdamW lr {cfg['lr']:g} "
              "(DDP's, pushpull's server, DiLoCo's inner); DiLoCo's outer optimizer is the server's default "
              "(Nesterov SGD lr 0.7 momentum 0.9; async: delayed Nesterov) unless the setup's -outer names another. "
              "Each DDP rank and each trainer ran its share of the cores in torch threads.",
              ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_samples, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    shown = result["config"].get("plot_setups")
    runs = [r for r in result["runs"] if shown is None or r["setup"] in shown]
    model = result["config"].get("model", "byte_lm")
    colours = iter(plt.get_cmap("tab20" if len(runs) > 10 else "tab10").colors)
    for run in runs:
        rows, kind = run["snapshots"], parse_setup(run["setup"])
        # DDP, the reference, in black; pushpull in grey; async DiLoCo dashed
        style = {"color": "black", "linewidth": 2.2} if kind.kind == "ddp" else \
            {"color": "grey"} if kind.kind == "pushpull" else \
            {"color": next(colours), "linestyle": "--" if kind.outer == "async" else "-"}
        for ax, x in ((by_samples, "samples"), (by_time, "seconds")):
            ax.plot([r[x] for r in rows], [r["loss"] for r in rows], marker=".", label=run["setup"], **style)
    target = result["summary"]["target_loss"]
    for ax, xlabel in ((by_samples, "samples seen (all trainers)"), (by_time, "seconds since the trainers started")):
        if target:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"held-out loss ({UNITS[model]})")
        if model == "mnist_cnn":  # its losses span two orders of magnitude
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
        if args.target_loss is not None:  # the runs compared at another target, recorded with them
            result["config"]["target_loss"] = args.target_loss
        if args.plot_setups is not None:
            names = [n for n in args.plot_setups.split(",") if n]
            unknown = sorted(set(names) - {r["setup"] for r in result["runs"]})
            if unknown:
                sys.stderr.write(f"python -m benchmarks diloco: --plot-setups: no run of {', '.join(unknown)} in "
                                 f"{args.render}\n")
                return 2
            result["config"]["plot_setups"] = names
        result["summary"] = summarize(result["runs"], result["config"].get("target_loss"))
        stem = args.render.with_suffix("")
        sys.stdout.write(report.write_result(stem, result, "diloco", markdown))
        plot(result, stem.with_suffix(".png"))
        return 0
    args.delay_asked_ms = args.delay_ms
    problem = multihost.available()
    if problem:
        sys.stderr.write(f"python -m benchmarks diloco: {problem}\n")
        return 2
    t0, load_before = time.time(), os.getloadavg()[0]
    earlier = json.loads(args.rerun_into.read_text()) if args.rerun_into else None
    command = "python -m benchmarks diloco " + " ".join(argv if argv is not None else sys.argv[1:])
    stem = (args.rerun_into.with_suffix("") if args.rerun_into else
            args.results_dir / ("diloco" + ("" if args.model == "byte_lm" else f"-{args.model}")
                                + ("-quick" if args.quick else "")))
    runs: list[dict] = []
    failed: dict[str, str] = {}

    def write() -> dict:
        """The result so far: written after every setup, so that a later one that fails or a
        killed run loses none of the earlier ones."""
        # The configuration as it ran (a kernel without netem turned the delay to 0 at the first setup).
        config = {k: v for k, v in vars(args).items() if k not in ("setups", "results_dir", "rerun_into")}
        result = {"command": command, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": time.time() - t0,
                  "cpus": os.cpu_count(), "load_before": round(load_before, 2), "config": config, "runs": runs,
                  "failed": failed}
        if earlier is not None:
            result = rerun_into(earlier, result)
        result["summary"] = summarize(result["runs"], args.target_loss)
        report.write_result(stem, result, "diloco", markdown)
        return result

    with tempfile.TemporaryDirectory(prefix="diloco-") as tmp:
        for setup in args.setups:
            log.info("setup %s", setup.name)
            load = os.getloadavg()[0]
            try:
                run = run_setup(setup, args, Path(tmp) / setup.name)
            except (RuntimeError, OSError) as e:
                log.error("setup %s failed: %s", setup.name, _why(str(e)) or type(e).__name__)
                why = str(e)
                failed[setup.name] = why if len(why) <= 2000 else why.splitlines()[0] + "\n...\n" + why[-2000:]
                write()
                continue
            run["load"] = [round(load, 2), round(os.getloadavg()[0], 2)]
            run["command"] = command
            runs.append(run)
            log.info("setup %s: %d snapshots, final loss %s", setup.name, len(run["snapshots"]),
                     _f(run["snapshots"][-1]["loss"] if run["snapshots"] else None, "{:.3f}"))
            write()
    result = write()
    sys.stdout.write(stem.with_name(stem.name + ".md").read_text())
    plot(result, stem.with_suffix(".png"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
