"""``psserver train``: a trainer; ``--mode ps`` (default) joins a parameter server,
``--mode ddp|fsdp`` trains with collectives instead (see ``psserver.collective``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from psserver.cli.base import (
    SubCommand,
    add_optimizer_arguments,
    default_rank,
    default_server_address,
    default_world_size,
    optimizer_from_args,
)
from psserver.config.ps import STEP_MODES


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Dataset flags, shared by every training mode and the benchmarks."""
    from psserver.config.common import default_data_dir

    g = parser.add_argument_group("data")
    g.add_argument("--dataset", default="synthetic", help="synthetic (default, no download) or mnist")
    g.add_argument("--data-dir", type=Path, default=None,
                   help=f"directory of MNIST IDX files (default: {default_data_dir()})")
    g.add_argument("--train-split", type=int, default=None,
                   help="train on the first N images of a single split, evaluate on the rest")
    g.add_argument("--download", action="store_true", help="download MNIST with torchvision if missing")
    g.add_argument("--data-seed", type=int, default=0, help="seed of shuffling and synthetic data")


def data_from_args(args: argparse.Namespace):
    from psserver.config import DataConfig

    kwargs = dict(dataset=args.dataset, train_split=args.train_split, download=args.download, seed=args.data_seed)
    if args.data_dir is not None:
        kwargs["data_dir"] = args.data_dir
    return DataConfig(**kwargs)


class TrainCommand(SubCommand):
    name = "train"
    help = "train: join a parameter server (--mode ps) or run DDP/FSDP (--mode ddp|fsdp)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--mode", choices=["ps", "ddp", "fsdp"], default="ps",
                            help="ps: join a parameter server (default); ddp/fsdp: collective training")
        parser.add_argument("--rank", type=int, default=default_rank(),
                            help="trainer rank (default $RANK, $SLURM_PROCID, else 0)")
        parser.add_argument("--server", default=default_server_address(),
                            help="server HOST:PORT (default $MASTER_ADDR:$MASTER_PORT or 127.0.0.1:29500)")
        parser.add_argument("--num-trainers", type=int, default=default_world_size(),
                            help="number of data shards (default $WORLD_SIZE, else learnt from the server)")
        parser.add_argument("--model", default=None,
                            help="model (ps mode: learnt from the server; ddp/fsdp: default mnist_cnn)")
        parser.add_argument("--epochs", type=int, default=1, help="epochs over this trainer's shard")
        parser.add_argument("--batch-size", type=int, default=64, help="samples per step (default 64)")
        add_optimizer_arguments(parser, defaults_from_server=True)
        add_data_arguments(parser)
        parser.add_argument("--connect-timeout", type=float, default=60.0,
                            help="seconds to wait for a server that is still starting (default 60)")
        parser.add_argument("--reconnect", action="store_true",
                            help="if the server goes away, retry with backoff and continue the epoch")
        parser.add_argument("--rpc-timeout", type=float, default=60.0, help="RPC timeout in seconds")
        parser.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0: all epochs)")
        parser.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
        parser.add_argument("--step", choices=STEP_MODES, default="plain",
                            help="ps mode, round trips per step: plain = forward RPC + dist_autograd.backward + "
                                 "DistributedOptimizer.step (3, default); fold = update applied as the server's "
                                 "backward ends (2); chained = the last step's output gradient and the next batch "
                                 "in one RPC (1, loss on the trainer); fused = one RPC, cross-entropy on the server")
        parser.add_argument("--stats-out", type=Path, default=None,
                            help="write per-step timings as JSON (for benchmarks)")
        try:
            from psserver.collective.cli_args import add_collective_arguments
        except ImportError:  # collective mode not installed in this build
            return
        add_collective_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        if args.mode != "ps":
            from psserver.collective.cli_args import run_collective

            return run_collective(args)
        from psserver.config import TrainerConfig, parse_host_port
        from psserver.ps.trainer import run_trainer

        if args.model is not None:
            raise ValueError("--model is chosen by the server in ps mode (psserver serve --model)")
        host, port = parse_host_port(args.server, default_port=29500)
        config = TrainerConfig(
            rank=args.rank if args.rank is not None else 0,
            server_host=host,
            server_port=port,
            num_trainers=args.num_trainers,
            epochs=args.epochs,
            batch_size=args.batch_size,
            optimizer=optimizer_from_args(args),
            data=data_from_args(args),
            connect_timeout=args.connect_timeout,
            reconnect=args.reconnect,
            rpc_timeout=args.rpc_timeout,
            max_steps=args.max_steps,
            progress=False if args.no_progress else None,
            stats_out=args.stats_out,
            step=args.step,
        )
        return run_trainer(config)
