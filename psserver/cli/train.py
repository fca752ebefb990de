"""``psserver train``: a trainer; ``--mode ps`` (default) joins a parameter server,
``--mode ddp|fsdp`` trains with collectives instead (see ``psserver.collective``). One parser
takes both modes' flags; ``--help`` shows the mode's, and the other mode's are refused
(``psserver.cli.modes``). Each flag is a field of ``TrainerConfig`` or ``CollectiveConfig`` and
of the pieces they hold (``psserver.cli.builder``), but ``--mode``, ``--server``, ``--entry``
and ``--entry-args``.

A ``--mode ps`` trainer exits 0 when done, 2 for bad input (a rank whose holder is alive), 3
when its server is lost or evicts it (unless ``--reconnect``), 143 / 130 after leaving on
SIGTERM / SIGINT (``psserver.trainer.loop``)."""

from __future__ import annotations

import argparse

from psserver.cli.args import (
    add_control_arguments,
    add_data_arguments,
    add_optimizer_arguments,
    data_from_args,
    optimizer_from_args,
)
from psserver.cli.base import SubCommand, config_errors
from psserver.cli.builder import add_options, build
from psserver.cli.collective_args import (
    COLLECTIVE_GROUPS,
    LOSS_IS_PS,
    add_collective_arguments,
    collective_config_from_args,
)
from psserver.cli.modes import DDP, FSDP, MODES, PS, ModeAction, ModeFlags
from psserver.config import TrainerConfig, parse_host_port
from psserver.config.env import DEFAULT_SERVER_PORT, default_server_address
from psserver.config.trainer import PS_GROUP
from psserver.errors import UsageError
from psserver.utils.references import parse_json_args


class TrainCommand(SubCommand):
    name = "train"
    help = "train: join a parameter server (--mode ps) or run DDP/FSDP (--mode ddp|fsdp)"

    def __init__(self) -> None:
        self.mode_flags = ModeFlags()

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--mode", choices=MODES, default=PS, action=ModeAction, mode_flags=self.mode_flags,
                            help=f"{PS}: join a parameter server; {DDP}/{FSDP}: collective training (default {PS}). "
                                 "--help after it shows that mode's flags")
        ps = parser.add_argument_group(PS_GROUP)
        ps.add_argument("--server", default=None, metavar="HOST:PORT",
                        help="server HOST:PORT (default $PSSERVER_SERVER; else, not under torchrun, whose "
                             "$MASTER_PORT is its own rendezvous, $MASTER_ADDR:$MASTER_PORT; else "
                             f"{TrainerConfig.server_host}:{TrainerConfig.server_port})")
        add_options(parser, TrainerConfig, PS_GROUP)
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
    return build(TrainerConfig, args, server_host=host, server_port=port, optimizer=optimizer_from_args(args),
                 data=data_from_args(args))
