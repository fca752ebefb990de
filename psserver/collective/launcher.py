"""Where collective workers come from and how they join the process group.

Three ways to run, one worker function:

- under ``torchrun`` (or any env:// launcher, elastic rendezvous included): RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR and MASTER_PORT are in the environment; this process is one worker;
- standalone with ``--nproc-per-node N``: this process hosts the rendezvous store (a TCPStore
  bound to ``--master-addr:--master-port``, 0 picks a free port, so there is no race for it)
  and spawns N workers that join it as clients;
- standalone without it: a single worker, world size 1.

The backend follows the device (NCCL with one process per GPU, ``cuda:LOCAL_RANK``; gloo on
CPU) unless ``--backend`` says otherwise. The process group is destroyed on every exit path.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from psserver.config.collective import CollectiveConfig
from psserver.config.env import launcher_env
from psserver.errors import UsageError, first_line

log = logging.getLogger(__name__)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
INIT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class DistEnv:
    """This worker's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device


def under_torchrun() -> bool:
    """True when an env:// launcher (torchrun, torch.distributed.run, Slurm wrappers) started us."""
    return all(os.environ.get(v) not in (None, "") for v in TORCHRUN_VARS)


def torchrun_world_size() -> int:
    return launcher_env().world_size if under_torchrun() else 1


def configure_worker_logging(rank: int, level: str | int = logging.INFO) -> None:
    """Rank 0 logs at ``level``; the others only warnings and errors."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    root.setLevel(level if rank == 0 else logging.WARNING)
    if rank != 0:
        for handler in root.handlers:
            handler.setFormatter(logging.Formatter(
                f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s"))


def init_distributed(config: CollectiveConfig, rank: int, world_size: int, local_rank: int,
                     local_world_size: int, store: dist.Store | None = None) -> DistEnv:
    """Set the NCCL tunables, pick backend and device, and join the default process group."""
    for name, value in config.launch.nccl_env().items():
        os.environ[name] = value
        log.info("%s=%s", name, value)
    cuda = torch.cuda.is_available()
    backend = config.launch.resolved_backend(cuda)
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible "
                             f"(one process per GPU with NCCL)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
    kwargs = {"backend": backend, "timeout": INIT_TIMEOUT}
    if backend == "nccl":
        kwargs["device_id"] = device
    if store is not None or world_size == 1:
        kwargs.update(store=store if store is not None else dist.HashStore(), rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)  # env:// under torchrun
    log.info("rank %d/%d joined (%s, %s)", rank, world_size, backend, device)
    return DistEnv(rank, world_size, local_rank, local_world_size, backend, device)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already failing; never mask the real error
            log.debug("destroy_process_group failed", exc_info=True)


def run_in_process_group(config: CollectiveConfig, body: Callable[[DistEnv], int], *, rank: int,
                         world_size: int, local_rank: int, local_world_size: int,
                         store: dist.Store | None = None) -> int:
    """Join, run ``body``, leave: the process group is destroyed whatever happens."""
    if config.compute_threads:
        torch.set_num_threads(config.compute_threads)
    elif not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))
    previous = _exit_on_sigterm()
    try:
        env = init_distributed(config, rank, world_size, local_rank, local_world_size, store)
        return body(env)
    finally:
        destroy_distributed()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm():
    """SIGTERM (torchrun or our spawner stopping the job) raises SystemExit so ``finally`` runs."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


def _spawned_worker(local_rank: int, config: CollectiveConfig, body: Callable[[DistEnv], int],
                    host: str, port: int, nproc: int, log_level: int) -> None:
    """Entry point of one process spawned by :func:`spawn` (top level: spawn pickles it)."""
    configure_worker_logging(local_rank, log_level)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=host, MASTER_PORT=str(port))
    try:
        store = join_store(host, port, nproc, INIT_TIMEOUT)
        code = run_in_process_group(config, body, rank=local_rank, world_size=nproc, local_rank=local_rank,
                                    local_world_size=nproc, store=store)
    except UsageError as e:  # anything else is a bug: the parent logs the worker's traceback
        print(f"psserver train: error: rank {local_rank}: {e}", file=sys.stderr, flush=True)
        _exit_now(2)
    _exit_now(code or 0)


def join_store(host: str, port: int, nproc: int, timeout: timedelta) -> dist.TCPStore:
    """A worker's client of the rendezvous store at ``host:port``: torch retries a host it cannot
    reach for the whole ``timeout``, so the wait is logged first and its end is one line
    (``UsageError``), not a worker's traceback."""
    log.info("joining the rendezvous at %s:%d (waiting up to %gs for it)", host, port, timeout.total_seconds())
    try:
        return dist.TCPStore(host, port, nproc, is_master=False, timeout=timeout)
    except dist.DistError as e:
        raise UsageError(f"cannot reach the rendezvous at {host}:{port} within {timeout.total_seconds():g}s "
                         f"({first_line(e)}; is --master-addr an address of this host?)") from None


def _exit_now(code: int) -> None:
    """Leave without interpreter teardown: the process group is already destroyed, and C++
    threads of gloo/the store racing their destructors at exit occasionally abort a worker
    that finished cleanly ("terminate called without an active exception")."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(config: CollectiveConfig, body: Callable[[DistEnv], int]) -> int:
    """Host the rendezvous store here and run ``--nproc-per-node`` workers; their worst exit code."""
    import torch.multiprocessing as mp

    nproc = config.launch.nproc_per_node or 1
    host = config.launch.master_addr
    try:
        store = dist.TCPStore(host, config.launch.master_port, nproc, is_master=True, timeout=INIT_TIMEOUT,
                              wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - port taken, bad address: one line
        raise UsageError(f"cannot listen on {host}:{config.launch.master_port}: {str(e).splitlines()[0]}") from None
    port = store.port
    log.info("spawning %d workers, rendezvous on %s:%d", nproc, host, port)
    level = logging.getLogger().getEffectiveLevel()
    ctx = mp.start_processes(_spawned_worker, args=(config, body, host, port, nproc, level), nprocs=nproc,
                             join=False, start_method="spawn")
    try:
        while not ctx.join():
            pass
    except mp.ProcessExitedException as e:
        log.debug("worker failed: %s", e)
        return e.exit_code if e.exit_code and e.exit_code > 0 else 1
    except mp.ProcessRaisedException as e:
        log.error("a worker failed:\n%s", e)
        return 1
    except KeyboardInterrupt:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(10)
        raise
    finally:
        del store
    return 0


def launch(config: CollectiveConfig, body: Callable[[DistEnv], int]) -> int:
    """Run ``body`` in every worker of the job this process belongs to (or spawns)."""
    if config.launch.under_torchrun:
        env = launcher_env()  # a UsageError as well: one line, naming the variable
        rank, world, local_rank, local_world = env.rank, env.world_size, env.local_rank, env.local_world_size
        configure_worker_logging(rank, logging.getLogger().getEffectiveLevel())
        code = run_in_process_group(config, body, rank=rank, world_size=world, local_rank=local_rank,
                                    local_world_size=local_world)
        # A rank that finished leaves as a spawned worker does: one CI run's rank 1 aborted in
        # interpreter teardown after its work was done, and torchrun failed the job for it.
        _exit_now(code or 0)
    if config.launch.nproc_per_node:
        return spawn(config, body)
    return run_in_process_group(config, body, rank=0, world_size=1, local_rank=0, local_world_size=1)
