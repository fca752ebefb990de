"""``psserver train --entry MODULE:FUNCTION``: a loop function of the user's, run with a
connected ``ps`` (``psserver.trainer.connection``) built from the usual flags.

The function is called as ``FUNCTION(ps, **entry_args)``; ``ps.config`` holds the flags
(batch size, epochs, data set) for a loop that wants them. It returns nothing, or an exit
code in 0..255 (anything else is one line, exit 2: a shell would see it modulo 256, 10**30 as
255 with no word of why). psserver's own errors (an eviction, a lost server, bad input) pass
through as themselves; any other exception in the user's code (a ``BaseException`` of its own
too) leaves the server and becomes one line naming it and where it was raised (exit 2).
"""

from __future__ import annotations

from typing import Any

from psserver.config import TrainerConfig
from psserver.errors import ServerLost, UsageError, UserCodeError
from psserver.trainer.connection import Connection
from psserver.trainer.rejoin import command_line
from psserver.trainer.stop_signals import Stopped
from psserver.utils.references import check_arguments, load_reference, user_code_failed


def run_entry(config: TrainerConfig, reference: str, args: dict[str, Any] | None = None) -> int:
    """Run the loop ``reference`` names with a connection; its exit code (0 when it returns None)."""
    fn = load_reference(reference, "--entry")
    what = f"--entry {reference}"
    if isinstance(fn, type) or not callable(fn):
        raise UserCodeError(f"{what} is a {'class' if isinstance(fn, type) else type(fn).__name__}, not a function "
                            "taking ps")
    kwargs = dict(args or {})
    check_arguments(fn, (None,), kwargs, what)
    with Connection(config, rejoin_command=command_line) as ps:
        try:
            result = fn(ps, **kwargs)
        except (UsageError, ServerLost, KeyboardInterrupt, SystemExit, Stopped):
            raise  # psserver's own, Ctrl-C, and the exit after a signal (the user's sys.exit(n) too)
        except BaseException as e:  # noqa: BLE001 - the user's loop failed (a BaseException of its own
            # included): one line, after leaving
            raise user_code_failed(what, e) from None
    if result is None:
        return 0
    if isinstance(result, bool) or not isinstance(result, int) or not 0 <= result <= 255:
        shown = type(result).__name__ if not isinstance(result, int) else (
            str(result) if abs(result) < 10**12 else f"an int of {len(str(abs(result)))} digits")
        raise UserCodeError(f"{what} returned {shown}: return None or an exit code in 0..255")
    return result
