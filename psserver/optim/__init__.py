"""psserver's own optimizers, which the server takes by name beside ``torch.optim``'s
(``psserver.config.optimizer.optimizer_class``)."""

from __future__ import annotations

from psserver.optim.delayed_nesterov import DelayedNesterov

OWN_OPTIMIZERS = {"delayed_nesterov": DelayedNesterov}
"""psserver's optimizers by the name ``--optimizer`` takes."""

__all__ = ["OWN_OPTIMIZERS", "DelayedNesterov"]
