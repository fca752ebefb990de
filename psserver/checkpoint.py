"""Checkpoints that survive crashes: atomic writes, checksums, and a newest-valid search.

A file is ``ckpt-<step 12 digits>.pt``: a small header line (magic, format, SHA-256 of the
payload, payload length) followed by the ``torch.save`` payload. It is written to a
temporary file, fsynced, renamed into place and the directory fsynced, so a crash mid-write
leaves the previous checkpoint intact; a truncated or bit-flipped file fails the checksum and
is reported and skipped.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch

from psserver.errors import UsageError
from psserver.telemetry import CheckpointInfo

log = logging.getLogger(__name__)

MAGIC = "PSSERVER-CKPT"
FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{12})\.pt$")


class CheckpointError(UsageError):
    """A checkpoint that cannot be used (corrupt, partial, or for another model)."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:012d}.pt"


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


def write_checkpoint(path: Path, state: dict[str, Any], *, fault_after_bytes: int | None = None) -> int:
    """Write ``state`` atomically; returns the bytes written.

    ``fault_after_bytes`` (tests only, also ``$PSSERVER_CKPT_FAULT_AFTER``) kills the process
    after writing that many bytes of the temporary file, to prove a crash mid-write is safe.
    """
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    header = json.dumps(
        {"magic": MAGIC, "format": FORMAT, "sha256": hashlib.sha256(payload).hexdigest(), "length": len(payload)}
    ).encode() + b"\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if fault_after_bytes is None and os.environ.get("PSSERVER_CKPT_FAULT_AFTER"):
        fault_after_bytes = int(os.environ["PSSERVER_CKPT_FAULT_AFTER"])
    with open(tmp, "wb") as f:
        data = header + payload
        if fault_after_bytes is not None:
            f.write(data[:fault_after_bytes])
            f.flush()
            os.fsync(f.fileno())
            log.error("injected fault: dying after %d bytes of %s", fault_after_bytes, tmp)
            os._exit(17)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return len(header) + len(payload)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load and verify one file; ``CheckpointError`` with the reason if it is not valid."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header_line = f.readline(4096)
            payload = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    try:
        header = json.loads(header_line)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{path} is not a psserver checkpoint (bad header)") from None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise CheckpointError(f"{path} is not a psserver checkpoint")
    if header.get("format") != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {header.get('format')}, expected {FORMAT}")
    if len(payload) != header.get("length"):
        raise CheckpointError(f"{path} is truncated ({len(payload)} of {header.get('length')} bytes)")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise CheckpointError(f"{path} is corrupt (checksum mismatch)")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, newest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def load_latest(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies; invalid ones are reported and skipped."""
    for path in list_checkpoints(directory):
        try:
            return path, read_checkpoint(path)
        except CheckpointError as e:
            log.error("skipping invalid checkpoint: %s", e)
    return None


class Checkpointer:
    """Writes checkpoints in the background: training pauses only for the state copy."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.last: CheckpointInfo | None = None
        self._lock = threading.Lock()  # one write at a time, in step order
        self._thread: threading.Thread | None = None

    def save(self, step: int, state: dict[str, Any], *, wait: bool) -> CheckpointInfo:
        """Write ``state`` (already a CPU copy) as the checkpoint of ``step``."""
        path = checkpoint_path(self.directory, step)
        info = CheckpointInfo(str(path), step, time.time())

        def work() -> None:
            with self._lock:
                t0 = time.monotonic()
                size = write_checkpoint(path, state)
                info.duration_s = time.monotonic() - t0
                self.last = info
                log.info("checkpoint step %d written to %s (%.1f MB, %.2fs)", step, path, size / 1e6,
                         info.duration_s)
                self._prune()

        if wait:
            self.wait()
            work()
        else:
            self.wait()
            self._thread = threading.Thread(target=self._guard, args=(work,), name="psserver-ckpt", daemon=True)
            self._thread.start()
        return info

    @staticmethod
    def _guard(work) -> None:
        try:
            work()
        except Exception:  # noqa: BLE001 - a failed write must not kill the server
            log.exception("checkpoint write failed")

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _prune(self) -> None:
        for old in list_checkpoints(self.directory)[self.keep:]:
            try:
                old.unlink()
            except OSError:
                log.warning("cannot delete old checkpoint %s", old)
