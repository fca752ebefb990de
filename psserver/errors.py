"""Errors that the CLI turns into one line on stderr and an exit code (2, or 3 for ServerLost).

Any other exception reaching the CLI is an internal error (exit code 1, traceback in a log).
"""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""


class ServerUnavailable(UsageError):
    """The server (RPC or control plane) cannot be reached."""


class AdmissionUnanswered(ServerUnavailable):
    """The server did not answer a join's request for room (it died meanwhile, or is stuck):
    a trainer with ``--reconnect`` tries again, as after any join lost half-way."""


class DataError(UsageError, ValueError):
    """Training data that is missing, unreadable or does not fit the model (also a
    ``ValueError``, as the data loaders documented before it existed)."""


class UserCodeError(UsageError, ValueError):
    """A ``MODULE:ATTR`` reference that does not resolve, arguments it does not take, or the
    user's code failing while psserver calls it: one line naming which, exit code 2."""


class JoinLater(RuntimeError):
    """A server's refusal of a join for now, not for good: it is starting, waits for a missing
    server process or drains, or another join of the same rank is under way. The refusal says
    so (``retry``), and a trainer with ``--reconnect`` tries again."""


class ServerLost(Exception):
    """A trainer lost its server mid-training (exit code 3 unless ``--reconnect``)."""


class Evicted(ServerLost):
    """The server evicted this trainer while it was alive (a pause longer than the server's
    ``--trainer-timeout``, or a gradient it would not keep): exit code 3 unless ``--reconnect``,
    which rejoins under a fresh name."""


class StepFailed(ServerLost):
    """The server, alive and holding this trainer as a member, could not complete its step (a
    sync round that did not complete within the server's ``--rpc-timeout``, a gradient it
    refused): the server's reason in one line, exit code 3; the trainer has left."""


class DeviceMapFailed(Exception):
    """The device map a trainer joined with failed its probe, and took the trainer's pipe to the
    server with it (a transport-level failure: the ``fall_back`` call could not be made either).
    RPC cannot be set up twice in one process: the trainer joins again in a fresh process image
    that goes ``staged`` (``reason``: what failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the device map to the server failed ({reason}) and took the connection with it")
        self.reason = reason


class NoVersion(Exception):
    """No version of the model's weights can be read: no model yet (``later``: one may come, a
    reader waiting for a version waits for it), or one spread over several server processes
    (the weights service says so to the reader)."""

    def __init__(self, message: str, later: bool = False) -> None:
        super().__init__(message)
        self.later = later


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of ``e``'s message (torch's errors carry C++ context below it), at most
    ``limit`` characters, or its type's name when it has none."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__
