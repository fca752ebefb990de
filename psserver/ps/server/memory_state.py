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
  (``begin``/``end`` around each update, the global step, the samples).
- ``meta.pkl``: what the tensors are (the checkpoint's structure, each tensor replaced by its
  slot) and which generation is current; replaced atomically. The set of tensors changes a
  few times in a run (a model learnt from a trainer, an optimizer's state made by its first
  step, a table's slots doubled by a lookup): each time a new generation is written beside the
  old one, which goes once ``meta`` names the new one, so a death at any moment leaves one
  whole generation. A table grown by a lookup gets its generation before the next update, or
  at the end of the update it grew during (a death inside that one loses the update's rows).
- ``owner.json``: the processes that own it (the server, its supervisor), so a segment whose
  owners are gone is told apart from one in use.

The key names the run: a server maps only its own key's state (``--state-key``; the
supervisor gives its key to every restart, a Kubernetes pod its UID), so a fresh run never
maps another's. Segments of other keys whose owners are gone are reported as stale and, with
``--remove-stale-state``, deleted. A clean stop deletes the server's segment.

The header also keeps, per rank, the number of the last gradient applied
(``psserver.ps.engine.sequences``): a trainer that rejoins sends again the gradient whose reply
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
import pickle
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from psserver.config import MemoryStateConfig
from psserver.config.ps import DEFAULT_STATE_DIR
from psserver.errors import UsageError
from psserver.ps.engine.engine import StepEngine
from psserver.ps.server.state_arena import Arena, ArenaError, Journal, Slot
from psserver.ps.server.supervisor import SUPERVISOR_ENV
from psserver.utils.processes import boot_id, running, start_time

log = logging.getLogger(__name__)

META, OWNER = "meta.pkl", "owner.json"
FORMAT = 1
_TENSOR = "__psserver_tensor__"


class MemoryStateError(UsageError):
    """A segment that cannot be used (its files are torn or of another format)."""


@dataclass
class Segment:
    """One server process's state in ``--state-dir``."""

    path: Path
    key: str
    owner: dict | None

    @property
    def alive(self) -> bool:
        """Whether a process that owns it still runs on this host (since this boot)."""
        o = self.owner
        if not o or o.get("boot_id") != boot_id():
            return False
        return any(running(pid, start) for pid, start in ((o.get("pid"), o.get("pid_start")),
                                                            (o.get("supervisor"), o.get("supervisor_start"))))

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.glob("tensors-*.bin"))

    def describe(self) -> str:
        o = self.owner or {}
        return (f"{self.path} ({self.nbytes / 2**20:.1f} MiB, run {o.get('run', '?')}, left by pid "
                f"{o.get('pid', '?')} on {time.strftime('%Y-%m-%d %H:%M', time.localtime(o.get('started', 0)))})")


def scan(root: Path) -> list[Segment]:
    """Every segment under ``root`` (whatever its key)."""
    out = []
    if not root.is_dir():
        return out
    for key_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for seg in sorted(p for p in key_dir.iterdir() if p.is_dir() and p.name.startswith("server-")):
            out.append(Segment(seg, key_dir.name, _read_owner(seg)))
    return out


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

    # ---- start ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Report (or delete) other runs' dead segments."""
        for seg in scan(self.root):
            if seg.key == self.key or seg.alive:
                continue
            if self.config.remove_stale:
                shutil.rmtree(seg.path, ignore_errors=True)
                with contextlib.suppress(OSError):
                    seg.path.parent.rmdir()
                log.warning("removed the stale state of a job that is gone: %s", seg.describe())
            else:
                self.stale.append(seg)
                log.warning("stale state of a job that is gone: %s; remove it with psserver serve "
                            "--remove-stale-state (or rm -r %s)", seg.describe(), seg.path.parent)

    def load(self) -> tuple[dict, Path] | None:
        """The state this run's previous process left (checkpoint structure, tensors mapped), or
        None when it left none."""
        meta_path = self.dir / META
        if not meta_path.exists():
            return None
        try:
            with open(meta_path, "rb") as f:
                meta = _PlainUnpickler(f).load()
            if meta.get("format") != FORMAT:
                raise MemoryStateError(f"format {meta.get('format')!r}, this psserver reads {FORMAT}")
            arena = Arena.open(self.dir / meta["file"])
            journal = arena.journal()
            if journal.generation != meta["generation"]:
                raise MemoryStateError(f"{arena.path} is generation {journal.generation}, meta names "
                                       f"{meta['generation']}")
            slots = [Slot(o, d, tuple(s)) for o, d, s in meta["slots"]]
            views = [arena.view(slot) for slot in slots]
        except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, ArenaError) as e:
            raise MemoryStateError(f"the state in {self.dir} cannot be read ({e}); move it away to start "
                                   "without it") from None
        state = _fill(meta["state"], views)
        step, samples = journal.global_step, journal.samples
        if journal.torn:
            step, samples = journal.next_step, journal.next_samples
            log.warning("the server died while applying the update of global step %d: some elements of the "
                        "parameters and optimizer state hold it, the others do not; it counts as applied (its "
                        "trainers do not send it again)", step)
        state["global_step"], state["samples_seen"] = step, samples
        log.info("found the state of run %s in memory: %s, generation %d, global step %d, %d samples",
                 state.get("run"), self.dir, journal.generation, step, samples)
        self.arena, self._slots = arena, slots  # kept mapped until the next generation replaces it
        self._seq = journal.begin
        self.ranks = arena.ranks()
        return state, self.dir

    def attach(self, engine: StepEngine, snapshot: Callable[[], dict], run: str) -> None:
        """Keep ``engine``'s state in the segment from now on (``snapshot``: the checkpoint
        structure of its live tensors, taken under the updater's lock; ``run``: its run id)."""
        why = unsupported_reason(engine)
        if why is not None:
            self.disabled = why
            log.warning("state in memory: off, %s; a restarted server resumes from its last checkpoint", why)
            return
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

    # ---- the journal (psserver.ps.engine.sequences; the updater's lock held) -------------------

    def begin(self, global_step: int, samples: int, applied: list[tuple[int, int]]) -> None:
        assert self._engine is not None
        if self.arena is not None and self._engine.state_signature() != self._signature:
            self._bind()  # a table grew since the last update (a lookup created rows)
        self._next = (global_step, self._samples + samples)
        if self.arena is not None:
            self._seq += 1
            self.arena.begin(self._seq, *self._next, applied)

    def commit(self) -> None:
        global_step, self._samples = self._next
        assert self._engine is not None
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
        off_host = next((t.device for t in tensors if t.device.type != "cpu"), None)
        if off_host is not None:
            raise TypeError(f"a tensor on {off_host} cannot be kept in shared memory")
        generation = (self.arena.generation + 1) if self.arena is not None else 1
        journal = Journal(generation, self._seq, self._seq, engine.global_step, self._samples, engine.global_step,
                          self._samples)
        name = f"tensors-{generation}.bin"
        path = self.dir / name
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a generation a dead process began and never named
        try:
            arena, slots = Arena.create(path, tensors, journal)
            arena.write_ranks(engine.sequences.applied)
        except OSError as e:
            path.unlink(missing_ok=True)
            need = Arena.plan(tensors)[1]
            free = shutil.disk_usage(self.dir).free
            self._give_up(f"cannot write {path} ({e.strerror or e}; it needs {need / 2**20:.1f} MiB, "
                          f"{free / 2**20:.1f} MiB free there)")
            return
        meta = {"format": FORMAT, "generation": generation, "file": name, "key": self.key,
                "slots": [(s.offset, s.dtype, s.shape) for s in slots], "state": structure}
        tmp = self.dir / f"{META}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(meta, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, self.dir / META)
        old = self.arena
        self.arena, self._slots = arena, slots
        self._signature = engine.state_signature()
        for f in self.dir.glob("tensors-*.bin"):
            if f.name != name:
                f.unlink(missing_ok=True)  # the old mapping lives on until its last view goes
        log.info("state in memory: %s, generation %d, %d tensors, %.1f MiB (%.0f ms)%s", path, generation,
                 len(tensors), arena.size / 2**20, (time.perf_counter() - started) * 1e3,
                 "" if old is None else f", replacing generation {old.generation}")

    def _make_dir(self) -> None:
        for attempt in range(3):
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                return
            except FileNotFoundError:  # another server removed the empty default directory between two levels
                if attempt == 2:
                    raise MemoryStateError(f"--state-dir {self.root}: cannot create {self.dir}") from None
            except OSError as e:
                raise MemoryStateError(f"--state-dir {self.root}: cannot create {self.dir} ({e.strerror})") from None

    def _give_up(self, why: str) -> None:
        self.disabled = why
        if self._engine is not None:
            self._engine.sequences.durable = None
        # The tensors may still be views of the last generation and change without its journal:
        # no restart may map it.
        (self.dir / META).unlink(missing_ok=True)
        log.error("state in memory: off from now on, %s; a restarted server resumes from its last checkpoint", why)

    # ---- stop ----------------------------------------------------------------------------------

    def release(self) -> None:
        """The server stopped cleanly: its segment goes."""
        if self._engine is not None:
            self._engine.sequences.durable = None
        self.arena = None
        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.dir.parent.rmdir()  # the key's directory, once no server of it has a segment
            if self.root == Path(DEFAULT_STATE_DIR):
                self.root.rmdir()  # psserver's own directory, once no job's state is in it
        if self.disabled is None:
            log.info("state in memory released: %s", self.dir)

    def _write_owner(self, run: str) -> None:
        supervisor = os.environ.get(SUPERVISOR_ENV)
        sup = int(supervisor) if supervisor and supervisor.isdigit() else None
        owner = {"pid": os.getpid(), "pid_start": start_time(os.getpid()), "supervisor": sup,
                 "supervisor_start": start_time(sup) if sup else None, "boot_id": boot_id(),
                 "host": socket.gethostname(), "key": self.key, "started": time.time(),
                 "run": run}
        tmp = self.dir / f"{OWNER}.tmp"
        tmp.write_text(json.dumps(owner))
        os.replace(tmp, self.dir / OWNER)


def unsupported_reason(engine: StepEngine) -> str | None:
    """Why ``engine``'s state cannot be kept in memory (None: it can). Device memory dies with
    its process (a host copy per update is what ``benchmarks.state_copy`` measures); a sync
    round in flight across server processes cannot be rebuilt."""
    if engine.plan is not None and engine.config.update == "sync":
        return "several server processes in sync mode do not keep it there (a round in flight across them cannot " \
               "be rebuilt: a lost one sends every server to a checkpoint)"
    if any(d.type != "cpu" for d in engine.devices):
        return f"the model lives on {', '.join(str(d) for d in engine.devices)}, not in host memory"
    return None


def state_layout(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` (nested dicts, lists and tuples) with each tensor replaced by a reference, and
    its tensors in the order of the references, each tensor object once: how the state in memory
    lays out its file (``benchmarks.state_copy`` lays out its host copy so too)."""
    tensors: list[torch.Tensor] = []
    return _refs(state, tensors, {}), tensors


def _refs(obj: Any, tensors: list[torch.Tensor], seen: dict[int, int]) -> Any:
    """``obj`` with each tensor replaced by its index in ``tensors`` (one per tensor object)."""
    if isinstance(obj, torch.Tensor):
        index = seen.get(id(obj))
        if index is None:
            index = seen[id(obj)] = len(tensors)
            tensors.append(obj)
        return (_TENSOR, index)
    if isinstance(obj, dict):
        return {k: _refs(v, tensors, seen) for k, v in obj.items()}
    if isinstance(obj, torch.Size):
        return tuple(obj)
    if isinstance(obj, (list, tuple)):
        out = [_refs(v, tensors, seen) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _fill(obj: Any, views: list[torch.Tensor]) -> Any:
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == _TENSOR:
        return views[obj[1]]
    if isinstance(obj, dict):
        return {k: _fill(v, views) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, views) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fill(v, views) for v in obj)
    return obj


class _PlainUnpickler(pickle.Unpickler):
    """Builtin containers and scalars only: a segment's metadata names no class."""

    def find_class(self, module: str, name: str):  # noqa: ARG002
        raise pickle.UnpicklingError(f"{module}.{name} in a state segment's metadata")


def _read_owner(seg: Path) -> dict | None:
    try:
        return json.loads((seg / OWNER).read_text())
    except (OSError, ValueError):
        return None

