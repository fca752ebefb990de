"""What the trainer-compute protocols share (``pull``, ``pushpull``).

The trainer keeps a replica of the model on its own device; the server keeps the fp32 master
weights and the optimizer state, sends parameters and receives gradients in the trainer's
wire dtype (``--wire-dtype``), always on the CPU. The trainer evaluates on its replica, loaded
once from the server's current parameters.
"""

from __future__ import annotations

import threading

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from psserver.models import build_model
from psserver.ps.messages import JoinRequest
from psserver.ps.protocols.base import ServerHalf, TrainerHalf

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainerComputeServer(ServerHalf):
    """Remembers each trainer's wire dtype; serves the flat parameters for evaluation."""

    ops = ("parameters",)
    compute_threads = 1  # an update and copies, on a host the trainers share (psserver.ps.compute)

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._wire_lock = threading.Lock()
        self._wire: dict[str, torch.dtype] = {}

    def join_info(self, trainer: str, request: JoinRequest) -> dict:
        self.set_wire_dtype(trainer, request.wire_dtype)
        return {**super().join_info(trainer, request),
                "shard_params": [len(s.params) for s in self.engine.shards]}

    def set_wire_dtype(self, trainer: str, name: str) -> None:
        if name not in WIRE_DTYPES:
            raise ValueError(f"unknown wire dtype {name!r}; known: {', '.join(WIRE_DTYPES)}")
        with self._wire_lock:
            self._wire[trainer] = WIRE_DTYPES[name]

    def wire_dtype(self, trainer: str) -> torch.dtype:
        with self._wire_lock:
            return self._wire.get(trainer, torch.float32)

    def parameters(self, trainer: str) -> list[torch.Tensor]:
        """Every shard's parameters as one flat fp32 CPU buffer, copied at one step (no step
        opens: the trainer evaluates on them)."""
        self.engine.wait_applied(trainer)
        return self.engine.flat_parameters()

    def trainer_gone(self, trainer: str, evicted: bool) -> None:
        with self._wire_lock:
            self._wire.pop(trainer, None)
        super().trainer_gone(trainer, evicted)


class TrainerComputeHalf(TrainerHalf):
    """The trainer's replica: the model on ``channel.device``, its parameters grouped as the
    server's shards (one flat buffer each on the wire)."""

    def __init__(self, channel) -> None:
        super().__init__(channel)
        self.device: torch.device = channel.device
        self.wire_dtype: torch.dtype = channel.wire_dtype
        self.model = build_model(channel.info["model"]).to(self.device)
        self.names = [n for n, _ in self.model.named_parameters()]
        params = list(self.model.parameters())
        self.shards: list[list[torch.nn.Parameter]] = []
        for n in channel.info["shard_params"]:
            self.shards.append(params[:n])
            params = params[n:]
        self._loaded = False  # the replica holds the server's current parameters

    def load(self, flats: list[torch.Tensor]) -> None:
        """Copy one flat buffer per shard (any dtype, on the CPU) into the replica."""
        with torch.no_grad():
            for shard, flat in zip(self.shards, flats, strict=True):
                vector_to_parameters(flat.to(self.device, torch.float32, non_blocking=True), shard)

    def flat_grads(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """One flat CPU buffer per shard in the wire dtype, from one gradient per parameter
        (None: unused, zero)."""
        by_param = dict(zip([p for shard in self.shards for p in shard], grads, strict=True))
        return [parameters_to_vector([torch.zeros_like(p) if by_param[p] is None else by_param[p] for p in shard])
                .to("cpu", self.wire_dtype) for shard in self.shards]

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type == "cpu":
            return x, y
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self._loaded = False
        return self.train_step(*self.batch(x, y))

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        raise NotImplementedError

    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """Eval-mode outputs of the replica, loaded once with the server's current parameters."""
        if not self._loaded:
            self.load(self.channel.call("parameters"))
            self._loaded = True
        self.model.eval()
        try:
            with torch.no_grad():
                return self.model(x.to(self.device)).float().to("cpu")
        finally:
            self.model.train()
