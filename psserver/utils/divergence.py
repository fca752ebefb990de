"""Training that diverges while every value stays finite: a loss or a model's outputs grown by
orders of magnitude over their first value. No guard on non-finite values sees it (a log-
probability loss fed raw outputs, ``nll_loss`` after a model without ``log_softmax``, falls
without bound: -8e8 after one epoch, every value finite), so a watch tells it once.

One comparison per value, of numbers the caller has already; nothing is kept but the first.
"""

from __future__ import annotations

import math

GROWTH = 1e4
"""How many times its first magnitude (at least 1) a value must reach to be told. Training
that converges moves a loss down and logits up by tens (log-probabilities of a confident
classifier reach -50 to -100 from -2.3); divergence reaches millions."""

CAUSES = ("a loss that takes log-probabilities (nll_loss) fed a model's raw outputs falls without bound; "
          "so does training at too high a learning rate")
"""The usual causes, for the message."""


class GrowthWatch:
    """Tells once when a series' magnitude reaches :data:`GROWTH` times its first value's."""

    def __init__(self, growth: float = GROWTH) -> None:
        self.growth = growth
        self.first: float | None = None
        self.told = False

    def observe(self, value: float) -> str | None:
        """``value``'s place in the series: None, or once a sentence saying how far it grew
        (non-finite values are left to the guards that refuse them)."""
        if self.told or not math.isfinite(value):
            return None
        if self.first is None:
            self.first = value
            return None
        if abs(value) < self.growth * max(abs(self.first), 1.0):
            return None
        self.told = True
        return f"{value:.3g}, from {self.first:.3g} at first: training is diverging ({CAUSES})"
