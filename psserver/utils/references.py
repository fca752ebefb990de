"""``MODULE:ATTR`` references to users' code, and their ``--*-args JSON``.

The Python packaging entry-point syntax (torchx's ``module:function``): ``MODULE`` is an
importable dotted module name, ``ATTR`` a dotted attribute path inside it. Every failure is a
:class:`~psserver.errors.UserCodeError` (a usage error and a ``ValueError``) of one line that
says which part failed (the import, the attribute, the arguments, the user's code), so the CLI
reports it with exit code 2.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import math
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

from psserver.errors import UserCodeError
from psserver.utils.user_code import ExitCalled, running_user_code, timeout_s

log = logging.getLogger(__name__)

_REFERENCE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_reference(text: str) -> bool:
    """Whether ``text`` has the ``MODULE:ATTR`` form (a bare name has no colon)."""
    return ":" in text


def load_reference(reference: str, what: str) -> Any:
    """The object ``reference`` (``MODULE:ATTR``) names; ``what`` names the flag in errors.

    ``ValueError`` for a malformed reference, a module that does not import (with the
    import's own first line: a missing dependency of the module is not the module missing),
    and an attribute that is not there.
    """
    if not _REFERENCE.match(reference.strip()):
        raise UserCodeError(f"{what} {reference!r} is not MODULE:ATTR (for example mypkg.models:MyNet)")
    module_name, _, attr_path = reference.strip().partition(":")
    limit = timeout_s()
    # A module imported before runs no code again: no watchdog to start for it.
    guard = (contextlib.nullcontext() if module_name in sys.modules else
             running_user_code(f"{what} {reference}: importing module {module_name!r}", limit))
    try:
        with guard:
            module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise UserCodeError(f"{what} {reference}: module {module_name!r} is not importable (no module named "
                             f"{e.name!r}; is its package on PYTHONPATH?)") from None
        raise UserCodeError(f"{what} {reference}: importing module {module_name!r} failed: {_one_line(e)}") from None
    except BaseException as e:  # noqa: BLE001 - any error in the user's module is the user's, told in one
        # line: a sys.exit() or os._exit() in it too (it would end psserver with its code, 0 included), and
        # a BaseException of its own; only Ctrl-C stays an interrupt
        log.debug("importing %s failed", module_name, exc_info=True)
        raise UserCodeError(f"{what} {reference}: importing module {module_name!r} failed: {_one_line(e)}") from None
    obj: Any = module
    walked = module_name
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise UserCodeError(f"{what} {reference}: {walked!r} has no attribute {part!r}")
        obj = getattr(obj, part)
        walked = f"{walked}.{part}" if walked != module_name else f"{module_name}:{part}"
    return obj


def parse_json_args(text: str | None, flag: str) -> dict[str, Any]:
    """The keyword arguments of ``--*-args JSON``: a JSON object (None or empty: none).
    ``ValueError`` for text that is not JSON, not an object, or holds NaN or infinity."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise UserCodeError(f"{flag} is not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    except ValueError as e:
        raise UserCodeError(f"{flag}: {e}") from None
    except RecursionError:
        raise UserCodeError(f"{flag}: nested too deeply to be keyword arguments") from None
    if not isinstance(value, dict):
        raise UserCodeError(f"{flag} must be a JSON object of keyword arguments, like '{{\"width\": 64}}'; "
                         f"got {type(value).__name__}")
    if not _finite(value):
        raise UserCodeError(f"{flag}: a number out of range (infinity) is not a value an argument may take")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a value an argument may take")


def check_arguments(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], what: str) -> None:
    """``ValueError`` (one line) unless ``fn`` accepts these arguments; a callable without a
    signature Python can read (a C builtin) is accepted as it is."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        raise UserCodeError(f"{what} does not accept these arguments: {e} (its signature: {signature})") from None


def call_user(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], what: str) -> Any:
    """``fn(*args, **kwargs)`` with the arguments checked first; an exception inside the user's
    code becomes one ``ValueError`` line naming it and where it was raised."""
    check_arguments(fn, args, kwargs, what)
    limit = timeout_s()
    try:
        with running_user_code(what, limit):
            return fn(*args, **kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the user's code failed (or called sys.exit() or os._exit(),
        # or raised a BaseException of its own): say where, in one line
        raise user_code_failed(what, e) from None


def user_code_failed(what: str, e: BaseException) -> UserCodeError:
    """The one line for an exception ``e`` raised inside the user's code (``what`` names the
    flag): its type, first line and where it was raised; the traceback goes to the debug log."""
    log.debug("%s failed", what, exc_info=e)
    return UserCodeError(f"{what} raised {_one_line(e)}{_where(e)}")


def _finite(value: Any) -> bool:
    """Whether parsed JSON holds no infinity (``1e999`` parses to one)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def _one_line(e: BaseException) -> str:
    if isinstance(e, ExitCalled):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {last.filename}:{last.lineno})"


__all__ = ["call_user", "check_arguments", "is_reference", "load_reference", "parse_json_args", "user_code_failed"]
