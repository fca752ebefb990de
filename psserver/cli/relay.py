"""``psserver relay``: serve a running server's weights again to readers of other hosts, so the
server sends each version once per relay, whatever the number of readers behind it
(``psserver.reader.relay``). Runs until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import signal

from psserver.cli.args import finite_float, path_arg
from psserver.cli.base import SubCommand
from psserver.errors import UsageError

DEFAULT_PORT = 50061


class RelayCommand(SubCommand):
    name = "relay"
    help = ("serve the weights of a server (or of another relay) again to readers of other hosts: the server sends "
            "each version once per relay")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from psserver.config.control import READ_TOKEN_ENV
        from psserver.control import ADDRESS_ENV, DEFAULT_ADDRESS
        from psserver.control.client import default_address

        parser.add_argument("--upstream", default=default_address(),
                            help=f"the server's control plane HOST:PORT, or another relay's (default ${ADDRESS_ENV} "
                                 f"or {DEFAULT_ADDRESS})")
        parser.add_argument("--host", default="127.0.0.1",
                            help="address to serve readers on (default 127.0.0.1; 0.0.0.0 for other hosts)")
        parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                            help=f"port to serve readers on (default {DEFAULT_PORT}; 0 picks one)")
        parser.add_argument("--upstream-token-file", type=path_arg, default=None,
                            help=f"file holding the token this relay reads its upstream with (else ${READ_TOKEN_ENV})")
        parser.add_argument("--read-token-file", type=path_arg, default=None,
                            help=f"file holding the token readers of this relay must show (else ${READ_TOKEN_ENV}; "
                                 "none: open, refused beyond loopback when the upstream needs a token, unless --open)")
        parser.add_argument("--open", action="store_true",
                            help="serve readers beyond loopback without a token though the upstream needs one")
        parser.add_argument("--tls-ca", type=path_arg, default=None,
                            help="PEM CA certificate that signed the upstream's: connect to it with TLS")
        parser.add_argument("--tls-cert", type=path_arg, default=None, help="PEM certificate: serve readers TLS")
        parser.add_argument("--tls-key", type=path_arg, default=None, help="PEM private key of --tls-cert")
        parser.add_argument("--timeout", type=finite_float, default=30.0,
                            help="seconds to wait for the upstream at each call (default 30)")
        parser.add_argument("--name", default="psserver-relay", help="what the upstream's status lists this relay as")

    def run(self, args: argparse.Namespace) -> int:
        from psserver.config.common import parse_host_port
        from psserver.reader.relay import Relay

        try:
            parse_host_port(args.upstream or "")
        except ValueError as e:
            raise UsageError(f"--upstream: {e}") from None
        if not 0 <= args.port <= 65535:
            raise UsageError(f"--port must be in 0..65535, got {args.port}")
        if not 0 < args.timeout <= 3600:
            raise UsageError(f"--timeout must be between 0 and 3600 seconds, got {args.timeout:g}")
        # Blocked before any thread starts (every thread inherits the mask), taken by sigwait:
        # no handler runs inside a lock the main thread holds.
        signals = {signal.SIGTERM, signal.SIGINT}
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            with Relay(args.upstream, host=args.host, port=args.port, upstream_token_file=args.upstream_token_file,
                       read_token_file=args.read_token_file, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                       tls_key=args.tls_key, open=args.open, name=args.name, timeout=args.timeout):
                signal.sigwait(signals)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        return 0
