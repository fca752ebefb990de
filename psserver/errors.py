"""Errors that the CLI turns into one line on stderr and exit code 2."""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""


class ServerUnavailable(UsageError):
    """The server (RPC or control plane) cannot be reached."""


class ServerLost(Exception):
    """A trainer lost its server mid-training (exit code 3 unless ``--reconnect``)."""
