"""The two halves of ``--step diloco`` in one process, without RPC: what the tests of its
windows and of streaming DiLoCo's fragments share."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from psserver.common.devices import resolve_devices
from psserver.common.transport import WIRE_DTYPES
from psserver.config import OptimizerConfig, ServerConfig, TrainerConfig
from psserver.server.engine.engine import StepEngine
from psserver.server.steps.diloco import DiLoCoServer
from tests.end_to_end.joins import give_replica, join_request


class Done:
    """A call's future, its value already there (the in-process call ran to its end)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value


class Channel:
    """The ``Channel`` a trainer half sees, calling the server half in-process (``others``: the
    halves of server processes 1, 2, ..., of a model partitioned over them all)."""

    def __init__(self, half: DiLoCoServer, name: str, rank: int, config: TrainerConfig,
                 others: tuple[DiLoCoServer, ...] = (), steps_before: int = 0) -> None:
        self.name, self.config, self.half = name, config, half
        self.halves = [half, *others]
        self.steps_before = steps_before
        self.bucket_cap_mb = 25.0
        self.servers = [f"s{i}" for i in range(len(self.halves))]
        self.device = torch.device("cpu")
        self.wire_dtype = WIRE_DTYPES["fp32"]
        for h in self.halves:
            h.engine.trainer_joined(name)
        request = dataclasses.replace(join_request(rank, name), steps=steps_before)
        self.info: dict[str, Any] = {"model": "mlp", **half.join_info(name, request)}
        if others:
            self.info.update(servers=self.servers, plan=half.engine.plan.to_dict())
        give_replica(self, "mlp")

    def call(self, op: str, *args: Any) -> Any:
        assert op in self.half.ops
        return getattr(self.half, op)(self.name, *args)

    def call_async(self, op: str, *args: Any) -> Done:
        return Done(self.call(op, *args))

    def call_each(self, op: str, args: list[tuple]) -> list:
        assert op in self.half.ops and len(args) == len(self.halves)
        return [getattr(h, op)(self.name, *a) for h, a in zip(self.halves, args, strict=True)]

    def call_each_async(self, op: str, args: list[tuple]) -> Done:
        return Done(self.call_each(op, args))


def diloco_engine(outer: OptimizerConfig, k: int = 1, mode: str = "sync", dynamic: bool = False,
                  servers: int = 1, rank: int = 0) -> StepEngine:
    """The engine of server process ``rank`` of ``servers`` (each builds the same ``mlp``)."""
    cfg = ServerConfig(model="mlp", devices=["cpu"], update="diloco", outer=mode, sync_trainers=k, optimizer=outer,
                       dynamic_local_steps=dynamic, num_servers=servers, server_rank=rank,
                       coordinator="127.0.0.1:1" if rank else None)
    return StepEngine(cfg, resolve_devices(cfg.devices))


def batches(n: int, seed: int = 3, size: int = 8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 1, 28, 28, generator=g), torch.randint(0, 10, (size,), generator=g)) for _ in range(n)]


def server_weights(engine: StepEngine) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in engine.params])
