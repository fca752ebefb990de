"""Every option is written once, on its config dataclass field: every flag of ``serve`` and
``train`` but four is built from a field (its default, type, choices and help the field's), a flag
is never declared by two fields, the configuration built from no flags is the dataclass's own,
and no help text shows a default other than the real one."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from psserver.cli import build_parser
from psserver.cli.builder import FIELDS_ATTR
from psserver.config import (
    CollectiveConfig,
    ControlConfig,
    ServerConfig,
    TrainerConfig,
)
from psserver.config.common import parse_bytes as byte_size
from psserver.config.options import field_default, id_count
from psserver.data import GENERATED_SIZES

Field = tuple[type, str]

HAND_WRITTEN: dict[str, dict[str, str]] = {
    "train": {"mode": "which configuration is built", "server": "HOST:PORT, split into server_host and server_port",
              "entry": "the function run_entry calls", "entry_args": "that function's keyword arguments"},
    "serve": {},
}
"""The flags of ``serve`` and ``train`` that are no configuration field, and what they are."""


def fields_of(action: argparse.Action) -> list[Field]:
    """The configuration fields ``action`` feeds: those it was built from."""
    return getattr(action, FIELDS_ATTR, None) or []


NOT_A_FIELD: dict[str, dict[str, str]] = {
    "train": {"mode": "which configuration is built"},
    "demo": {"model": "the demo's own", "trainers": "the demo's own", "epochs": "the demo's own",
             "compute": "the first of COMPUTE_MODES"},
    "status": {"address": "$PSSERVER_CONTROL_ADDRESS", "timeout": "per verb", "interval": "the client's"},
    "checkpoint": {"address": "$PSSERVER_CONTROL_ADDRESS", "timeout": "per verb"},
    "stop": {"address": "$PSSERVER_CONTROL_ADDRESS", "timeout": "per verb", "wait_timeout": "the client's"},
}
"""Flags with a default that feeds no config field, and where it comes from instead."""
VERBS = ("serve", "train", "status", "checkpoint", "stop", "export", "demo")
"""Every verb but ``bench``, which has no flags: it only says where the benchmarks went."""
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR",
                "MASTER_PORT", "PSSERVER_SERVER", "PSSERVER_NUM_SERVERS", "PSSERVER_SERVER_RANK",
                "PSSERVER_COORDINATOR", "PSSERVER_STATE_DIR", "PSSERVER_STATE_KEY", "PSSERVER_DATA_DIR",
                "PSSERVER_CONTROL_ADDRESS", "PSSERVER_JOIN_TOKEN", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


@pytest.fixture(autouse=True)
def _no_environment_defaults(monkeypatch):
    """The defaults the dataclasses state, not the ones a launcher's environment gives."""
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOSTNAME", "host")  # no StatefulSet ordinal (ps-2) for --server-rank


def verb_parser(verb: str, *argv: str) -> tuple[argparse.ArgumentParser, argparse.Namespace | None, object]:
    """The parser of ``verb`` with its arguments added, the namespace of ``argv`` (None: not
    parsed), and the verb's command."""
    parser, commands = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    args = parser.parse_args([verb, *argv]) if verb != "export" else None
    if args is None:
        sub.choices[verb].parse_known_args(["x", "--out", "y"])
    return sub.choices[verb], args, commands[verb]


def options(verb: str) -> list[argparse.Action]:
    parser, _, _ = verb_parser(verb)
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("verb", VERBS)
def test_a_flags_default_is_its_fields(verb):
    """Each flag that feeds a field defaults to the field's default, or to None (left out: the
    config's, which the tests below check); a flag with any other default says where it comes from."""
    other = NOT_A_FIELD.get(verb, {})
    wrong = []
    for action in options(verb):
        fields = fields_of(action)
        for cls, name in fields:
            default = field_default(cls, name)
            if action.default not in (None, default) and not (isinstance(action, argparse._StoreTrueAction)
                                                              and default is not False):
                wrong.append(f"{action.option_strings[0]} defaults to {action.default!r}, "
                             f"{cls.__name__}.{name} to {default!r}")
        if not fields and action.default not in (None, False) and action.dest not in other:
            wrong.append(f"{action.option_strings[0]} defaults to {action.default!r} and feeds no config field named "
                         "here (NOT_A_FIELD)")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("verb", sorted(HAND_WRITTEN))
def test_every_flag_of_serve_and_train_is_a_configuration_field(verb):
    """The flag, its default, type, choices and help are the field's (``psserver.config.options``):
    none is written in the CLI. A flag added by hand for a field would either clash with the
    field's (argparse refuses an option string twice) or show up here, built from no field."""
    built = {a.dest for a in options(verb) if getattr(a, FIELDS_ATTR, None)}
    by_hand = {a.dest for a in options(verb)} - built
    assert by_hand == set(HAND_WRITTEN[verb]), f"flags of {verb} written by hand: {sorted(by_hand)}"
    assert len(built) > 40


def test_a_flag_declared_by_two_fields_is_refused():
    """Two configurations share a flag only by sharing its declaration (``psserver.config.loop``);
    a second, different declaration of the same flag is an error when the parser is built."""
    from psserver.cli.builder import add_options
    from psserver.config.options import option

    @dataclasses.dataclass
    class First:
        epochs: int = option(1, help="epochs (default {default})")

    @dataclasses.dataclass
    class Again:
        epochs: int = option(2, help="epochs (default {default})")

    parser = argparse.ArgumentParser()
    add_options(parser, First)
    with pytest.raises(AssertionError, match="--epochs is declared by two fields"):
        add_options(parser, Again)


def test_a_shared_declaration_is_one_flag_feeding_both_modes():
    """``--epochs`` is ``TrainerConfig.epochs`` and ``CollectiveConfig.epochs``, one flag."""
    parser, _, _ = verb_parser("train")
    (action,) = [a for a in parser._actions if "--epochs" in a.option_strings]
    assert getattr(action, FIELDS_ATTR) == [(TrainerConfig, "epochs"), (CollectiveConfig, "epochs")]
    assert TrainerConfig.__dataclass_fields__["epochs"].metadata == CollectiveConfig.__dataclass_fields__[
        "epochs"].metadata


def test_no_flags_build_the_servers_default_config():
    from psserver.cli.serve import server_config_from_args

    _, args, _ = verb_parser("serve")
    assert server_config_from_args(args) == ServerConfig()


def test_no_flags_build_the_trainers_default_config():
    from psserver.cli.train import trainer_config_from_args

    _, args, _ = verb_parser("train")
    assert trainer_config_from_args(args) == TrainerConfig()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_no_flags_build_the_collective_default_config(mode):
    from psserver.cli.collective_args import collective_config_from_args

    _, args, _ = verb_parser("train", "--mode", mode)
    assert collective_config_from_args(args) == CollectiveConfig(mode=mode)


def test_the_control_planes_default_is_on():
    """``--no-control`` negates ``ControlConfig.enabled``: left out, the plane is served."""
    assert field_default(ControlConfig, "enabled") is True and field_default(CollectiveConfig, "control").enabled


NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?|\d+\^\d+|\d+[KMGT]")
"""A number as a help shows it: 60, 0.05, 1e-3, 2^40, 1G."""
DEFAULT_VALUE = re.compile(r"\bdefault ((?:\$\w+(?:, else|,| or)\s+)*)([^\s,;)]+?)(?=[\s,;)]|:\s|$)")
"""``default VALUE``, ``default $VAR or VALUE``, ``default $A, $B, else VALUE``."""
BOOLEAN_WORDS = {"yes": True, "no": False, "on": True, "off": False}


def real_default(verb: str, action: argparse.Action) -> Any:
    """What a flag left out means: its default, else (None) the field's it feeds."""
    if action.default is not None and not isinstance(action, argparse._StoreTrueAction):
        return action.default
    fields = fields_of(action)
    return field_default(*fields[0]) if fields else action.default


def shown_matches(text: str, value: Any) -> bool | None:
    """Whether ``text``, shown in a help as the default, is ``value``; None: ``text`` is words
    that state no value of this type (``default the server's model``, ``by default this one``)."""
    if isinstance(value, bool):
        return BOOLEAN_WORDS[text] == value if text in BOOLEAN_WORDS else None
    if not NUMBER.fullmatch(text):
        if value is None or isinstance(value, int | float) or text == "the":
            return None
        return Path(text) == value if isinstance(value, Path) else text == str(value)
    if not isinstance(value, int | float):
        return False  # a number shown for a flag without one
    for parse in (float, id_count, byte_size):
        try:
            if parse(text) == value:
                return True
        except (ValueError, argparse.ArgumentTypeError):
            continue
    return False


def help_texts(verb: str) -> list[tuple[argparse.Action, str]]:
    """Every option's help, of every mode (``train`` hides the other modes' flags)."""
    parser, _, command = verb_parser(verb)
    mode_flags = getattr(command, "mode_flags", None)
    helps = []
    for action in parser._actions:
        text = mode_flags.help_of(action) if mode_flags is not None else action.help
        if action.option_strings and text and text != argparse.SUPPRESS:
            helps.append((action, text))
    return helps


@pytest.mark.parametrize("verb", VERBS)
def test_no_help_shows_a_default_other_than_the_real_one(verb):
    wrong = []
    checked = 0
    for action, text in help_texts(verb):
        if action.dest in ("train_samples", "eval_samples"):  # per dataset: GENERATED_SIZES
            column = 0 if action.dest == "train_samples" else 1
            for name, sizes in GENERATED_SIZES.items():
                assert f"{name}: default {sizes[column]}" in text, (action.dest, text)
            continue
        value = real_default(verb, action)
        for m in DEFAULT_VALUE.finditer(text):
            shown = m.group(2)
            matches = shown_matches(shown, value)
            if matches is None:
                continue
            checked += 1
            if not matches:
                wrong.append(f"{action.option_strings[0]}: help says default {shown}, it is {value!r}")
    assert not wrong, "\n".join(wrong)
    assert checked or verb in ("export", "checkpoint"), "no default found in any help: the pattern is stale"


def test_a_literal_default_that_differs_is_caught(monkeypatch):
    """The checks above fail for a flag that writes its own default again, differing."""
    from psserver.cli import train

    add = train.TrainCommand.add_arguments

    def literal(self, parser):
        add(self, parser)
        action = next(a for a in parser._actions if a.dest == "connect_timeout")
        monkeypatch.setattr(action, "default", 30.0)

    monkeypatch.setattr(train.TrainCommand, "add_arguments", literal)
    said = "--connect-timeout defaults to 30.0, TrainerConfig.connect_timeout"
    with pytest.raises(AssertionError, match=re.escape(said)):
        test_a_flags_default_is_its_fields("train")
    with pytest.raises(AssertionError, match=re.escape("--connect-timeout: help says default 60, it is 30.0")):
        test_no_help_shows_a_default_other_than_the_real_one("train")
    with pytest.raises(AssertionError):
        test_no_flags_build_the_trainers_default_config()


def test_defaults_kept_outside_the_config_agree_with_it():
    """What a client, the library or the trainer falls back to where no flag reaches them."""
    from psserver.config.env import default_server_address
    from psserver.control import DEFAULT_ADDRESS
    from psserver.trainer.session import DEFAULT_MODEL

    assert DEFAULT_ADDRESS == f"{ControlConfig.host}:{ControlConfig.port}"
    assert default_server_address() == f"{TrainerConfig.server_host}:{TrainerConfig.server_port}"
    model = next(text for action, text in help_texts("train") if action.dest == "model")
    assert f"ps mode: default the server's model, else {DEFAULT_MODEL}" in model
