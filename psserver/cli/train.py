"""``psserver train``: a trainer; ``--mode ps`` (default) joins a parameter server,
``--mode ddp|fsdp`` trains with collectives instead (see ``psserver.collective``). One parser
takes both modes' flags; ``--help`` shows the mode's, and the other mode's are refused
(``psserver.cli.modes``). Each default is its config field's (``psserver.cli.defaults``).

A ``--mode ps`` trainer exits 0 when done, 2 for bad input (a rank whose holder is alive), 3
when its server is lost or evicts it (unless ``--reconnect``), 143 / 130 after leaving on
SIGTERM / SIGINT (``psserver.trainer.loop``)."""

from __future__ import annotations

import argparse

from psserver.cli.args import (
    MODEL_HELP,
    add_control_arguments,
    add_data_arguments,
    add_model_args_argument,
    add_optimizer_arguments,
    data_from_args,
    finite_float,
    model_args_from_args,
    optimizer_from_args,
    path_arg,
)
from psserver.cli.base import SubCommand, config_errors
from psserver.cli.collective_args import (
    COLLECTIVE_GROUPS,
    LOSS_IS_PS,
    add_collective_arguments,
    collective_config_from_args,
)
from psserver.cli.modes import DDP, FSDP, MODES, PS, ModeAction, ModeFlags
from psserver.config import CollectiveConfig, TrainerConfig, parse_host_port
from psserver.config.common import MIN_CONNECT_TIMEOUT_S, MIN_RPC_TIMEOUT_S
from psserver.config.env import DEFAULT_SERVER_PORT, default_rank, default_server_address, default_world_size
from psserver.config.ps import COMPUTE_MODES, OVERLAP_MODES, STEP_MODES, TRANSPORTS, WIRE_DTYPES
from psserver.errors import UsageError
from psserver.utils.memory import ALLOCATORS
from psserver.utils.references import parse_json_args

COMPUTE_HELP = ("ps mode, where forward and backward run (default: the server's pin, else trainer): "
                + "; ".join(f"{name} = {line}" for name, line in COMPUTE_MODES.items()))
PS_GROUP = "parameter server (--mode ps)"
STEP_HELP = ("ps mode, how a step crosses (default: the first of its --compute): "
             + "; ".join(f"{name} = [{mode.compute}] {mode.help}" for name, mode in STEP_MODES.items()))


class TrainCommand(SubCommand):
    name = "train"
    help = "train: join a parameter server (--mode ps) or run DDP/FSDP (--mode ddp|fsdp)"

    def __init__(self) -> None:
        self.mode_flags = ModeFlags()

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        t = TrainerConfig  # the class: its fields' defaults
        parser.add_argument("--mode", choices=MODES, default=PS, action=ModeAction, mode_flags=self.mode_flags,
                            help=f"{PS}: join a parameter server; {DDP}/{FSDP}: collective training (default {PS}). "
                                 "--help after it shows that mode's flags")
        parser.add_argument("--model", default=None,
                            help=MODEL_HELP + " (ps mode: default the server's model, else mnist_cnn; ddp/fsdp: "
                                 f"default {CollectiveConfig.model})")
        add_model_args_argument(parser)
        parser.add_argument("--epochs", type=int, default=t.epochs,
                            help=f"epochs over this trainer's shard (default {t.epochs})")
        parser.add_argument("--batch-size", type=int, default=t.batch_size,
                            help=f"samples per step (default {t.batch_size})")
        parser.add_argument("--eval-batch-size", type=int, default=t.eval_batch_size,
                            help=f"samples per batch of the final evaluation (default {t.eval_batch_size})")
        parser.add_argument("--max-steps", type=int, default=t.max_steps,
                            help=f"stop after N steps (default {t.max_steps}: all epochs)")
        parser.add_argument("--compute-threads", type=int, default=t.compute_threads,
                            help=f"torch threads of this trainer or worker (default {t.compute_threads}: its share of "
                                 "this host's cores among the trainers or workers on it)")
        parser.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
        parser.add_argument("--bucket-cap-mb", type=finite_float, default=t.bucket_cap_mb,
                            help=f"gradient bucket size in MiB (default {t.bucket_cap_mb:g}): with --mode ps, those a "
                                 "--step pushpull trainer fills during backward; with --mode ddp, DDP's all-reduce "
                                 "buckets")
        parser.add_argument("--rank", type=int, default=default_rank(),
                            help=f"trainer rank (default $RANK, $SLURM_PROCID, else {t.rank}; ddp/fsdp: the "
                                 "launcher's, which it must match)")
        parser.add_argument("--num-trainers", type=int, default=default_world_size(),
                            help="number of data shards (default $WORLD_SIZE, else learnt from the server; ddp/fsdp: "
                                 "the world size, which it must match)")
        ps = parser.add_argument_group(PS_GROUP)
        ps.add_argument("--server", default=None, metavar="HOST:PORT",
                        help="server HOST:PORT (default $PSSERVER_SERVER; else, not under torchrun, whose "
                             "$MASTER_PORT is its own rendezvous, $MASTER_ADDR:$MASTER_PORT; else "
                             f"{t.server_host}:{t.server_port})")
        ps.add_argument("--compute", choices=list(COMPUTE_MODES), default=None, help=COMPUTE_HELP)
        ps.add_argument("--step", choices=list(STEP_MODES), default=None, help=STEP_HELP)
        ps.add_argument("--device", default=t.device,
                        help=f"trainer compute: run the model on cpu or cuda:N (default {t.device})")
        ps.add_argument("--transport", choices=TRANSPORTS, default=t.transport,
                        help="trainer compute: how parameters and gradients travel: device-map (GPU to GPU on one "
                             "host, no host copy), staged (pinned host memory), cpu; auto takes the best the two "
                             f"sides allow and logs why (default {t.transport})")
        ps.add_argument("--overlap", choices=OVERLAP_MODES, default=t.overlap,
                        help="--step pushpull: compute the next step while the last one's gradient is handed in "
                             "(on the parameters of the reply before: one step staler); async, or ssp with "
                             f"--staleness >= 1; auto: on for a GPU trainer in async (default {t.overlap})")
        ps.add_argument("--wire-dtype", choices=WIRE_DTYPES, default=t.wire_dtype,
                        help="trainer compute: dtype of parameters and gradients in flight (the server keeps "
                             f"fp32 master weights and optimizer state; default {t.wire_dtype})")
        ps.add_argument("--connect-timeout", type=finite_float, default=t.connect_timeout,
                        help=f"seconds to wait for a server that is still starting (default {t.connect_timeout:g}, "
                             f"at least {MIN_CONNECT_TIMEOUT_S:g})")
        ps.add_argument("--reconnect", action="store_true",
                        help="if the server goes away or evicts this trainer, rejoin under a fresh name (retrying "
                             "with backoff) and continue where it was; without it, exit code 3")
        ps.add_argument("--start-over", action="store_true",
                        help="start this rank's data from the first epoch even where a trainer of this rank left "
                             "the running job unfinished (by default this one continues where that one stopped)")
        ps.add_argument("--rpc-timeout", type=finite_float, default=t.rpc_timeout,
                        help=f"RPC timeout in seconds (default {t.rpc_timeout:g}, at least {MIN_RPC_TIMEOUT_S:g})")
        ps.add_argument("--allocator", choices=ALLOCATORS, default=t.allocator,
                        help="host memory: cached keeps a step's freed buffers for the next one, system returns them "
                             f"to the kernel at once (each step maps and zero-fills them again; default {t.allocator})")
        ps.add_argument("--join-token-file", type=path_arg, default=None,
                        help="file holding the job's join token, for a server that asks for one (else "
                             "$PSSERVER_JOIN_TOKEN)")
        ps.add_argument("--stats-out", type=path_arg, default=None,
                        help="write per-step timings as JSON (for benchmarks)")
        ps.add_argument("--loss", default=None, metavar="NAME|MODULE:ATTR",
                        help="training loss: cross_entropy, mse, bce, or MODULE:ATTR (a callable (output, target) "
                             "-> scalar, or an nn.Module class made without arguments); default: the model's "
                             "(cross_entropy for a MODULE:ATTR model)")
        ps.add_argument("--metric", default=None, metavar="NAME|MODULE:ATTR",
                        help="held-out metric printed at the end: accuracy, rmse, auc, loss (mean held-out loss) "
                             "or MODULE:ATTR (a callable (outputs, targets) -> float over the whole held-out set); "
                             "default: the model's (accuracy for a MODULE:ATTR model)")
        ps.add_argument("--entry", default=None, metavar="MODULE:FUNCTION",
                        help="run your own training loop: FUNCTION(ps) with ps a connected psserver.Connection "
                             "(rank, server, token, --reconnect and the rest from these flags; ps.config holds them)")
        ps.add_argument("--entry-args", default=None, metavar="JSON",
                        help="keyword arguments of the --entry function, a JSON object")
        add_optimizer_arguments(parser, defaults_from_server=True)
        add_data_arguments(parser)
        add_collective_arguments(parser)
        add_control_arguments(parser, "--mode ddp|fsdp: served by rank 0, as by psserver serve")
        self.mode_flags.tag(parser, {PS_GROUP: frozenset({PS}), **COLLECTIVE_GROUPS},
                            {"bucket_cap_mb": frozenset({PS, DDP})})
        self.mode_flags.show(PS)

    def run(self, args: argparse.Namespace) -> int:
        if args.mode != PS and (args.entry is not None or args.entry_args is not None):
            raise UsageError(f"--entry runs a loop against a parameter server (--mode ps), not --mode {args.mode}")
        if args.mode != PS and (args.loss is not None or args.metric is not None):
            raise UsageError(LOSS_IS_PS.format(mode=args.mode))
        self.mode_flags.refuse_other_mode(args)
        if args.mode != PS:
            from psserver.collective.run import run_collective

            with config_errors():
                config = collective_config_from_args(args)
            return run_collective(config)
        with config_errors():
            config = trainer_config_from_args(args)
            entry_args = parse_json_args(args.entry_args, "--entry-args") if args.entry_args is not None else None
        if args.entry_args is not None and args.entry is None:
            raise UsageError("--entry-args needs --entry")
        if args.entry is not None:
            from psserver.trainer.entry import run_entry

            return run_entry(config, args.entry, entry_args)
        from psserver.trainer.loop import run_trainer

        return run_trainer(config)


def trainer_config_from_args(args: argparse.Namespace) -> TrainerConfig:
    """The configuration of a ``--mode ps`` trainer."""
    # The environment is read here, not as the flag's default: a parser built under torchrun
    # (psserver train --mode ddp, psserver serve) needs no psserver address.
    host, port = parse_host_port(args.server if args.server is not None else default_server_address(),
                                 default_port=DEFAULT_SERVER_PORT)
    return TrainerConfig(
        rank=args.rank if args.rank is not None else TrainerConfig.rank,
        server_host=host,
        server_port=port,
        num_trainers=args.num_trainers,
        epochs=args.epochs,
        batch_size=args.batch_size,
        eval_batch_size=args.eval_batch_size,
        optimizer=optimizer_from_args(args),
        model=args.model,
        model_args=model_args_from_args(args) if args.model_args is not None else None,
        data=data_from_args(args),
        connect_timeout=args.connect_timeout,
        reconnect=args.reconnect,
        start_over=args.start_over,
        rpc_timeout=args.rpc_timeout,
        max_steps=args.max_steps,
        progress=False if args.no_progress else None,
        stats_out=args.stats_out,
        compute=args.compute,
        step=args.step,
        device=args.device,
        wire_dtype=args.wire_dtype,
        transport=args.transport,
        bucket_cap_mb=args.bucket_cap_mb,
        overlap=args.overlap,
        join_token_file=args.join_token_file,
        loss=args.loss,
        metric=args.metric,
        compute_threads=args.compute_threads,
        allocator=args.allocator,
    )
