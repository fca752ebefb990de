"""``psserver status``, ``psserver checkpoint``, ``psserver stop``: thin control-plane clients.

All three take ``--address`` (default ``$PSSERVER_CONTROL_ADDRESS`` or 127.0.0.1:50051),
``--auth-token-file`` (else ``$PSSERVER_AUTH_TOKEN``; else, for ``checkpoint`` and ``stop``, the
admin token a server of this user on this host left in its private file), ``--tls-ca`` and ``--timeout``. An
unreachable server or a refused token is one line on stderr and exit code 2 (the errors are
:class:`~psserver.errors.UsageError`; :func:`psserver.cli.main` prints them).
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
import time

from psserver.cli.args import finite_float, path_arg
from psserver.cli.base import SubCommand
from psserver.config.common import parse_host_port
from psserver.errors import UsageError

MIN_TIMEOUT = 0.01
MAX_TIMEOUT = 86400.0
WATCH_INTERVAL = 2.0
"""``status --watch``: seconds between updates."""
WAIT_TIMEOUT = 300.0
"""``stop --wait``: seconds to wait for the server to go."""


def add_client_arguments(parser: argparse.ArgumentParser, default_timeout: float) -> None:
    from psserver.control import ADDRESS_ENV, DEFAULT_ADDRESS
    from psserver.control.client import default_address

    g = parser.add_argument_group("connection")
    g.add_argument("--address", default=default_address(),
                   help=f"control plane HOST:PORT (default ${ADDRESS_ENV} or {DEFAULT_ADDRESS})")
    g.add_argument("--auth-token-file", type=path_arg, default=None,
                   help="file holding the bearer token (else $PSSERVER_AUTH_TOKEN; else, for checkpoint and "
                        "stop, the one a server of yours on this host wrote for this address)")
    g.add_argument("--tls-ca", type=path_arg, default=None,
                   help="PEM CA certificate that signed the server's: connect with TLS")
    g.add_argument("--timeout", type=finite_float, default=default_timeout,
                   help=f"seconds to wait for an answer, {MIN_TIMEOUT:g} to {MAX_TIMEOUT:g} "
                        f"(default {default_timeout:g})")


def client_from_args(args: argparse.Namespace, *, admin: bool = False):
    """The client of ``args``; for an ``admin`` verb (checkpoint, stop) without a token given,
    with the local admin token a server of this user on this host wrote for the address."""
    from psserver.control.client import ControlClient, read_token

    try:
        parse_host_port(args.address or "")
    except ValueError as e:
        raise UsageError(f"--address: {e}") from None
    if not MIN_TIMEOUT <= args.timeout <= MAX_TIMEOUT:  # gRPC's deadline overflows past that: 'unreachable'
        raise UsageError(f"--timeout must be between {MIN_TIMEOUT:g} and {MAX_TIMEOUT:g} seconds (one day), "
                         f"got {args.timeout:g}")
    token = read_token(args.auth_token_file, args.address if admin else None)
    return ControlClient(args.address, token=token, tls_ca=args.tls_ca, timeout=args.timeout)


def _emit(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class StatusCommand(SubCommand):
    name = "status"
    help = "show a running server: progress, shards, trainers (--json for scripts, --watch to follow)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true",
                            help='print JSON: {"status": {...}, "trainers": [...]} (one line per update with --watch)')
        parser.add_argument("--watch", action="store_true",
                            help="keep printing updates until Ctrl-C or the server stops")
        parser.add_argument("--interval", type=finite_float, default=WATCH_INTERVAL,
                            help=f"seconds between --watch updates (default {WATCH_INTERVAL:g})")
        add_client_arguments(parser, default_timeout=10.0)

    def run(self, args: argparse.Namespace) -> int:
        from psserver.control.service import MAX_INTERVAL, MIN_INTERVAL

        if args.watch and not MIN_INTERVAL <= args.interval <= MAX_INTERVAL:
            raise UsageError(f"--interval must be between {MIN_INTERVAL} and {MAX_INTERVAL:g} seconds")
        with client_from_args(args) as client:
            if not args.watch:
                status = client.get_status()
                _emit(self._format(args, client, status, client.list_trainers()))
                return 0
            return self._watch(args, client)

    def _watch(self, args: argparse.Namespace, client) -> int:
        from psserver.control.client import ControlUnavailable

        clear = sys.stdout.isatty() and not args.json
        stream = client.watch(args.interval)
        try:
            for status in stream:
                try:
                    trainers = client.list_trainers()
                except ControlUnavailable:
                    trainers = []
                text = self._format(args, client, status, trainers)
                if clear:
                    text = "\x1b[H\x1b[2J" + text  # redraw in place in a terminal
                elif not args.json:
                    text += "\n"  # a blank line between tables in a log
                _emit(text)
        except KeyboardInterrupt:
            return 0  # the normal way to leave --watch
        finally:
            stream.close()
        print(f"psserver status: the server at {args.address} ended the stream (stopped)", file=sys.stderr)
        return 0

    @staticmethod
    def _format(args: argparse.Namespace, client, status, trainers) -> str:
        from psserver.control import convert, render

        if args.json:
            payload = {"status": convert.status_to_dict(status),
                       "trainers": [convert.trainer_to_dict(t) for t in trainers]}
            if args.watch:
                return json.dumps(payload, sort_keys=False, allow_nan=False)
            return json.dumps(payload, indent=2)
        return render.render_status(status, trainers, address=client.address)


class CheckpointCommand(SubCommand):
    name = "checkpoint"
    help = "ask a running server to write a checkpoint now and print its path"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help='print {"path": ..., "step": ..., "time": ...}')
        add_client_arguments(parser, default_timeout=300.0)

    def run(self, args: argparse.Namespace) -> int:
        from psserver.control import convert

        with client_from_args(args, admin=True) as client:
            info = client.checkpoint()
        if args.json:
            _emit(json.dumps(convert.checkpoint_to_dict(info)))
        else:
            _emit(f"checkpoint written: {info.path} (step {info.step:,})")
        return 0


class StopCommand(SubCommand):
    name = "stop"
    help = "ask a running server to drain (finish in-flight steps, checkpoint) and exit"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--reason", default=None, help="written to the server's log (default: user@host)")
        parser.add_argument("--wait", action="store_true", help="return only once the server has gone")
        parser.add_argument("--wait-timeout", type=finite_float, default=WAIT_TIMEOUT,
                            help=f"seconds --wait waits before giving up (default {WAIT_TIMEOUT:g})")
        add_client_arguments(parser, default_timeout=10.0)

    def run(self, args: argparse.Namespace) -> int:
        from psserver.control.client import ControlUnavailable
        from psserver.control.convert import enum_name
        from psserver.control.v1 import control_pb2 as pb

        if args.wait_timeout < 0:
            raise UsageError(f"--wait-timeout must be >= 0, got {args.wait_timeout:g}")
        reason = args.reason or f"psserver stop by {_who()}"
        with client_from_args(args, admin=True) as client:
            state = client.shutdown(reason=reason)
            _emit(f"server at {client.address} is {enum_name(pb.ServerState, state).lower()}")
            if not args.wait:
                return 0
            deadline = time.monotonic() + args.wait_timeout
            while time.monotonic() < deadline:
                try:
                    client.health(timeout=min(args.timeout, 2.0))
                except ControlUnavailable:
                    _emit(f"server at {client.address} has stopped")
                    return 0
                time.sleep(0.5)
        raise UsageError(f"server at {args.address} still answers after {args.wait_timeout:g}s")


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
