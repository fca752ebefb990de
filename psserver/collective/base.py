"""The small interface a collective strategy implements, chosen by name (Lightning style).

A strategy wraps the model for its parallelism, says which data-parallel shard this rank
reads, and may add work around the optimizer step (post-local-SGD's model averaging).
Everything else (data, loop, checkpoints, control plane) is shared.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from psserver.collective.launcher import DistEnv
from psserver.config.collective import CollectiveConfig

log = logging.getLogger(__name__)

STRATEGIES: dict[str, type[Strategy]] = {}
"""Registered strategies by name: every subclass with a ``name`` adds itself on definition."""


class Strategy(ABC):
    """One way of spreading a model over the process group."""

    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if getattr(cls, "name", None):
            STRATEGIES[cls.name] = cls

    def __init__(self, config: CollectiveConfig, env: DistEnv) -> None:
        self.config = config
        self.env = env
        self.module: nn.Module | None = None
        """The model as set up (the wrapper the step calls)."""
        self.averaged_steps: list[int] = []
        """Steps after which parameters were averaged across ranks (post-local-SGD)."""

    @abstractmethod
    def setup(self, model: nn.Module) -> nn.Module:
        """Place and wrap ``model``; returns the module to call in the training step."""

    @property
    def unwrapped(self) -> nn.Module:
        """The user's model (parameter names without wrapper prefixes)."""
        assert self.module is not None
        return self.module

    @property
    def eval_module(self) -> nn.Module:
        """What evaluation calls; all ranks evaluate together (FSDP needs every rank)."""
        return self.module

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank reads."""
        return self.env.rank

    @property
    def dp_size(self) -> int:
        """Number of data shards (world size over the tensor-parallel degree)."""
        return self.env.world_size

    @property
    def counts_for_eval(self) -> bool:
        """Whether this rank's evaluation counts (one rank per tensor-parallel group)."""
        return True

    def after_optimizer_step(self, step: int) -> None:
        """Called after each ``optimizer.step()`` with the global step just completed."""

    def devices(self) -> list[str]:
        """The devices this rank's share of the model lives on."""
        return [str(self.env.device)]

    def describe(self) -> str:
        return self.name


def create_strategy(config: CollectiveConfig, env: DistEnv) -> Strategy:
    """The registered strategy named ``config.mode``. Strategies register themselves when
    their module is imported (``psserver.collective.loop`` imports the one a run asks for); this
    module never imports its subclasses."""
    try:
        cls = STRATEGIES[config.mode]
    except KeyError:
        raise ValueError(f"unknown strategy {config.mode!r}; known: {', '.join(sorted(STRATEGIES))}") from None
    return cls(config, env)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter (gathers DTensors: a collective, call on every rank)."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t
