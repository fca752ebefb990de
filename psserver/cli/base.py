"""The small interface every sub-command implements (torchx style)."""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager

from psserver.errors import UsageError


class SubCommand(ABC):
    """One verb: ``psserver <name>``.

    ``run`` raises :class:`~psserver.errors.UsageError` for anything the user can fix (one
    line, exit code 2); any other exception is an internal error (exit code 1, the traceback
    in a log file). Configurations validate in ``__post_init__`` with ``ValueError``: build
    them inside :func:`config_errors`.
    """

    name: str
    help: str

    @abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    @abstractmethod
    def run(self, args: argparse.Namespace) -> int: ...


@contextmanager
def config_errors() -> Iterator[None]:
    """Report a ``ValueError`` raised while building a configuration from the flags (the
    config dataclasses validate in ``__post_init__``) as a :class:`UsageError`.

    Only the construction goes inside: a ``ValueError`` from running the command is a bug.
    """
    try:
        yield
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from e
