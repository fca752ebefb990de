"""A trainer the server evicts along with its last steps (its guard's notice came with a step's
answer, and no later call failed on it) ends with exit code 3 and the server's reason, never as
a success. In-process: the loop and its ``ModelSteps`` against a connection and a session that
only record."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from psserver.config import TrainerConfig
from psserver.errors import Evicted
from psserver.trainer import loop
from psserver.trainer.model_steps import ModelSteps
from psserver.trainer.rejoin import Position
from psserver.trainer.session import EVICTION_NOTICE, Session


class Told:
    """A session told what the server says along with each call (``Session._told``): its step
    protocol's steps answer what a server's guard says of NaN gradients."""

    _told = Session._told

    def __init__(self, evict_at: int | None) -> None:
        self.name, self.evicted, self.report, self.abandoned = "trainer_0_1", None, None, False
        self.info = {"compute": "server"}
        self.spec = SimpleNamespace(name="mlp", loss="cross_entropy")
        self.protocol, self.steps, self.evict_at = self, 0, evict_at

    def step(self, x, y) -> float:
        self.steps += 1
        notices = ["the server dropped a step of this trainer: its gradient norm is nan"]
        if self.steps == self.evict_at:
            notices.append(f"{EVICTION_NOTICE}sent 3 non-finite gradients in a row (--max-nonfinite-steps 3)")
        self._told(notices)
        return float("nan")

    def abandon(self) -> None:
        self.abandoned = True


class Batches:
    steps_per_epoch = samples_per_epoch = 4
    num_replicas = 1

    def epoch(self, epoch: int, start: int = 0):
        for _ in range(start, 4):
            yield torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)


class Connection:
    """What the loop and its ``ModelSteps`` use of a connection: they only record."""

    def __init__(self) -> None:
        self.config = TrainerConfig(server_port=29500)
        self.position, self.resumed, self.stop_signal = Position(), False, None
        self.closed = self.evaluated = False

    def _call(self, fn, on_failure=None):
        return fn()

    def _count_step(self, samples: int, loss) -> None:
        self.position.steps += 1

    def evaluate(self, batches, metric) -> float:
        self.evaluated = True
        return 0.5

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("evict_at", [3, 4])
def test_an_eviction_told_with_the_last_steps_is_exit_3_with_its_reason(evict_at, capsys):
    ps, session = Connection(), Told(evict_at)
    with pytest.raises(Evicted, match=r"^trainer_0_1 was evicted by the psserver at 127.0.0.1:29500 with its last "
                                      r"steps: sent 3 non-finite gradients in a row \(--max-nonfinite-steps 3\)$"):
        loop._run(ps, ModelSteps(ps, session), Batches(), None, "accuracy", lambda *a: 0.0)
    assert session.abandoned and not ps.evaluated and not ps.closed
    assert "accuracy" not in capsys.readouterr().out


def test_a_run_without_an_eviction_ends_as_before(capsys):
    ps, session = Connection(), Told(None)
    assert loop._run(ps, ModelSteps(ps, session), Batches(), None, "accuracy", lambda *a: 0.0) == 0
    assert ps.closed and not session.abandoned
    assert "rank 0 accuracy nan" in capsys.readouterr().out
