"""Configuration of ``psserver serve`` and ``psserver train`` (parameter-server mode)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from psserver.config.common import (
    JOIN_TOKEN_ENV,
    MAX_THREADS,
    MIN_CONNECT_TIMEOUT_S,
    MIN_RPC_TIMEOUT_S,
    MIN_TRAINER_TIMEOUT_S,
    DataConfig,
    check_device,
    check_host,
    check_output_dir,
    check_output_file,
    check_port,
    check_seed,
    check_timeout,
    check_token_file,
    is_loopback_host,
    parse_host_port,
    read_join_token,
)
from psserver.config.control import ControlConfig, ObservabilityConfig
from psserver.config.embedding import EmbeddingConfig
from psserver.config.env import DEFAULT_SERVER_PORT
from psserver.config.optimizer import OptimizerConfig
from psserver.config.schedule import LRScheduleConfig
from psserver.utils.memory import ALLOCATORS

UPDATE_MODES = ("async", "sync", "ssp")
MAX_TRAINERS = 1 << 16
"""The most data shards a job may name (``--num-trainers``): far past any job, and a sampler of
1e20 shards ran out of memory only after the trainer had joined."""
MAX_BUCKET_CAP_MB = 1 << 16
"""The largest gradient bucket, in MiB (64 GiB: one bucket for any model)."""
WIRE_DTYPES = ("fp32", "bf16", "fp16")
BUFFER_POLICIES = ("average", "rank0")
"""How the server's copy of the model's buffers follows the trainers' (``psserver.common.tensors``)."""
TRANSPORTS = ("auto", "device-map", "staged", "cpu")
"""``--transport`` (``psserver.common.transport``; ``auto``: the best path the two sides allow)."""
OVERLAP_MODES = ("auto", "on", "off")
"""``--overlap`` (``psserver.server.steps.pushpull``; ``auto``: on for a GPU trainer in async)."""
COMPUTE_MODES: dict[str, str] = {
    "trainer": "the trainer runs forward and backward on parameters it pulls; the server applies the "
               "gradient (default: adding trainers adds throughput)",
    "server": "the server runs the model on its devices; trainers feed it batches",
}
"""Where a step's forward and backward run, the default first."""


@dataclass(frozen=True)
class StepMode:
    compute: str
    """The ``COMPUTE_MODES`` entry this protocol implements."""
    help: str
    """The line ``--help`` shows."""


STEP_MODES: dict[str, StepMode] = {
    "pushpull": StepMode("trainer", "the flat gradient of step t goes up and the flat parameters of step t+1 "
                                    "come down in one RPC (1 round trip; trainer compute's default)"),
    "pull": StepMode("trainer", "the trainer pulls the parameters inside dist_autograd; dist_autograd.backward "
                                "and DistributedOptimizer.step apply the gradient on the server (3; the reference)"),
    "chained": StepMode("server", "the last step's output gradient and the next batch in one RPC "
                                  "(1 round trip; server compute's default)"),
    "plain": StepMode("server", "forward RPC + dist_autograd.backward + DistributedOptimizer.step (3)"),
}
"""Step protocols (``psserver.server.steps``, one module each), each for one compute mode, the
default of each mode first. Adding a protocol: its module and its entry here."""


def default_step(compute: str) -> str:
    """The step protocol a trainer speaks when it names only where it computes."""
    return next(name for name, mode in STEP_MODES.items() if mode.compute == compute)


def check_compute(compute: str | None, flag: str = "--compute") -> None:
    if compute is not None and compute not in COMPUTE_MODES:
        raise ValueError(f"{flag} must be one of {', '.join(COMPUTE_MODES)}, got {compute!r}")


@dataclass
class CheckpointConfig:
    """Where and when the server writes checkpoints."""

    directory: Path | None = None
    """Directory of checkpoints; None disables periodic and SIGTERM checkpoints."""
    every_steps: int = 0
    """Write one every N global steps (0: never by step count)."""
    interval_s: float = 0.0
    """Write one every N seconds while training (0: never by time)."""
    keep: int = 3
    """Keep this run's newest N valid checkpoints and delete its older ones; other runs' files
    in ``directory`` are never deleted."""
    resume: str | None = None
    """``latest`` (continue the run of the newest valid checkpoint in ``directory``) or a
    checkpoint path."""
    new_run: bool = False
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

    directory: Path | None = None
    """Where the state files live: a memory filesystem (``/dev/shm/psserver``, a Kubernetes
    ``emptyDir`` with ``medium: Memory``); None: the state lives in the process only."""
    key: str | None = None
    """The run the state belongs to. A server maps only the state of its own key; a server
    given none (a fresh run) makes one. ``--supervise`` hands its key to every restart; in
    Kubernetes the pod's UID keeps it across container restarts."""
    remove_stale: bool = False
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

    host: str = "127.0.0.1"
    """Address the RPC rendezvous store and the RPC transport bind to (only this one)."""
    port: int = DEFAULT_SERVER_PORT
    """Port of the RPC rendezvous store; trainers use ``--server HOST:PORT``."""
    model: str | None = None
    """A model name (entry point of ``psserver.models``) or ``MODULE:ATTR`` (an ``nn.Module``
    class or a function returning one), which pins the model and is imported here; None: the
    server runs none of the model's code and learns it from the first trainer that joins (its
    layout and initial values), or from the checkpoint it resumes."""
    model_args: dict = field(default_factory=dict)
    """Keyword arguments of the model's class or function (``--model-args JSON``)."""
    devices: list[str] | None = None
    """One model stage per device, in order; None: every visible GPU, else ``cpu``."""
    update: str = "async"
    """``async``: apply each trainer's update as it arrives; ``sync``: one step per K gradients,
    averaged; ``ssp``: as async, but no live trainer runs more than ``staleness`` steps ahead of
    the slowest live one (stale synchronous parallel)."""
    sync_trainers: int = 2
    """K in sync mode: gradients averaged per optimizer step (capped by live trainers)."""
    staleness: int = 4
    """S of ``ssp``: how many steps the fastest live trainer may run ahead of the slowest
    (0: bulk-synchronous)."""
    buffers: str = "average"
    """The model's buffers (BatchNorm statistics) on the server: ``average`` of what the
    trainers send (a sync round's mean in sync mode), or ``rank0``'s (DDP's broadcast_buffers)."""
    compute: str | None = None
    """Pin where every trainer's step runs (``trainer`` or ``server``); None: each trainer
    chooses (``psserver train --compute``), trainer compute unless it says otherwise."""
    optimizer: OptimizerConfig | None = None
    """Server optimizer; None: taken from the first trainer (default adam, lr 1e-3)."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """The learning rate of that optimizer over the server's global steps (the embedding
    tables' row optimizers keep ``embedding.lr``)."""
    max_grad_norm: float | None = None
    """Clip each trainer step's whole gradient to this L2 norm before it is applied (None: no
    clipping). A gradient whose norm is NaN or inf is never applied, whatever this says."""
    max_nonfinite_steps: int = 3
    """Evict a trainer after this many non-finite gradients in a row (each one is dropped)."""
    trainer_timeout: float = 5.0
    """Seconds without a heartbeat after which a trainer is declared lost and evicted."""
    rpc_timeout: float = 60.0
    """Default timeout of one RPC, seconds."""
    rpc_threads: int = 16
    """Threads serving RPC requests (sync mode parks one per waiting trainer)."""
    compute_threads: int = 0
    """torch intra-op threads of the server (0: number of cores)."""
    allocator: str = "cached"
    """Host memory policy: ``cached`` keeps freed memory for the next step (glibc), ``system``
    returns it to the kernel at once (each step page-faults its buffers in again)."""
    seed: int = 0
    """Seed of the model's initial parameters."""
    supervise: bool = False
    """Run the server as the child of a supervisor that restarts it when it dies by a signal:
    from its state in shared memory (``memory_state``), else its last checkpoint."""
    max_restarts: int = 5
    """Restarts the supervisor allows within ten minutes before it gives up."""
    join_token_file: Path | None = None
    """File holding the job's join token, which every trainer must know to join (else
    ``$PSSERVER_JOIN_TOKEN``; neither: anyone who reaches the store may join). It may be the
    control plane's token file."""
    no_join_token: bool = False
    """Serve beyond loopback without a join token (anyone who reaches the port may join). A
    server whose ``host`` is not loopback needs a token unless this says otherwise."""
    max_model_bytes: int = 1 << 30
    """The largest model (parameters and buffers, in bytes) a server without ``model`` takes from
    the first trainer: what it brings is allocated here whole, and a few kilobytes on the wire can
    declare gigabytes (a stride-0 tensor)."""
    num_servers: int = 1
    """Server processes that together hold the model's parameters, each a partition
    (``psserver.common.partition``); trainers push to and pull from all of them."""
    server_rank: int = 0
    """This process's place among them: 0 coordinates (store, membership, control plane,
    checkpoint schedule), the others hold their partition and follow it."""
    coordinator: str | None = None
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
        if self.update not in UPDATE_MODES:
            raise ValueError(f"--update must be one of {', '.join(UPDATE_MODES)}, got {self.update!r}")
        if self.buffers not in BUFFER_POLICIES:
            raise ValueError(f"--buffers must be one of {', '.join(BUFFER_POLICIES)}, got {self.buffers!r}")
        if self.sync_trainers < 1:
            raise ValueError(f"--sync-trainers must be >= 1, got {self.sync_trainers}")
        if self.staleness < 0:
            raise ValueError(f"--staleness must be >= 0, got {self.staleness}")
        check_compute(self.compute)
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
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"--allocator must be one of {', '.join(ALLOCATORS)}, got {self.allocator!r}")
        check_token_file(self.join_token_file, "--join-token-file")
        self._check_join_token()
        if not 1 <= self.max_model_bytes < 2 ** 63:
            raise ValueError(f"--max-model-bytes must be at least 1, got {self.max_model_bytes}")
        if self.supervise and self.checkpoint.directory is None and not self.memory_state.enabled:
            raise ValueError("--supervise needs a --state-dir or a --checkpoint-dir: what a restarted server "
                             "continues from")
        if self.max_restarts < 1:
            raise ValueError(f"--max-restarts must be >= 1, got {self.max_restarts}")

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


@dataclass(frozen=True)
class TrainerConfig:
    """``psserver train --rank N`` in parameter-server mode. Frozen: what ``__post_init__``
    checked stays checked (``dataclasses.replace`` makes a changed one, checked again)."""

    rank: int = 0
    """Trainer rank (0-based): picks the data shard; unique among live trainers."""
    server_host: str = "127.0.0.1"
    """Host of the server's rendezvous store."""
    server_port: int = DEFAULT_SERVER_PORT
    """Port of the server's rendezvous store."""
    num_trainers: int | None = None
    """Number of data shards; None: learnt from the server (its sync K, else WORLD_SIZE)."""
    epochs: int = 1
    """Passes over this trainer's shard."""
    batch_size: int = 64
    """Samples per step."""
    optimizer: OptimizerConfig | None = None
    """Requested server optimizer; must match the server's if it already has one."""
    model: str | None = None
    """This trainer's model, a name or ``MODULE:ATTR``; None: the server's (its ``--model``, or
    the model the first trainer brought), else ``mnist_cnn``. Its layout must be the server's."""
    model_args: dict | None = None
    """Keyword arguments of ``model`` (``--model-args``); None: the server's, with the server's model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and split."""
    connect_timeout: float = 60.0
    """Seconds to keep trying to reach a server that is not up yet."""
    reconnect: bool = False
    """On losing the server, retry with backoff until it is back and continue the epoch."""
    start_over: bool = False
    """Start the rank's data from its first epoch even where a trainer of this rank left the
    running job before finishing (by default the new one continues where that one stopped)."""
    rpc_timeout: float = 60.0
    """Timeout of one RPC, seconds."""
    allocator: str = "cached"
    """Host memory policy of the trainer, as the server's ``--allocator``: ``cached`` keeps the
    step's freed buffers for the next step instead of mapping and zero-filling them again."""
    compute_threads: int = 0
    """torch intra-op threads of the trainer; 0: its share of the CPUs it may use (affinity and
    cgroup quota, divided among the trainers the server knows on this host, followed as they
    come and go) when it computes, one when the server does (server compute)."""
    device: str = "cpu"
    """Where trainer compute runs the model (``cpu`` or ``cuda:N``)."""
    transport: str = "auto"
    """How its parameters and gradients travel (``psserver.common.transport``): ``auto`` picks
    ``device-map`` (CUDA to CUDA on one host, no host copy) where both sides are on GPUs of one
    host, else ``staged`` (pinned host memory) for a GPU trainer, else ``cpu``; a path named here
    that cannot be used is an error."""
    wire_dtype: str = "fp32"
    """dtype of parameters and gradients in flight (trainer compute); the server keeps fp32
    master weights and optimizer state."""
    overlap: str = "auto"
    """Whether a ``--step pushpull`` trainer computes its next step while the call that hands
    in the last one is in flight (``OVERLAP_MODES``): its gradient then comes from the
    parameters of the reply before, one step older. ``async``, and ``ssp`` with ``--staleness``
    >= 1 (the server bounds such a trainer one step tighter, so the bound holds); never sync.
    ``auto``: on for a GPU trainer (``--device cuda:N``) in async, where the exchange is worth
    hiding; ssp overlaps when asked (``on``)."""
    bucket_cap_mb: float = 25.0
    """MiB of gradient per bucket that a ``--step pushpull`` trainer fills from autograd hooks
    during backward (``psserver.trainer.compute.buckets``; DDP's ``bucket_cap_mb``): a bucket is
    copied and cast into the flat buffer, and on the staged path starts its copy to the host,
    while backward goes on."""
    eval_batch_size: int = 1000
    """Batch size of the final evaluation."""
    max_steps: int = 0
    """Stop after this many steps in total (0: run all epochs); for smoke tests and benchmarks."""
    progress: bool | None = None
    """Show a tqdm bar (None: only when stderr is a terminal)."""
    compute: str | None = None
    """Where the step's forward and backward run (``COMPUTE_MODES``); None: the step
    protocol's, else the server's pin, else ``trainer``."""
    step: str | None = None
    """How a step reaches the server (``STEP_MODES``, ``psserver.server.steps``); None: the
    default protocol of the compute mode."""
    stats_out: Path | None = None
    """Write per-step timings (monotonic end time of each step, samples) as JSON here."""
    join_token_file: Path | None = None
    """File holding the job's join token (else ``$PSSERVER_JOIN_TOKEN``), for a server that
    asks for one."""
    loss: str | None = None
    """The training loss (``--loss``): a name of ``psserver.models.losses.LOSSES`` or
    ``MODULE:ATTR``, a callable ``(output, target) -> scalar`` or an ``nn.Module`` class
    (instantiated without arguments); None: the model spec's (cross-entropy for a user's model).
    The protocols take it from ``psserver.models.losses.resolve_loss(loss, spec.loss)``."""
    metric: str | None = None
    """The held-out metric printed at the end (``--metric``): ``accuracy``, ``rmse``, ``auc``,
    ``loss`` (the mean held-out loss under the training loss) or ``MODULE:ATTR``, a callable
    ``(outputs, targets) -> float`` over the whole held-out set; None: the model spec's."""

    def __post_init__(self) -> None:
        from psserver.models import get_model_spec
        from psserver.models.losses import resolve_loss
        from psserver.utils.eval_metrics import resolve_metric

        check_token_file(self.join_token_file, "--join-token-file")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"--allocator must be one of {', '.join(ALLOCATORS)}, got {self.allocator!r}")
        if self.model_args is not None and self.model is None:
            raise ValueError("--model-args needs --model")
        if self.model is not None:
            get_model_spec(self.model, self.model_args)  # a reference that does not resolve: one line now
        # Resolved here so a bad reference is one line before the trainer joins (and again,
        # from the module cache, where the trainer uses them).
        if self.loss is not None:
            resolve_loss(self.loss)
        if self.metric is not None:
            resolve_metric(self.metric, "accuracy")
        for value, flag in ((self.rank, "--rank"), (self.num_trainers, "--num-trainers")):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{flag} must be an integer, got {value!r}")
        if not 0 <= self.rank < MAX_TRAINERS:
            raise ValueError(f"--rank must be in 0..{MAX_TRAINERS - 1}, got {self.rank}")
        check_port(self.server_port, "server port")
        if self.num_trainers is not None and not 1 <= self.num_trainers <= MAX_TRAINERS:
            raise ValueError(f"--num-trainers must be in 1..{MAX_TRAINERS}, got {self.num_trainers}")
        if self.num_trainers is not None and self.rank >= self.num_trainers:
            raise ValueError(f"--rank {self.rank} must be < --num-trainers {self.num_trainers}")
        if self.epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.eval_batch_size < 1:
            raise ValueError(f"--eval-batch-size must be >= 1, got {self.eval_batch_size}")
        check_timeout(self.connect_timeout, "--connect-timeout", MIN_CONNECT_TIMEOUT_S)
        check_timeout(self.rpc_timeout, "--rpc-timeout", MIN_RPC_TIMEOUT_S)
        if self.max_steps < 0:
            raise ValueError("--max-steps must be >= 0")
        check_compute(self.compute)
        if self.step is not None:
            if self.step not in STEP_MODES:
                raise ValueError(f"--step must be one of {', '.join(STEP_MODES)}, got {self.step!r}")
            mode = STEP_MODES[self.step].compute
            if self.compute is not None and self.compute != mode:
                raise ValueError(f"--step {self.step} is a protocol of --compute {mode}, not --compute {self.compute}")
            object.__setattr__(self, "compute", mode)
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"--wire-dtype must be one of {', '.join(WIRE_DTYPES)}, got {self.wire_dtype!r}")
        check_device(self.device, "--device")
        if not 0 <= self.compute_threads <= MAX_THREADS:
            raise ValueError(f"--compute-threads must be in 0..{MAX_THREADS}, got {self.compute_threads}")
        if not isinstance(self.bucket_cap_mb, int | float) or not math.isfinite(self.bucket_cap_mb) \
                or not 0 < self.bucket_cap_mb <= MAX_BUCKET_CAP_MB:
            raise ValueError(f"--bucket-cap-mb must be a number in (0, {MAX_BUCKET_CAP_MB}], got {self.bucket_cap_mb}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"--overlap must be one of {', '.join(OVERLAP_MODES)}, got {self.overlap!r}")
        if self.overlap == "on" and (self.compute == "server" or self.step not in (None, "pushpull")):
            raise ValueError("--overlap on is for --step pushpull (the trainer computes its steps)")
        if self.transport in ("device-map", "staged") and not self.device.startswith("cuda"):
            raise ValueError(f"--transport {self.transport} needs a trainer on a GPU (--device cuda:N)")
        if self.wire_dtype != "fp32" and self.compute == "server":
            raise ValueError("--wire-dtype applies to --compute trainer (server compute sends batches)")
        if self.device != "cpu" and self.compute == "server":
            raise ValueError("--device applies to --compute trainer (server compute runs on the server's devices)")
        check_output_file(self.stats_out, "--stats-out")

    def join_token(self) -> str | None:
        """The join token, read once at start (``ValueError``: an empty or unreadable file)."""
        return read_join_token(self.join_token_file)
