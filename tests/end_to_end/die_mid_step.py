"""Tests only: ``python -m tests.end_to_end.die_mid_step train ARGS`` is ``psserver train ARGS`` that
SIGKILLs itself in the middle of step ``$PSSERVER_TEST_DIE_AT_STEP`` (1-based), at the point
of each step protocol where its gradient is half-way to being applied:

- ``plain``, ``pull``: after ``dist_autograd.backward`` has delivered the step's gradient into
  the server's autograd context, before ``DistributedOptimizer.step`` would apply it;
- ``pushpull``, ``chained``: after the step's gradient is computed and owed to the server,
  before the call that would carry it (the server has the step open: its parameters or its
  forward went out).

Either way steps 1..N-1 are applied whole and step N not at all, so the server must count
exactly N-1 updates (and their samples) from this trainer. The line ``dying mid-step N`` is
printed first.
"""

from __future__ import annotations

import functools
import os
import signal
import sys

ENV = "PSSERVER_TEST_DIE_AT_STEP"


def _die(step: int) -> None:
    print(f"dying mid-step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def install(at_step: int) -> None:
    from torch.distributed.optim import DistributedOptimizer

    from psserver.trainer.steps.chained import ChainedTrainer
    from psserver.trainer.steps.pushpull import PushPullTrainer

    count = {"optimizer": 0, "owed": 0}

    def before_optimizer_step(step):
        @functools.wraps(step)
        def wrapper(self, *args, **kwargs):
            count["optimizer"] += 1
            if count["optimizer"] == at_step:
                _die(at_step)
            return step(self, *args, **kwargs)

        return wrapper

    def after_gradient_owed(step):
        @functools.wraps(step)
        def wrapper(self, *args, **kwargs):
            loss = step(self, *args, **kwargs)
            count["owed"] += 1
            if count["owed"] == at_step:
                _die(at_step)
            return loss

        return wrapper

    DistributedOptimizer.step = before_optimizer_step(DistributedOptimizer.step)
    PushPullTrainer.train_step = after_gradient_owed(PushPullTrainer.train_step)
    ChainedTrainer.step = after_gradient_owed(ChainedTrainer.step)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # as psserver.cli.main, before torch is imported
    install(int(os.environ[ENV]))
    from psserver.cli import main

    sys.exit(main(sys.argv[1:]))
