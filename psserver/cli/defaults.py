"""The flags' defaults, read from the config dataclasses they feed: each default is written once,
on the dataclass field, and a flag (and the help text that shows it) takes it from there.

``tests/cli/test_option_defaults.py`` walks every verb's parser and holds the two together.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name``: its ``default``, or a fresh value of its
    ``default_factory`` (a class attribute exists only for the former)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise TypeError(f"{cls.__name__}.{name} has no default")
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


def power_of_two(value: int) -> str:
    """``2^40`` for 1 << 40 (how id spaces are written on the command line), else the number."""
    return f"2^{value.bit_length() - 1}" if value > 0 and value & (value - 1) == 0 else str(value)
