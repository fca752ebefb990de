"""The control plane's local admin token: a private file the server writes, the CLI reads.

A server started without ``--auth-token-file`` or ``$PSSERVER_AUTH_TOKEN`` would refuse
``Checkpoint`` and ``Shutdown`` to everyone, so ``psserver checkpoint|stop`` failed on a server
started as the README shows. Instead, the server makes a random token for these two calls and
writes it where only its own user can read it, as Jupyter does with its runtime files; the CLI
of that user on the same host finds it by the address it is given. Other users, and other
hosts, never see it: they are refused as before.

Where: ``$XDG_RUNTIME_DIR/psserver``, else ``~/.local/state/psserver``; one file per control
plane, ``control-<hostname>-<port>.json``, holding the address the server bound, its pid and
the token. The directory is made 0700 and the file 0600, both opened without following a
symbolic link; a directory or file that is not this user's own, or that others may write, is
refused in one line (the server logs it and serves without a local token, the CLI stops):
nothing another local user can write is trusted. The server removes the file when it stops; a
file left by a server that was killed is skipped (its pid is gone).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import os
import secrets
import socket
import stat
from pathlib import Path

from psserver.config.common import is_loopback_host, parse_host_port
from psserver.control.auth import check_token
from psserver.errors import UsageError
from psserver.utils.private_paths import DIR_FLAGS, not_private, unsafe_parent

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 64 * 1024
_WILDCARD = {"0.0.0.0", "::"}  # unbracketed


def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/psserver`` (a per-user tmpfs on systemd hosts), else
    ``~/.local/state/psserver``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "psserver"
    return Path.home() / ".local" / "state" / "psserver"


def file_name(port: int) -> str:
    """The file of the control plane on ``port`` of this host (a home shared between hosts
    keeps them apart)."""
    return f"control-{socket.gethostname()}-{port}.json"


def _problem(st: os.stat_result, kind: str) -> str | None:
    """Why a directory or file with ``st`` is not this user's private one, else None."""
    return not_private(st, unreadable=kind == "file")


def _refuse(kind: str, path: Path, why: str) -> UsageError:
    fix = "chmod 700 it, or remove it" if kind == "directory" else "remove it"
    return UsageError(f"control token {kind} {path} {why}: psserver trusts only a private one of your own ({fix})")


def open_private_dir(path: Path, *, create: bool) -> int | None:
    """A descriptor of ``path``, a directory of this user that nobody else can write, made 0700
    when ``create`` and missing (None when missing and not ``create``); ``UsageError`` in one
    line for a symbolic link, a non-directory, or a directory of another user or writable by
    others."""
    why = unsafe_parent(path)
    if why is not None:
        raise _refuse("directory", path, f"is not safe: {why}")
    if create:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
        except OSError as e:
            raise UsageError(f"cannot make the control token directory {path}: {e.strerror or e}") from None
        why = unsafe_parent(path)  # again: a parent another user made while these were made is theirs
        if why is not None:
            raise _refuse("directory", path, f"is not safe: {why}")
    try:
        fd = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        if create:
            raise UsageError(f"cannot open the control token directory {path}: it vanished") from None
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse("directory", path, "is a symbolic link or not a directory") from None
        raise UsageError(f"cannot open the control token directory {path}: {e.strerror or e}") from None
    why = _problem(os.fstat(fd), "directory")
    if why is not None:
        os.close(fd)
        raise _refuse("directory", path, why)
    return fd


class LocalToken:
    """The token file of one running control plane: written by :meth:`write`, removed by
    :meth:`remove`. The directory stays open, so the removal never follows a path that changed."""

    def __init__(self, token: str, path: Path, dir_fd: int) -> None:
        self.token = token
        self.path = path
        self._dir_fd: int | None = dir_fd

    @classmethod
    def write(cls, host: str, port: int, token: str | None = None) -> LocalToken:
        """A new random token for the control plane bound to ``host:port``, in its private file
        (mode 0600, replaced atomically: a reader never sees half of it)."""
        token = token or secrets.token_urlsafe(32)
        directory = runtime_dir()
        fd = open_private_dir(directory, create=True)
        assert fd is not None
        name = file_name(port)
        tmp = f".{name}.{os.getpid()}.tmp"
        record = {"host": host, "port": port, "pid": os.getpid(), "token": token}
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=fd)
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=fd)
            with os.fdopen(out, "w") as f:
                json.dump(record, f)
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as e:
            os.close(fd)
            raise UsageError(f"cannot write the control token file {directory / name}: {e.strerror or e}") from None
        return cls(token, directory / name, fd)

    def remove(self) -> None:
        """Delete the file, if it still holds this token (a later server on the port may have
        replaced it)."""
        fd, self._dir_fd = self._dir_fd, None
        if fd is None:
            return
        try:
            if _read_record(self.path, fd).get("token") == self.token:
                os.unlink(self.path.name, dir_fd=fd)
        except (OSError, UsageError) as e:
            log.warning("control token file %s not removed: %s", self.path, e)
        finally:
            os.close(fd)


def _read_record(path: Path, dir_fd: int) -> dict:
    """The JSON object of ``path`` (in ``dir_fd``), if it is a private regular file of this user;
    ``FileNotFoundError`` when missing, ``UsageError`` in one line otherwise."""
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse("file", path, "is a symbolic link") from None
        if e.errno == errno.ENOENT:
            raise
        raise UsageError(f"cannot read the control token file {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _refuse("file", path, "is not a regular file")
        why = _problem(st, "file")
        if why is not None:
            raise _refuse("file", path, why)
        data = f.read(MAX_FILE_BYTES + 1)
    try:
        record = json.loads(data) if len(data) <= MAX_FILE_BYTES else None
    except (ValueError, UnicodeDecodeError):
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("token"), str):
        raise UsageError(f"control token file {path} is not one psserver wrote (remove it)")
    return record


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _is_local_ip(host: str) -> bool:
    """Whether ``host`` is an IP address of this machine (it can be bound); no resolver."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((str(ip), 0))
    except OSError:
        return False
    return True


def reaches_bound(address_host: str, bound_host: str) -> bool:
    """Whether a client dialling ``address_host`` reaches a server on this host that bound
    ``bound_host``: the same name, loopback to loopback or to a wildcard bind, or one of this
    machine's addresses to a wildcard bind. Anything else may be another machine, which must
    never be sent this host's token."""
    a, b = address_host.strip("[]").lower(), bound_host.strip("[]").lower()
    if a == b:
        return True
    wildcard = b in _WILDCARD
    if is_loopback_host(a):
        return wildcard or is_loopback_host(b)
    return wildcard and _is_local_ip(a)


def find_local_token(address: str) -> str | None:
    """The token a server on this host wrote for the control plane at ``address``, if it runs
    as this user; None when there is none (another user's server, another host, or one that
    was started with a token of its own), it is gone, or it bound another address."""
    try:
        host, port = parse_host_port(address)
    except ValueError:
        return None
    directory = runtime_dir()
    fd = open_private_dir(directory, create=False)
    if fd is None:
        return None
    path = directory / file_name(port)
    try:
        record = _read_record(path, fd)
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)
    if record.get("port") != port or not reaches_bound(host, str(record.get("host", ""))):
        return None
    if not _pid_alive(record.get("pid")):
        log.debug("control token file %s is stale (pid %s is gone)", path, record.get("pid"))
        return None
    return check_token(record["token"], str(path))
