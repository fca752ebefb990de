"""``psserver bench``: the throughput harness of ``benchmarks/`` (``python -m benchmarks.run``).

The harness lives in the repository checkout (``benchmarks/``, not part of the installed
package); this verb finds it next to the ``psserver`` package of an editable install, and
is a usage error (one line, exit code 2) anywhere else.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path
from types import ModuleType

from psserver.cli.base import SubCommand, config_errors
from psserver.errors import UsageError


def _harness() -> ModuleType:
    """``benchmarks.run``, importable as is or from the checkout this package lives in."""
    try:
        return importlib.import_module("benchmarks.run")
    except ModuleNotFoundError as e:
        if e.name != "benchmarks":  # the harness is there but one of its imports is not: a bug
            raise
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "run.py").is_file():
        raise UsageError(f"psserver bench needs the repository checkout: no benchmarks/run.py in {root}")
    sys.path.insert(0, str(root))
    return importlib.import_module("benchmarks.run")


class BenchCommand(SubCommand):
    name = "bench"
    help = "measure local loop, PS (1/2/4 trainers, async/sync), DDP and FSDP in one run (repository checkout)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        _harness().add_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        command = "psserver " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        harness = _harness()
        with config_errors():  # the harness names a bad flag in a ValueError
            setups = harness.check_args(args)
        return harness.run_args(args, setups, command=command)
