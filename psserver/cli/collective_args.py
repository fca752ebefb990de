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
    optimizer_from_args,
)
from psserver.cli.builder import add_options, build
from psserver.cli.modes import COLLECTIVE, DDP, FSDP
from psserver.config import OptimizerConfig
from psserver.config.collective import (
    RUN_GROUP,
    CollectiveCheckpointConfig,
    CollectiveConfig,
    DDPOptions,
    FSDPOptions,
    LaunchConfig,
)
from psserver.config.env import launcher_env
from psserver.errors import UsageError

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
    """Add the collective-only flags to ``psserver train``, one group per configuration."""
    add_options(parser, CollectiveConfig, RUN_GROUP)
    add_options(parser, LaunchConfig, LAUNCH_GROUP, "where the workers come from")
    add_options(parser, DDPOptions, DDP_GROUP, "and --bucket-cap-mb above")
    add_options(parser, FSDPOptions, FSDP_GROUP, "FSDP2 (fully_shard), optionally with tensor parallelism")
    add_options(parser, CollectiveCheckpointConfig, CHECKPOINT_GROUP, "torch.distributed.checkpoint, sharded")


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
    return build(
        CollectiveConfig, args, mode=args.mode, optimizer=optimizer_from_args(args) or OptimizerConfig(),
        data=data_from_args(args), launch=build(LaunchConfig, args, world_size=world, under_torchrun=torchrun),
        ddp=build(DDPOptions, args), fsdp=build(FSDPOptions, args), checkpoint=build(CollectiveCheckpointConfig, args),
        control=control, observability=obs,
    )
