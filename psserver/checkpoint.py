"""Checkpoints that survive crashes and belong to a run: atomic writes, checksums, safe loads.

A file is ``ckpt-<step 12 digits>.pt``: a small header line (magic, format, run id, write
time, SHA-256 of the payload, payload length) followed by the ``torch.save`` payload. It is
written to a temporary file (``.ckpt-<step>.pt.tmp-<writer pid>``), fsynced, renamed into
place and the directory fsynced, so a crash mid-write leaves the previous checkpoint intact; a
truncated or bit-flipped file fails the checksum and is reported and skipped.

Every checkpoint names the *run* that wrote it (a uuid4 hex made when a fresh run starts and
kept when one resumes), so several runs can share a directory: a writer prunes only its own
run's files, and a resume picks the run written to most recently. Files of format 1 (written
before run ids existed) read as the run ``legacy``, which no writer ever prunes.

Payloads load with ``torch.load(weights_only=True)``: a checkpoint holds only tensors and
plain data, so a file that would import or call anything else is refused, never executed.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import stat
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from psserver.errors import UsageError
from psserver.telemetry import CheckpointInfo
from psserver.utils.private_paths import unsafe_parent, untrusted_file
from psserver.utils.processes import pid_alive

log = logging.getLogger(__name__)

MAGIC = "PSSERVER-CKPT"
FORMAT = 2
"""Format 2 added the run id and the write time to the header; format 1 still reads."""
READABLE_FORMATS = (1, 2)
LEGACY_RUN = "legacy"
"""The run of format-1 files: one run of its own, never pruned, never continued."""
_NAME = re.compile(r"^ckpt-(\d{12})\.pt$")
_TEMPORARY = re.compile(r"^\.(?:ckpt-\d{12}\.pt\.tmp|psserver-probe)-(\d+)$")
_GLOBAL = re.compile(r"\bGLOBAL ([\w.]+)")


class CheckpointError(UsageError):
    """A checkpoint that cannot be used (corrupt, partial, or for another model)."""


class UnsafeCheckpointError(CheckpointError):
    """A file with a valid checksum whose payload would import or call code that psserver
    never stores: tampered with or not psserver's. Refused, never skipped for an older one."""


class CheckpointDirError(UsageError):
    """A checkpoint directory a server cannot start in: one it cannot write (refused at start,
    not at the first save), or one holding another run's checkpoints without ``--resume`` or
    ``--new-run``."""


@dataclass(frozen=True)
class Header:
    """The header line of one checkpoint file (read without its payload)."""

    path: Path
    format: int
    run: str
    time: float
    """Unix time of the write (format 1: the file's modification time)."""
    sha256: str
    length: int


def new_run_id() -> str:
    return uuid.uuid4().hex


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:012d}.pt"


def step_of(path: Path) -> int:
    """The step in a checkpoint's file name (``ValueError`` for another name)."""
    m = _NAME.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not named like a checkpoint (ckpt-<12 digits>.pt)")
    return int(m.group(1))


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(path: Path, state: dict[str, Any], *, run: str | None = None) -> int:
    """Write ``state`` atomically as a checkpoint of ``run`` (None: a run of its own); returns
    the bytes written. A failed write removes its temporary file and raises ``OSError``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    header = json.dumps({
        "magic": MAGIC, "format": FORMAT, "run": run or new_run_id(), "time": time.time(),
        "sha256": hashlib.sha256(payload).hexdigest(), "length": len(payload),
    }).encode() + b"\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(_create_private(tmp), "wb") as f:
            f.write(header + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)  # a full disk must not keep the partial file
        raise
    fsync_dir(path.parent)
    return len(header) + len(payload)


def _create_private(path: Path) -> int:
    """A descriptor of a new file at ``path`` (0600), made by this call: whatever lies there under
    the name (a link planted to a file elsewhere, a dead writer's file of the same pid) is
    removed first, never followed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        os.unlink(path)  # the link itself, not what it points to
        return os.open(path, flags, 0o600)


def _unlink_quietly(path: Path) -> bool:
    """Remove ``path``; whether it was removed (a failure is a warning)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("cannot remove %s: %s", path, e.strerror or e)
        return False
    return True


def _parse_header(path: Path, line: bytes) -> Header:
    try:
        header = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
        raise CheckpointError(f"{path} is not a psserver checkpoint (bad header)") from None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise CheckpointError(f"{path} is not a psserver checkpoint")
    fmt = header.get("format")
    if fmt not in READABLE_FORMATS:
        raise CheckpointError(f"{path} has checkpoint format {fmt}, this psserver reads formats "
                              f"{', '.join(map(str, READABLE_FORMATS))}")
    if fmt == 1:
        run, written = LEGACY_RUN, None
    else:
        run, written = header.get("run"), header.get("time")
        if not isinstance(run, str) or not run or run == LEGACY_RUN or not isinstance(written, (int, float)):
            raise CheckpointError(f"{path} is not a psserver checkpoint (bad run id or time in its header)")
    length, digest = header.get("length"), header.get("sha256")
    if not isinstance(length, int) or isinstance(length, bool) or length < 0 or not isinstance(digest, str):
        raise CheckpointError(f"{path} is not a psserver checkpoint (bad length or checksum in its header)")
    if written is None:
        try:
            written = path.stat().st_mtime
        except OSError:
            written = 0.0
    return Header(path, fmt, run, float(written), digest, length)


_CHUNK = 1 << 20
"""Bytes read at a time: the checksum is computed on the file as it is read, never on a copy."""


def _open(path: Path) -> Any:
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO or a device: open() would wait
        raise CheckpointError(f"{path} is not a regular file")
    try:
        return open(path, "rb")  # noqa: SIM115 - the callers close it
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None


def _read_header(path: Path, f: Any) -> Header:
    """The header of the open file ``f``, once the file is as long as the header says (its
    size is checked before a byte of the payload is read, so a forged length allocates nothing)."""
    try:
        line = f.readline(4096)
        size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    header = _parse_header(Path(path), line)
    have = size - len(line)
    if have < header.length:
        raise CheckpointError(f"{path} is truncated ({have} of {header.length} bytes)")
    if have > header.length:
        raise CheckpointError(f"{path} is not a psserver checkpoint ({have} bytes where its header says "
                              f"{header.length})")
    return header


def _digest(path: Path, f: Any, length: int) -> str:
    """SHA-256 of the next ``length`` bytes of ``f``, read ``_CHUNK`` at a time."""
    sha = hashlib.sha256()
    done = 0
    try:
        while done < length:
            chunk = f.read(min(_CHUNK, length - done))
            if not chunk:
                raise CheckpointError(f"{path} is truncated ({done} of {length} bytes)")
            sha.update(chunk)
            done += len(chunk)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    return sha.hexdigest()


def read_header(path: Path) -> Header:
    """The header of ``path`` (one short read); ``CheckpointError`` if it has none."""
    with _open(path) as f:
        try:
            line = f.readline(4096)
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    return _parse_header(Path(path), line)


def verify(path: Path) -> Header:
    """The header of ``path`` once its payload matches its checksum, in constant memory
    (nothing is unpickled, nothing is kept); ``CheckpointError`` if it does not."""
    with _open(path) as f:
        header = _read_header(path, f)
        if _digest(path, f, header.length) != header.sha256:
            raise CheckpointError(f"{path} is corrupt (checksum mismatch)")
    return header


def _verified_payload(path: Path) -> tuple[Header, bytes]:
    """The header and payload of ``path``: the checksum is computed streaming first, so a file
    that does not match costs no memory, then the payload is read (and checked again: the file
    may change between the two reads)."""
    with _open(path) as f:
        header = _read_header(path, f)
        start = f.tell()
        if _digest(path, f, header.length) != header.sha256:
            raise CheckpointError(f"{path} is corrupt (checksum mismatch)")
        try:
            f.seek(start)
            payload = f.read(header.length)
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    if len(payload) != header.length or hashlib.sha256(payload).hexdigest() != header.sha256:
        raise CheckpointError(f"{path} changed while it was read (checksum mismatch)")
    return header, payload


def load_checkpoint(path: Path) -> tuple[Header, dict[str, Any]]:
    """Verify and load one file: its header and state. ``CheckpointError`` with the reason if
    it is not valid, ``UnsafeCheckpointError`` if its payload holds more than tensors and data."""
    header, payload = _verified_payload(path)
    try:
        with warnings.catch_warnings():  # torch's (a sparse tensor's invariants...): the checks below word it
            warnings.simplefilter("ignore")
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # The weights-only unpickler's refusal, however torch words it (it changed between
        # versions): the checksum holds, so the file was made to be this way.
        unsafe = _GLOBAL.search(str(e))
        what = (f"would load {unsafe.group(1)}, which a psserver checkpoint never holds" if unsafe
                else f"is refused by torch's weights-only loader ({_first_line(e)})")
        raise UnsafeCheckpointError(
            f"refusing {path}: its payload {what} (tampered with, or not written by psserver)") from None
    except (RuntimeError, EOFError, ValueError, RecursionError, MemoryError, IndexError, KeyError, TypeError,
            AttributeError, OverflowError) as e:
        # A payload of a few malformed pickle opcodes (the unpickler's stack or memo out of reach).
        raise CheckpointError(f"{path} holds no loadable state ({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a psserver checkpoint")
    return header, state


def load_named(path: Path) -> tuple[Header, dict[str, Any]]:
    """``load_checkpoint`` of a file a resume names (``--resume FILE``, a partition's step), once it is this user's
    alone: the same rule as the files of a directory a resume searches (``untrusted_file``),
    and no directory or link on the way to it that another user can change."""
    path = Path(path)
    why = unsafe_parent(path)
    if why is None:
        why = untrusted_file(Path(os.path.realpath(path)))
        if why is not None:
            why = f"{path} {why}"
    if why is not None:
        raise CheckpointError(f"refusing to resume {path}: {why}; only this user's own checkpoints are resumed "
                              "(copy the file into a directory of your own if you trust it)")
    return load_checkpoint(path)


def _first_line(e: BaseException) -> str:
    """The informative line of torch's multi-line load errors."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return next((x for x in lines if "unsupported" in x.lower()), lines[0] if lines else type(e).__name__)[:200]


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load and verify one file; ``CheckpointError`` with the reason if it is not valid."""
    return load_checkpoint(path)[1]


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory`` (every run's), newest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def resume_order(directory: Path) -> tuple[list[Path], list[CheckpointError]]:
    """Checkpoint files in the order a resume tries them: the run written to most recently
    first, each run's newest step first; and the errors of the files without a valid header or
    that another user could have written (``untrusted_file``)."""
    runs: dict[str, list[Header]] = {}
    unreadable: list[CheckpointError] = []
    for path in list_checkpoints(directory):
        why = untrusted_file(path)
        if why is not None:  # planted by another user (a directory of /tmp's kind lets them)
            unreadable.append(CheckpointError(f"{path} {why}: only this user's own checkpoints are resumed"))
            continue
        try:
            header = read_header(path)
        except CheckpointError as e:
            unreadable.append(e)
            continue
        runs.setdefault(header.run, []).append(header)
    order = sorted(runs.values(), key=lambda hs: max(h.time for h in hs), reverse=True)
    return [h.path for hs in order for h in hs], unreadable


def find_latest(directory: Path) -> tuple[Header, dict[str, Any]] | None:
    """The newest checkpoint that verifies (see ``resume_order``); invalid ones are reported
    and skipped, an unsafe one (``UnsafeCheckpointError``) stops the search."""
    order, unreadable = resume_order(directory)
    for e in unreadable:
        log.error("skipping invalid checkpoint: %s", e)
    for path in order:
        try:
            return load_checkpoint(path)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as e:
            log.error("skipping invalid checkpoint: %s", e)
    return None


def load_latest(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """``find_latest`` as (path, state)."""
    found = find_latest(directory)
    return (found[0].path, found[1]) if found is not None else None


# ---- the directory ----------------------------------------------------------------------------


def check_writable(directory: Path) -> None:
    """Create ``directory`` and a probe file in it, then remove the probe: a server that could
    never save a checkpoint is refused at start rather than at its first save."""
    directory = Path(directory)
    why = unsafe_parent(directory)  # before anything is made there
    if why is not None:
        raise CheckpointDirError(f"--checkpoint-dir {directory}: {why}; use a directory of your own")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CheckpointDirError(f"--checkpoint-dir {directory} is not a directory") from None
    except OSError as e:
        raise CheckpointDirError(f"--checkpoint-dir {directory} cannot be created: {e.strerror or e}") from None
    if not directory.is_dir():
        raise CheckpointDirError(f"--checkpoint-dir {directory} is not a directory")
    why = unsafe_parent(directory)  # again: a parent another user made while these were made is theirs
    if why is not None:
        raise CheckpointDirError(f"--checkpoint-dir {directory}: {why}; use a directory of your own")
    link = os.lstat(directory)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, os.geteuid()):
        raise CheckpointDirError(f"--checkpoint-dir {directory} is a link of uid {link.st_uid}: that user can point it "
                                 "elsewhere; use a directory of your own")
    st = directory.stat()
    mode = st.st_mode
    if mode & 0o022 and not mode & stat.S_ISVTX:  # sticky (/tmp, a tmpfs): no one renames or removes ours
        raise CheckpointDirError(f"--checkpoint-dir {directory} is writable by its group or others (mode "
                                 f"{mode & 0o7777:o}): another user could plant checkpoints or links there, or swap "
                                 "ours; chmod go-w it, or use another")
    if st.st_uid not in (0, os.geteuid()):  # the owner of a sticky directory may still rename in it
        raise CheckpointDirError(f"--checkpoint-dir {directory} is owned by uid {st.st_uid}: that user can swap the "
                                 "checkpoints in it; use a directory of your own")
    probe = directory / f".psserver-probe-{os.getpid()}"
    try:
        fd = _create_private(probe)
    except OSError as e:
        raise CheckpointDirError(f"--checkpoint-dir {directory} is not writable: {e.strerror or e}") from None
    try:
        try:
            os.write(fd, b"psserver")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as e:
        _unlink_quietly(probe)
        raise CheckpointDirError(f"--checkpoint-dir {directory} is not writable: {e.strerror or e}") from None


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove the temporary files of writes that died (their writer's pid, in the name, is
    gone, or is this process, which has written nothing yet); a live writer's are left."""
    directory = Path(directory)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for path in sorted(directory.iterdir()):
        m = _TEMPORARY.match(path.name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and pid_alive(pid):
            log.warning("leaving %s alone: its writer (pid %d) is still running", path, pid)
            continue
        if _unlink_quietly(path):
            removed.append(path)
    if removed:
        log.info("removed %d temporary file(s) of interrupted checkpoint writes in %s", len(removed), directory)
    return removed


# ---- the writer -------------------------------------------------------------------------------


class Checkpointer:
    """Writes one run's checkpoints in the background (training pauses only for the state
    copy) and keeps that run's newest ``keep`` valid ones, never touching another run's."""

    def __init__(self, directory: Path, keep: int, run: str | None = None) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.run = run or new_run_id()
        self.last: CheckpointInfo | None = None
        self._lock = threading.Lock()  # one write at a time, in step order
        self._thread: threading.Thread | None = None
        self._checked: dict[Path, tuple[tuple[int, int], bool]] = {}  # (size, mtime_ns) -> verifies

    def save(self, step: int, state: dict[str, Any], *, wait: bool,
             before: Callable[[], None] | None = None) -> CheckpointInfo:
        """Write ``state`` (already a CPU copy) as the checkpoint of ``step``; with ``wait`` a
        failed write raises ``OSError`` (without, it is logged). ``before`` runs first, in the
        same thread: when it raises (``OSError``, ``RuntimeError``) nothing is written."""
        path = checkpoint_path(self.directory, step)
        info = CheckpointInfo(str(path), step, time.time())

        def work() -> None:
            with self._lock:
                t0 = time.monotonic()
                if before is not None:
                    before()
                size = write_checkpoint(path, state, run=self.run)
                info.duration_s = time.monotonic() - t0
                self._is_valid(path, written=True)
                self.last = info
                log.info("checkpoint step %d written to %s (%.1f MB, %.2fs)", step, path, size / 1e6,
                         info.duration_s)
                self._prune(path)

        self.wait()
        if wait:
            work()
        else:
            self._thread = threading.Thread(target=self._guard, args=(step, work), name="psserver-ckpt", daemon=True)
            self._thread.start()
        return info

    @staticmethod
    def _guard(step: int, work: Callable[[], None]) -> None:
        try:
            work()
        except (OSError, RuntimeError) as e:  # a full or vanished disk, a missing partition: one line
            log.error("checkpoint step %d failed: %s", step, e)
        except Exception:  # noqa: BLE001 - a failed write must not kill the server
            log.exception("checkpoint step %d failed", step)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _is_valid(self, path: Path, *, written: bool = False) -> bool:
        """Whether ``path`` verifies, reading it once per version of the file (``written``: it
        was just written and fsynced here, so it does)."""
        try:
            st = path.stat()
        except OSError:
            return False
        version = (st.st_size, st.st_mtime_ns)
        known = self._checked.get(path)
        if known is not None and known[0] == version:
            return known[1]
        valid = True
        if not written:
            try:
                verify(path)
            except CheckpointError as e:
                log.warning("not counting %s among the checkpoints kept: %s", path, e)
                valid = False
        self._checked[path] = (version, valid)
        return valid

    def _prune(self, written: Path) -> None:
        """Keep ``written`` and this run's newest valid checkpoints, ``keep`` in all, and delete
        this run's files older than the oldest of them; other runs' and unreadable files stay."""
        mine: list[tuple[int, Path]] = []
        for path in list_checkpoints(self.directory):
            try:
                if read_header(path).run == self.run:
                    mine.append((step_of(path), path))
            except CheckpointError:
                continue  # no readable header: whose it is is unknown, so it is not ours to delete
        kept = [written]
        for _, path in mine:
            if len(kept) >= self.keep:
                break
            if path != written and self._is_valid(path):
                kept.append(path)
        if len(kept) < self.keep:
            return  # fewer valid checkpoints than asked for: nothing is old enough to go
        oldest = min(step_of(p) for p in kept)
        for step, path in mine:
            if step < oldest and path not in kept and _unlink_quietly(path):
                log.info("removed old checkpoint %s", path)
                self._checked.pop(path, None)
