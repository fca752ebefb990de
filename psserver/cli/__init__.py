"""``psserver`` command line: one sub-command class per verb, ``main(argv)`` for tests.

Every error a user can cause ends as one line on stderr and exit code 2; tracebacks are for
bugs only (and then exit 1).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
from typing import Sequence

from psserver import __version__
from psserver.cli.base import SubCommand
from psserver.errors import ServerLost, UsageError

log = logging.getLogger(__name__)


_VERBS = [
    ("psserver.cli.serve", "ServeCommand"),
    ("psserver.cli.train", "TrainCommand"),
    ("psserver.cli.control", "StatusCommand"),
    ("psserver.cli.control", "CheckpointCommand"),
    ("psserver.cli.control", "StopCommand"),
    ("psserver.cli.demo", "DemoCommand"),
    ("psserver.cli.bench", "BenchCommand"),
]


def _commands() -> list[SubCommand]:
    import importlib

    cmds: list[SubCommand] = []
    for module, cls in _VERBS:
        try:
            cmds.append(getattr(importlib.import_module(module), cls)())
        except ModuleNotFoundError as e:  # a verb not part of this build
            if e.name != module:
                raise
            log.debug("verb %s.%s unavailable: %s", module, cls, e)
    return cmds


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, as for every usage error
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, SubCommand]]:
    parser = _Parser(prog="psserver", description="A parameter-server service for PyTorch.")
    parser.add_argument("--version", action="version", version=f"psserver {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("PSSERVER_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: INFO, or $PSSERVER_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands = {}
    for cmd in _commands():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        commands[cmd.name] = cmd
    return parser, commands


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now (tests swap it), not the one at set-up."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(level: str) -> None:
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level), handlers=[handler], force=True)


def main(argv: Sequence[str] | None = None) -> int:
    # TensorPipe logs a C++ warning for every peer that leaves (EOF on its pipe): routine for
    # a parameter server whose trainers come and go. Keep C++ errors; the user may override.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    setup_logging(args.log_level)
    if not faulthandler.is_enabled() and sys.__stderr__ is not None:
        # A crash inside the C++ runtime (RPC, autograd) then leaves the Python stacks of
        # every thread in the log instead of a bare exit status.
        try:
            faulthandler.enable(file=sys.__stderr__)
        except (ValueError, OSError):  # no usable file descriptor 2
            pass
    cmd = commands[args.command]
    try:
        return int(cmd.run(args) or 0)
    except (UsageError, ValueError) as e:
        print(f"psserver {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ServerLost as e:
        print(f"psserver {args.command}: error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"psserver {args.command}: interrupted", file=sys.stderr)
        return 130
