"""``psserver pull --out FILE``: one whole version of a running server's model, as ``psserver
export`` writes a checkpoint's (``.safetensors`` or ``.pt`` under the model's own keys, a JSON
beside it), read with the readers' token: no trainer joins, nothing is checkpointed."""

from __future__ import annotations

import argparse
import json
import sys

from psserver.cli.args import finite_float, path_arg
from psserver.cli.base import SubCommand
from psserver.errors import UsageError


class PullCommand(SubCommand):
    name = "pull"
    help = ("read the newest version of a running server's weights (one global step, parameters and buffers) into "
            ".safetensors or .pt, as a reader that never trains")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from psserver.config.control import READ_DTYPES, READ_TOKEN_ENV
        from psserver.control import ADDRESS_ENV, DEFAULT_ADDRESS
        from psserver.control.client import default_address

        parser.add_argument("--out", type=path_arg, required=True, metavar="FILE",
                            help="FILE.safetensors or FILE.pt; FILE.json beside it says which step and model")
        parser.add_argument("--address", default=default_address(),
                            help=f"the server's control plane HOST:PORT (default ${ADDRESS_ENV} or {DEFAULT_ADDRESS})")
        parser.add_argument("--read-token-file", type=path_arg, default=None,
                            help=f"file holding the readers' token (else ${READ_TOKEN_ENV})")
        parser.add_argument("--tls-ca", type=path_arg, default=None,
                            help="PEM CA certificate that signed the server's: connect with TLS")
        parser.add_argument("--dtype", choices=[d for d in READ_DTYPES if d], default=None,
                            help="floating-point tensors in this dtype (default: as the server holds them)")
        parser.add_argument("--newer-than", type=int, default=None, metavar="STEP",
                            help="wait for a version of a global step past STEP (at most --timeout)")
        parser.add_argument("--timeout", type=finite_float, default=30.0,
                            help="seconds to wait for the server and for a newer version (default 30)")
        parser.add_argument("--name", default="psserver-pull", help="what psserver status lists this reader as")

    def run(self, args: argparse.Namespace) -> int:
        from psserver.config.common import parse_host_port
        from psserver.reader.reader import Reader
        from psserver.utils.state_files import out_format, write_atomic, write_state

        fmt = out_format(args.out)
        try:
            parse_host_port(args.address or "")
        except ValueError as e:
            raise UsageError(f"--address: {e}") from None
        if not 0 < args.timeout <= 3600:
            raise UsageError(f"--timeout must be between 0 and 3600 seconds, got {args.timeout:g}")
        with Reader(args.address, token_file=args.read_token_file, tls_ca=args.tls_ca, name=args.name,
                    dtype=args.dtype, timeout=args.timeout) as reader:
            if args.newer_than is None:
                version = reader.latest()
            else:
                version = reader.wait(args.newer_than)
                if version is None:
                    raise UsageError(f"no version past step {args.newer_than} within {args.timeout:g}s")
        try:
            write_state(args.out, fmt, version.state)
            meta = args.out.with_suffix(".json")
            info = {"model": version.model, "step": version.step, "published_at": version.published_at,
                    "age_seconds": version.age, "format": fmt, "keys": len(version.state),
                    "dtype": args.dtype or "as held", "source": args.address}
            write_atomic(meta, lambda f: f.write(json.dumps(info, indent=2).encode() + b"\n"))
        except OSError as e:
            raise UsageError(f"--out {args.out}: cannot write it ({e.strerror or e})") from None
        sys.stdout.write(f"pulled step {version.step} of {version.model or 'the model'} ({len(version.state)} tensors, "
                         f"{version.age * 1e3:.0f} ms old when read) to {args.out}, metadata {meta}\n")
        return 0
