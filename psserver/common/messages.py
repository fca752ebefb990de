"""What trainers and the server send each other besides tensors: plain frozen dataclasses,
importable by both sides (and by the step protocols) without importing the endpoint."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any

from psserver.config.protocols import COMPUTE_MODES
from psserver.config.trainer import OVERLAP_MODES, TRANSPORTS, WIRE_DTYPES

ALLREDUCE_OPS = ("average", "sum", "min", "max")
"""How ``ps.allreduce`` combines the trainers' values (``psserver.server.averages``)."""
ALLREDUCE_MAX_ELEMENTS = 1 << 20
"""What one contribution may hold: metrics and small statistics, not a model."""
ALLREDUCE_MAX_NAME = 200


@dataclass(frozen=True)
class Report:
    """A trainer's progress, riding on its calls (the control plane shows it)."""

    steps: int
    samples: int
    loss: float
    samples_per_s: float
    accuracy: float | None = None
    """Held-out accuracy, once the trainer has evaluated."""
    epoch: int = 0
    """The epoch it trains in, and where in it (``epoch_samples`` of its shard, ``batch_idx``
    batches): what a trainer started again under its rank continues from."""
    epoch_samples: int = 0
    batch_idx: int = 0
    finished: bool = False
    """Its loop ran to its end: a trainer of its rank started again starts over."""


@dataclass(frozen=True)
class JoinRequest:
    rank: int
    name: str
    """The trainer's RPC name (``trainer_<rank>_<incarnation>``)."""
    host: str
    pid: int
    step: str | None
    """The step protocol the trainer speaks; None: the default of ``compute``."""
    optimizer: dict | None
    """The optimizer it asks for (``OptimizerConfig`` fields), None for the server's."""
    compute: str | None = None
    """Where it wants its steps to run; None: the server's pin, else ``trainer``."""
    wire_dtype: str = "fp32"
    """dtype of the parameters and gradients it exchanges (trainer compute)."""
    device: str = "cpu"
    """Where it runs the model (trainer compute)."""
    model: str | None = None
    """The reference of the trainer's model (``--model``), plain text the server only records."""
    model_args: dict | None = None
    """Its ``--model-args``."""
    layout: dict | None = None
    """The ``ModelLayout`` of its replica, as plain data, checked against the server's."""
    values: list | None = None
    """Its initial tensors in the layout's order, sent only while the server has no model (the
    first trainer's become the model's, as Horovod's ``broadcast_parameters`` from rank 0)."""
    steps: int = 0
    """Steps this rank trained before this join: 0 for a fresh trainer, its position for one
    that rejoins (its gradients are numbered by step across rejoins)."""
    transport: str = "cpu"
    """The path its flat buffers take (``psserver.common.transport``): ``device-map`` ones cross
    as CUDA tensors, and the server replies with CUDA tensors too."""
    transport_reason: str = ""
    """Why that path, as the trainer logged it (``psserver status`` shows it)."""
    overlap: str = "off"
    """Its ``--overlap`` (``auto``, ``on``, ``off``): whether it may compute a step while the
    call that hands in the one before is in flight (the server decides, by its update mode)."""

    def malformed(self) -> str | None:
        """What in this request no psserver trainer sends (a field of another type, a number out
        of range), else None: a peer may send anything, and the server checks it before any use."""
        for f in fields(self):
            value = getattr(self, f.name)
            kinds = _JOIN_FIELDS[f.name]
            if value is None and type(None) in kinds:
                continue
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                return f"its {f.name} is a {type(value).__name__}"
        if not 0 <= self.rank < 2**31 or not 0 <= self.steps < 2**53 or not 0 <= self.pid < 2**31:
            return "its rank, steps or pid is out of range"
        for name in ("name", "host", "step", "compute", "wire_dtype", "device", "model", "transport",
                     "transport_reason", "overlap"):
            value = getattr(self, name)
            if value is not None and (not value.isprintable() or len(value) > 1024):
                return f"its {name} is not one line of at most 1024 printable characters"
        if re.fullmatch(rf"trainer_{self.rank}_\d{{1,18}}", self.name) is None:
            return f"its name {self.name[:40]!r} is not a trainer's of rank {self.rank} (trainer_{self.rank}_N)"
        if self.transport not in TRANSPORT_PATHS:
            return f"its transport {self.transport[:20]!r} is not one of {', '.join(TRANSPORT_PATHS)}"
        if self.compute is not None and self.compute not in COMPUTE_MODES:
            return f"its compute is {self.compute[:20]!r}, not one of {', '.join(COMPUTE_MODES)}"
        if self.wire_dtype not in WIRE_DTYPES or self.overlap not in OVERLAP_MODES:
            return "its wire dtype or overlap is not one a trainer speaks"
        for name in ("optimizer", "model_args"):
            why = plain_data(getattr(self, name))
            if why is not None:
                return f"its {name} {why}"
        return None


MAX_DEPTH, MAX_JSON_BYTES = 16, 1 << 16
TRANSPORT_PATHS = tuple(t for t in TRANSPORTS if t != "auto")
"""The paths a trainer's flat buffers take, as a join names them (``auto`` is chosen before)."""


def plain_data(value: object) -> str | None:
    """Why ``value`` is not small plain JSON data (what a model's arguments or an optimizer's
    are: recorded in checkpoints, published, sent back with every join), else None."""
    def depth(v: object, level: int) -> int:
        if level > MAX_DEPTH:
            return level
        if isinstance(v, dict):
            return max((depth(x, level + 1) for x in v.values()), default=level)
        if isinstance(v, list | tuple):
            return max((depth(x, level + 1) for x in v), default=level)
        return level

    if depth(value, 0) > MAX_DEPTH:
        return f"is nested more than {MAX_DEPTH} deep"
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        return f"is not plain JSON data ({str(e)[:60]})"
    if len(text) > MAX_JSON_BYTES:
        return f"is over {MAX_JSON_BYTES} bytes of JSON"
    return None


_JOIN_FIELDS: dict[str, tuple[type, ...]] = {
    "rank": (int,), "name": (str,), "host": (str,), "pid": (int,), "step": (str, type(None)),
    "optimizer": (dict, type(None)), "compute": (str, type(None)), "wire_dtype": (str,), "device": (str,),
    "model": (str, type(None)), "model_args": (dict, type(None)), "layout": (dict, type(None)),
    "values": (list, type(None)), "steps": (int,), "transport": (str,), "transport_reason": (str,),
    "overlap": (str,),
}


@dataclass(frozen=True)
class ServerHello:
    """A server process of rank > 0 registering with server 0 (several server processes)."""

    rank: int
    num_servers: int
    model: str
    seed: int
    host: str
    pid: int
    parameters: int
    """Elements of the partition it built: server 0 checks it against its own plan."""
    checkpoints: bool
    """Whether it has a ``--checkpoint-dir`` (needed when server 0 has one)."""
    lr_schedule: dict | None = None
    """Its learning-rate schedule (``LRScheduleConfig`` fields): every server steps server 0's."""
    memory_step: int | None = None
    """The global step of the state a dead process of it left in memory (None: none found):
    server 0 says whether it continues from there (``ServerGroup.register``)."""


@dataclass(frozen=True)
class QuantizedFlat:
    """A flat fp32 buffer as ``bits``-bit codes with one fp32 scale per ``block`` elements
    (``psserver.common.quantize``): a DiLoCo pseudo-gradient sent with ``--compress``."""

    data: Any
    """uint8 codes (int8 as bytes; 4 bits: two per byte, offset by 8)."""
    scales: Any
    """fp32, one per block: ``max|x| / q_max`` of the block."""
    bits: int
    numel: int
    block: int
