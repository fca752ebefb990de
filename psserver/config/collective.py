"""Configuration of ``psserver train --mode ddp|fsdp`` (collective training, no parameter server).

Everything that can be checked without a process group is checked in ``__post_init__``:
a bad combination fails with one readable line before any worker starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from psserver.config import loop
from psserver.config.common import (
    DataConfig,
    check_host,
    check_output_dir,
    check_output_file,
    check_port,
    check_seed,
)
from psserver.config.control import ControlConfig, ObservabilityConfig
from psserver.config.optimizer import OptimizerConfig
from psserver.config.options import option

MODES = ("ddp", "fsdp")
RUN_GROUP = "collective training (--mode ddp|fsdp)"
BACKENDS = ("auto", "nccl", "gloo")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd", "powersgd+fp16", "post-localsgd")
MIXED_PRECISION = ("none", "bf16", "fp16")
# Hooks that all-reduce in a reduced-precision dtype, and the backends known to reduce it.
# gloo reduces float16 and bfloat16 since torch 2.x (checked in torch 2.14.1); MPI does not.
_LOW_PRECISION_BACKENDS = {"fp16": ("nccl", "gloo"), "bf16": ("nccl", "gloo")}
NCCL_ENV = {
    "nccl_nsocks_perthread": "NCCL_NSOCKS_PERTHREAD",
    "nccl_socket_nthreads": "NCCL_SOCKET_NTHREADS",
    "nccl_min_nchannels": "NCCL_MIN_NCHANNELS",
}
NCCL_MAX = {"nccl_nsocks_perthread": 64, "nccl_socket_nthreads": 16, "nccl_min_nchannels": 64}
"""NCCL's own limits (its environment-variable documentation): 1 to 16 socket threads, at most 64
sockets per connection (NSOCKS_PERTHREAD x SOCKET_NTHREADS); channels: NCCL clamps the minimum to
its MAXCHANNELS (32 or 64 in NCCL 2.x). A larger value (10^20 was accepted) only reached NCCL."""
NCCL_MAX_SOCKETS = 64
WORKERS_PER_DEVICE = 4
"""``--nproc-per-node`` is at most this many workers per CPU core or GPU of the host (and at
least :data:`MIN_NPROC_LIMIT`): each worker is a whole process with its own torch and model,
so 100000 spawned until the host ran out of memory or process ids."""
MIN_NPROC_LIMIT = 16


def max_nproc_per_node() -> int:
    """The most workers ``--nproc-per-node`` may spawn here (see :data:`WORKERS_PER_DEVICE`)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    import torch

    return max(MIN_NPROC_LIMIT, WORKERS_PER_DEVICE * max(cores, torch.cuda.device_count()))


@dataclass
class DDPOptions:
    """Knobs of ``torch.nn.parallel.DistributedDataParallel`` (the ones Lightning's DDPStrategy documents)."""

    static_graph: bool = option(False, help="the graph is the same every step")
    """The graph (used parameters, their order) is the same every step: DDP can skip re-discovery."""
    gradient_as_bucket_view: bool = option(
        False, help="gradients are views into the all-reduce buckets (less memory, one copy fewer)")
    """Gradients are views into the all-reduce buckets: saves one copy and peak memory."""
    bucket_cap_mb: float = loop.bucket_cap_mb()
    """All-reduce bucket size in MiB (DDP's default is 25)."""
    find_unused_parameters: bool = option(
        False, help="look for parameters without gradients every step (slower)")
    """Traverse the autograd graph each step to find parameters without a gradient."""
    comm_hook: str = option("none", help=f"communication hook: {', '.join(COMM_HOOKS)} (default {{default}})")
    """Gradient communication hook: none, fp16, bf16, powersgd, powersgd+fp16, post-localsgd."""
    powersgd_rank: int = option(1, help="PowerSGD matrix approximation rank (default {default})")
    """PowerSGD ``matrix_approximation_rank`` (>= 1; higher: more accurate, more bytes)."""
    powersgd_start_iter: int = option(
        2, help="plain all-reduce before this step, PowerSGD after (default {default}, minimum 2)")
    """Plain all-reduce for the first N steps, PowerSGD after (>= 2 with error feedback)."""
    localsgd_start_iter: int = option(
        8, help="post-local-SGD: global all-reduce before this step (default {default})")
    """Post-local-SGD: global gradient all-reduce for the first N steps, local SGD after."""
    model_averaging_period: int = option(
        4, help="post-local-SGD: average parameters every N steps (default {default})")
    """Post-local-SGD: average the parameters of all ranks every N steps (PeriodicModelAverager)."""
    localsgd_group_size: int | None = option(
        None, help="post-local-SGD: ranks per gradient subgroup after warm-up (default: per node; 1: none)")
    """Post-local-SGD: ranks per gradient-averaging subgroup after the warm-up (None: one per
    node, PyTorch's default; 1: purely local steps between parameter averagings)."""

    def __post_init__(self) -> None:
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"unknown --comm-hook {self.comm_hook!r}; known: {', '.join(COMM_HOOKS)}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"--bucket-cap-mb must be positive, got {self.bucket_cap_mb:g}")
        if self.powersgd_rank < 1:
            raise ValueError(f"--powersgd-rank must be >= 1, got {self.powersgd_rank}")
        if self.powersgd_start_iter < 2:
            raise ValueError(
                f"--powersgd-start-iter must be >= 2 (PowerSGD's error feedback needs two plain steps), "
                f"got {self.powersgd_start_iter}"
            )
        if self.localsgd_start_iter < 1:
            raise ValueError(f"--localsgd-start-iter must be >= 1, got {self.localsgd_start_iter}")
        if self.model_averaging_period < 1:
            raise ValueError(f"--model-averaging-period must be >= 1, got {self.model_averaging_period}")
        if self.localsgd_group_size is not None and self.localsgd_group_size < 1:
            raise ValueError(f"--localsgd-group-size must be >= 1, got {self.localsgd_group_size}")


@dataclass
class FSDPOptions:
    """Knobs of FSDP2 (``torch.distributed.fsdp.fully_shard``) and of tensor parallelism."""

    reshard_after_forward: bool = option(
        True, help="free gathered parameters after forward (default: {default}; --no-... keeps them, ZeRO-2)")
    """Free the gathered parameters after forward (ZeRO-3); False keeps them until backward (ZeRO-2)."""
    mixed_precision: str = option("none", help=f"{', '.join(MIXED_PRECISION)} (default {{default}})")
    """Compute in bf16 or fp16 with fp32 master weights (``MixedPrecisionPolicy``), or none."""
    tp_size: int = option(
        1, help="tensor-parallel degree: 2-D mesh, TP inside groups of T ranks, FSDP across (llama_tiny; default "
                "{default})")
    """Tensor-parallel degree: a 2-D mesh (dp = world / tp, tp) with TP inside each group."""

    def __post_init__(self) -> None:
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"unknown --mixed-precision {self.mixed_precision!r}; known: {', '.join(MIXED_PRECISION)}"
            )
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")


@dataclass
class CollectiveCheckpointConfig:
    """Sharded checkpoints with ``torch.distributed.checkpoint`` (one directory per save)."""

    directory: Path | None = option(None, flag="--checkpoint-dir", help="directory of step-N/ checkpoints")
    """Directory of ``step-N/`` checkpoints; None: no checkpoints."""
    every_steps: int = option(0, flag="--checkpoint-every", help="save every N steps (default {default}: at the end)")
    """Save every N steps (0: only at the end of training)."""
    keep: int = option(3, flag="--keep-checkpoints", help="keep the newest N (default {default})")
    """Keep the newest N complete checkpoints."""
    resume: str | None = option(
        None, const="latest", metavar="PATH",
        help="resume from the newest complete checkpoint in --checkpoint-dir, or from PATH")
    """``latest`` (newest complete checkpoint in ``directory``) or a ``step-N`` directory."""

    def __post_init__(self) -> None:
        if self.directory is not None:
            self.directory = Path(self.directory)
            check_output_dir(self.directory, "--checkpoint-dir")
        if self.every_steps < 0:
            raise ValueError(f"--checkpoint-every must be >= 0, got {self.every_steps}")
        if self.keep < 1:
            raise ValueError(f"--keep-checkpoints must be >= 1, got {self.keep}")
        if self.resume == "latest" and self.directory is None:
            raise ValueError("--resume without a path needs --checkpoint-dir")
        if self.resume not in (None, "latest") and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume}: no such checkpoint directory")


@dataclass
class LaunchConfig:
    """Where the processes come from: torchrun's environment or our own spawn."""

    nproc_per_node: int | None = option(
        None, help="standalone: spawn N workers on this host (not under torchrun, which has its own)")
    """Spawn this many workers here (standalone); None: one process, or torchrun's."""
    master_addr: str = option(
        "127.0.0.1", help="standalone: rendezvous address (default {default}; torchrun: $MASTER_ADDR)")
    """Rendezvous address of a standalone launch (torchrun: $MASTER_ADDR)."""
    master_port: int = option(
        0, help="standalone: rendezvous port (default {default}: a free one; torchrun: $MASTER_PORT)")
    """Rendezvous port of a standalone launch (0: a free one, picked at launch; torchrun: $MASTER_PORT)."""
    backend: str = option(
        "auto", help=f"process-group backend: {', '.join(BACKENDS)} (default {{default}}: nccl on GPU, else gloo)")
    """``auto`` (nccl when CUDA is available, else gloo), ``nccl`` or ``gloo``."""
    world_size: int = 1
    """Number of processes in the job (resolved from torchrun's env or ``nproc_per_node``)."""
    under_torchrun: bool = False
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* come from torchrun (or any env:// launcher)."""
    nccl_nsocks_perthread: int | None = option(
        None, help="NCCL_NSOCKS_PERTHREAD: sockets per helper thread (TCP transport; set before the process group "
                   "starts, GPU only)")
    """Sets NCCL_NSOCKS_PERTHREAD (sockets per NCCL helper thread, TCP transport) before init."""
    nccl_socket_nthreads: int | None = option(
        None, help="NCCL_SOCKET_NTHREADS: CPU helper threads per connection (TCP transport)")
    """Sets NCCL_SOCKET_NTHREADS (CPU helper threads per NCCL connection) before init."""
    nccl_min_nchannels: int | None = option(None, help="NCCL_MIN_NCHANNELS: minimum number of channels (rings/trees)")
    """Sets NCCL_MIN_NCHANNELS (minimum rings/trees NCCL uses) before init."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown --backend {self.backend!r}; known: {', '.join(BACKENDS)}")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nproc_per_node is not None and self.nproc_per_node > (limit := max_nproc_per_node()):
            raise ValueError(f"--nproc-per-node {self.nproc_per_node} is more than this host can run: at most {limit} "
                             f"({WORKERS_PER_DEVICE} per CPU core or GPU, at least {MIN_NPROC_LIMIT})")
        if self.nproc_per_node is not None and self.under_torchrun:
            raise ValueError("--nproc-per-node is for standalone runs; under torchrun use torchrun's own flag")
        if not self.under_torchrun:  # torchrun's MASTER_ADDR is torchrun's to check
            check_host(self.master_addr, "--master-addr")
        check_port(self.master_port, "--master-port", allow_zero=True)
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        for attr, env in NCCL_ENV.items():
            value = getattr(self, attr)
            if value is not None and not 1 <= value <= NCCL_MAX[attr]:
                raise ValueError(f"--{attr.replace('_', '-')} ({env}) must be in 1..{NCCL_MAX[attr]}, got {value}")
        if self.nccl_nsocks_perthread and self.nccl_socket_nthreads and \
                self.nccl_nsocks_perthread * self.nccl_socket_nthreads > NCCL_MAX_SOCKETS:
            raise ValueError(f"--nccl-nsocks-perthread x --nccl-socket-nthreads must be at most {NCCL_MAX_SOCKETS} "
                             f"(NCCL's limit), got {self.nccl_nsocks_perthread} x {self.nccl_socket_nthreads}")

    def resolved_backend(self, cuda_available: bool) -> str:
        """The backend to use; ``ValueError`` for nccl without a GPU."""
        if self.backend == "auto":
            return "nccl" if cuda_available else "gloo"
        if self.backend == "nccl" and not cuda_available:
            raise ValueError("--backend nccl needs CUDA GPUs and none is available (use gloo on CPU)")
        return self.backend

    def nccl_env(self) -> dict[str, str]:
        """The NCCL_* variables the flags set (only those given)."""
        return {env: str(getattr(self, attr)) for attr, env in NCCL_ENV.items() if getattr(self, attr) is not None}


@dataclass
class CollectiveConfig:
    """``psserver train --mode ddp|fsdp``: collective data-parallel training."""

    mode: str = "ddp"
    """``ddp`` (replicated model, all-reduced gradients) or ``fsdp`` (sharded with FSDP2)."""
    model: str = option(loop.COLLECTIVE_MODEL, help=None)
    """A model name (entry point of ``psserver.models``) or ``MODULE:ATTR``."""
    model_args: dict = option(factory=dict, help=None)
    """Keyword arguments of the model's class or function (``--model-args JSON``)."""
    seed: int = option(0, group=RUN_GROUP,
                       help="seed of the initial parameters, the same on every rank (default {default})")
    """Seed of the initial parameters (the same on every rank)."""
    epochs: int = loop.epochs()
    """Passes over the training set (each rank sees 1/world of it per epoch)."""
    batch_size: int = loop.batch_size()
    """Samples per step per rank."""
    eval_batch_size: int = loop.eval_batch_size()
    """Batch size of the final evaluation on rank 0."""
    max_steps: int = loop.max_steps()
    """Stop after this many steps in total (0: run all epochs)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Local optimizer of each rank (adam, lr 1e-3 by default)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and split."""
    compute_threads: int = loop.compute_threads()
    """torch intra-op threads per process (0: cores / local processes)."""
    progress: bool | None = loop.progress()
    """tqdm bar on rank 0 (None: only on a terminal)."""
    result_file: str | None = option(
        None, group=RUN_GROUP,
        help="write a JSON summary per rank ({rank} in the name is replaced); for scripts and tests")
    """Write a JSON summary per rank here (``{rank}`` is replaced); for tests and scripts."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Process launch and backend."""
    ddp: DDPOptions = field(default_factory=DDPOptions)
    """DDP knobs (mode ddp)."""
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    """FSDP knobs (mode fsdp)."""
    checkpoint: CollectiveCheckpointConfig = field(default_factory=CollectiveCheckpointConfig)
    """Sharded checkpoints."""
    control: ControlConfig = field(default_factory=lambda: ControlConfig(enabled=True))
    """gRPC control plane served by rank 0."""
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    """Prometheus endpoint and TensorBoard."""

    def __post_init__(self) -> None:
        check_seed(self.seed, "--seed")
        if self.result_file:
            try:
                first = self.result_file.format(rank=0)
            except (KeyError, IndexError, ValueError):
                raise ValueError(f"--result-file {self.result_file!r}: {{rank}} is the one field it may hold") from None
            check_output_file(first, "--result-file")
        # Imported here: the model registry needs torch, which the CLI's parser does not.
        from psserver.models import get_model_spec

        if self.mode not in MODES:
            raise ValueError(f"unknown --mode {self.mode!r}; collective modes: {', '.join(MODES)}")
        spec = get_model_spec(self.model, self.model_args)
        loop.check_loop(self)
        if self.compute_threads < 0:
            raise ValueError("--compute-threads must be >= 0")
        self._check_combinations(spec)

    def _check_combinations(self, spec) -> None:
        launch, ddp, fsdp = self.launch, self.ddp, self.fsdp
        if self.mode == "fsdp" and ddp != DDPOptions():
            raise ValueError("DDP flags (--comm-hook, --static-graph, --bucket-cap-mb, ...) need --mode ddp")
        if self.mode == "ddp" and fsdp != FSDPOptions():
            raise ValueError("FSDP flags (--tp-size, --mixed-precision, --no-reshard-after-forward) need --mode fsdp")
        if fsdp.tp_size > 1:
            if launch.world_size % fsdp.tp_size:
                raise ValueError(
                    f"world size {launch.world_size} is not divisible by --tp-size {fsdp.tp_size}"
                )
            if spec.tp_plan is None:
                from psserver.models import model_names, resolve_model

                planned = ", ".join(n for n in model_names() if resolve_model(n).tp_plan is not None)
                raise ValueError(f"--tp-size needs a model with a tensor-parallel plan ({planned}), not {spec.name!r}")
            if spec.tp_max_degree is not None and spec.tp_max_degree % fsdp.tp_size:
                raise ValueError(
                    f"--tp-size {fsdp.tp_size} must divide the {spec.tp_max_degree} attention heads of {spec.name}"
                )
        import torch

        backend = launch.resolved_backend(torch.cuda.is_available())
        wire = {"fp16": "fp16", "bf16": "bf16", "powersgd+fp16": "fp16"}.get(ddp.comm_hook)
        if wire is not None and backend not in _LOW_PRECISION_BACKENDS[wire]:
            raise ValueError(f"--comm-hook {ddp.comm_hook} is not supported on backend {backend}")
        if ddp.localsgd_group_size is not None:
            if ddp.comm_hook != "post-localsgd":
                raise ValueError("--localsgd-group-size needs --comm-hook post-localsgd")
            if launch.world_size % ddp.localsgd_group_size:
                raise ValueError(f"world size {launch.world_size} is not divisible by --localsgd-group-size "
                                 f"{ddp.localsgd_group_size}")
        ck = self.checkpoint
        if ck.resume not in (None, "latest") and ck.directory is None:
            ck.directory = Path(ck.resume).parent

    @property
    def local_world_size(self) -> int:
        """Processes on this node (torchrun's LOCAL_WORLD_SIZE, else our own spawn count)."""
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if self.launch.under_torchrun and env:
            return int(env)
        return self.launch.nproc_per_node or 1
