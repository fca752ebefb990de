"""``psserver serve``: the long-running parameter server."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from psserver.cli.args import add_control_arguments, add_optimizer_arguments, control_from_args, optimizer_from_args
from psserver.cli.base import SubCommand, config_errors
from psserver.cli.builder import add_options, build, given
from psserver.config import (
    CheckpointConfig,
    EmbeddingConfig,
    LRScheduleConfig,
    MemoryStateConfig,
    OptimizerConfig,
    ServerConfig,
)
from psserver.config.env import server_rank_from_env
from psserver.config.options import field_default
from psserver.config.server import DEFAULT_STATE_DIR, outer_optimizer


class ServeCommand(SubCommand):
    name = "serve"
    help = "run the parameter server (RPC rank 0) until SIGINT/SIGTERM"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_options(parser, ServerConfig)
        add_optimizer_arguments(parser, defaults_from_server=False)
        add_options(parser, LRScheduleConfig, "learning-rate schedule", SCHEDULE_DESCRIPTION)
        add_options(parser, EmbeddingConfig, "embedding tables (models with tables: mf, dlrm_tiny)")
        add_options(parser, CheckpointConfig, "checkpoints")
        add_options(parser, MemoryStateConfig, "state in shared memory")
        add_control_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        with config_errors():
            config = server_config_from_args(args)
        if config.supervise:
            from psserver.server.state.supervisor import supervise

            # A partition server that lost server 0 exits 3: restarted, it waits for server 0 to be
            # back and continues from its state in memory (kept by this process's key).
            return supervise(args.argv, config.max_restarts, resume=config.checkpoint.directory is not None,
                             state=config.memory_state, restart_codes=(3,) if config.server_rank > 0 else ())
        from psserver.server.server import run_server  # (imports torch: what a standby has done ahead)
        from psserver.server.state.supervisor import STANDBY_ENV, standby_wait

        if os.environ.get(STANDBY_ENV) and not standby_wait():
            return 0
        return run_server(config)


SCHEDULE_DESCRIPTION = (
    "stepped once per optimizer update of the server (its global step; a sync round is one), in every --update mode, "
    "from --lr; checkpoints keep it and --resume continues it (another schedule given at --resume takes over at the "
    "resumed step, as if it had run from step 0). The embedding tables' rows keep --embedding-lr.")


def default_server_rank() -> int:
    """``--server-rank``'s default: where launchers say it, else ``ServerConfig.server_rank``."""
    return server_rank_from_env(field_default(ServerConfig, "server_rank"))


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    control, obs = control_from_args(args)
    several = args.num_servers > 1
    return build(
        ServerConfig, args,
        server_rank=args.server_rank if several else 0,
        coordinator=args.coordinator if several and args.server_rank > 0 else None,
        optimizer=outer_optimizer(args.outer, args.sync_trainers, **given(OptimizerConfig, args))
        if args.update == "diloco" else optimizer_from_args(args),
        lr_schedule=build(LRScheduleConfig, args),
        checkpoint=build(CheckpointConfig, args),
        memory_state=memory_state_from_args(args),
        embedding=build(EmbeddingConfig, args),
        control=control,
        observability=obs,
    )


def memory_state_from_args(args: argparse.Namespace) -> MemoryStateConfig:
    """``--state-dir DIR|off``: off (or none) keeps the state in the process; left out, a
    ``--supervise`` server keeps it in :data:`DEFAULT_STATE_DIR`."""
    directory = args.state_dir
    if directory is None and args.supervise:
        directory = DEFAULT_STATE_DIR
    if directory is not None and directory.strip().lower() in ("off", "none", ""):
        directory = None
    return build(MemoryStateConfig, args, directory=Path(directory) if directory else None)
