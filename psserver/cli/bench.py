"""``psserver bench``: the throughput harness of ``benchmarks/`` (``python -m benchmarks.run``).

The harness lives in the source checkout (``benchmarks/``, not part of the installed
package); this verb finds it next to the ``psserver`` package of an editable install.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from psserver.cli.base import SubCommand
from psserver.errors import UsageError


def _harness():
    try:
        from benchmarks import run
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        if not (root / "benchmarks" / "run.py").is_file():
            return None
        sys.path.insert(0, str(root))
        try:
            from benchmarks import run
        except ImportError:
            return None
    return run


class BenchCommand(SubCommand):
    name = "bench"
    help = "measure local loop, PS (1/2/4 trainers, async/sync), DDP and FSDP in one run"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        run = _harness()
        if run is None:
            parser.description = "needs a source checkout of psserver (benchmarks/ next to psserver/)"
            return
        run.add_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        run = _harness()
        if run is None:
            raise UsageError("psserver bench needs a source checkout: benchmarks/run.py was not found next to psserver/")
        command = "psserver " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        return run.run_args(args, command=command)
