"""Dynamic local updates (DyLU, Liu et al., 2024): each trainer's local steps per window sized
by its measured inner step rate, so that a slow trainer's window takes as long as a fast one's
and its pseudo-gradient is no staler than theirs: ``H_i = max(1, floor(H * v_i / v_max))``,
``v_max`` the fastest live trainer's rate."""

from __future__ import annotations

import math
import threading


class LocalStepPlanner:
    """The inner step rate each trainer reported with its last window, and its window from it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates: dict[str, float] = {}

    def observe(self, trainer: str, steps: int, seconds: float) -> None:
        """``trainer`` took ``steps`` inner steps in ``seconds`` (its last window, syncs excluded)."""
        if steps < 1 or not seconds > 0 or not math.isfinite(seconds):
            raise ValueError(f"a window is >= 1 step in a positive time, got {steps} in {seconds!r}s")
        with self._lock:
            self._rates[trainer] = steps / seconds

    def steps_for(self, trainer: str, base: int) -> int:
        """``trainer``'s next window of a base of ``base`` steps (``base`` while its rate is unknown)."""
        with self._lock:
            rate = self._rates.get(trainer)
            fastest = max(self._rates.values(), default=0.0)
        if rate is None or fastest <= 0:
            return base
        return max(1, math.floor(base * rate / fastest))

    def forget(self, trainer: str) -> None:
        """``trainer`` left: it sets nobody's window any more."""
        with self._lock:
            self._rates.pop(trainer, None)
