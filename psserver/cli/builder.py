"""Flags derived from configuration fields, and configurations built back from the flags.

Each field made with :func:`psserver.config.options.option` becomes one flag: its name, help,
value parser, choices and default are read from the field, so none is written in the CLI.
:func:`add_options` adds a dataclass's flags (one argument group per configuration);
:func:`build` makes the dataclass of the parsed flags, a flag left out keeping the field's
default. Each action made here records the fields it feeds (:data:`FIELDS_ATTR`), which
``tests/cli/test_option_defaults.py`` uses to show that every flag is a field's.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from psserver.config.options import (
    Option,
    field_default,
    finite_float,
    flag_of,
    option_of,
    path_value,
    shown_default,
)
from psserver.utils.references import parse_json_args

FIELDS_ATTR = "config_fields"
"""The attribute of an action built from fields: a list of ``(dataclass, field name)``."""
LEFT_OUT = "left out"


def _bare(hint: Any) -> Any:
    """``int`` of ``int | None``; the hint itself otherwise."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return typing.get_origin(hint) or hint


def argparse_type(parse: Callable[[str], Any], flag: str) -> Callable[[str], Any]:
    """``parse`` whose ``ValueError`` argparse reports in its own words (one line, exit 2)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", flag)
    return convert


def _parser_of(kind: Any) -> Callable[[str], Any] | None:
    return {int: int, float: finite_float, Path: path_value, str: str, dict: str}.get(kind)


def dest_of(f: dataclasses.Field) -> str:
    return flag_of(f)[2:].replace("-", "_")


def _existing(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in parser._actions if flag in a.option_strings), None)


def _group(parser: argparse.ArgumentParser, title: str) -> Any:
    """The argument group ``title`` of ``parser``, made if missing."""
    return next((g for g in parser._action_groups if g.title == title), None) or parser.add_argument_group(title)


def add_options(parser: argparse.ArgumentParser, cls: type, group: str | None = None, description: str | None = None,
                *, left_out: str | None = None, only: Collection[str] | None = None) -> None:
    """A flag for each option field of dataclass ``cls`` (in the argument group ``group``; a
    ``common`` option above the groups). A field whose flag the parser has already, from the same
    declaration of another configuration (``--epochs`` of both training modes), feeds that flag.

    ``left_out``: the flags default to None and the help's ``{default}`` reads ``left_out``
    (which may hold ``{default}``, the field's): the configuration is then built only when one
    of them is given (the optimizer of ``serve``, which takes the first trainer's otherwise).
    ``only``: the flags of these fields alone (``demo`` passes a few on to the processes it starts)."""
    hints = typing.get_type_hints(cls)
    target: Any = _group(parser, group) if group else parser
    if group and description:
        target.description = description
    for f in dataclasses.fields(cls):
        opt = option_of(f)
        if opt is None or (only is not None and f.name not in only):
            continue
        flag = flag_of(f)
        default = field_default(cls, f.name)
        action = _existing(parser, flag)
        if action is not None:
            if opt.help is not None and getattr(action, "option", None) != (opt, default):
                raise AssertionError(f"{flag} is declared by two fields: {cls.__name__}.{f.name} and "
                                     f"{getattr(action, FIELDS_ATTR, '?')}")
            getattr(action, FIELDS_ATTR).append((cls, f.name))
            continue
        if opt.help is None:
            raise AssertionError(f"{cls.__name__}.{f.name} takes {flag}, which no configuration added before it "
                                 "declares")
        shown = shown_default(opt, default)
        if left_out is not None:
            shown = left_out.format(default=shown)
        text = opt.help() if callable(opt.help) else opt.help
        kwargs: dict[str, Any] = {"help": text.replace("%", "%%").replace("{default}", shown)}
        kind = _bare(hints[f.name])
        if opt.negate:
            kwargs.update(action="store_true", dest=dest_of(f))
        elif kind is bool and opt.parse is None:
            kwargs.update(action=argparse.BooleanOptionalAction if default else "store_true", default=default)
        else:
            parse = opt.parse or _parser_of(kind)
            if parse is None:
                raise AssertionError(f"{cls.__name__}.{f.name}: no parser for {hints[f.name]}; give Option.parse")
            # int and str keep argparse's own words ("invalid int value: 'ten'")
            kwargs.update(type=parse if parse in (int, str) else argparse_type(parse, flag), choices=opt.choices,
                          metavar=opt.metavar)
            if opt.const is not None:
                kwargs.update(nargs="?", const=opt.const)
            if left_out is None and not opt.unset and f.default is not dataclasses.MISSING and kind is not dict:
                env = opt.env_default() if opt.env_default is not None else None
                kwargs["default"] = env if env is not None else default
            else:
                kwargs["default"] = None
        target_of = parser if opt.common else _group(parser, opt.group) if opt.group else target
        action = target_of.add_argument(flag, **kwargs)
        action.option = (opt, default)
        setattr(action, FIELDS_ATTR, [(cls, f.name)])


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``cls``'s option fields that the flags in ``args`` state: a flag left out
    (None), or a ``--no-X`` not given, says nothing; a ``dict`` field's JSON is parsed here, naming
    its flag (``ValueError``: build inside ``config_errors``)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        opt: Option | None = option_of(f)
        if opt is None or not hasattr(args, dest_of(f)):
            continue
        value = getattr(args, dest_of(f))
        if opt.negate:
            if value:
                values[f.name] = False
            continue
        if value is None:
            continue
        if _bare(hints[f.name]) is dict:
            value = parse_json_args(value, flag_of(f))
        values[f.name] = value
    return values


def build(cls: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """``cls`` of the flags in ``args`` (:func:`given`), with ``fixed`` fields set by the caller."""
    return cls(**{**given(cls, args), **fixed})
