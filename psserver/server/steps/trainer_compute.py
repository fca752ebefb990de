"""What the trainer-compute protocols share (``pull``, ``pushpull``).

The trainer keeps a replica of the model on its own device; the server keeps the fp32 master
weights and the optimizer state, sends parameters and receives gradients in the trainer's
wire dtype (``--wire-dtype``), as one flat buffer per shard. Where the buffers travel is the
trainer's transport (``psserver.common.transport``): as CUDA tensors from device to device
(``device-map``, ``--step pushpull``), through pinned host buffers the trainer reuses every step
(``staged``), or through host memory (``cpu``). The trainer evaluates on its replica, loaded
once from the server's current parameters.
"""

from __future__ import annotations

import logging
import threading

import torch

from psserver.common import torch_rpc
from psserver.common.messages import JoinRequest
from psserver.common.transport import WIRE_DTYPES
from psserver.config.ps import TRANSPORTS
from psserver.server.steps.base import ServerHalf

log = logging.getLogger(__name__)


PATHS = tuple(t for t in TRANSPORTS if t != "auto")

"""The transports a trainer may report (``psserver.common.transport``): ``--transport``'s, less ``auto``."""

REASON_CHARS = 200

"""The most of a trainer's reason for its transport the server keeps."""



class TrainerComputeServer(ServerHalf):
    """Remembers each trainer's wire dtype; serves the flat parameters for evaluation."""

    ops = ("parameters", "rows")
    compute_threads = 1  # an update and copies, on a host the trainers share (psserver.server.engine.compute)

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._wire_lock = threading.Lock()
        self._wire: dict[str, torch.dtype] = {}
        self._transport: dict[str, tuple[str, str]] = {}  # trainer -> (path, why)

    device_replies = False
    """Whether this protocol sends its flat buffers as the trainer's transport says (one that
    does not carries them through host memory: such a trainer is told it is ``cpu``)."""

    def check_join(self, request: JoinRequest) -> None:
        if request.transport not in PATHS:
            raise ValueError(f"unknown transport {str(request.transport)[:40]!r}; known: {', '.join(PATHS)}")
        if request.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"unknown wire dtype {str(request.wire_dtype)[:20]!r}; known: {', '.join(WIRE_DTYPES)}")

    def join_info(self, trainer: str, request: JoinRequest) -> dict:
        self.check_join(request)  # before anything is kept of the trainer
        self.set_wire_dtype(trainer, request.wire_dtype)
        info = {**super().join_info(trainer, request), "shard_params": [len(s.params) for s in self.engine.shards],
                "transport": self._set_transport(trainer, request)}
        if self.engine.tables is not None:
            info["tables"] = self.engine.tables.describe()
        buffers = self.engine.buffers
        if buffers is not None:
            # rank0: only trainer 0's statistics reach the server (DDP's broadcast_buffers).
            info["buffers"] = {"numel": buffers.numel, "send": buffers.policy == "average" or request.rank == 0}
        return info

    def with_buffers(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """A reply's parameters, and the model's buffers after them when this server holds any."""
        if self.engine.buffers is None:
            return params
        return [*params, self.engine.flat_buffers()]

    def check_buffers(self, buffers: object) -> torch.Tensor | None:
        """A trainer's buffers as sent (None: none sent); ``ValueError`` for ones that do not fit."""
        if buffers is None:
            return None
        if self.engine.buffers is None:
            raise ValueError("this server holds no buffers of the model, yet a trainer sent some")
        return self.engine.buffers.check(buffers)

    def _set_transport(self, trainer: str, request: JoinRequest) -> dict[str, str]:
        """The path ``trainer``'s buffers take, as the trainer asked unless this protocol or this
        server cannot use it (then ``cpu`` or ``staged``, and why); what its join reply tells it."""
        kind, reason = request.transport, request.transport_reason
        reason = _one_line(reason)
        if kind != "cpu" and not self.device_replies:
            kind, reason = "cpu", "its --step sends through host memory (flat buffers on the device: --step pushpull)"
        elif kind == "device-map" and not all(s.device.type == "cuda" for s in self.engine.shards):
            kind, reason = "staged", "the server's model is not on a GPU"
        with self._wire_lock:
            self._transport[trainer] = (kind, reason)
        if kind == "device-map":  # its replies' CUDA tensors go to its device
            torch_rpc.map_replies(trainer, {self.engine.shards[0].device: torch.device(request.device)})
        return {"kind": kind, "reason": reason}

    def on_device(self, trainer: str) -> bool:
        """Whether ``trainer``'s buffers cross as CUDA tensors (its device map to the shard's device)."""
        return self.transport_of(trainer)[0] == "device-map"

    def transport_of(self, trainer: str) -> tuple[str, str]:
        """The path ``trainer``'s buffers take now, and why (``("", "")``: none known)."""
        with self._wire_lock:
            return self._transport.get(trainer, ("", ""))

    def probe(self, trainer: str, x: object) -> torch.Tensor:
        """A ``device-map`` trainer's first call: one value that must arrive on the shard's device,
        and go back to the trainer's as a CUDA tensor too (plus one)."""
        if not self.on_device(trainer):
            raise ValueError("only a trainer on the device-map path probes it")
        device = self.engine.shards[0].device
        if not isinstance(x, torch.Tensor) or x.numel() != 1 or x.device != device:
            where = x.device if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"the probe arrived as {where}, not one value on the server's {device}")
        return x + 1

    def fall_back(self, trainer: str, reason: object) -> None:
        """A ``device-map`` trainer whose probe failed goes ``staged`` from now on (``reason``: what failed)."""
        if not self.on_device(trainer):
            raise ValueError("only a trainer on the device-map path falls back from it")
        why = _one_line(f"the device map failed ({reason}), so through pinned host memory")
        with self._wire_lock:
            self._transport[trainer] = ("staged", why)
        torch_rpc.unmap_replies(trainer)
        log.warning("trainer %s: %s", trainer, why)

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
        return self.with_buffers(self.engine.flat_parameters())

    def rows(self, trainer: str, ids: object) -> dict[str, torch.Tensor]:
        """Rows of an embedding table for evaluation (nothing is created), after ``trainer``'s
        last update landed."""
        tables = self.engine.tables
        if tables is None:
            raise ValueError(f"model {self.engine.config.model} has no embedding tables")
        self.engine.wait_applied(trainer)
        return tables.lookup(ids)

    def trainer_gone(self, trainer: str, evicted: bool) -> None:
        with self._wire_lock:
            self._wire.pop(trainer, None)
            if self._transport.pop(trainer, ("", ""))[0] == "device-map":
                torch_rpc.unmap_replies(trainer)
        super().trainer_gone(trainer, evicted)



def _one_line(text: object) -> str:
    """What a trainer says of its transport, as the log and the status show it: one printable
    line of at most ``REASON_CHARS`` characters."""
    return "".join(c if c.isprintable() else " " for c in str(text)[:REASON_CHARS])
