"""Tests only: ``python -m tests.end_to_end.poisoned_trainer train ARGS`` is ``psserver train ARGS``
whose batches turn to NaN: every ``$PSSERVER_TEST_POISON_EVERY``-th step (1: every step) of
any step protocol, so its gradient for that step is NaN. A corrupt input shard, or a loss that
overflows, does the same to a real trainer; the server must never apply such a gradient.
"""

from __future__ import annotations

import functools
import os
import sys

ENV = "PSSERVER_TEST_POISON_EVERY"


def install(every: int) -> None:
    from psserver.trainer.steps import HALVES

    count = {"steps": 0}

    def poisoned(step):
        @functools.wraps(step)
        def wrapper(self, x, y):
            count["steps"] += 1
            if count["steps"] % every == 0:
                x = x.float() * float("nan")
            return step(self, x, y)

        return wrapper

    for half in HALVES.values():
        half.step = poisoned(half.step)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # as psserver.cli.main, before torch is imported
    install(int(os.environ[ENV]))
    from psserver.cli import main

    sys.exit(main(sys.argv[1:]))
