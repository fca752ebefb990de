"""Configuration of ``psserver train --mode ps``: a trainer that joins a parameter server (the
library's ``psserver.connect(config=TrainerConfig(...))`` takes it too)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from psserver.config import loop
from psserver.config.common import (
    JOIN_TOKEN_ENV,
    MAX_THREADS,
    MIN_CONNECT_TIMEOUT_S,
    MIN_RPC_TIMEOUT_S,
    DataConfig,
    check_device,
    check_output_file,
    check_port,
    check_timeout,
    check_token_file,
    read_join_token,
)
from psserver.config.env import (
    DEFAULT_SERVER_PORT,
    default_rank,
    default_world_size,
)
from psserver.config.loop import MODEL_ARGS_HELP
from psserver.config.optimizer import OptimizerConfig, optimizer_class
from psserver.config.options import check_choices, option
from psserver.config.protocols import COMPUTE_HELP, COMPUTE_MODES, STEP_HELP, STEP_MODES
from psserver.utils.memory import ALLOCATORS

PS_GROUP = "parameter server (--mode ps)"
DEFAULT_LOCAL_STEPS = 100
"""DiLoCo's H when a trainer of a ``--update diloco`` server gives no ``--local-steps``."""
COMPRESSIONS = ("none", "int8", "int4")
"""What a DiLoCo trainer's pseudo-gradient may travel as (``--compress``)."""
"""The argument group of the flags only a ``--mode ps`` trainer takes."""
MAX_TRAINERS = 1 << 16
"""The most data shards a job may name (``--num-trainers``): far past any job, and a sampler of
1e20 shards ran out of memory only after the trainer had joined."""
MAX_BUCKET_CAP_MB = 1 << 16
"""The largest gradient bucket, in MiB (64 GiB: one bucket for any model)."""
WIRE_DTYPES = ("fp32", "bf16", "fp16")
TRANSPORTS = ("auto", "device-map", "staged", "cpu")
"""``--transport`` (``psserver.common.transport``; ``auto``: the best path the two sides allow)."""
OVERLAP_MODES = ("auto", "on", "off")
"""``--overlap`` (``psserver.server.steps.pushpull``; ``auto``: on for a GPU trainer in async)."""


@dataclass(frozen=True)
class TrainerConfig:
    """``psserver train --rank N`` in parameter-server mode. Frozen: what ``__post_init__``
    checked stays checked (``dataclasses.replace`` makes a changed one, checked again)."""

    rank: int = option(
        0, common=True, env_default=default_rank,
        help="trainer rank (default $RANK, $SLURM_PROCID, else {default}; ddp/fsdp: the launcher's, which it must "
             "match)")
    """Trainer rank (0-based): picks the data shard; unique among live trainers."""
    server_host: str = "127.0.0.1"
    """Host of the server's rendezvous store."""
    server_port: int = DEFAULT_SERVER_PORT
    """Port of the server's rendezvous store."""
    num_trainers: int | None = option(
        None, common=True, env_default=default_world_size,
        help="number of data shards (default $WORLD_SIZE, else learnt from the server; ddp/fsdp: the world size, "
             "which it must match)")
    """Number of data shards; None: learnt from the server (its sync K, else WORLD_SIZE)."""
    epochs: int = loop.epochs()
    """Passes over this trainer's shard."""
    batch_size: int = loop.batch_size()
    """Samples per step."""
    optimizer: OptimizerConfig | None = None
    """Requested server optimizer; must match the server's if it already has one."""
    model: str | None = option(None, common=True, help=loop.TRAIN_MODEL_HELP)
    """This trainer's model, a name or ``MODULE:ATTR``; None: the server's (its ``--model``, or
    the model the first trainer brought), else ``mnist_cnn``. Its layout must be the server's."""
    model_args: dict | None = option(None, common=True, metavar="JSON", help=MODEL_ARGS_HELP)
    """Keyword arguments of ``model`` (``--model-args``); None: the server's, with the server's model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and split."""
    connect_timeout: float = option(
        60.0, group=PS_GROUP,
        help=f"seconds to wait for a server that is still starting (default {{default}}, at least "
             f"{MIN_CONNECT_TIMEOUT_S:g})")
    """Seconds to keep trying to reach a server that is not up yet."""
    reconnect: bool = option(
        False, group=PS_GROUP,
        help="if the server goes away or evicts this trainer, rejoin under a fresh name (retrying with backoff) and "
             "continue where it was; without it, exit code 3")
    """On losing the server, retry with backoff until it is back and continue the epoch."""
    start_over: bool = option(
        False, group=PS_GROUP,
        help="start this rank's data from the first epoch even where a trainer of this rank left the running job "
             "unfinished (by default this one continues where that one stopped)")
    """Start the rank's data from its first epoch even where a trainer of this rank left the
    running job before finishing (by default the new one continues where that one stopped)."""
    rpc_timeout: float = option(
        60.0, group=PS_GROUP, help=f"RPC timeout in seconds (default {{default}}, at least {MIN_RPC_TIMEOUT_S:g})")
    """Timeout of one RPC, seconds."""
    allocator: str = option(
        "cached", choices=ALLOCATORS, group=PS_GROUP,
        help="host memory: cached keeps a step's freed buffers for the next one, system returns them to the kernel "
             "at once (each step maps and zero-fills them again; default {default})")
    """Host memory policy of the trainer, as the server's ``--allocator``: ``cached`` keeps the
    step's freed buffers for the next step instead of mapping and zero-filling them again."""
    compute_threads: int = loop.compute_threads()
    """torch intra-op threads of the trainer; 0: its share of the CPUs it may use (affinity and
    cgroup quota, divided among the trainers the server knows on this host, followed as they
    come and go) when it computes, one when the server does (server compute)."""
    device: str = option("cpu", group=PS_GROUP,
                         help="trainer compute: run the model on cpu or cuda:N (default {default})")
    """Where trainer compute runs the model (``cpu`` or ``cuda:N``)."""
    transport: str = option(
        "auto", choices=TRANSPORTS, group=PS_GROUP,
        help="trainer compute: how parameters and gradients travel: device-map (GPU to GPU on one host over "
             "CUDA IPC), staged (pinned host memory), cpu; auto takes the best the two sides allow and logs why "
             "(default {default})")
    """How its parameters and gradients travel (``psserver.common.transport``): ``auto`` picks
    ``device-map`` (CUDA to CUDA on one host over CUDA IPC) where both sides are on GPUs of one
    host, else ``staged`` (pinned host memory) for a GPU trainer, else ``cpu``; a path named here
    that cannot be used is an error."""
    wire_dtype: str = option(
        "fp32", choices=WIRE_DTYPES, group=PS_GROUP,
        help="trainer compute: dtype of parameters and gradients in flight (the server keeps fp32 master weights and "
             "optimizer state; default {default})")
    """dtype of parameters and gradients in flight (trainer compute); the server keeps fp32
    master weights and optimizer state."""
    overlap: str = option(
        "auto", choices=OVERLAP_MODES, group=PS_GROUP,
        help="--step pushpull: compute the next step while the last one's gradient is handed in (on the parameters "
             "of the reply before: one step staler); async, or ssp with --staleness >= 1; auto: on for a GPU trainer "
             "in async (default {default})")
    """Whether a ``--step pushpull`` trainer computes its next step while the call that hands
    in the last one is in flight (``OVERLAP_MODES``): its gradient then comes from the
    parameters of the reply before, one step older. ``async``, and ``ssp`` with ``--staleness``
    >= 1 (the server bounds such a trainer one step tighter, so the bound holds); never sync.
    ``auto``: on for a GPU trainer (``--device cuda:N``) in async, where the exchange is worth
    hiding; ssp overlaps when asked (``on``)."""
    bucket_cap_mb: float = loop.bucket_cap_mb()
    """MiB of gradient per bucket that a ``--step pushpull`` trainer fills from autograd hooks
    during backward (``psserver.trainer.compute.buckets``; DDP's ``bucket_cap_mb``): a bucket is
    copied and cast into the flat buffer, and on the staged path starts its copy to the host,
    while backward goes on."""
    eval_batch_size: int = loop.eval_batch_size()
    """Batch size of the final evaluation."""
    max_steps: int = loop.max_steps()
    """Stop after this many steps in total (0: run all epochs); for smoke tests and benchmarks."""
    progress: bool | None = loop.progress()
    """Show a tqdm bar (None: only when stderr is a terminal)."""
    compute: str | None = option(None, choices=list(COMPUTE_MODES), group=PS_GROUP, help=lambda: COMPUTE_HELP)
    """Where the step's forward and backward run (``COMPUTE_MODES``); None: the step
    protocol's, else the server's pin, else ``trainer``."""
    step: str | None = option(None, choices=list(STEP_MODES), group=PS_GROUP, help=lambda: STEP_HELP)
    """How a step reaches the server (``STEP_MODES``, ``psserver.server.steps``); None: the
    default protocol of the compute mode."""
    local_steps: int | None = option(
        None, metavar="H", group=PS_GROUP,
        help=f"--step diloco: inner steps per window, after which the pseudo-gradient goes to the server (given, "
             f"--step is diloco; left out, a trainer of a server of --update diloco takes {DEFAULT_LOCAL_STEPS})")
    """DiLoCo's H: inner steps between two syncs (``--step diloco``); None: ``DEFAULT_LOCAL_STEPS``
    against a server of ``--update diloco``. Giving it asks for ``--step diloco``."""
    inner_optimizer: str = option(
        "adamw", metavar="NAME", group=PS_GROUP,
        help="--step diloco: the trainer's own optimizer of its local steps, any of torch.optim by name; its state "
             "stays on the trainer (default {default})")
    """The inner optimizer of ``--step diloco`` (a ``torch.optim`` class by name), built over the
    replica's parameters; its state never leaves the trainer."""
    inner_lr: float = option(1e-3, metavar="LR", group=PS_GROUP,
                             help="--step diloco: learning rate of the inner optimizer (default {default})")
    """Learning rate of the inner optimizer."""
    inner_weight_decay: float = option(0.0, metavar="WD", group=PS_GROUP,
                                       help="--step diloco: weight decay of the inner optimizer (default {default}; "
                                            "DiLoCo's AdamW takes 0.1)")
    """Weight decay of the inner optimizer (decoupled for adamw)."""
    inner_optimizer_args: dict = option(
        factory=dict, metavar="JSON", group=PS_GROUP, show=lambda value: "none",
        help='--step diloco: the inner optimizer\'s other keyword arguments, a JSON object ({"betas": [0.9, 0.95]})')
    """The inner optimizer's other keyword arguments, as ``--optimizer-args`` takes the server's."""
    compress: str = option(
        "none", choices=list(COMPRESSIONS), group=PS_GROUP,
        help="--step diloco: the pseudo-gradient on the wire: none (the --wire-dtype), int8 or int4 (blockwise, one "
             "fp32 scale per 256 values, the rounding carried into the next sync; default {default})")
    """How a DiLoCo pseudo-gradient travels (``COMPRESSIONS``): quantized with error feedback
    (``psserver.common.quantize``), or as the wire dtype."""
    fragments: int = option(
        1, metavar="F", group=PS_GROUP,
        help="--step diloco: streaming DiLoCo, the model's parameters in F fragments each synced every H inner steps "
             "on a staggered schedule, one on the wire at a time (default {default}: the whole model at once)")
    """Streaming DiLoCo's fragments (``psserver.common.fragments``): 1 syncs the whole model
    every H steps; F > 1 syncs fragment f at inner step f*H/F of each window."""
    fragment_overlap: int | None = option(
        None, metavar="TAU", group=PS_GROUP,
        help="--fragments: inner steps a fragment's sync runs under before its global weights are merged in "
             "(0: wait for them; left out, 1; below H/F)")
    """Inner steps taken while a fragment's sync is in flight (None: 1); 0 waits for the reply."""
    fragment_mix: float | None = option(
        None, metavar="ALPHA", group=PS_GROUP,
        help="--fragments with an overlap: the share of the trainer's own weights kept when a fragment's global "
             "weights arrive (left out, 0.5)")
    """Merging factor: local <- alpha * local + (1 - alpha) * global (None: 0.5); with no overlap
    the global weights replace the local ones."""
    stats_out: Path | None = option(None, group=PS_GROUP, help="write per-step timings as JSON (for benchmarks)")
    """Write per-step timings (monotonic end time of each step, samples) as JSON here."""
    join_token_file: Path | None = option(
        None, group=PS_GROUP, help=f"file holding the job's join token, for a server that asks for one (else "
                             f"${JOIN_TOKEN_ENV})")
    """File holding the job's join token (else ``$PSSERVER_JOIN_TOKEN``), for a server that
    asks for one."""
    loss: str | None = option(
        None, group=PS_GROUP, metavar="NAME|MODULE:ATTR",
        help="training loss: cross_entropy, mse, bce, or MODULE:ATTR (a callable (output, target) -> scalar, or an "
             "nn.Module class made without arguments); default: the model's (cross_entropy for a MODULE:ATTR model)")
    """The training loss (``--loss``): a name of ``psserver.models.losses.LOSSES`` or
    ``MODULE:ATTR``, a callable ``(output, target) -> scalar`` or an ``nn.Module`` class
    (instantiated without arguments); None: the model spec's (cross-entropy for a user's model).
    The protocols take it from ``psserver.models.losses.resolve_loss(loss, spec.loss)``."""
    metric: str | None = option(
        None, group=PS_GROUP, metavar="NAME|MODULE:ATTR",
        help="held-out metric printed at the end: accuracy, rmse, auc, loss (mean held-out loss) or MODULE:ATTR (a "
             "callable (outputs, targets) -> float over the whole held-out set); default: the model's (accuracy for "
             "a MODULE:ATTR model)")
    """The held-out metric printed at the end (``--metric``): ``accuracy``, ``rmse``, ``auc``,
    ``loss`` (the mean held-out loss under the training loss) or ``MODULE:ATTR``, a callable
    ``(outputs, targets) -> float`` over the whole held-out set; None: the model spec's."""

    def __post_init__(self) -> None:
        from psserver.models import get_model_spec
        from psserver.models.losses import resolve_loss
        from psserver.utils.eval_metrics import resolve_metric

        check_token_file(self.join_token_file, "--join-token-file")
        check_choices(self)
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
        loop.check_loop(self)
        check_timeout(self.connect_timeout, "--connect-timeout", MIN_CONNECT_TIMEOUT_S)
        check_timeout(self.rpc_timeout, "--rpc-timeout", MIN_RPC_TIMEOUT_S)
        self._check_diloco()
        if self.step is not None:
            mode = STEP_MODES[self.step].compute
            if self.compute is not None and self.compute != mode:
                raise ValueError(f"--step {self.step} is a protocol of --compute {mode}, not --compute {self.compute}")
            object.__setattr__(self, "compute", mode)
        check_device(self.device, "--device")
        if not 0 <= self.compute_threads <= MAX_THREADS:
            raise ValueError(f"--compute-threads must be in 0..{MAX_THREADS}, got {self.compute_threads}")
        if not isinstance(self.bucket_cap_mb, int | float) or not math.isfinite(self.bucket_cap_mb) \
                or not 0 < self.bucket_cap_mb <= MAX_BUCKET_CAP_MB:
            raise ValueError(f"--bucket-cap-mb must be a number in (0, {MAX_BUCKET_CAP_MB}], got {self.bucket_cap_mb}")
        if self.overlap == "on" and (self.compute == "server" or self.step not in (None, "pushpull")):
            raise ValueError("--overlap on is for --step pushpull (the trainer computes its steps)")
        if self.transport in ("device-map", "staged") and not self.device.startswith("cuda"):
            raise ValueError(f"--transport {self.transport} needs a trainer on a GPU (--device cuda:N)")
        if self.wire_dtype != "fp32" and self.compute == "server":
            raise ValueError("--wire-dtype applies to --compute trainer (server compute sends batches)")
        if self.device != "cpu" and self.compute == "server":
            raise ValueError("--device applies to --compute trainer (server compute runs on the server's devices)")
        check_output_file(self.stats_out, "--stats-out")

    def _check_diloco(self) -> None:
        if self.local_steps is not None:
            if isinstance(self.local_steps, bool) or not isinstance(self.local_steps, int) or self.local_steps < 1:
                raise ValueError(f"--local-steps must be an integer >= 1, got {self.local_steps!r}")
            if self.step not in (None, "diloco"):
                raise ValueError(f"--local-steps is for --step diloco, not --step {self.step}")
            object.__setattr__(self, "step", "diloco")
        f, tau, alpha = self.fragments, self.fragment_overlap, self.fragment_mix
        if isinstance(f, bool) or not isinstance(f, int) or f < 1:
            raise ValueError(f"--fragments must be an integer >= 1, got {f!r}")
        if (f > 1 or tau is not None or alpha is not None) and self.step not in (None, "diloco"):
            raise ValueError(f"--fragments is for --step diloco, not --step {self.step}")
        if (tau is not None or alpha is not None) and f == 1:
            raise ValueError("--fragment-overlap and --fragment-mix are for --fragments 2 or more")
        if f > 1:
            object.__setattr__(self, "step", "diloco")
        if tau is not None and (isinstance(tau, bool) or not isinstance(tau, int) or tau < 0):
            raise ValueError(f"--fragment-overlap must be an integer >= 0, got {tau!r}")
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float)
                                  or not 0 <= alpha < 1):
            raise ValueError(f"--fragment-mix must be a number in [0, 1), got {alpha!r}")
        if self.compress != "none" and self.step not in (None, "diloco"):
            raise ValueError(f"--compress {self.compress} is for --step diloco (its pseudo-gradient), not --step "
                             f"{self.step}")
        try:
            optimizer_class(self.inner_optimizer)
        except ValueError as e:
            raise ValueError(f"--inner-optimizer: {e}") from None
        if isinstance(self.inner_lr, bool) or not isinstance(self.inner_lr, int | float) \
                or not math.isfinite(self.inner_lr) or not self.inner_lr > 0:
            raise ValueError(f"--inner-lr must be a positive number, got {self.inner_lr!r}")
        wd = self.inner_weight_decay
        if isinstance(wd, bool) or not isinstance(wd, int | float) or not math.isfinite(wd) or wd < 0:
            raise ValueError(f"--inner-weight-decay must be a number >= 0, got {wd!r}")
        try:
            self.inner_optimizer_config  # noqa: B018 - built once here: its arguments checked before any step
        except ValueError as e:
            raise ValueError(str(e).replace("--optimizer-args", "--inner-optimizer-args")
                             .replace("--weight-decay", "--inner-weight-decay")) from None

    @property
    def inner_optimizer_config(self) -> OptimizerConfig:
        """The inner optimizer of ``--step diloco`` (``--inner-optimizer``, ``--inner-lr``)."""
        return OptimizerConfig(name=self.inner_optimizer, lr=float(self.inner_lr),
                               weight_decay=self.inner_weight_decay, args=dict(self.inner_optimizer_args))

    def join_token(self) -> str | None:
        """The join token, read once at start (``ValueError``: an empty or unreadable file)."""
        return read_join_token(self.join_token_file)
