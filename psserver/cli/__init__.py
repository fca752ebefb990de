"""``psserver`` command line: one sub-command class per verb, ``main(argv)`` for tests.

Exit codes: 0 success; 2 a usage error (a bad flag, a configuration that does not validate,
any :class:`~psserver.errors.UsageError`: one line on stderr); 3 a trainer lost its server, was
evicted or had a step the server could not complete (:class:`~psserver.errors.ServerLost`);
130 / 143 a trainer that left on SIGINT / SIGTERM; 1 a server whose final checkpoint failed
(logged as it happened), or anything else, an internal error: the traceback goes to a log file
(``$PSSERVER_LOG_DIR``, else the system's temporary directory) and stderr gets one line saying
where.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import logging
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path

from psserver import __version__
from psserver.cli.base import SubCommand
from psserver.cli.bench import BenchCommand
from psserver.cli.control import CheckpointCommand, StatusCommand, StopCommand
from psserver.cli.demo import DemoCommand
from psserver.cli.export import ExportCommand
from psserver.cli.pull import PullCommand
from psserver.cli.relay import RelayCommand
from psserver.cli.serve import ServeCommand
from psserver.cli.train import TrainCommand
from psserver.errors import ServerLost, UsageError
from psserver.trainer.stop_signals import Stopped
from psserver.utils.cpp_log import quiet_cpp_warnings

log = logging.getLogger(__name__)

VERBS: tuple[type[SubCommand], ...] = (
    ServeCommand,
    TrainCommand,
    StatusCommand,
    CheckpointCommand,
    StopCommand,
    ExportCommand,
    PullCommand,
    RelayCommand,
    DemoCommand,
    BenchCommand,
)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_LEVEL_ENV = "PSSERVER_LOG_LEVEL"
LOG_DIR_ENV = "PSSERVER_LOG_DIR"
"""Where internal errors leave their traceback (default: the system's temporary directory)."""


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line and exit code 2; no abbreviated flags (``--compute`` must not
    become ``--compute-threads``). A verb's parser gets its arguments when it is used, so one
    verb's imports never affect another's."""

    def __init__(self, *args, command: SubCommand | None = None, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._command = command

    def parse_known_args(self, args=None, namespace=None):
        if self._command is not None:
            command, self._command = self._command, None
            try:
                command.add_arguments(self)
            except UsageError as e:
                self.error(str(e))
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, SubCommand]]:
    parser = _Parser(prog="psserver", description="A parameter-server service for PyTorch.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"psserver {__version__}")
    parser.add_argument("--log-level", type=str.upper, default=None, choices=LOG_LEVELS,
                        help=f"logging level (default: ${LOG_LEVEL_ENV}, else INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands = {}
    for verb in VERBS:
        cmd = verb()
        sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, allow_abbrev=False, command=cmd)
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


def log_level(args: argparse.Namespace) -> str:
    """``--log-level``, else ``$PSSERVER_LOG_LEVEL``, else INFO; ``UsageError`` for a bad value."""
    if args.log_level is not None:
        return args.log_level
    value = os.environ.get(LOG_LEVEL_ENV, "").strip() or "INFO"
    if value.upper() not in LOG_LEVELS:
        raise UsageError(f"${LOG_LEVEL_ENV}={value!r} is not a log level; use one of {', '.join(LOG_LEVELS)}")
    return value.upper()


def main(argv: Sequence[str] | None = None) -> int:
    # TensorPipe logs a C++ warning for every peer that leaves (EOF on its pipe): routine for
    # a parameter server whose trainers come and go. Keep C++ errors; the user may override.
    quiet_cpp_warnings()
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a supervisor runs again
    try:
        level = log_level(args)
    except UsageError as e:
        print(f"psserver{' ' + args.command if args.command else ''}: error: {e}", file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    setup_logging(level)
    if not faulthandler.is_enabled() and sys.__stderr__ is not None:
        # A crash inside the C++ runtime (RPC, autograd) then leaves the Python stacks of
        # every thread in the log instead of a bare exit status.
        try:
            faulthandler.enable(file=sys.__stderr__)
        except (ValueError, OSError):  # no usable file descriptor 2
            pass
    verb = args.command
    try:
        return int(commands[verb].run(args) or 0)
    except UsageError as e:
        print(f"psserver {verb}: error: {e}", file=sys.stderr)
        return 2
    except ServerLost as e:
        print(f"psserver {verb}: error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"psserver {verb}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.filename is None:  # a socket's, a library's: nothing the user named
            return internal_error(verb, e, argv)
        # A path the user gave (too long, a file where a directory belongs, no permission): the
        # system's own words for it, in one line.
        print(f"psserver {verb}: error: {path_error(e)}", file=sys.stderr)
        return 1
    except Stopped as s:  # SIGTERM or SIGINT where a trainer's own loop could not leave (--entry)
        print(f"psserver {verb}: received {signal.Signals(s.signum).name} {s.why}: exiting", file=sys.stderr)
        return s.code
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a bug, or a BaseException of the user's code that no
        # narrower handler names: the traceback to a file, one line here, never a raw traceback
        return internal_error(verb, e, argv)


def path_error(e: OSError) -> str:
    """``[Errno 36] File name too long: 'x...'`` as ``x...: File name too long`` (a long name
    cut to its ends)."""
    name = str(e.filename)
    if len(name) > 120:
        name = f"{name[:60]}...{name[-40:]}"
    return f"{name}: {e.strerror or type(e).__name__}"


def _new_private_file(path: Path) -> tuple[int, Path]:
    """A file made for this write alone (0600), never one planted under its name: a link another
    user left in the temporary directory, to a file of ours, would have us overwrite that file.
    Where the name is taken, a fresh one beside it."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), path
    except FileExistsError:
        fd, name = tempfile.mkstemp(prefix=path.stem + "-", suffix=path.suffix, dir=path.parent)
        return fd, Path(name)


def internal_error(verb: str, error: BaseException, argv: Sequence[str] | None = None) -> int:
    """Write ``error``'s traceback to ``psserver-<verb>-<pid>.log`` (in ``$PSSERVER_LOG_DIR``,
    else, or when that cannot be written, the temporary directory), say where in one line; 1.
    Where no file can be written, the one line says why, never the traceback."""
    name = f"psserver-{verb}-{os.getpid()}.log"
    temporary = Path(tempfile.gettempdir()) / name
    configured = os.environ.get(LOG_DIR_ENV)
    candidates = [Path(configured) / name, temporary] if configured else [temporary]
    lines = str(error).strip().splitlines()
    summary = type(error).__name__ + (f": {lines[0]}" if lines else "")
    text = "".join(traceback.format_exception(error))
    failures: list[str] = []
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, path = _new_private_file(path)
            with os.fdopen(fd, "w") as f:
                f.write(f"{datetime.datetime.now().isoformat(timespec='seconds')} psserver {__version__}: "
                        f"internal error in {verb}\n")
                f.write(f"command: psserver {' '.join(sys.argv[1:] if argv is None else argv)}\n")
                f.write(f"python {sys.version.split()[0]}, pid {os.getpid()}\n\n{text}")
        except OSError as e:
            failures.append(f"{path}: {e.strerror or e}")
            continue
        where = f"traceback in {path}"
        if failures:
            where += f"; {LOG_DIR_ENV} unusable: {failures[0]}"
        print(f"psserver {verb}: internal error: {summary} ({where})", file=sys.stderr)
        return 1
    print(f"psserver {verb}: internal error: {summary} (traceback not saved: cannot write {'; '.join(failures)})",
          file=sys.stderr)
    return 1
