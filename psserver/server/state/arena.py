"""One file of tensors that outlives the process: the server's live state, mapped shared.

The file lives on a memory filesystem (``/dev/shm``, a Kubernetes ``emptyDir`` with
``medium: Memory``). :meth:`Arena.create` copies tensors into it and points each tensor at its
place there (``tensor.data = view``: the same Python object, so the optimizer, the modules and
every other holder keep working, and no autograd version changes), so an update applied in
place is written to the file by the update itself: no second copy of the state per step. The
pages belong to the file, not to the process: a SIGKILL loses nothing that was written.

A header at the start carries the update journal and the digest of the segment's metadata of the
same generation (``psserver.server.state.meta``), so a file is never read with another
generation's metadata. Before an update is applied: the step and
samples it will make, the number of each trainer's gradient in it (one slot per rank), then
``begin``; after it: the global step and samples, then ``end``. A reader tells a clean file
(``begin == end``) from one whose last update was interrupted mid-apply.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"PSSTATE3"
HEADER_BYTES = 16384
ALIGN = 64
_FIELDS = struct.Struct("<8sqqqqqqq")  # magic, generation, begin, end, global_step, samples, next step, next samples
_RANKS_AT = 64
DIGEST_BYTES = 32
_DIGEST_AT = HEADER_BYTES - DIGEST_BYTES
MAX_RANKS = (_DIGEST_AT - _RANKS_AT) // 8
"""Ranks whose last gradient number the header keeps (a higher rank's gradients are not deduplicated
across a restart)."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in the file (plain data: it goes into the segment's metadata)."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _DTYPES[self.dtype].itemsize


_DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128, torch.complex64, torch.int64,
    torch.int32, torch.int16, torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool)}
SUPPORTED = frozenset(_DTYPES.values())
FINITE_CHECKED = frozenset(d for d in _DTYPES.values() if d.is_floating_point or d.is_complex)
"""The dtypes whose values are checked at a restart to be finite where they were when written."""
MAX_COUNT = 2**62
"""The largest global step and sample count the header keeps (room to count on, in 64 bits)."""


def slot_problem(slot: Slot) -> str | None:
    """What is wrong with a slot read from a file (None: nothing)."""
    if slot.dtype not in _DTYPES:
        return f"dtype {slot.dtype!r}"
    if len(slot.shape) > 64 or any(type(d) is not int or not 0 <= d < 2**48 for d in slot.shape):
        return f"shape {slot.shape!r}"
    if type(slot.offset) is not int or not HEADER_BYTES <= slot.offset < 2**62:
        return f"offset {slot.offset!r}"
    return None


def aligned(nbytes: int) -> int:
    """The room a tensor of ``nbytes`` takes in the file."""
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


@dataclass(frozen=True)
class Journal:
    """The header's counters."""

    generation: int
    begin: int
    end: int
    global_step: int
    samples: int
    next_step: int = 0
    """The global step of the update begun last (its own, once it ended)."""
    next_samples: int = 0

    def problem(self) -> str | None:
        """What makes these counters impossible for a file this code wrote (None: nothing)."""
        if self.generation < 1:
            return f"generation {self.generation}"
        if not 0 <= self.end <= self.begin <= self.end + 1:
            return f"updates begun {self.begin}, ended {self.end}"
        for name in ("global_step", "samples", "next_step", "next_samples"):
            if not 0 <= getattr(self, name) <= MAX_COUNT:
                return f"{name.replace('_', ' ')} {getattr(self, name)} (at most {MAX_COUNT})"
        return None

    @property
    def torn(self) -> bool:
        """An update was being applied when the writer died: some tensors may hold it, some not."""
        return self.begin != self.end


class ArenaError(RuntimeError):
    """The file is not a whole arena (missing, truncated, another format)."""


class Arena:
    """A mapped file of tensors plus the journal header."""

    def __init__(self, path: Path, mm: mmap.mmap, generation: int) -> None:
        self.path = path
        self._mm = mm
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self.generation = generation
        self._in_flight: list[tuple[int, int]] = []  # the ranks' numbers of the update begun, not ended

    # ---- making and opening ------------------------------------------------------------------

    @staticmethod
    def plan(tensors: list[torch.Tensor]) -> tuple[list[Slot], int]:
        """Each tensor's slot, and the file's size."""
        slots, offset = [], HEADER_BYTES
        for t in tensors:
            if t.dtype not in SUPPORTED:
                raise TypeError(f"a tensor of {t.dtype} cannot be kept in shared memory")
            slot = Slot(offset, str(t.dtype).removeprefix("torch."), tuple(t.shape))
            slots.append(slot)
            offset += aligned(slot.nbytes)
        return slots, offset

    @classmethod
    def create(cls, path: Path, tensors: list[torch.Tensor], journal: Journal,
               dir_fd: int | None = None) -> tuple[Arena, list[Slot]]:
        """A new file at ``path`` (``path.name`` in the directory ``dir_fd`` when given: no link
        on the way is followed) holding ``tensors`` (CPU, any layout), each tensor then a view
        of its place in it; the header holds ``journal``."""
        slots, size = cls.plan(tensors)
        fd = os.open(path if dir_fd is None else path.name,
                     os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            # Reserved now: a memory filesystem that fills up fails here (ENOSPC), not with a
            # SIGBUS at some later write into the mapping.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        arena = cls(path, mm, journal.generation)
        arena.write_journal(journal)
        with torch.no_grad():
            for t, slot in zip(tensors, slots, strict=True):
                view = arena.view(slot)
                view.copy_(t.detach())
                t.data = view
        return arena, slots

    @classmethod
    def open(cls, path: Path, dir_fd: int | None = None) -> Arena:
        """An existing file (``ArenaError`` when it is not one, or a link, or another user's, or
        writable by others); ``path.name`` in the directory ``dir_fd`` when given."""
        try:
            fd = os.open(path if dir_fd is None else path.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            raise ArenaError(f"{path}: {'a symbolic link' if e.errno == errno.ELOOP else e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise ArenaError(f"{path}: not a regular file of this user that only it can write")
            size = st.st_size
            if size < HEADER_BYTES:
                raise ArenaError(f"{path}: {size} bytes, shorter than its header")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, generation, *_ = _FIELDS.unpack_from(mm, 0)
        if magic != MAGIC:
            mm.close()
            raise ArenaError(f"{path}: not a psserver state file")
        return cls(path, mm, generation)

    # ---- use -----------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self._mm)

    def view(self, slot: Slot) -> torch.Tensor:
        if slot.offset < HEADER_BYTES or slot.offset + slot.nbytes > self.size:
            raise ArenaError(f"{self.path}: a tensor at {slot.offset}+{slot.nbytes} is outside the file's "
                             f"{self.size} bytes")
        return self._bytes[slot.offset:slot.offset + slot.nbytes].view(_DTYPES[slot.dtype]).view(slot.shape)

    def journal(self) -> Journal:
        return Journal(*_FIELDS.unpack_from(self._mm, 0)[1:])

    def digest(self) -> bytes:
        """The digest of the metadata this file was written with."""
        return bytes(self._mm[_DIGEST_AT:HEADER_BYTES])

    def write_digest(self, digest: bytes) -> None:
        assert len(digest) == DIGEST_BYTES
        self._mm[_DIGEST_AT:HEADER_BYTES] = digest

    def write_journal(self, j: Journal) -> None:
        _FIELDS.pack_into(self._mm, 0, MAGIC, j.generation, j.begin, j.end, j.global_step, j.samples, j.next_step,
                          j.next_samples)

    def ranks(self, torn: bool) -> dict[int, int]:
        """Rank -> the number of its last gradient applied. A number of the update in flight is
        written negated before the update's begin mark and positive before its end mark: when
        the writer died, it counts as applied if the update is ``torn`` (begun: it counts as
        applied), else the update never began and the one before it is the rank's last (a
        trainer sends again only the gradient in flight, so nothing older is asked of it)."""
        values = struct.unpack_from(f"<{MAX_RANKS}q", self._mm, _RANKS_AT)
        ranks = {rank: (-n if torn else -n - 1) if n < 0 else n for rank, n in enumerate(values)}
        return {rank: n for rank, n in ranks.items() if n}

    def write_ranks(self, ranks: dict[int, int]) -> None:
        for rank, n in ranks.items():
            self.set_rank(rank, n)

    def set_rank(self, rank: int, number: int) -> None:
        if 0 <= rank < MAX_RANKS:
            struct.pack_into("<q", self._mm, _RANKS_AT + 8 * rank, number)

    def begin(self, seq: int, global_step: int, samples: int, applied: list[tuple[int, int]]) -> None:
        """An update is about to be applied in place: what it will be (its gradients' numbers
        negated: in flight), then the mark that opens it."""
        struct.pack_into("<qq", self._mm, 48, global_step, samples)
        for rank, number in applied:
            self.set_rank(rank, -number)
        self._in_flight = list(applied)
        struct.pack_into("<q", self._mm, 16, seq)

    def end(self, seq: int, global_step: int, samples: int) -> None:
        """That update is whole: its gradients' numbers, its step and samples, then the mark
        that closes it."""
        for rank, number in self._in_flight:
            self.set_rank(rank, number)
        self._in_flight = []
        struct.pack_into("<qq", self._mm, 32, global_step, samples)
        struct.pack_into("<q", self._mm, 24, seq)
