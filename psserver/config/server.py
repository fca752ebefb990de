"""Configuration of ``psserver serve``: the server, its checkpoints and its state in shared
memory (the embedding tables, schedule, control plane and metrics have modules of their own)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from psserver.config.common import (
    JOIN_TOKEN_ENV,
    MAX_THREADS,
    MIN_RPC_TIMEOUT_S,
    MIN_TRAINER_TIMEOUT_S,
    check_device,
    check_host,
    check_output_dir,
    check_port,
    check_seed,
    check_timeout,
    check_token_file,
    is_loopback_host,
    parse_bytes,
    parse_host_port,
    read_join_token,
)
from psserver.config.control import ControlConfig, ObservabilityConfig
from psserver.config.embedding import EmbeddingConfig
from psserver.config.env import (
    COORDINATOR_VAR,
    DEFAULT_SERVER_PORT,
    NUM_SERVERS_VAR,
    SERVER_RANK_VAR,
    STATE_DIR_VAR,
    STATE_KEY_VAR,
    default_coordinator,
    default_num_servers,
    default_serve_port,
    default_state_dir,
    default_state_key,
    server_rank_from_env,
)
from psserver.config.loop import MODEL_ARGS_HELP, MODEL_HELP
from psserver.config.optimizer import OptimizerConfig
from psserver.config.options import check_choices, comma_list, option
from psserver.config.protocols import COMPUTE_MODES
from psserver.config.schedule import LRScheduleConfig
from psserver.utils.memory import ALLOCATORS

UPDATE_MODES = ("async", "sync", "ssp", "diloco")
OUTER_MODES = ("sync", "async")
"""How ``--update diloco`` applies the trainers' pseudo-gradients (``docs/diloco.md``)."""
BUFFER_POLICIES = ("average", "rank0")
"""How the server's copy of the model's buffers follows the trainers' (``psserver.common.tensors``)."""
GUARD_GROUP = "guarding the shared model"
DILOCO_GROUP = "DiLoCo (--update diloco)"
SERVERS_GROUP = "several server processes"
"""Argument groups of server fields shown apart from the others (``Option.group``)."""


@dataclass
class CheckpointConfig:
    """Where and when the server writes checkpoints."""

    directory: Path | None = option(None, flag="--checkpoint-dir", help="directory of checkpoints")
    """Directory of checkpoints; None disables periodic and SIGTERM checkpoints."""
    every_steps: int = option(0, flag="--checkpoint-every",
                              help="checkpoint every N global steps (default {default}: not by steps)")
    """Write one every N global steps (0: never by step count)."""
    interval_s: float = option(0.0, flag="--checkpoint-interval",
                               help="checkpoint every N seconds (default {default}: not by time)")
    """Write one every N seconds while training (0: never by time)."""
    keep: int = option(3, flag="--keep-checkpoints",
                       help="keep this run's newest N valid checkpoints; other runs' files stay (default {default})")
    """Keep this run's newest N valid checkpoints and delete its older ones; other runs' files
    in ``directory`` are never deleted."""
    resume: str | None = option(
        None, const="latest", metavar="PATH",
        help="continue the run of the newest valid checkpoint in --checkpoint-dir, or resume from PATH")
    """``latest`` (continue the run of the newest valid checkpoint in ``directory``) or a
    checkpoint path."""
    new_run: bool = option(False, help="start a new run in a --checkpoint-dir that holds another run's checkpoints, "
                                       "leaving their files alone (without it or --resume, such a start is refused)")
    """Start a new run in a ``directory`` that holds another run's checkpoints, leaving their
    files alone (without it, or ``resume``, such a start is refused so that no run is mixed up
    with another by mistake)."""

    def __post_init__(self) -> None:
        if self.directory is not None:
            self.directory = Path(self.directory)
            check_output_dir(self.directory, "--checkpoint-dir")
        if self.every_steps < 0 or self.interval_s < 0:
            raise ValueError("checkpoint frequency must be >= 0")
        if self.keep < 1:
            raise ValueError(f"--keep-checkpoints must be >= 1, got {self.keep}")
        if self.resume == "latest" and self.directory is None:
            raise ValueError("--resume without a path needs --checkpoint-dir")
        if self.new_run and self.resume is not None:
            raise ValueError("--new-run starts a new run, --resume continues one: give one of them")
        if self.new_run and self.directory is None:
            raise ValueError("--new-run needs --checkpoint-dir")


DEFAULT_STATE_DIR = f"/dev/shm/psserver-{os.geteuid()}"
"""Where ``--supervise`` keeps the state when ``--state-dir`` is not given (Linux's shared memory):
one directory per user, made by the server with mode 0700 (one another user made is refused)."""
STATE_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


@dataclass
class MemoryStateConfig:
    """The server's live state in named shared memory, which outlives the process: a server
    process that dies (any signal) and comes back maps it again and loses no applied update."""

    directory: Path | None = option(
        None, flag="--state-dir", parse=str, metavar="DIR|off", env_default=default_state_dir,
        help="keep the model's live state (parameters, buffers, optimizer state, step) in files under DIR, a memory "
             "filesystem, so a server process that dies comes back with every update it had applied (default "
             f"${STATE_DIR_VAR}, else {DEFAULT_STATE_DIR} with --supervise, else off)")
    """Where the state files live: a memory filesystem (``/dev/shm/psserver``, a Kubernetes
    ``emptyDir`` with ``medium: Memory``); None: the state lives in the process only."""
    key: str | None = option(
        None, flag="--state-key", metavar="KEY", env_default=lambda: default_state_key(None),
        help=f"the run that state belongs to: a server maps only its own key's state (default ${STATE_KEY_VAR}; "
             "none: a new run's key; --supervise keeps one across restarts)")
    """The run the state belongs to. A server maps only the state of its own key; a server
    given none (a fresh run) makes one. ``--supervise`` hands its key to every restart; in
    Kubernetes the pod's UID keeps it across container restarts."""
    remove_stale: bool = option(
        False, flag="--remove-stale-state",
        help="delete the state that jobs whose processes are gone left in --state-dir (it is reported either way)")
    """Delete the state left behind by jobs whose processes are gone (they are reported either way)."""

    def __post_init__(self) -> None:
        if self.directory is not None:
            self.directory = Path(self.directory)
            if self.directory.exists() and not self.directory.is_dir():
                raise ValueError(f"--state-dir {self.directory} is not a directory")
        if self.key is not None and (not self.key or len(self.key) > 128 or set(self.key) - STATE_KEY_CHARS
                                     or self.key.startswith(".")):
            raise ValueError(f"--state-key must be 1-128 letters, digits, '-', '_' or '.', not starting with '.', "
                             f"got {self.key!r}")
        if self.remove_stale and self.directory is None:
            raise ValueError("--remove-stale-state needs a --state-dir")

    @property
    def enabled(self) -> bool:
        return self.directory is not None


@dataclass
class ServerConfig:
    """``psserver serve``: the long-running parameter server (RPC rank 0)."""

    host: str = option("127.0.0.1", help="address to bind (default {default})")
    """Address the RPC rendezvous store and the RPC transport bind to (only this one)."""
    port: int = option(DEFAULT_SERVER_PORT, env_default=lambda: default_serve_port(None),
                       help="rendezvous port trainers connect to (default $MASTER_PORT or {default})")
    """Port of the RPC rendezvous store; trainers use ``--server HOST:PORT``."""
    model: str | None = option(
        None, help=MODEL_HELP + " (default: none; the server learns the model from the first trainer that joins, its "
                                "layout and initial values, and runs none of its code)")
    """A model name (entry point of ``psserver.models``) or ``MODULE:ATTR`` (an ``nn.Module``
    class or a function returning one), which pins the model and is imported here; None: the
    server runs none of the model's code and learns it from the first trainer that joins (its
    layout and initial values), or from the checkpoint it resumes."""
    model_args: dict = option(factory=dict, metavar="JSON", help=MODEL_ARGS_HELP)
    """Keyword arguments of the model's class or function (``--model-args JSON``)."""
    devices: list[str] | None = option(
        None, parse=comma_list, help="comma-separated devices, one model stage each (default: all GPUs, else cpu)")
    """One model stage per device, in order; None: every visible GPU, else ``cpu``."""
    update: str = option(
        "async", choices=UPDATE_MODES,
        help="async: apply updates as they arrive; sync: one step per K gradients, averaged; ssp: async, no trainer "
             "more than --staleness steps ahead of the slowest; diloco: trainers take local steps with their own "
             "inner optimizer and send pseudo-gradients, the server's optimizer is the outer one (--outer) "
             "(default {default})")
    """``async``: apply each trainer's update as it arrives; ``sync``: one step per K gradients,
    averaged; ``ssp``: as async, but no live trainer runs more than ``staleness`` steps ahead of
    the slowest live one (stale synchronous parallel); ``diloco``: trainers run local steps and
    send pseudo-gradients (``--step diloco``), rounds as ``outer`` says."""
    outer: str = option(
        "sync", choices=OUTER_MODES, group=DILOCO_GROUP,
        help="--update diloco: sync: one outer step per round of --sync-trainers K pseudo-gradients, averaged; async: "
             "each applied as it arrives. Without --optimizer the outer optimizer is sgd, lr 0.7, momentum 0.9, "
             "Nesterov (async: delayed_nesterov, its momentum once per K arrivals) (default {default})")
    """How ``--update diloco`` applies pseudo-gradients: ``sync`` (rounds of K, averaged, as
    ``--update sync``) or ``async`` (each on arrival, as ``--update async``)."""
    dynamic_local_steps: bool = option(
        False, group=DILOCO_GROUP,
        help="--update diloco --outer async: size each trainer's local steps by its measured inner step rate, "
             "H_i = max(1, floor(H * v_i / v_max)), told in each sync's reply (default off)")
    """Dynamic local updates: a trainer measured at ``v_i`` inner steps/s runs
    ``max(1, floor(H * v_i / v_max))`` local steps per window, so that a slow trainer's
    pseudo-gradient is as fresh as a fast one's (async only)."""
    sync_trainers: int = option(2, help="K of --update sync (default {default})")
    """K in sync mode: gradients averaged per optimizer step (capped by live trainers)."""
    staleness: int = option(4, help="S of --update ssp (0: bulk-synchronous; default {default})")
    """S of ``ssp``: how many steps the fastest live trainer may run ahead of the slowest
    (0: bulk-synchronous)."""
    buffers: str = option(
        "average", choices=BUFFER_POLICIES,
        help="the model's buffers (BatchNorm statistics) on the server: average of what the trainers send with their "
             "updates (sync: each round's mean), or rank0's, as DDP's broadcast_buffers; trainers load the server's "
             "every step (default {default})")
    """The model's buffers (BatchNorm statistics) on the server: ``average`` of what the
    trainers send (a sync round's mean in sync mode), or ``rank0``'s (DDP's broadcast_buffers)."""
    compute: str | None = option(
        None, choices=list(COMPUTE_MODES),
        help="pin where every trainer's steps run, trainer or server (default: each trainer's choice, trainer unless "
             "it says otherwise)")
    """Pin where every trainer's step runs (``trainer`` or ``server``); None: each trainer
    chooses (``psserver train --compute``), trainer compute unless it says otherwise."""
    optimizer: OptimizerConfig | None = None
    """Server optimizer; None: taken from the first trainer (default adam, lr 1e-3)."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """The learning rate of that optimizer over the server's global steps (the embedding
    tables' row optimizers keep ``embedding.lr``)."""
    max_grad_norm: float | None = option(
        None, metavar="NORM", group=GUARD_GROUP,
        help="clip each trainer step's gradient to this L2 norm (default: no clipping; a gradient with NaN or inf is "
             "always dropped)")
    """Clip each trainer step's whole gradient to this L2 norm before it is applied (None: no
    clipping). A gradient whose norm is NaN or inf is never applied, whatever this says."""
    max_nonfinite_steps: int = option(
        3, metavar="N", group=GUARD_GROUP,
        help="evict a trainer after N non-finite gradients in a row (default {default})")
    """Evict a trainer after this many non-finite gradients in a row (each one is dropped)."""
    trainer_timeout: float = option(
        5.0, help="seconds without heartbeat before a trainer is evicted (default {default}, at least "
                  f"{MIN_TRAINER_TIMEOUT_S:g})")
    """Seconds without a heartbeat after which a trainer is declared lost and evicted."""
    rpc_timeout: float = option(
        60.0, help=f"RPC timeout in seconds (default {{default}}, at least {MIN_RPC_TIMEOUT_S:g})")
    """Default timeout of one RPC, seconds."""
    rpc_threads: int = option(16, help="RPC worker threads (default {default})")
    """Threads serving RPC requests (sync mode parks one per waiting trainer)."""
    compute_threads: int = option(0, help="torch threads (default {default}: all cores)")
    """torch intra-op threads of the server (0: number of cores)."""
    allocator: str = option(
        "cached", choices=ALLOCATORS,
        help="host memory: cached keeps freed buffers for the next step; system returns them to the kernel at once "
             "(default {default})")
    """Host memory policy: ``cached`` keeps freed memory for the next step (glibc), ``system``
    returns it to the kernel at once (each step page-faults its buffers in again)."""
    seed: int = option(0, help="seed of the initial parameters (default {default})")
    """Seed of the model's initial parameters."""
    supervise: bool = option(
        False, help="run the server under a supervisor that restarts it if it dies by a signal (SIGKILL, the OOM "
                    "killer, a crash inside TensorPipe): from its state in shared memory (--state-dir, default "
                    f"{DEFAULT_STATE_DIR} here), else its last checkpoint")
    """Run the server as the child of a supervisor that restarts it when it dies by a signal:
    from its state in shared memory (``memory_state``), else its last checkpoint."""
    max_restarts: int = option(
        5, metavar="N", help="supervised: give up after N restarts within ten minutes (default {default})")
    """Restarts the supervisor allows within ten minutes before it gives up."""
    join_token_file: Path | None = option(
        None, help=f"file holding the job's join token; only trainers that know it can join (else ${JOIN_TOKEN_ENV}; "
                   "neither: anyone who reaches --port can join). It may be the control plane's --auth-token-file")
    """File holding the job's join token, which every trainer must know to join (else
    ``$PSSERVER_JOIN_TOKEN``; neither: anyone who reaches the store may join). It may be the
    control plane's token file."""
    no_join_token: bool = option(
        False, help="serve a --host beyond loopback without a join token: anyone who reaches --port can join, read "
                    "the model and write it (without this, such a server needs a token)")
    """Serve beyond loopback without a join token (anyone who reaches the port may join). A
    server whose ``host`` is not loopback needs a token unless this says otherwise."""
    max_model_bytes: int = option(
        1 << 30, parse=parse_bytes, metavar="SIZE", show=lambda n: f"{n >> 30}G" if n % (1 << 30) == 0 else str(n),
        help="the largest model a server without --model takes from the first trainer, parameters and buffers "
             "(bytes, or with K/M/G/T; default {default})")
    """The largest model (parameters and buffers, in bytes) a server without ``model`` takes from
    the first trainer: what it brings is allocated here whole, and a few kilobytes on the wire can
    declare gigabytes (a stride-0 tensor)."""
    num_servers: int = option(
        1, metavar="S", group=SERVERS_GROUP, env_default=lambda: default_num_servers(None),
        help=f"server processes that hold the parameters together, each a partition (default ${NUM_SERVERS_VAR} or "
             "{default})")
    """Server processes that together hold the model's parameters, each a partition
    (``psserver.common.partition``); trainers push to and pull from all of them."""
    server_rank: int = option(
        0, metavar="I", group=SERVERS_GROUP, env_default=lambda: server_rank_from_env(None),
        help=f"this server's rank, 0 coordinates (default ${SERVER_RANK_VAR}, else $SLURM_PROCID, else the ordinal of "
             "a StatefulSet pod's hostname NAME-I, else {default})")
    """This process's place among them: 0 coordinates (store, membership, control plane,
    checkpoint schedule), the others hold their partition and follow it."""
    coordinator: str | None = option(
        None, metavar="HOST:PORT", group=SERVERS_GROUP, env_default=lambda: default_coordinator(None),
        help=f"server 0's --host:--port, for servers of rank > 0 (default ${COORDINATOR_VAR}, else "
             "$MASTER_ADDR:$MASTER_PORT)")
    """``HOST:PORT`` of server 0's store (its ``--host``/``--port``), for a server of rank > 0."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint policy."""
    memory_state: MemoryStateConfig = field(default_factory=MemoryStateConfig)
    """The live state in shared memory (what a restarted server process continues from)."""
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    """The embedding tables of a recommendation model (ignored by a dense model)."""
    control: ControlConfig = field(default_factory=ControlConfig)
    """gRPC control plane."""
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    """Prometheus and TensorBoard."""

    def __post_init__(self) -> None:
        from psserver.models import get_model_spec

        check_host(self.host, "--host")
        check_port(self.port, "--port")
        if self.model is None:
            self._check_without_model()
        elif get_model_spec(self.model, self.model_args).sparse:
            self._check_tables()
        self._check_servers()
        check_choices(self)
        if self.sync_trainers < 1:
            raise ValueError(f"--sync-trainers must be >= 1, got {self.sync_trainers}")
        if self.staleness < 0:
            raise ValueError(f"--staleness must be >= 0, got {self.staleness}")
        self._check_diloco()
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ValueError(f"--max-grad-norm must be a positive number, got {self.max_grad_norm}")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"--max-nonfinite-steps must be >= 1, got {self.max_nonfinite_steps}")
        if self.devices is not None:
            if not self.devices:
                raise ValueError("--devices needs at least one device")
            for dev in self.devices:
                check_device(dev, "device")
        check_timeout(self.trainer_timeout, "--trainer-timeout", MIN_TRAINER_TIMEOUT_S)
        check_timeout(self.rpc_timeout, "--rpc-timeout", MIN_RPC_TIMEOUT_S)
        if not 4 <= self.rpc_threads <= MAX_THREADS:
            raise ValueError(f"--rpc-threads must be in 4..{MAX_THREADS}, got {self.rpc_threads}")
        if not 0 <= self.compute_threads <= MAX_THREADS:
            raise ValueError(f"--compute-threads must be in 0..{MAX_THREADS}, got {self.compute_threads}")
        check_seed(self.seed, "--seed")
        check_token_file(self.join_token_file, "--join-token-file")
        self._check_join_token()
        read = self.control.read_token()
        if read is not None and read == self.join_token():
            raise ValueError("the read token is the join token: give readers a token of their own "
                             "(--read-token-file), which cannot join as a trainer")
        if not 1 <= self.max_model_bytes < 2 ** 63:
            raise ValueError(f"--max-model-bytes must be at least 1, got {self.max_model_bytes}")
        if self.supervise and self.checkpoint.directory is None and not self.memory_state.enabled:
            raise ValueError("--supervise needs a --state-dir or a --checkpoint-dir: what a restarted server "
                             "continues from")
        if self.max_restarts < 1:
            raise ValueError(f"--max-restarts must be >= 1, got {self.max_restarts}")

    @property
    def updater_mode(self) -> str:
        """How updates are applied: ``--update``, or for ``diloco`` its ``--outer`` (sync rounds
        or each on arrival)."""
        return self.outer if self.update == "diloco" else self.update

    @property
    def rounds(self) -> bool:
        """Whether updates are applied in rounds of K (``--update sync``, ``diloco --outer sync``)."""
        return self.updater_mode == "sync"

    def _check_diloco(self) -> None:
        if self.update != "diloco":
            if self.dynamic_local_steps:
                raise ValueError("--dynamic-local-steps is for --update diloco --outer async")
            return
        if self.dynamic_local_steps and self.outer != "async":
            raise ValueError("--dynamic-local-steps needs --outer async: a sync round waits for its slowest "
                             "trainer whatever its window")
        if self.compute == "server":
            raise ValueError("--update diloco: trainers take the local steps (--compute trainer)")
        if self.model is not None:
            from psserver.models import get_model_spec

            if get_model_spec(self.model, self.model_args).sparse:
                raise ValueError(f"--update diloco: model {self.model} keeps embedding tables on the servers, "
                                 "which local steps cannot take")
        if self.optimizer is None:
            self.optimizer = outer_optimizer(self.outer, self.sync_trainers)

    def _check_join_token(self) -> None:
        """A server reachable beyond this machine needs a join token unless told otherwise: without
        one, any peer that reaches its port joins, reads the model and writes it."""
        if self.no_join_token or is_loopback_host(self.host):
            return
        if self.join_token_file is None and not os.environ.get(JOIN_TOKEN_ENV, "").strip():
            raise ValueError(f"--host {self.host} is reachable beyond this machine: give the job a join token "
                             f"(--join-token-file FILE, or ${JOIN_TOKEN_ENV}; every trainer passes the same), or "
                             "--no-join-token to let anyone who reaches --port join")

    def _check_servers(self) -> None:
        if not 1 <= self.num_servers <= 64:
            raise ValueError(f"--num-servers must be in 1..64, got {self.num_servers}")
        if not 0 <= self.server_rank < self.num_servers:
            raise ValueError(f"--server-rank {self.server_rank} must be in 0..{self.num_servers - 1} "
                             f"(--num-servers {self.num_servers})")
        if self.num_servers == 1:
            return
        if self.compute == "server":
            raise ValueError("--compute server runs the model on one server process: it needs --num-servers 1")
        if self.server_rank > 0:
            if self.coordinator is None:
                raise ValueError(f"server {self.server_rank} needs --coordinator HOST:PORT (server 0's --host and "
                                 "--port; or set PSSERVER_COORDINATOR, or MASTER_ADDR and MASTER_PORT)")
            parse_host_port(self.coordinator)
            if self.checkpoint.resume not in (None, "latest"):
                raise ValueError(f"--resume PATH is for server 0; server {self.server_rank} loads the checkpoint "
                                 "server 0 resumes from (use --resume without a path, or none)")

    def _check_without_model(self) -> None:
        """What a server that runs none of the model's code cannot do."""
        if self.model_args:
            raise ValueError("--model-args needs --model")
        if self.compute == "server":
            raise ValueError("--compute server runs the model on the server: it needs --model")
        if self.devices is not None and len(self.devices) > 1:
            raise ValueError("--devices with several devices splits the model into stages, which needs its code: "
                             "give --model, or one device")

    def _check_tables(self) -> None:
        """What a model with embedding tables on the servers cannot do (yet)."""
        if self.compute == "server":
            raise ValueError(f"model {self.model} keeps embedding tables on the servers: trainers compute "
                             "(--compute trainer)")
        if self.devices is not None and len(self.devices) > 1:
            raise ValueError(f"model {self.model}: the dense part of a model with embedding tables is one stage "
                             "(one device per server process; use --num-servers for more)")

    @property
    def coordinator_address(self) -> tuple[str, int]:
        """(host, port) of server 0's store."""
        if self.coordinator is None:
            return self.host, self.port
        return parse_host_port(self.coordinator)

    def join_token(self) -> str | None:
        """The join token, read once at start (``ValueError``: an empty or unreadable file)."""
        return read_join_token(self.join_token_file)


DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.9
"""The outer optimizer of DiLoCo (Douillard et al., 2023): SGD, lr 0.7, Nesterov momentum 0.9."""


def outer_optimizer(outer: str, sync_trainers: int, **given: object) -> OptimizerConfig:
    """The optimizer of ``--update diloco`` with ``given`` fields (``OptimizerConfig``'s): one
    named is taken as given; else the defaults, over which ``given`` goes: sync, Nesterov SGD
    (lr 0.7, momentum 0.9); async, its delayed form, whose momentum acts once per
    ``--sync-trainers`` arrivals (``delayed_nesterov``)."""
    if "name" in given:  # an optimizer named on the command line is taken as it is given
        return OptimizerConfig(**given)  # type: ignore[arg-type]
    name = "sgd" if outer == "sync" else "delayed_nesterov"
    values: dict = {"lr": DILOCO_OUTER_LR, "momentum": DILOCO_OUTER_MOMENTUM, **given}
    if not values.get("args"):
        values["args"] = {"nesterov": True} if name == "sgd" else {"period": sync_trainers}
    return OptimizerConfig(name=name, **values)
