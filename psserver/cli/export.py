"""``psserver export CHECKPOINT_OR_DIR --out FILE``: the trained model as a plain ``state_dict``."""

from __future__ import annotations

import argparse
import sys

from psserver.cli.args import path_arg
from psserver.cli.base import SubCommand


class ExportCommand(SubCommand):
    name = "export"
    help = ("write a checkpoint's model as a plain state_dict under the model's own keys (.safetensors or .pt), "
            "gathered from every server process, with a JSON beside it")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("checkpoint", type=path_arg, metavar="CHECKPOINT_OR_DIR",
                            help="a checkpoint file, or a --checkpoint-dir (its newest complete checkpoint; of several "
                                 "server processes: the directory holding server-0/, server-1/, ...)")
        parser.add_argument("--out", type=path_arg, required=True, metavar="FILE",
                            help="FILE.safetensors or FILE.pt; FILE.json beside it says what it is, and a model with "
                                 "embedding tables also gets FILE.tables.safetensors (or .pt): <table>.ids, "
                                 "<table>.rows")

    def run(self, args: argparse.Namespace) -> int:
        from psserver.server.checkpoints.export import export

        done = export(args.checkpoint, args.out)
        sys.stdout.write(f"exported step {done.step}: {done.tensors} tensors to {done.model}"
                         f"{f', tables to {done.tables}' if done.tables else ''}, metadata {done.metadata}\n")
        return 0
