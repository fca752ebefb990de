"""Setup names of the harness (``local``, ``ps-chained-async-2``, ``ddp-2``, ...) and the
command lines of the processes each setup starts.

Names:

- ``local``, ``local-cached``, ``local-Nt``: one local loop (all cores; the server's allocator
  policy; N torch threads). ``local-Nt-xK``: K such loops side by side, one process each (their
  rate is the sum over the interval in which all of them step). Only single loops are ceiling
  candidates (the "best local loop" every ``x local`` divides by).
- ``ps-[STEP-][WIRE-]UPDATE-N[-straggler]``: a PS server and N trainers. STEP is the trainer's
  ``--step`` and is always passed explicitly: ``plain`` when not named (server compute, the
  reference), ``chained`` (server compute), ``pull``, ``pushpull`` (trainer compute). WIRE is
  ``bf16`` or ``fp16`` (``--wire-dtype``, trainer compute only; fp32 when not named). UPDATE is
  ``async``, ``sync`` (``--sync-trainers N``) or ``sspS`` (``--update ssp --staleness S``).
  ``-serverTt``: the server runs ``--compute-threads T`` (default: all cores). ``-straggler``:
  the last trainer is held to half a core (``benchmarks.harness.throttle``). ``-sock``: the server's
  TensorPipe uses its ``basic`` channel, so tensors cross the sockets as between hosts and the
  harness can count their bytes (on one host TensorPipe otherwise moves them with ``cma``,
  process to process, outside any socket: the way psserver runs there). ``-shm``: the server
  keeps its state in shared memory (``--state-dir`` under ``/dev/shm``), against the same setup
  without (its state in the process only).
  ``-staged`` and ``-hostcopy``: GPU trainers (``--trainer-device cuda:N``) send through pinned
  host buffers (``--transport staged``) or pageable host memory (``--transport cpu``) instead of
  their default, device to device where the server's model is on a GPU of the same host.
  ``-overlap`` and ``-no-overlap`` (``pushpull-``): the trainers' ``--overlap on`` or ``off``
  (without either: ``auto``, on for GPU trainers in async). ``-bucketM`` (``pushpull-``): the
  trainers' ``--bucket-cap-mb M``; buckets of at least 1 MiB but the last go to the server
  while backward runs (mnist_cnn at ``-bucket1``: its 4.7 MB fc1.weight; at the default 25, none).
- ``ddp-N[-straggler]``: N DDP ranks of one torch thread each (psserver's collective loop),
  the last one held to half a core with ``-straggler``. ``fsdp-N``: FSDP2, N ranks.

Every process that runs one torch thread (one-thread local loops, DDP ranks) also gets
``OMP_NUM_THREADS=1``; PS trainers size their threads themselves (``process_env``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Literal

from benchmarks.harness import measure

STEPS = ("plain", "chained", "pull", "pushpull")
TRAINER_COMPUTE = ("pull", "pushpull")
"""``--step`` protocols in which the trainer runs the model (psserver.config.ps.STEP_MODES)."""
WIRE_DTYPES = ("fp32", "bf16", "fp16")
STRAGGLER_SHARE = 0.5
"""CPU share the straggler of a ``-straggler`` setup is held to (cores)."""

_PS = re.compile(r"ps-(?:(chained|pull|pushpull)-)?(?:(bf16|fp16)-)?(async|sync|ssp(\d+))-(\d+)(?:-server(\d+)t)?"
                 r"(-straggler)?(-sock)?(?:-(token|open))?(-shm)?(?:-(staged|hostcopy))?(?:-(overlap|no-overlap))?"
                 r"(?:-bucket(\d+))?")
_HELP = ("use local, local-cached, local-Nt, local-Nt-xK, ps-[chained-|pull-|pushpull-][bf16-|fp16-]"
         "{async|sync|sspS}-N[-serverTt][-straggler][-sock][-token|-open][-shm][-staged|-hostcopy]"
         "[-overlap|-no-overlap][-bucketM], ddp-N[-straggler], fsdp-N")
TRANSPORTS = {"staged": "staged", "hostcopy": "cpu"}
"""A setup's suffix -> its trainers' ``--transport`` (without one: ``auto``)."""
SHM_STATE_DIR = "/dev/shm/psserver-bench"
"""``--state-dir`` of ``-shm`` setups' servers (each server a run key of its own, released at its stop)."""
BENCH_TOKEN = "benchmark-join-token-0123456789abcdef"
"""The join token of ``-token`` setups (server and trainers)."""


Kind = Literal["local", "ps", "ddp", "fsdp"]


@dataclass(frozen=True)
class Setup:
    """One setup, parsed from its name (``parse_setup``): what the harness starts and how.

    Fields a kind does not use stay None (False for flags), and ``to_dict`` leaves them out, so
    a result's JSON row names only what the setup is."""

    name: str
    kind: Kind
    trainers: int
    """PS trainers, DDP/FSDP ranks, or local loops side by side."""
    update: str | None = None
    """PS: ``async``, ``sync`` or ``ssp``."""
    threads: int | None = None
    """Torch threads of a local loop (0: all cores) or a DDP rank (1)."""
    allocator: str | None = None
    """Local loops: ``system`` or ``cached`` (the server's policy)."""
    procs: int | None = None
    """Local loops: processes side by side."""
    step: str | None = None
    """PS: the trainers' ``--step``, always passed."""
    staleness: int | None = None
    compute: str | None = None
    """``trainer`` for the trainer-compute steps (pull, pushpull)."""
    wire: str | None = None
    """Trainer compute: ``--wire-dtype`` (fp32, bf16, fp16)."""
    server_threads: int | None = None
    straggler: bool = False
    sock: bool = False
    guard: str | None = None
    """``token``: a join token on top of the RPC allow-list; ``open``: neither."""
    shm: bool = False
    transport: str | None = None
    overlap: str | None = None
    bucket_cap_mb: int | None = None

    def to_dict(self) -> dict:
        """The fields this setup sets (name, kind, trainers and update always), for JSON rows."""
        always = ("name", "kind", "trainers", "update")
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name in always or getattr(self, f.name) not in (None, False)}


def parse_setup(name: str) -> Setup:
    """The setup a name describes; ValueError of one line naming what is wrong."""
    if name == "local":  # torch threads = cores, as the issue defines the ceiling
        return Setup(name, "local", 1, threads=0, allocator="system", procs=1)
    if name == "local-cached":  # the server's host allocator policy (psserver serve --allocator cached)
        return Setup(name, "local", 1, threads=0, allocator="cached", procs=1)
    m = re.fullmatch(r"local-(\d+)t(?:-x(\d+))?", name)
    if m:  # fewer threads: on a loaded machine one thread can beat all cores (OpenMP barriers)
        threads, procs = int(m.group(1)), int(m.group(2) or 1)
        if threads < 1 or procs < 1 or (m.group(2) and procs < 2):
            raise ValueError(f"setup {name!r}: need N >= 1 threads and K >= 2 loops side by side")
        return Setup(name, "local", procs, threads=threads, allocator="system", procs=procs)
    m = _PS.fullmatch(name)
    if m:
        return _ps_setup(name, m)
    m = re.fullmatch(r"(ddp|fsdp)-(\d+)(-straggler)?", name)
    if m:
        kind, n, straggler = m.group(1), int(m.group(2)), bool(m.group(3))
        if n < 1 or (straggler and (kind != "ddp" or n < 2)):
            raise ValueError(f"setup {name!r}: -straggler is for ddp-N with N >= 2")
        # DDP: one torch thread per rank (psserver train --mode ddp --compute-threads 1)
        return Setup(name, kind, n, threads=1 if kind == "ddp" else None, straggler=straggler)
    raise ValueError(f"unknown setup {name!r}: {_HELP}")


def _ps_setup(name: str, m: re.Match) -> Setup:
    (step, wire, update, staleness, n, server_threads, straggler, sock, guard, shm, transport, overlap,
     bucket) = m.groups()
    step = step or "plain"  # the reference; the trainer's default is pushpull, so it is always passed
    trainers = int(n)
    if (overlap or bucket) and step != "pushpull":
        raise ValueError(f"setup {name!r}: -overlap, -no-overlap and -bucketM are for pushpull- setups")
    if bucket is not None and int(bucket) < 1:
        raise ValueError(f"setup {name!r}: -bucketM needs M >= 1 MiB")
    if overlap == "overlap" and (update == "sync" or staleness == "0"):
        raise ValueError(f"setup {name!r}: -overlap needs async or sspS with S >= 1")
    if (wire or transport) and step not in TRAINER_COMPUTE:
        raise ValueError(f"setup {name!r}: a wire dtype or transport needs a trainer-compute step (pull-, "
                         "pushpull-)")
    if trainers < 1 or (straggler and trainers < 2) or server_threads == "0":
        raise ValueError(f"setup {name!r}: need N >= 1 trainers (N >= 2 with -straggler), T >= 1 server threads")
    trainer_side = step in TRAINER_COMPUTE
    return Setup(
        name, "ps", trainers, update="ssp" if staleness else update, step=step,
        staleness=int(staleness) if staleness else None,
        compute="trainer" if trainer_side else None, wire=(wire or "fp32") if trainer_side else None,
        server_threads=int(server_threads) if server_threads else None, straggler=bool(straggler),
        sock=bool(sock), guard=guard, shm=bool(shm), transport=TRANSPORTS[transport] if transport else None,
        overlap=("on" if overlap == "overlap" else "off") if overlap else None,
        bucket_cap_mb=int(bucket) if bucket else None)


def parse_setups(names: str) -> list[Setup]:
    """A comma-separated list of setup names, each once."""
    out = [parse_setup(n.strip()) for n in names.split(",") if n.strip()]
    seen = [s.name for s in out]
    dup = sorted({n for n in seen if seen.count(n) > 1})
    if dup:
        raise ValueError(f"setup named twice: {', '.join(dup)}")
    if not out:
        raise ValueError("no setup named")
    return out


def is_ceiling(setup: Setup) -> bool:
    """A single local loop: the candidates of "the best local loop" ratios divide by."""
    return setup.kind == "local" and (setup.procs or 1) == 1


def trainer_compute(setup: Setup) -> bool:
    return setup.kind == "ps" and setup.step in TRAINER_COMPUTE


def straggler_index(setup: Setup) -> int | None:
    """The process held to ``STRAGGLER_SHARE`` of a core (the last trainer or rank), or None."""
    return setup.trainers - 1 if setup.straggler else None


READY = {"ps": r"rank \d+/\d+: \d+ training samples", "ddp": r"ddp rank \d+ stepping"}
"""A trainer's (rank's) log line just before its first step: a straggler is held from there on,
so its start-up (imports, joining) is no slower than the others'."""


def steps_for(setup: Setup, index: int, steps: int) -> int:
    """Steps of process ``index``: ``steps``, but with an async or ssp straggler the others run
    1/share times as many, so they keep stepping for as long as the straggler does (a run is
    timed only while all its processes step). DDP and sync trainers move in lockstep anyway."""
    idx = straggler_index(setup)
    if idx is None or index == idx or setup.kind != "ps" or setup.update == "sync":
        return steps
    return round(steps / STRAGGLER_SHARE)


def process_env(setup: Setup) -> dict[str, str]:
    """Extra environment of a setup's ranks or loops: ``OMP_NUM_THREADS=1`` for every process
    that runs one torch thread (PS trainers size their threads themselves: their share of the
    host's CPUs, ``psserver.utils.cpus``)."""
    one_thread = setup.kind == "ddp" or (setup.kind == "local" and setup.threads == 1)
    return {"OMP_NUM_THREADS": "1"} if one_thread else {}


def channels_of(setup: Setup, tp_channels: str) -> str:
    """The TensorPipe channels of a PS setup's server: ``basic`` for ``-sock`` setups, else the
    run's ``--tp-channels``."""
    return "basic" if setup.sock else tp_channels


def counts_bytes(setup: Setup, tp_channels: str) -> bool:
    """Whether the tensors of a PS setup cross sockets, where the harness counts bytes."""
    return channels_of(setup, tp_channels) != "default"


def server_key(setup: Setup) -> tuple:
    """Setups that can share one long-lived server (paired rounds): same update mode, sync K,
    staleness and step protocol (wire dtype and stragglers are the trainers' business)."""
    return (setup.update, setup.trainers if setup.update == "sync" else 0, (setup.staleness or 0),
            setup.step, (setup.server_threads or 0), setup.sock, (setup.guard or ""),
            setup.shm)


def guard_flags(setup: Setup) -> list[str]:
    """``benchmarks.harness.workers psserver`` options of a ``-token`` or ``-open`` setup's processes."""
    guard = setup.guard
    return ["--join-token", BENCH_TOKEN] if guard == "token" else ["--no-allowlist"] if guard == "open" else []


def check_devices(devices: str | None, trainer_device: str | None = None) -> None:
    """``ValueError`` unless ``--devices`` is a comma-separated list of what ``psserver serve
    --devices`` takes (cpu, cuda, cuda:N) and ``--trainer-device`` one of them: checked before any
    child starts (a bad one failed in a child, after the harness had measured for a while)."""
    from psserver.config.common import check_device

    if devices is not None:
        for device in devices.split(","):
            check_device(device.strip(), "--devices")
    if trainer_device is not None:
        check_device(trainer_device, "--trainer-device")


def server_argv(setup: Setup, *, model: str, port: int, devices: str | None, tp_channels: str) -> list[str]:
    """``psserver serve`` for a PS setup: 127.0.0.1, no control plane, the setup's update mode.

    ``tp_channels`` other than ``default`` restricts TensorPipe's channels (``basic``: tensors
    cross the socket as between hosts, so ``ss`` and the interface counters see them; see
    ``benchmarks.harness.workers``)."""
    tp_channels = channels_of(setup, tp_channels)
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--model", model, "--update", setup.update,
            "--sync-trainers", str(setup.trainers), "--no-control"]
    if setup.update == "ssp":
        argv += ["--staleness", str(setup.staleness)]
    if setup.server_threads:
        argv += ["--compute-threads", str(setup.server_threads)]
    if devices:
        argv += ["--devices", devices]
    if setup.shm:
        argv += ["--state-dir", SHM_STATE_DIR]
    flags = guard_flags(setup) + (["--channels", tp_channels] if tp_channels != "default" else [])
    if flags:
        return measure.worker_argv("psserver", *flags, "--", *argv)
    return measure.psserver_argv(*argv)


def trainer_argv(setup: Setup, rank: int, *, port: int, batch_size: int, steps: int, stats_out: str,
                 device: str | None = None) -> list[str]:
    """``psserver train`` for rank ``rank`` of a PS setup: synthetic data, ``steps`` steps, the
    setup's ``--step`` always named (trainer compute is the default), the trainer's default
    threads (its share of the CPUs); ``device``: the trainer's ``--device`` where it computes (None:
    its default)."""
    argv = ["train", "--server", f"127.0.0.1:{port}", "--rank", str(rank), "--num-trainers", str(setup.trainers),
            "--epochs", "1000000", "--batch-size", str(batch_size), "--max-steps", str(steps), "--dataset",
            "synthetic", "--no-progress", "--stats-out", stats_out, "--step", setup.step]
    if (setup.wire or "fp32") != "fp32":
        argv += ["--wire-dtype", setup.wire]
    if device and trainer_compute(setup):
        argv += ["--device", device]
    if setup.transport:
        argv += ["--transport", setup.transport]
    if setup.overlap:
        argv += ["--overlap", setup.overlap]
    if setup.bucket_cap_mb:
        argv += ["--bucket-cap-mb", str(setup.bucket_cap_mb)]
    if guard_flags(setup):
        return measure.worker_argv("psserver", *guard_flags(setup), "--", *argv)
    return measure.psserver_argv(*argv)


def ddp_rank_env(setup: Setup, rank: int, *, master_port: int) -> dict[str, str]:
    """torchrun's variables for rank ``rank`` of a ``ddp-N`` setup (one process per rank, all here)."""
    n = str(setup.trainers)
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), **process_env(setup)}


def ddp_rank_argv(setup: Setup, *, model: str, batch_size: int, steps: int, stats_out: str) -> list[str]:
    """One rank of a ``ddp-N`` setup: psserver's collective loop (``CollectiveTrainer`` +
    ``Fit.step``, as ``psserver train --mode ddp --compute-threads 1``) for ``steps`` steps,
    recording the end of each step (``benchmarks.harness.workers ddp``; rank and rendezvous from
    ``ddp_rank_env``)."""
    return measure.worker_argv("ddp", "--model", model, "--batch-size", str(batch_size), "--steps", str(steps),
                               "--threads", str(setup.threads or 1), "--stats-out", stats_out)


def local_argv(setup: Setup, *, model: str, batch_size: int, seconds: float, stats_out: str,
               steps: int | None = None) -> list[str]:
    """One local loop of a ``local*`` setup, for ``seconds`` (or ``steps`` steps, whichever ends first)."""
    argv = ["local", "--model", model, "--batch-size", str(batch_size), "--seconds", f"{seconds:.2f}", "--threads",
            str(setup.threads), "--allocator", setup.allocator, "--stats-out", stats_out]
    if steps is not None:
        argv += ["--max-steps", str(steps)]
    return measure.worker_argv(*argv)
