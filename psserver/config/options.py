"""A configuration field that is also a command-line option, declared once.

A field made with :func:`option` carries its flag's name, help, value parser, choices and
metavar in its metadata beside its default, so the CLI (``psserver.cli.builder``) derives the
flag from the field and nothing about it is written a second time. The help may hold
``{default}``, which the builder fills with the field's default as the flag shows it.

Validation stays in each dataclass's ``__post_init__`` (``ValueError``, one line naming the
flag): what the library builds is checked the same way as what the command line builds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OPTION = "psserver.option"
"""The key of a field's metadata that holds its :class:`Option`."""


@dataclass(frozen=True)
class Option:
    """How a configuration field appears on the command line."""

    help: str | Callable[[], str] | None
    """The flag's help; ``{default}`` is replaced by the default as shown (:attr:`show`). A
    function: the help it returns when the parser is built (one that names what a module that
    imports torch holds). None: the field takes the flag another configuration declares, and
    its help is there (``--model`` of both training modes)."""
    flag: str | None = None
    """The flag; None: ``--`` and the field's name with dashes."""
    parse: Callable[[str], Any] | None = None
    """Text to value, ``ValueError`` for bad text (one line, exit 2); None: from the field's type
    (``int``, ``float``: finite, ``Path``: not empty, ``str``; a ``dict`` field takes a JSON
    object, parsed when the configuration is built so that its errors name the flag)."""
    choices: Sequence[str] | None = None
    metavar: str | None = None
    show: Callable[[Any], str] | None = None
    """The default as the help shows it; None: ``:g`` for a number, ``yes``/``no`` for a flag."""
    negate: bool = False
    """A ``--no-X`` switch: given, the field is False; left out, the field's default."""
    const: Any = None
    """The value of the flag given without one (``--resume``: ``latest``); None: it takes one."""
    common: bool = False
    """A flag every mode of its verb shares: shown above the argument groups."""
    unset: bool = False
    """Left out, the flag holds None (the field keeps its default): for a flag whose being given
    matters (``--id-space`` is refused for a dataset that has no ids)."""
    group: str | None = None
    """The argument group the flag is shown in, where it is not its configuration's."""
    env_default: Callable[[], Any] | None = None
    """The flag's default where a launcher's environment states it (``--rank``: ``$RANK``), read
    when the parser is built; None (unset) leaves the field's default."""


def option(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None,
           help: str | Callable[[], str] | None, **how: Any) -> Any:
    """A dataclass field with ``default`` (or ``factory``) that is also a flag (:class:`Option`)."""
    metadata = {OPTION: Option(help=help, **how)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def option_of(f: dataclasses.Field) -> Option | None:
    return f.metadata.get(OPTION)


def flag_of(f: dataclasses.Field) -> str:
    opt = option_of(f)
    return (opt.flag if opt and opt.flag else None) or "--" + f.name.replace("_", "-")


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name``: its ``default``, or a fresh value of its
    ``default_factory``."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise TypeError(f"{cls.__name__}.{name} has no default")
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


def check_choices(config: Any) -> None:
    """Each field of ``config`` whose option has choices holds one of them (or None, where that is
    its default): the choices the flag offers are the ones a configuration the library builds is
    held to, declared once. ``ValueError`` naming the flag."""
    for f in dataclasses.fields(config):
        opt = option_of(f)
        if opt is None or opt.choices is None:
            continue
        value = getattr(config, f.name)
        if value is None and field_default(type(config), f.name) is None:
            continue
        if value not in opt.choices:
            raise ValueError(f"{flag_of(f)} must be one of {', '.join(opt.choices)}, got {value!r}")


# Value parsers: text to value, ValueError with a readable message.

def finite_float(text: str) -> float:
    """A number; NaN and infinities are refused (a timeout of inf overflowed in the RPC layer, an
    lr of inf trained to NaN)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {text!r}")
    return value


def path_value(text: str) -> Path:
    """A path; an empty one is refused (``Path("")`` is the current directory, where
    ``--checkpoint-dir ''`` wrote its checkpoints)."""
    if not text.strip():
        raise ValueError("an empty path names no file or directory")
    return Path(text)


def id_count(value: str) -> int:
    """A count of ids: a plain integer, or ``2^40`` / ``2**40`` (id spaces are powers of two,
    and 1099511627776 is easy to mistype)."""
    text = value.strip().replace("_", "")
    base, sep, exp = text.partition("**") if "**" in text else text.partition("^")
    try:
        if not sep:
            return int(text)
        b, e = int(base), int(exp)
    except ValueError:
        raise ValueError(f"{value!r} is not an integer (e.g. 1099511627776, 2^40 or 2**40)") from None
    if not 0 <= e <= 64 or not 0 <= b <= 2**32 or b**e > 2**64:
        raise ValueError(f"{value!r}: want a power B^E with 0 <= E <= 64, at most 2^64")
    return b**e


def comma_list(text: str) -> list[str] | None:
    """``cpu,cuda:0`` as a list; an empty text as None (not given)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    return items or None


def power_of_two(value: int) -> str:
    """``2^40`` for 1 << 40 (how id spaces are written on the command line), else the number."""
    return f"2^{value.bit_length() - 1}" if value > 0 and value & (value - 1) == 0 else str(value)


def shown_default(opt: Option, value: Any) -> str:
    """``value`` as the help of ``opt`` shows it."""
    if opt.show is not None:
        return opt.show(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)
