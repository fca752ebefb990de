"""Which ``psserver train`` flags belong to which ``--mode``.

One ``train`` parser takes every mode's flags (a script's flags keep their meaning whatever
mode it names), but ``--help`` shows only the flags of the mode given before it (``psserver
train --mode ddp --help``; ``ps`` without one), and a flag of the other family (a parameter
server's in ``--mode ddp|fsdp``, a collective one in ``--mode ps``) is refused in one line
naming its mode instead of being ignored. Between ``ddp`` and ``fsdp`` the configuration
(``CollectiveConfig``) refuses the other's knobs itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from psserver.errors import UsageError

PS = "ps"
DDP = "ddp"
FSDP = "fsdp"
MODES = (PS, DDP, FSDP)
COLLECTIVE = frozenset({DDP, FSDP})
EVERY = frozenset(MODES)
WHY: dict[str, str] = {
    "seed": "a --mode ps trainer's initial parameters are its server's: psserver serve --seed",
}
"""A word on why a flag of one mode means nothing in the other, where the name does not say."""


def family(mode: str) -> frozenset[str]:
    """The modes that share flags with ``mode``: ``ps`` alone, or the collective ones."""
    return COLLECTIVE if mode in COLLECTIVE else frozenset({PS})


def shown(modes: Iterable[str]) -> str:
    """``--mode ddp|fsdp`` for a set of modes, in :data:`MODES` order."""
    return "--mode " + "|".join(m for m in MODES if m in set(modes))


class ModeFlags:
    """The modes of each flag of a ``train`` parser, from the argument group it sits in."""

    def __init__(self) -> None:
        self._modes: dict[argparse.Action, frozenset[str]] = {}
        self._help: dict[argparse.Action, str | None] = {}
        self._groups: list[tuple[argparse._ArgumentGroup, str | None, frozenset[str]]] = []

    def tag(self, parser: argparse.ArgumentParser, groups: dict[str, frozenset[str]],
            flags: dict[str, frozenset[str]]) -> None:
        """Record each action's modes: ``flags`` by dest first, else its group's by title in
        ``groups``, else every mode."""
        # argparse keeps an action's group only in the group's private list.
        for group in parser._action_groups:
            group_modes = groups.get(group.title or "", EVERY)
            self._groups.append((group, group.description, group_modes))
            for action in group._group_actions:
                self._modes[action] = flags.get(action.dest, group_modes)
                self._help[action] = action.help
        unknown = (set(groups) - {g.title for g in parser._action_groups}) | (
            set(flags) - {a.dest for a in parser._actions})
        if unknown:
            raise AssertionError(f"mode tags name no group or flag of the parser: {sorted(unknown)}")

    def modes(self, action: argparse.Action) -> frozenset[str]:
        return self._modes.get(action, EVERY)

    def help_of(self, action: argparse.Action) -> str | None:
        """``action``'s help whatever mode ``--help`` shows now."""
        return self._help.get(action, action.help)

    def show(self, mode: str) -> None:
        """Let ``--help`` show ``mode``'s flags only: the others' help is suppressed, and a group
        left empty loses its description too (argparse then leaves the whole section out)."""
        for action, modes in self._modes.items():
            action.help = self._help[action] if mode in modes else argparse.SUPPRESS
        for group, description, modes in self._groups:
            group.description = description if mode in modes else None

    def refuse_other_mode(self, args: argparse.Namespace) -> None:
        """``UsageError`` naming the first flag given (a value other than its default) whose
        modes are all outside ``args.mode``'s family."""
        mode = args.mode
        for action, modes in self._modes.items():
            if not action.option_strings or modes & family(mode):
                continue
            value = getattr(args, action.dest, action.default)
            if value != action.default:
                why = WHY.get(action.dest)
                flag = action.option_strings[-1 if value is False else 0]  # --no-X of a BooleanOptionalAction
                raise UsageError(f"{flag} is a flag of {shown(modes)}, not --mode {mode}"
                                 + (f" ({why})" if why and PS in family(mode) else ""))


class ModeAction(argparse.Action):
    """``--mode``: stores the mode and lets a ``--help`` after it show that mode's flags."""

    def __init__(self, *args, mode_flags: ModeFlags, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode_flags = mode_flags

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        self.mode_flags.show(values)
