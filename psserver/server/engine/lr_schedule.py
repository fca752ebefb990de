"""The server's learning-rate schedule: a torch scheduler, stepped once per optimizer update.

A torch scheduler is written against one optimizer, and several compute the next learning rate
from the optimizer's current one (the chainable forms). The server has one optimizer per shard,
on every server process, made when the optimizer is known (possibly by the first trainer) and
reloaded from checkpoints. So the scheduler drives a private *reference* optimizer of the same
class and hyperparameters over one parameter that never has a gradient; before each update the
server copies what the scheduler set there (``lr``, and ``momentum``/``betas``, which
``OneCycleLR`` and ``CyclicLR`` cycle) into every shard's optimizer, and steps the scheduler
after it. The update that makes global step t+1 then uses exactly the learning rate that
``for t: opt.step(); sched.step()`` uses at iteration t, for any scheduler, a user's included.

No RPC here: the updaters call :meth:`LRSchedule.apply` and :meth:`LRSchedule.step` under their
lock, and unit tests drive it directly.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import torch
from torch.optim.lr_scheduler import LinearLR, LRScheduler, ReduceLROnPlateau, SequentialLR

from psserver.config import OptimizerConfig
from psserver.config.optimizer import make_optimizer
from psserver.config.schedule import LRScheduleConfig, resolve_scheduler
from psserver.errors import UserCodeError
from psserver.utils.references import call_user

log = logging.getLogger(__name__)

SCHEDULED_KEYS = ("lr", "momentum", "betas")
"""Hyperparameters copied from the reference optimizer into the shards' (those they have)."""
MAX_REPLAY = 100_000_000
"""Scheduler steps a resume replays at most (about 10 minutes at torch's pace here)."""
TRIED_STEPS = 10
"""Steps of a copy of the schedule taken at the start, whose values are checked there."""


def build_scheduler(optimizer: torch.optim.Optimizer, config: LRScheduleConfig) -> LRScheduler:
    """``config``'s scheduler on ``optimizer``, composed with the warm-up as a user would write it:
    ``SequentialLR(opt, [LinearLR(opt, 1/N, 1.0, N-1), main], milestones=[N])``, or the
    ``LinearLR`` alone without a schedule. ``UserCodeError`` (one line) when it cannot be built."""
    n = config.warmup_steps
    warmup = LinearLR(optimizer, start_factor=1.0 / n, end_factor=1.0, total_iters=n - 1) if n else None
    if config.name is None:
        if warmup is None:
            raise ValueError("no schedule and no warm-up: nothing to build")
        return warmup
    what = f"--lr-schedule {config.name}"
    main = call_user(resolve_scheduler(config.name), (optimizer,), config.args, what)
    if isinstance(main, ReduceLROnPlateau):
        raise UserCodeError(f"{what} returned a ReduceLROnPlateau: it steps on a metric (a validation loss) that "
                            "the server does not have")
    if not isinstance(main, LRScheduler):
        raise UserCodeError(f"{what} returned a {type(main).__name__}, not a torch.optim.lr_scheduler.LRScheduler")
    if main.optimizer is not optimizer:
        raise UserCodeError(f"{what} returned a scheduler of another optimizer than the one it was given")
    return main if warmup is None else SequentialLR(optimizer, [warmup, main], milestones=[n])


def _plain(value: Any) -> bool:
    """Whether ``value`` holds only what ``torch.load(weights_only=True)`` reads back."""
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, torch.Tensor):
        return True
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) in (str, int) and _plain(v) for k, v in value.items())
    return False


class LRSchedule:
    """One scheduler on a reference optimizer like the shards'; ``steps`` counts its steps,
    which is the server's global step (``restore`` and ``fast_forward`` keep it so)."""

    def __init__(self, config: LRScheduleConfig, optimizer: OptimizerConfig) -> None:
        self.config = config
        self.optimizer_config = optimizer
        self._param = torch.zeros(1, requires_grad=True)
        self.reference = make_optimizer([self._param], optimizer)
        self.scheduler = build_scheduler(self.reference, config)
        # Once (no gradient: it changes nothing): a scheduler whose optimizer never stepped warns
        # at its first step. Stepping it at every update would cost more than the schedule.
        self.reference.step()
        self.keys = tuple(k for k in SCHEDULED_KEYS if k in self.reference.param_groups[0])
        self._try_first_steps()
        self.steps = 0
        self._failed = False
        self._warned_bad = False

    def _try_first_steps(self) -> None:
        """Step a copy of the scheduler :data:`TRIED_STEPS` times: arguments it refuses only when
        it steps (a ``T_max`` of 0) and values no optimizer can take (a string, a negative or
        non-finite lr) in its first steps fail the start, not the first updates."""
        what = f"--lr-schedule {self.config.name} {self.config.args}"
        bad = self._bad(self.reference.param_groups[0])
        if bad:
            raise UserCodeError(f"{what} gives {bad} at step 0")
        try:
            reference, trial = copy.deepcopy((self.reference, self.scheduler))
        except Exception:  # noqa: BLE001 - a user's scheduler that cannot be copied is checked as it steps
            return
        for step in range(1, TRIED_STEPS + 1):
            try:
                with warnings.catch_warnings():  # the copy's optimizer never stepped: torch warns of the order
                    warnings.simplefilter("ignore")
                    trial.step()
            except Exception as e:  # noqa: BLE001 - whatever the user's arguments make it raise
                if step > 1 and not isinstance(e, TypeError):
                    return  # a schedule that ends (OneCycleLR past total_steps) keeps its last lr
                # at its first step, or values of the wrong kind (a factor "x") at any
                raise UserCodeError(f"{what}: its {'first step' if step == 1 else f'step {step}'} failed: "
                                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
            bad = self._bad(reference.param_groups[0])
            if bad:
                raise UserCodeError(f"{what} gives {bad} at step {step}")

    def _bad(self, group: dict[str, Any]) -> str:
        """What no optimizer can take among the scheduled values of ``group`` (``lr 'x'``, ``lr
        -0.1``), or empty: an lr that is a finite number >= 0, a momentum that is a finite number,
        betas that are finite numbers."""
        for key in self.keys:
            value = group[key]
            values = value if key == "betas" and isinstance(value, tuple | list) else (value,)
            for v in values:
                number = float(v) if isinstance(v, int | float) and not isinstance(v, bool) else (
                    float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point() else None)
                if number is None:
                    return f"{key} {str(value)[:40]!r} (not a number)"
                if not math.isfinite(number):
                    return f"{key} {value}"
                if key == "lr" and number < 0:
                    return f"a negative learning rate ({number:g})"
        return ""

    @property
    def lr(self) -> float:
        """The learning rate of the next update (at global step ``steps``); NaN when the schedule
        gives no number (:meth:`apply` keeps the last good one then)."""
        try:
            return float(self.reference.param_groups[0]["lr"])
        except (TypeError, ValueError):
            return math.nan

    def describe(self) -> str:
        return self.config.describe()

    # ---- every update --------------------------------------------------------------------

    def apply(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Before the update at global step ``steps``: its learning rate into every optimizer.
        Values no optimizer can take (a negative or non-finite lr, a string: :meth:`_bad`) are not
        applied: the last good ones stay, and one WARNING line says so (not one per step). The
        server keeps training rather than stop every trainer for a schedule that went wrong
        mid-run; a schedule whose first values are wrong is refused at the start."""
        group = self.reference.param_groups[0]
        bad = self._bad(group)
        if bad:
            if not self._warned_bad:
                self._warned_bad = True
                log.warning("the learning-rate schedule %s gives %s at step %d: the last good values stay (said once)",
                            self.describe(), bad, self.steps)
            return
        values = {k: group[k] for k in self.keys}
        for opt in optimizers:
            for g in opt.param_groups:
                for k, v in values.items():
                    if k in g:
                        g[k] = v

    def step(self) -> None:
        """After the update: the schedule moves to the next global step. A scheduler that fails
        (``OneCycleLR`` past its ``total_steps``) is stepped no more: the learning rate stays
        where it was (one ERROR line), and training goes on."""
        self.steps += 1
        if self._failed:
            return
        try:
            self.scheduler.step()
        except Exception as e:  # noqa: BLE001 - the schedule's end must not stop the shared optimizer
            self._failed = True
            log.error("the learning-rate schedule %s failed at step %d (%s: %s): the learning rate stays at %g",
                      self.describe(), self.steps, type(e).__name__, str(e).splitlines()[0] if str(e) else "",
                      self.lr)

    # ---- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain data (``torch.load(weights_only=True)``): what the schedule is and where it stands.
        The scheduler's own state is left out (None) when it holds anything else (a user's
        scheduler); ``restore`` then replays its steps."""
        state = copy.deepcopy(self.scheduler.state_dict())
        return {
            "describe": self.describe(),
            "config": asdict(self.config),
            "optimizer": asdict(self.optimizer_config),
            "steps": self.steps,
            "failed": self._failed,
            "reference": copy.deepcopy(self.reference.state_dict()),
            "scheduler": state if _plain(state) else None,
        }

    def restore(self, saved: dict[str, Any] | None, global_step: int) -> None:
        """Continue at ``global_step`` of a resumed checkpoint (this schedule fresh, at step 0).

        The checkpoint's own schedule (same scheduler, arguments, warm-up and optimizer)
        continues exactly where it was. Any other (another schedule, another ``--lr``, or a
        checkpoint without one) starts at ``global_step`` as if it had run from step 0: the
        learning rate is the new schedule's at that step (one WARNING line says so).
        """
        same = (saved is not None and saved.get("config") == asdict(self.config)
                and saved.get("optimizer") == asdict(self.optimizer_config))
        if (same and saved.get("scheduler") is not None and self.steps == 0
                and 0 <= int(saved.get("steps", -1)) <= global_step):
            # Saved at global_step (a checkpoint), or before it (the state in memory records the
            # schedule when its tensors were placed, and its steps since are replayed).
            self.reference.load_state_dict(saved["reference"])
            self.scheduler.load_state_dict(saved["scheduler"])
            self.steps = int(saved["steps"])
            self._failed = bool(saved.get("failed", False))
            self.fast_forward(global_step)
            return
        if saved is not None and not same:
            log.warning("the checkpoint's learning-rate schedule was %s on %s; this server's is %s on %s: it takes "
                        "over at global step %d as if it had run from step 0", saved.get("describe") or "none",
                        _optimizer(saved.get("optimizer")), self.describe(), _optimizer(asdict(self.optimizer_config)),
                        global_step)
        elif saved is None and global_step > 0:
            log.warning("the checkpoint has no learning-rate schedule; %s takes over at global step %d as if it had "
                        "run from step 0", self.describe(), global_step)
        self.fast_forward(global_step)

    def fast_forward(self, global_step: int) -> None:
        """Step the scheduler until it stands at ``global_step`` (as many steps as it lacks):
        a scheduler's state may be anything its class keeps, so it is replayed, not computed.
        Bounded (``MAX_REPLAY``: minutes at most), with a progress line every 10 s."""
        if global_step < self.steps:
            raise ValueError(f"the schedule is at step {self.steps}, past global step {global_step}")
        todo = global_step - self.steps
        if todo > MAX_REPLAY:
            raise ValueError(f"global step {global_step:,} is {todo:,} steps of the learning-rate schedule "
                             f"{self.describe()} to replay, more than the {MAX_REPLAY:,} psserver replays: resume "
                             "without --lr-schedule, or from a checkpoint of fewer steps")
        if todo > 100_000:
            log.info("replaying %d steps of the learning-rate schedule", todo)
        shown = time.monotonic()
        while self.steps < global_step:
            self.step()
            if self.steps % 65536 == 0 and time.monotonic() - shown > 10:
                shown = time.monotonic()
                log.info("replaying the learning-rate schedule: %d of %d steps", todo - (global_step - self.steps),
                         todo)


def _optimizer(d: dict | None) -> str:
    return "?" if not d else f"{d.get('name')} lr {d.get('lr'):g}"
