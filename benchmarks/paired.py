"""``python -m benchmarks.paired``: paired rounds of chosen setups (``benchmarks.harness.paired``),
kept at the command the docs and ``python -m benchmarks paired`` name."""

from __future__ import annotations

import sys

from benchmarks.harness.paired import main

if __name__ == "__main__":
    sys.exit(main())
