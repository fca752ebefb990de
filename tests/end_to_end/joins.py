"""What a trainer brings to a join, for tests that drive the server's halves without RPC."""

from __future__ import annotations

from psserver.common.devices import resolve_devices
from psserver.common.messages import JoinRequest
from psserver.config import OptimizerConfig, ServerConfig
from psserver.models import build_model, get_model_spec
from psserver.models.layout import ModelLayout, values_of
from psserver.models.losses import get_loss
from psserver.server.engine.engine import StepEngine


def join_request(rank: int = 0, name: str = "t", *, model: str = "mlp", step: str | None = None,
                 optimizer: dict | None = None, compute: str | None = "trainer", wire_dtype: str = "fp32",
                 values: bool = False, device: str = "cpu", overlap: str = "off") -> JoinRequest:
    """A join of a trainer of ``model`` (its layout; its initial values too with ``values``)."""
    replica = build_model(model)
    layout = ModelLayout.of(replica)
    return JoinRequest(rank, name, "host", 1, step, optimizer, compute, wire_dtype, device, model, {},
                       layout.to_dict(), values_of(replica, layout) if values else None, overlap=overlap)


def give_replica(channel, model: str) -> None:
    """What a session gives its protocol's trainer half: the model's spec, its replica and loss."""
    channel.spec = get_model_spec(model)
    channel.model = build_model(channel.spec)
    channel.loss_fn = get_loss(channel.spec.loss)


def mlp_engine(*joined: str) -> StepEngine:
    """A server's engine of ``mlp`` on the CPU with Adam, which ``joined`` trainers have joined
    (the caller closes it)."""
    cfg = ServerConfig(model="mlp", devices=["cpu"], optimizer=OptimizerConfig(name="adam", lr=0.01))
    engine = StepEngine(cfg, resolve_devices(cfg.devices))
    for name in joined:
        engine.trainer_joined(name)
    return engine
