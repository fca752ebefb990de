"""Sizes as people read them, for log lines, errors and ``psserver status``."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that leaves a number >= 1 (bytes whole)."""
    for unit in UNITS:
        if abs(n) < 1024 or unit == UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
