"""Flags of ``psserver train --mode ddp|fsdp`` and the ``CollectiveConfig`` built from them.

Shared flags (--model, --epochs, --batch-size, --bucket-cap-mb, optimizer, data, --max-steps,
--no-progress) come from ``psserver.cli.train`` and ``psserver.cli.args``; the ones here, and the
control plane's, are collective-only (``COLLECTIVE_GROUPS``, ``psserver.cli.modes``). Every
combination that can be checked without a process group is checked
(by ``CollectiveConfig``) before any worker starts: one line, exit code 2. Running the
workers is ``psserver.collective.run.run_collective``.

Control plane: rank 0 serves the same gRPC control plane as ``psserver serve``, by default on
127.0.0.1:50051 like the server, so ``psserver status`` works unchanged for both modes. A
training run does not fail for its control plane: when the port is taken (a parameter
server on the same host, say) it logs a warning and trains on. ``--control-port 0`` picks a
free port (logged), ``--no-control`` turns it off.
"""

from __future__ import annotations

import argparse

from psserver.cli.args import (
    CONTROL_GROUP,
    METRICS_GROUP,
    control_from_args,
    data_from_args,
    model_args_from_args,
    optimizer_from_args,
    path_arg,
)
from psserver.cli.modes import COLLECTIVE, DDP, FSDP
from psserver.config import OptimizerConfig
from psserver.config.collective import (
    BACKENDS,
    COMM_HOOKS,
    MIXED_PRECISION,
    CollectiveCheckpointConfig,
    CollectiveConfig,
    DDPOptions,
    FSDPOptions,
    LaunchConfig,
)
from psserver.config.env import launcher_env
from psserver.errors import UsageError

RUN_GROUP = "collective training (--mode ddp|fsdp)"
LAUNCH_GROUP = "collective launch (--mode ddp|fsdp)"
DDP_GROUP = "DDP (--mode ddp)"
FSDP_GROUP = "FSDP (--mode fsdp)"
CHECKPOINT_GROUP = "collective checkpoints (--mode ddp|fsdp)"
COLLECTIVE_GROUPS: dict[str, frozenset[str]] = {
    RUN_GROUP: COLLECTIVE, LAUNCH_GROUP: COLLECTIVE, DDP_GROUP: frozenset({DDP}), FSDP_GROUP: frozenset({FSDP}),
    CHECKPOINT_GROUP: COLLECTIVE, CONTROL_GROUP: COLLECTIVE, METRICS_GROUP: COLLECTIVE,
}
"""The modes of each argument group of ``psserver train`` that is not common to all
(``psserver.cli.modes``): the control plane of a ``--mode ps`` job is its server's."""
LOSS_IS_PS = ("--loss and --metric apply to --mode ps (--mode {mode} trains with cross-entropy and reports "
              "accuracy)")


def add_collective_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the collective-only flags to ``psserver train``, one group per concern."""
    r = parser.add_argument_group(RUN_GROUP)
    r.add_argument("--seed", type=int, default=CollectiveConfig.seed,
                   help=f"seed of the initial parameters, the same on every rank (default {CollectiveConfig.seed})")
    r.add_argument("--result-file", default=CollectiveConfig.result_file,
                   help="write a JSON summary per rank ({rank} in the name is replaced); for scripts and tests")
    lc = LaunchConfig  # the class: its fields' defaults
    g = parser.add_argument_group(LAUNCH_GROUP, "where the workers come from")
    g.add_argument("--nproc-per-node", type=int, default=lc.nproc_per_node,
                   help="standalone: spawn N workers on this host (not under torchrun, which has its own)")
    g.add_argument("--master-addr", default=lc.master_addr,
                   help=f"standalone: rendezvous address (default {lc.master_addr}; torchrun: $MASTER_ADDR)")
    g.add_argument("--master-port", type=int, default=lc.master_port,
                   help=f"standalone: rendezvous port (default {lc.master_port}: a free one; torchrun: $MASTER_PORT)")
    g.add_argument("--backend", default=lc.backend,
                   help=f"process-group backend: {', '.join(BACKENDS)} (default {lc.backend}: nccl on GPU, else gloo)")
    g.add_argument("--nccl-nsocks-perthread", type=int, default=lc.nccl_nsocks_perthread,
                   help="NCCL_NSOCKS_PERTHREAD: sockets per helper thread (TCP transport; set before the "
                        "process group starts, GPU only)")
    g.add_argument("--nccl-socket-nthreads", type=int, default=lc.nccl_socket_nthreads,
                   help="NCCL_SOCKET_NTHREADS: CPU helper threads per connection (TCP transport)")
    g.add_argument("--nccl-min-nchannels", type=int, default=lc.nccl_min_nchannels,
                   help="NCCL_MIN_NCHANNELS: minimum number of channels (rings/trees)")
    o = DDPOptions
    d = parser.add_argument_group(DDP_GROUP, "and --bucket-cap-mb above")
    d.add_argument("--static-graph", action="store_true", help="the graph is the same every step")
    d.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="gradients are views into the all-reduce buckets (less memory, one copy fewer)")
    d.add_argument("--find-unused-parameters", action="store_true",
                   help="look for parameters without gradients every step (slower)")
    d.add_argument("--comm-hook", default=o.comm_hook,
                   help=f"communication hook: {', '.join(COMM_HOOKS)} (default {o.comm_hook})")
    d.add_argument("--powersgd-rank", type=int, default=o.powersgd_rank,
                   help=f"PowerSGD matrix approximation rank (default {o.powersgd_rank})")
    d.add_argument("--powersgd-start-iter", type=int, default=o.powersgd_start_iter,
                   help=f"plain all-reduce before this step, PowerSGD after (default {o.powersgd_start_iter}, "
                        "minimum 2)")
    d.add_argument("--localsgd-start-iter", type=int, default=o.localsgd_start_iter,
                   help=f"post-local-SGD: global all-reduce before this step (default {o.localsgd_start_iter})")
    d.add_argument("--model-averaging-period", type=int, default=o.model_averaging_period,
                   help=f"post-local-SGD: average parameters every N steps (default {o.model_averaging_period})")
    d.add_argument("--localsgd-group-size", type=int, default=o.localsgd_group_size,
                   help="post-local-SGD: ranks per gradient subgroup after warm-up (default: per node; 1: none)")
    fo = FSDPOptions
    f = parser.add_argument_group(FSDP_GROUP, "FSDP2 (fully_shard), optionally with tensor parallelism")
    f.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=fo.reshard_after_forward,
                   help="free gathered parameters after forward (default: "
                        f"{'yes' if fo.reshard_after_forward else 'no'}; --no-... keeps them, ZeRO-2)")
    f.add_argument("--mixed-precision", default=fo.mixed_precision,
                   help=f"{', '.join(MIXED_PRECISION)} (default {fo.mixed_precision})")
    f.add_argument("--tp-size", type=int, default=fo.tp_size,
                   help="tensor-parallel degree: 2-D mesh, TP inside groups of T ranks, FSDP across (llama_tiny; "
                        f"default {fo.tp_size})")
    ck = CollectiveCheckpointConfig
    c = parser.add_argument_group(CHECKPOINT_GROUP, "torch.distributed.checkpoint, sharded")
    c.add_argument("--checkpoint-dir", type=path_arg, default=ck.directory, help="directory of step-N/ checkpoints")
    c.add_argument("--checkpoint-every", type=int, default=ck.every_steps,
                   help=f"save every N steps (default {ck.every_steps}: at the end)")
    c.add_argument("--keep-checkpoints", type=int, default=ck.keep, help=f"keep the newest N (default {ck.keep})")
    c.add_argument("--resume", nargs="?", const="latest", default=ck.resume, metavar="PATH",
                   help="resume from the newest complete checkpoint in --checkpoint-dir, or from PATH")


def collective_config_from_args(args: argparse.Namespace) -> CollectiveConfig:
    """Build and validate the configuration (``ValueError``/``UsageError`` on bad input)."""
    from psserver.collective.launcher import under_torchrun  # torch.distributed: not at parser build

    torchrun = under_torchrun()
    if torchrun:
        env = launcher_env()  # RANK, WORLD_SIZE, LOCAL_RANK checked here, each named, before any rendezvous
        world = env.world_size
        if args.rank is not None and args.rank != env.rank:
            raise UsageError(f"--rank {args.rank} contradicts RANK={env.rank} set by the launcher")
    else:
        world = args.nproc_per_node or 1
        if args.rank not in (None, 0):
            raise UsageError("--rank is set by the launcher in collective mode (use --nproc-per-node or torchrun)")
    if getattr(args, "loss", None) is not None or getattr(args, "metric", None) is not None:
        raise UsageError(LOSS_IS_PS.format(mode=args.mode))
    if args.num_trainers is not None and args.num_trainers != world:
        raise UsageError(f"--num-trainers {args.num_trainers} does not match the world size {world} "
                         f"({'WORLD_SIZE' if torchrun else '--nproc-per-node'})")
    control, obs = control_from_args(args)
    return CollectiveConfig(
        mode=args.mode,
        model=args.model or CollectiveConfig.model,
        model_args=model_args_from_args(args),
        seed=args.seed,
        epochs=args.epochs,
        batch_size=args.batch_size,
        eval_batch_size=args.eval_batch_size,
        max_steps=args.max_steps,
        optimizer=optimizer_from_args(args) or OptimizerConfig(),
        data=data_from_args(args),
        compute_threads=args.compute_threads,
        progress=False if args.no_progress else None,
        result_file=args.result_file,
        launch=LaunchConfig(
            nproc_per_node=args.nproc_per_node,
            master_addr=args.master_addr,
            master_port=args.master_port,
            backend=args.backend,
            world_size=world,
            under_torchrun=torchrun,
            nccl_nsocks_perthread=args.nccl_nsocks_perthread,
            nccl_socket_nthreads=args.nccl_socket_nthreads,
            nccl_min_nchannels=args.nccl_min_nchannels,
        ),
        ddp=DDPOptions(
            static_graph=args.static_graph,
            gradient_as_bucket_view=args.gradient_as_bucket_view,
            bucket_cap_mb=args.bucket_cap_mb,
            find_unused_parameters=args.find_unused_parameters,
            comm_hook=args.comm_hook,
            powersgd_rank=args.powersgd_rank,
            powersgd_start_iter=args.powersgd_start_iter,
            localsgd_start_iter=args.localsgd_start_iter,
            model_averaging_period=args.model_averaging_period,
            localsgd_group_size=args.localsgd_group_size,
        ),
        fsdp=FSDPOptions(
            reshard_after_forward=args.reshard_after_forward,
            mixed_precision=args.mixed_precision,
            tp_size=args.tp_size,
        ),
        checkpoint=CollectiveCheckpointConfig(
            directory=args.checkpoint_dir,
            every_steps=args.checkpoint_every,
            keep=args.keep_checkpoints,
            resume=args.resume,
        ),
        control=control,
        observability=obs,
    )
