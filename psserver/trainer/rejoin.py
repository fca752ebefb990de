"""A trainer that rejoins continues in a fresh process image of its own command line.

torch keeps per-process state tied to the first RPC worker id (the ``dist_autograd`` container
refuses another id; the RRef context keeps the first agent and its id), and an agent keeps its
pipe to a worker id for as long as it runs (the server's calls to an id that comes back fail
with EPIPE). A process can therefore neither take a fresh id nor keep its old one; a fresh
process (``exec``, same PID) takes a fresh one, and continues from the :class:`Position` the
old image handed over in a file named by ``$PSSERVER_TRAINER_RESUME``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, NoReturn

from psserver.errors import ServerLost, UsageError
from psserver.trainer.stop_signals import StopSignals

log = logging.getLogger(__name__)

RESUME_ENV = "PSSERVER_TRAINER_RESUME"
"""Set by a trainer for itself when it re-executes to rejoin: the file holding its position."""


@dataclasses.dataclass
class Position:
    """Where a trainer is in its run: what it continues from after re-executing to rejoin."""

    epoch: int = 0
    batch_idx: int = 0
    steps: int = 0
    samples: int = 0
    loss: float = math.nan
    t_start: float = dataclasses.field(default_factory=time.monotonic)
    """``time.monotonic()`` when the run started: one clock for the whole system, across ``exec``."""
    epoch_samples: int = 0
    """Samples trained on in ``epoch`` (the library's sampler skips them after a rejoin)."""
    step_ends: list[float] = dataclasses.field(default_factory=list)
    report: dict[str, Any] | None = None
    """The last :class:`Report`'s fields."""
    reconnects: int = 0
    samples_before: int = 0
    """Samples its rank's last trainer trained, which this process (started again by hand) took
    up: left out of this process's rate."""
    first_join_tries: int = 0
    """Tries of a first join that failed while the RPC group changed under it (another member
    leaving during this one's ``init_rpc``): this process tries the first join again."""
    fell_back: str | None = None
    """Why the device map the last image joined with failed and broke its pipe to the server
    (``DeviceMapFailed``): this image joins ``staged``."""
    owed_window: str | None = None
    """A file holding what the failed call carried that the server may not have applied (a
    DiLoCo window: ``save_owed``), sent again, under its number, once the new image has joined."""


def save_owed(tensors: dict[str, Any]) -> str:
    """``tensors`` (plain types and tensors) in a new file of this user's only; its path."""
    import torch

    fd, path = tempfile.mkstemp(prefix="psserver-window-", suffix=".pt")
    with os.fdopen(fd, "wb") as f:
        torch.save(tensors, f)
    return path


def take_owed(path: str) -> dict[str, Any] | None:
    """What :func:`save_owed` wrote (the file is removed); None for a file that is not this
    user's own or not such a file (its window is then lost, as a failed sync's is, with a WARNING)."""
    import torch

    try:
        st = os.stat(path, follow_symlinks=False)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077 or not os.path.isfile(path) or os.path.islink(path):
            raise ValueError("not a file of this user's only")
        return torch.load(path, weights_only=True)
    except (OSError, ValueError, RuntimeError, EOFError) as e:  # noqa: PERF203
        log.warning("the window owed to the server is lost: %s (%s)", path, e)
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def reexec(pos: Position, stop: StopSignals, argv: Sequence[str] | None = None) -> NoReturn:
    """Continue in a fresh process image of ``argv`` (default: the same ``psserver train``
    command line), which rejoins (see the module's docstring for why not in this one)."""
    argv = list(argv) if argv is not None else command_line()
    if argv is None:
        raise ServerLost("cannot rejoin: this trainer is not the psserver command line (only `psserver train` "
                         "re-executes itself to rejoin)")
    stop.check("before rejoining")
    fd, path = tempfile.mkstemp(prefix="psserver-trainer-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(pos), f)
    os.environ[RESUME_ENV] = path
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        os.environ.pop(RESUME_ENV, None)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise ServerLost(f"cannot rejoin: re-executing {argv[0]} failed ({e.strerror or e})") from None


def command_line() -> list[str] | None:
    """This process's command line when it is ``psserver train`` (``python -m psserver``, the
    console script, a launcher's ``-m``); None inside another program that calls the CLI's
    ``main`` (a test runner), which re-executing would replace."""
    if "train" not in sys.argv[1:]:
        return None
    return [sys.executable, *sys.orig_argv[1:]]


def script_command_line() -> list[str] | None:
    """This process's own command line, to re-execute a library trainer's script (``python
    train.py ...``, ``python -m pkg``, ``python -c ...``); None for an interactive interpreter,
    which has no command to run again."""
    args = sys.orig_argv[1:]
    if not args or args == ["-i"] or (sys.flags.interactive and not sys.argv[0]):
        return None
    return [sys.executable, *args]


def take_position() -> Position | None:
    """The position a re-executed trainer continues from (its file is removed), else None."""
    path = os.environ.pop(RESUME_ENV, None)
    if not path:
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        position = Position(**data)
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"${RESUME_ENV}={path}: not the position of a rejoining trainer ({e})") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return position
