"""``python -m benchmarks.run``: the throughput study (``benchmarks.studies.throughput``), kept
at the command the docs, CI and ``python -m benchmarks throughput`` name."""

from __future__ import annotations

import sys

from benchmarks.studies.throughput.run import main

if __name__ == "__main__":
    sys.exit(main())
