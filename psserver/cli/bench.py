"""``psserver bench``: removed; the benchmarks run from a repository checkout.

The benchmarks measure psserver from outside (processes of their own, ``benchmarks/results``
and its committed JSON), so they live in the repository, not in the installed package, and the
installed CLI never imports a checkout: this verb only says where they went (one line, exit 2).
"""

from __future__ import annotations

import argparse

from psserver.cli.base import SubCommand
from psserver.errors import UsageError

MOVED = ("psserver bench was removed: the benchmarks run from a repository checkout, "
         "`python -m benchmarks.run --quick` there (`python -m benchmarks --help` lists every study)")


class BenchCommand(SubCommand):
    name = "bench"
    help = "removed: run `python -m benchmarks.run` in a repository checkout"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Refused before its flags are read, whatever they are (``--help`` included)."""
        raise UsageError(MOVED)

    def run(self, args: argparse.Namespace) -> int:  # never reached: add_arguments refuses first
        raise UsageError(MOVED)
