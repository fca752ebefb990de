"""The server's learning-rate schedule (``psserver serve --lr-schedule``): which scheduler, its
arguments and the warm-up, checked before anything starts.

The schedule is the server's, which owns the optimizer; trainers never see it. It is built and
stepped by ``psserver.server.engine.lr_schedule``; this module only names and checks it, so a bad flag is
one line and exit code 2 before the model is built.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from psserver.config.options import option
from psserver.errors import UserCodeError
from psserver.utils.references import check_arguments, is_reference, load_reference

REFUSED: dict[str, str] = {
    "ReduceLROnPlateau": "it steps on a metric (a validation loss) that the server does not have",
    "SequentialLR": "it takes other schedulers as arguments",
    "ChainedScheduler": "it takes other schedulers as arguments",
    "LambdaLR": "it takes functions as arguments",
    "MultiplicativeLR": "it takes functions as arguments",
}
"""``torch.optim.lr_scheduler`` classes that cannot be named bare, and why. All but
``ReduceLROnPlateau`` can be built by a user's function given as ``MODULE:ATTR``."""


def scheduler_names() -> list[str]:
    """The ``torch.optim.lr_scheduler`` classes ``--lr-schedule NAME`` takes, sorted."""
    from torch.optim import lr_scheduler

    return sorted(name for name, obj in vars(lr_scheduler).items()
                  if inspect.isclass(obj) and issubclass(obj, lr_scheduler.LRScheduler) and not name.startswith("_")
                  and obj is not lr_scheduler.LRScheduler and name not in REFUSED)


def resolve_scheduler(name: str) -> Callable[..., Any]:
    """The scheduler class or factory ``name`` stands for: a ``torch.optim.lr_scheduler`` class
    by name, or ``MODULE:ATTR`` (a scheduler class, or a function ``(optimizer, **args) ->
    scheduler``); ``UserCodeError`` (one line) otherwise."""
    if is_reference(name):
        obj = load_reference(name, "--lr-schedule")
        if not callable(obj):
            raise UserCodeError(f"--lr-schedule {name} is a {type(obj).__name__}, not a scheduler class or a "
                                "function (optimizer, **args) -> scheduler")
        return obj
    if name in REFUSED:
        how = ("" if name == "ReduceLROnPlateau" else
               ": build it in a function (optimizer, **args) -> scheduler of yours and give --lr-schedule MODULE:ATTR")
        raise UserCodeError(f"--lr-schedule {name} is not supported: {REFUSED[name]}{how}")
    known = scheduler_names()
    if name not in known:
        raise UserCodeError(f"--lr-schedule {name!r} is not a torch.optim.lr_scheduler class the server can step; "
                            f"known: {', '.join(known)} (or MODULE:ATTR)")
    from torch.optim import lr_scheduler

    return getattr(lr_scheduler, name)


def _finite(value: Any) -> bool:
    """Whether ``value`` (parsed JSON) holds no NaN or infinity."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


@dataclass
class LRScheduleConfig:
    """The learning rate of the server's optimizer over its global steps (``--lr-schedule``,
    ``--lr-schedule-args``, ``--warmup-steps``); disabled by default: the lr stays ``--lr``."""

    name: str | None = option(
        None, flag="--lr-schedule", metavar="NAME|MODULE:ATTR",
        help="a torch.optim.lr_scheduler class by name (CosineAnnealingLR, StepLR, MultiStepLR, LinearLR, "
             "ExponentialLR, PolynomialLR, OneCycleLR, CyclicLR, ...), or MODULE:ATTR: a scheduler class or a "
             "function (optimizer, **args) -> scheduler (default: none, the lr stays --lr)")
    """A ``torch.optim.lr_scheduler`` class by name (``CosineAnnealingLR``, ``StepLR``, ...), or
    ``MODULE:ATTR``: a scheduler class or a function ``(optimizer, **args) -> scheduler``; None:
    no schedule (only the warm-up, if any, then the base lr)."""
    args: dict[str, Any] = option(
        factory=dict, flag="--lr-schedule-args", metavar="JSON",
        help='keyword arguments of the scheduler beside the optimizer, a JSON object ({"T_max": 1000})')
    """Keyword arguments of the scheduler, beside the optimizer (``--lr-schedule-args JSON``)."""
    warmup_steps: int = option(
        0, metavar="N",
        help="linear warm-up: the lr at step t < N is --lr * (t+1)/N, then the schedule from its own step 0, as "
             "SequentialLR(opt, [LinearLR(opt, start_factor=1/N, end_factor=1.0, total_iters=N-1), schedule], "
             "milestones=[N]); without --lr-schedule the lr stays --lr after it (default {default})")
    """N > 0: a linear warm-up before the schedule, as ``SequentialLR([LinearLR(start_factor=1/N,
    end_factor=1.0, total_iters=N-1), schedule], milestones=[N])``: the lr at step t < N is
    base lr * (t+1)/N, and the schedule starts at its own step 0 at step N. 0: none."""

    def __post_init__(self) -> None:
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.args, dict) or not all(isinstance(k, str) for k in self.args):
            raise ValueError(f"--lr-schedule-args must be a JSON object of keyword arguments, like "
                             f"'{{\"T_max\": 1000}}'; got {self.args!r}")
        if not _finite(self.args):
            raise ValueError(f"--lr-schedule-args: NaN or infinity is not a value an argument may take: {self.args}")
        if self.name is None:
            if self.args:
                raise ValueError("--lr-schedule-args needs --lr-schedule (the scheduler they are for)")
            return
        self.name = self.name.strip()
        factory = resolve_scheduler(self.name)
        # The optimizer is the first argument; the server passes it, never the JSON.
        check_arguments(factory, (None,), self.args, f"--lr-schedule {self.name}")
        _check_types(factory, self.args, f"--lr-schedule {self.name}")

    @property
    def enabled(self) -> bool:
        """Whether the server sets the lr at every step (a schedule or a warm-up)."""
        return self.name is not None or self.warmup_steps > 0

    def describe(self) -> str:
        """One line for logs and ``psserver status``; empty when disabled."""
        if self.name is None:
            return f"linear warm-up over {self.warmup_steps} steps, then constant" if self.warmup_steps else ""
        args = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
        warmup = f" after a linear warm-up of {self.warmup_steps} steps" if self.warmup_steps else ""
        return f"{self.name}({args}){warmup}"


def _check_types(factory: Any, args: dict[str, Any], what: str) -> None:
    """Arguments a scheduler annotates plainly ``int`` or ``float`` must be numbers of that kind:
    a string ``gamma`` passed every start-time check and failed only at the step it was used."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    for key, value in args.items():
        annotation = params[key].annotation if key in params else None
        kind = {"int": (int,), "float": (int, float), int: (int,), float: (int, float)}.get(annotation)
        if kind is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise UserCodeError(f"{what}: {key} is {'an int' if kind == (int,) else 'a number'}, got {value!r}")
