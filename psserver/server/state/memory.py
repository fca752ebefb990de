"""The server's live state in shared memory: a server process that dies loses no applied update.

Why memory and not a checkpoint per step: a checkpoint copies the whole state each time; here
the state *is* the file. The parameters, buffers, optimizer state and embedding tables (every
slot: ids, rows, their optimizer state and clocks; the admission sketch) are placed in one file on
a memory filesystem (``state_arena``) and every update writes them where they are, so the
restarted process maps the file again and goes on from the last update that completed. The
pages outlive the process (SIGKILL, the OOM killer, a segfault in libtorch), not the host:
for that, checkpoints stay.

A segment is ``<--state-dir>/<key>/server-<rank>/``:

- ``tensors-<generation>.bin``: the tensors, after a header holding the update journal
  (``begin``/``end`` around each update, the global step, the samples) and the digest of the
  generation's metadata.
- ``meta.json``: what the tensors are (the checkpoint's structure, each tensor replaced by its
  slot; which tensors were finite when written) and which generation is current; plain data
  (``state_meta``), replaced atomically. The set of tensors changes a
  few times in a run (a model learnt from a trainer, an optimizer's state made by its first
  step, a table's slots doubled by a lookup): each time a new generation is written beside the
  old one, which goes once ``meta`` names the new one, so a death at any moment leaves one
  whole generation. A table grown by a lookup gets its generation before the next update, or
  at the end of the update it grew during (a death inside that one loses the update's rows).
- ``owner.json``: the processes that own it (the server, its supervisor), so a segment whose
  owners are gone is told apart from one in use.

The directory and everything in it are this user's alone (``state_dir``: mode 0700, refused
when another user made it or can write it; no symbolic link followed). A restart checks what it
maps: the metadata's digest against the tensors file's, the file's size against the slots, the
journal's counters, and that each tensor finite when written still is. A state that fails is
refused in one line; under ``--supervise`` with checkpoints the restart discards it instead,
says so in one WARNING line, and resumes from the newest checkpoint.

The key names the run: a server maps only its own key's state (``--state-key``; the
supervisor gives its key to every restart, a Kubernetes pod its UID), so a fresh run never
maps another's. Segments of other keys whose owners are gone are reported as stale and, with
``--remove-stale-state``, deleted. A clean stop deletes the server's segment.

The header also keeps, per rank, the number of the last gradient applied
(``psserver.server.engine.journal``): a trainer that rejoins sends again the gradient whose reply
it never got, and the restarted server applies it only if the dead one had not.

A torn update: a process killed while an update was being applied leaves ``begin != end``.
The optimizers update element by element in place, so then any subset of the elements of the
parameters and of the optimizer state hold that update and the others do not. The restarted
server counts it as applied (its step, its samples, its gradients' numbers, all written before
it began): its trainers do not send it again, and the elements it had not reached never get
it (one step's update, partly missing). It is logged as such.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from psserver.checkpoint import CheckpointError
from psserver.config import MemoryStateConfig
from psserver.config.ps import DEFAULT_STATE_DIR
from psserver.server.checkpoints.content import check_state
from psserver.server.engine.engine import StepEngine
from psserver.server.state import directory as sd
from psserver.server.state.arena import FINITE_CHECKED, MAX_COUNT, Arena, ArenaError, Journal, Slot
from psserver.server.state.directory import MemoryStateError
from psserver.server.state.layout import all_finite, check, fill, state_layout, unplaceable
from psserver.server.state.meta import MAX_META_BYTES, MetaError, dump_meta, parse_meta
from psserver.server.state.segments import OWNER, Segment, scan, scan_open
from psserver.server.state.supervisor import FALLBACK_ENV, SUPERVISOR_ENV
from psserver.utils.processes import boot_id, start_time

log = logging.getLogger(__name__)

META, LEGACY_META = "meta.json", "meta.pkl"

__all__ = ["MemoryState", "MemoryStateError", "Segment", "scan", "state_layout", "unsupported_reason"]


class MemoryState:
    """This server's segment: restore from it, keep it current, release it."""

    def __init__(self, config: MemoryStateConfig, server_rank: int) -> None:
        assert config.directory is not None
        self.config = config
        self.root = config.directory
        self.key = config.key or uuid.uuid4().hex[:16]
        self.dir = self.root / self.key / f"server-{server_rank}"
        self.stale: list[Segment] = []
        """Segments of other runs whose processes are gone (reported; deleted with ``remove_stale``)."""
        self.arena: Arena | None = None
        self._slots: list[Slot] = []
        self._seq = 0
        self._samples = 0
        self._signature: tuple | None = None
        self._next = (0, 0)
        self.ranks: dict[int, int] = {}
        """Rank -> its last gradient applied, as the state found in memory records it."""
        self._engine: StepEngine | None = None
        self._snapshot: Callable[[], dict] | None = None
        self._fds: dict[str, int] = {}
        """Open descriptors of the root, the key's and the segment's directories (once made or found)."""
        self.disabled: str | None = None
        """Why this server keeps no state in memory after all (None: it does)."""

    def describe(self) -> str:
        """One line for ``psserver status``."""
        if self.disabled is not None:
            return f"off: {self.disabled}"
        arena = self.arena
        if arena is None or self._engine is None:
            return f"{self.dir} (written at the first update)"
        return f"{self.dir}, generation {arena.generation}, {arena.size / 2**20:.1f} MiB"

    # ---- the directories (descriptors: no link on the way is followed) -------------------------

    def _open(self, level: str, create: bool) -> int | None:
        """The descriptor of ``root``, ``key`` or ``segment``, each checked to be this user's alone."""
        fd = self._fds.get(level)
        if fd is not None:
            return fd
        if level == "root":
            fd = sd.open_root(self.root, create)
        else:
            parent = self._open("root" if level == "key" else "key", create)
            if parent is None:
                return None
            where, name = (self.root, self.key) if level == "key" else (self.dir.parent, self.dir.name)
            fd = sd.open_dir(parent, name, where, create)
        if fd is not None:
            self._fds[level] = fd
        return fd

    def _close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    # ---- start ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Check the directory (this user's alone: made so when missing); report (or delete)
        other runs' dead segments."""
        root = self._open("root", create=True)
        assert root is not None
        for seg in scan_open(root, self.root):
            if seg.key == self.key or seg.alive:
                continue
            if self.config.remove_stale:
                with contextlib.suppress(MemoryStateError):
                    key_fd = sd.open_dir(root, seg.key, self.root, create=False)
                    if key_fd is not None:
                        try:
                            sd.remove_tree(key_fd, seg.path.name)
                        finally:
                            os.close(key_fd)
                        sd.rmdir(root, seg.key)
                log.warning("removed the stale state of a job that is gone: %s", seg.describe())
            else:
                self.stale.append(seg)
                log.warning("stale state of a job that is gone: %s; remove it with psserver serve "
                            "--remove-stale-state (or rm -r %s)", seg.describe(), seg.path.parent)

    def load(self) -> tuple[dict, Path] | None:
        """The state this run's previous process left (checkpoint structure, tensors mapped), or
        None when it left none, or (a supervised restart with checkpoints) one that failed its
        check, discarded."""
        try:
            found = self._load()
        except MemoryStateError as e:
            if not os.environ.get(FALLBACK_ENV):
                raise
            log.warning("%s: discarded; resuming from the newest good checkpoint instead", e)
            self._discard()
            return None
        if found is None:
            return None
        state, arena, slots, journal = found
        step, samples = journal.global_step, journal.samples
        if journal.torn:
            step, samples = journal.next_step, journal.next_samples
            log.warning("the server died while applying the update of global step %d: some elements of the "
                        "parameters and optimizer state hold it, the others do not; it counts as applied (its "
                        "trainers do not send it again)", step)
        state["global_step"], state["samples_seen"] = step, samples
        try:  # what a checkpoint is checked for (a negative second moment stays finite)
            check_state(state, self.dir)
        except CheckpointError as e:
            why = str(e).removeprefix(f"{self.dir} ")
            error = MemoryStateError(f"the state in {self.dir} fails the checks of a checkpoint ({why}); move it "
                                     "away to start without it")
            if not os.environ.get(FALLBACK_ENV):
                raise error from None
            log.warning("%s: discarded; resuming from the newest good checkpoint instead", error)
            self._discard()
            return None
        log.info("found the state of run %s in memory: %s, generation %d, global step %d, %d samples",
                 state.get("run"), self.dir, journal.generation, step, samples)
        self.arena, self._slots = arena, slots  # kept mapped until the next generation replaces it
        self._seq = journal.begin
        self.ranks = arena.ranks(journal.torn)
        return state, self.dir

    def _load(self) -> tuple[dict, Arena, list[Slot], Journal] | None:
        def refuse(why: str) -> MemoryStateError:
            return MemoryStateError(f"the state in {self.dir} cannot be read ({why}); move it away to start "
                                    "without it")

        try:
            fd = self._open("segment", create=False)
            if fd is None:
                return None
            data = sd.read_file(fd, META, self.dir, MAX_META_BYTES)
            if data is None:
                if LEGACY_META in os.listdir(fd):
                    raise refuse(f"{LEGACY_META} is the metadata of an older psserver, not read")
                return None
            meta, digest = parse_meta(data)
            if meta["key"] != self.key:
                raise refuse(f"it says it is the state of key {meta['key']!r}")
            arena = Arena.open(self.dir / meta["file"], dir_fd=fd)
        except MemoryStateError as e:
            raise refuse(str(e).removeprefix(f"{self.dir}/")) from None
        except (OSError, MetaError, ArenaError) as e:
            raise refuse(str(e)) from None
        why = check(arena, meta, digest)
        if why is not None:
            raise refuse(why)
        views = [arena.view(slot) for slot in meta["slots"]]
        bad = [i for i, (view, finite) in enumerate(zip(views, meta["finite"], strict=True))
               if finite and not all_finite(view)]
        if bad:
            raise refuse(f"{len(bad)} of its {len(views)} tensors hold NaN or infinite values that were finite "
                         f"when written, the first is tensor {bad[0]} {tuple(views[bad[0]].shape)}")
        return fill(meta["state"], views), arena, meta["slots"], arena.journal()

    def _discard(self) -> None:
        """A state that failed its check: its files go (the directory stays), so that no restart maps it."""
        fd = self._fds.get("segment")
        if fd is None:
            return
        for name in (META, LEGACY_META, *sd.files(fd, "tensors-")):
            sd.unlink(fd, name)

    def attach(self, engine: StepEngine, snapshot: Callable[[], dict], run: str) -> None:
        """Keep ``engine``'s state in the segment from now on (``snapshot``: the checkpoint
        structure of its live tensors, taken under the updater's lock; ``run``: its run id)."""
        why = unsupported_reason(engine)
        if why is not None:
            self.disabled = why
            log.warning("state in memory: off, %s; a restarted server resumes from its last checkpoint", why)
            return
        for name, count in (("global step", engine.global_step), ("sample count", engine.samples_seen)):
            if not 0 <= count <= MAX_COUNT:
                raise MemoryStateError(f"--state-dir: the {name} {count} is beyond what the state in memory counts "
                                       f"(0 to 2^62)")
        self._make_dir()
        self._engine, self._snapshot = engine, snapshot
        self._write_owner(run)
        with engine.updater.lock:
            self._samples = engine.samples_seen
            engine.sequences.applied.update(self.ranks)
            engine.sequences.durable = self
            if engine.has_model:
                self._bind()

    def forget_found(self) -> None:
        """What ``load`` found is not continued from (server 0 said so): the next generation
        starts from the engine's state, with no trainer's gradient counted as applied."""
        self.ranks = {}

    # ---- the journal (psserver.server.engine.journal; the updater's lock held) -------------------

    def begin(self, global_step: int, samples: int, applied: list[tuple[int, int]]) -> None:
        assert self._engine is not None
        if self.disabled is not None:
            return
        if self.arena is not None and self._engine.state_signature() != self._signature:
            self._bind()  # a table grew since the last update (a lookup created rows)
        self._next = (global_step, self._samples + samples)
        if self.arena is not None:
            self._seq += 1
            self.arena.begin(self._seq, *self._next, applied)

    def commit(self) -> None:
        global_step, self._samples = self._next
        assert self._engine is not None
        if self.disabled is not None:
            return
        if self._engine.state_signature() != self._signature:
            # Some of the update went to tensors outside the segment (an optimizer's first
            # state, a table grown by a lookup while it was applied): a new generation holds it
            # all, the end of this update included.
            self._bind()
        elif self.arena is not None:
            self.arena.end(self._seq, global_step, self._samples)

    def forget_rank(self, rank: int) -> None:
        if self.arena is not None:
            self.arena.set_rank(rank, 0)

    # ---- generations ---------------------------------------------------------------------------

    def _bind(self) -> None:
        """(lock held) A new generation holding the engine's tensors, each then a view of it."""
        engine, snapshot = self._engine, self._snapshot
        assert engine is not None and snapshot is not None
        # Lookups create rows in the tables outside the updater's lock: they wait while the
        # tables' tensors are copied and moved.
        with engine.tables.lock if engine.tables is not None else contextlib.nullcontext():
            self._bind_locked(engine, snapshot)

    def _bind_locked(self, engine: StepEngine, snapshot: Callable[[], dict]) -> None:
        started = time.perf_counter()
        state = snapshot()
        structure, tensors = state_layout(state)
        why = unplaceable(tensors)
        if why is not None:
            self._give_up(why)
            return
        fd = self._fds["segment"]
        generation = (self.arena.generation + 1) if self.arena is not None else 1
        journal = Journal(generation, self._seq, self._seq, engine.global_step, self._samples, engine.global_step,
                          self._samples)
        name = f"tensors-{generation}.bin"
        path = self.dir / name
        sd.unlink(fd, name)  # a generation a dead process began and never named
        try:
            arena, slots = Arena.create(path, tensors, journal, dir_fd=fd)
            arena.write_ranks(engine.sequences.applied)
            finite = [t.dtype in FINITE_CHECKED and all_finite(t) for t in tensors]
            data, digest = dump_meta(generation, name, self.key, slots, finite, structure)
            arena.write_digest(digest)
            sd.write_file(fd, META, data)
        except TypeError as e:  # a value in the structure JSON does not carry
            sd.unlink(fd, name)
            self._give_up(str(e))
            return
        except OSError as e:
            sd.unlink(fd, name)
            need = Arena.plan(tensors)[1]
            free = shutil.disk_usage(self.dir).free
            self._give_up(f"cannot write {path} ({e.strerror or e}; it needs {need / 2**20:.1f} MiB, "
                          f"{free / 2**20:.1f} MiB free there)")
            return
        old = self.arena
        self.arena, self._slots = arena, slots
        self._signature = engine.state_signature()
        for f in sd.files(fd, "tensors-", ".bin"):
            if f != name:
                sd.unlink(fd, f)  # the old mapping lives on until its last view goes
        log.info("state in memory: %s, generation %d, %d tensors, %.1f MiB (%.0f ms)%s", path, generation,
                 len(tensors), arena.size / 2**20, (time.perf_counter() - started) * 1e3,
                 "" if old is None else f", replacing generation {old.generation}")

    def _make_dir(self) -> None:
        """The segment's directory, made (mode 0700 at each level) where missing."""
        for attempt in range(3):
            try:
                self._open("segment", create=True)
                return
            except MemoryStateError:
                # another server removed the empty key directory between two levels
                self._fds.pop("segment", None)
                key = self._fds.pop("key", None)
                if key is not None:
                    os.close(key)
                if attempt == 2:
                    raise
            except OSError as e:
                raise MemoryStateError(f"--state-dir {self.root}: cannot create {self.dir} ({e.strerror})") from None

    def _give_up(self, why: str) -> None:
        self.disabled = why
        if self._engine is not None:
            self._engine.sequences.durable = None
        # The tensors may still be views of the last generation and change without its journal:
        # no restart may map it.
        fd = self._fds.get("segment")
        if fd is not None:
            sd.unlink(fd, META)
        log.error("state in memory: off from now on, %s; a restarted server resumes from its last checkpoint", why)

    # ---- stop ----------------------------------------------------------------------------------

    def release(self) -> None:
        """The server stopped cleanly: its segment goes (nothing outside the state directory)."""
        if self._engine is not None:
            self._engine.sequences.durable = None
        self.arena = None
        with contextlib.suppress(MemoryStateError, OSError):
            key = self._open("key", create=False)
            if key is not None:
                sd.remove_tree(key, self.dir.name)
                sd.rmdir(self._fds["root"], self.key)  # the key's directory, once no server of it has a segment
        self._close()
        if self.root == Path(DEFAULT_STATE_DIR):
            with contextlib.suppress(OSError):
                os.rmdir(self.root)  # psserver's own directory, once no job's state is in it
        if self.disabled is None:
            log.info("state in memory released: %s", self.dir)

    def _write_owner(self, run: str) -> None:
        supervisor = os.environ.get(SUPERVISOR_ENV)
        sup = int(supervisor) if supervisor and supervisor.isdigit() and 0 < int(supervisor) < 2**31 else None
        owner = {"pid": os.getpid(), "pid_start": start_time(os.getpid()), "supervisor": sup,
                 "supervisor_start": start_time(sup) if sup else None, "boot_id": boot_id(),
                 "host": socket.gethostname(), "key": self.key, "started": time.time(),
                 "run": run}
        sd.write_file(self._fds["segment"], OWNER, json.dumps(owner).encode())


def unsupported_reason(engine: StepEngine) -> str | None:
    """Why ``engine``'s state cannot be kept in memory (None: it can). Device memory dies with
    its process (a host copy per update is what ``benchmarks.state_copy`` measures); a sync
    round in flight across server processes cannot be rebuilt."""
    if engine.plan is not None and engine.config.rounds:
        return "several server processes in sync mode do not keep it there (a round in flight across them cannot " \
               "be rebuilt: a lost one sends every server to a checkpoint)"
    if any(d.type != "cpu" for d in engine.devices):
        return f"the model lives on {', '.join(str(d) for d in engine.devices)}, not in host memory"
    return None
