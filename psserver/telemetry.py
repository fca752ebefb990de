"""What a running server knows about itself, as plain snapshots.

The parameter server and collective rank 0 both produce these; the gRPC control plane,
Prometheus metrics and ``psserver status`` only consume them, so none of them reaches into
training internals.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

SERVER_STATES = ("STARTING", "SERVING", "DRAINING", "STOPPED", "WAITING")
TRAINER_STATES = ("ACTIVE", "LEFT", "LOST")


@dataclass
class ShardStatus:
    index: int
    device: str
    num_params: int
    bytes: int
    state_bytes: int
    """Bytes of the shard's parameters and its optimizer's state (moments, step counts), on
    its device; 0 where not known (collective mode). Not the process's memory: a CPU shard of
    85 KB lives in a process of hundreds of MB (torch itself)."""


@dataclass
class TrainerStatus:
    rank: int
    name: str
    """RPC worker name (``trainer_<rank>_<incarnation>``) or ``rank<N>`` in collective mode."""
    host: str
    joined_at: float
    last_seen: float
    steps: int = 0
    samples: int = 0
    last_loss: float = float("nan")
    samples_per_s: float = 0.0
    state: str = "ACTIVE"
    accuracy: float = float("nan")
    """Held-out accuracy the trainer measured at its end (NaN until then)."""
    clock: int = 0
    """Steps it started on the parameter server (``--update ssp`` bounds the gap between the
    clocks of live trainers); a joiner starts at the slowest live trainer's. 0 in collective mode."""
    staleness: int = 0
    """Of its latest update: optimizer steps other trainers applied between the start of its step
    and its update (0: computed on the current weights; sync with K >= trainers: always 0)."""
    max_staleness: int = 0
    """The largest ``staleness`` of any of its updates."""
    step: str = ""
    """Its step protocol on the parameter server (``pushpull``, ``pull``: trainer compute;
    ``chained``, ``plain``: server compute); empty in collective mode."""
    updates: int = 0
    """Its gradients the server applied (sync: summed into a round); 0 in collective mode."""
    nonfinite: int = 0
    """Its gradients the server dropped because their norm was NaN or inf."""
    clipped: int = 0
    """Its steps the server scaled down to ``--max-grad-norm``."""
    reason: str = ""
    """Why the server evicted it while it was alive (empty otherwise)."""
    transport: str = ""
    """How its parameters and gradients travel (trainer compute: ``device-map``, ``staged``,
    ``cpu``); empty for server compute and in collective mode."""
    transport_reason: str = ""
    """Why that path (a fallback from a faster one says what prevented it)."""
    received_bytes: int = 0
    """Bytes of its pseudo-gradients the server received (``--step diloco``), as they travelled."""


@dataclass
class CheckpointInfo:
    path: str
    step: int
    time: float
    duration_s: float = float("nan")
    """Seconds the write took (NaN when not measured, e.g. a checkpoint resumed from)."""


@dataclass
class ServerProcessStatus:
    """One server process of a parameter server spread over several (``--num-servers``), as
    server 0 sees it."""

    rank: int
    """Its ``--server-rank`` (0: the coordinator)."""
    name: str
    """Its RPC name."""
    host: str
    """Host it runs on (as it reported it)."""
    state: str
    """``SERVING``, ``LOST`` (stopped answering: the job's steps wait for it) or ``MISSING``
    (not registered yet)."""
    parameters: int
    """Parameter elements of its partition."""
    parameter_bytes: int
    """Bytes of those parameters."""
    updates_applied: int
    """Optimizer steps it applied to its partition."""
    last_seen_s: float = float("nan")
    """Seconds since it last answered server 0 (NaN: never)."""


@dataclass
class TableStatus:
    """One embedding table's rows on one server process (a recommendation model's tables)."""

    table: str
    server_rank: int
    rows: int
    """Rows that exist (ids admitted and not evicted)."""
    max_rows: int
    """The bound on rows of this table on this server (``--embedding-max-rows``)."""
    dim: int
    bytes: int
    """Memory of its rows, optimizer state, index and admission sketch."""
    admissions: int
    """Rows created (ids admitted), ever."""
    refused: int
    """Lookups of ids not admitted yet (they read the shared default row)."""
    evictions: int
    """Rows evicted past the bound."""
    expirations: int
    """Rows evicted by the time-to-live."""
    lookups: int
    """Row lookups served, ever (lookups/s: its rate)."""
    updates: int
    """Row updates applied, ever."""
    lookups_per_s: float = 0.0
    """Lookups per second over about the last 10 s: server 0 computes it from successive reads of
    ``lookups`` (0 in a process's own snapshot, which counts and keeps no clock)."""
    updates_per_s: float = 0.0
    """Row updates per second over the same window, from ``updates``."""


@dataclass
class StaleStateStatus:
    """State a job that is gone left in ``--state-dir`` (``psserver.server.state.memory``)."""

    path: str
    bytes: int
    run: str
    pid: int
    started_at: float


@dataclass
class ReaderStatus:
    """A reader of the weights (``WeightsService``), as the server saw it last."""

    name: str
    """The name it gave, else its address."""
    peer: str
    step: int = -1
    """The step of the version it read last."""
    read_at: float = 0.0
    """When it had all of that version (Unix seconds)."""
    age_s: float = 0.0
    """How old the version was then: ``read_at`` minus the time the server applied its step."""
    reads: int = 0
    sharing: int = 1
    """Readers on its host that read the copy it fetches (itself included)."""


AGE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the readers' version-age histogram."""


@dataclass
class AgeHistogram:
    """How old each version was when a reader had all of it: cumulative counts per bound of
    ``AGE_BUCKETS`` (Prometheus's form), their count and sum."""

    counts: list[int] = field(default_factory=lambda: [0] * len(AGE_BUCKETS))
    count: int = 0
    total: float = 0.0

    def observe(self, age: float) -> None:
        for i, bound in enumerate(AGE_BUCKETS):
            if age <= bound:
                self.counts[i] += 1
        self.count += 1
        self.total += age


@dataclass
class ServerStatus:
    version: str
    state: str
    mode: str
    """``ps``, ``ddp`` or ``fsdp``."""
    started_at: float
    model: str
    num_params: int
    update_mode: str
    """``async``, ``sync``, ``ssp``, ``diloco`` or ``collective``."""
    sync_trainers: int
    global_step: int
    samples_seen: int
    updates_per_s: float
    samples_per_s: float
    mean_loss: float
    shards: list[ShardStatus] = field(default_factory=list)
    last_checkpoint: CheckpointInfo | None = None
    accuracy: float = float("nan")
    """Latest held-out accuracy reported by a trainer (NaN until one finishes)."""
    staleness: int = 0
    """S of ``--update ssp``: steps the fastest live trainer may run ahead of the slowest (0 in
    other modes, where ``update_mode`` tells them apart from a bulk-synchronous ssp)."""
    nonfinite_gradients: int = 0
    """Gradients dropped because their norm was NaN or inf, since the server started."""
    clipped_steps: int = 0
    """Trainer steps scaled down to ``--max-grad-norm``, since the server started."""
    servers: list[ServerProcessStatus] = field(default_factory=list)
    """Every server process of the parameter server, server 0 first (empty for one process)."""
    tables: list[TableStatus] = field(default_factory=list)
    """Every embedding table on every server process, server 0's first (empty for a dense model):
    a table's rows are spread over the servers, and each server holds them to its own bound."""
    learning_rate: float = float("nan")
    """Learning rate of the next optimizer update (``--lr-schedule`` sets it at every step); NaN
    while the optimizer is not known, and in collective mode."""
    lr_schedule: str = ""
    """The learning-rate schedule, described in one line (empty: the learning rate is constant)."""
    memory_state: str = ""
    """Where the live state is kept in shared memory, or ``off: <why>`` (empty: no ``--state-dir``)."""
    stale_state: list[StaleStateStatus] = field(default_factory=list)
    """State that jobs whose processes are gone left in ``--state-dir``."""
    checkpoint_interval_s: float = 0.0
    """``--checkpoint-interval``: seconds between periodic checkpoints while steps are made (0: not
    by time, or checkpoints off); exported so that an alert can tell a checkpoint that is late."""
    checkpoint_every_steps: int = 0
    """``--checkpoint-every``: global steps between checkpoints (0: not by step count, or off)."""
    diloco: str = ""
    """``--update diloco`` in one line: the outer rounds and the outer optimizer (empty in other modes)."""
    readers: list[ReaderStatus] = field(default_factory=list)
    """Readers of the weights seen in the last 10 minutes."""
    reader_ages: AgeHistogram | None = None
    """Every read's version age since the server started (None: not a server that serves reads)."""
    versions_copied: int = 0
    """Versions of the model copied for readers (one copy under the update lock each)."""
    weights_bytes_sent: int = 0
    """Bytes of versions sent to readers."""

    @property
    def uptime_s(self) -> float:
        return time.time() - self.started_at


class ControlTarget(Protocol):
    """What the control plane needs from the process it serves."""

    ready: threading.Event
    """Set once the model is placed on its devices (health turns SERVING)."""

    def get_status(self) -> ServerStatus: ...

    def list_trainers(self) -> list[TrainerStatus]: ...

    def checkpoint_now(self) -> CheckpointInfo:
        """Write a checkpoint now; ``RuntimeError`` when checkpoints are not configured."""
        ...

    def request_shutdown(self) -> None:
        """Drain: stop accepting joins, let in-flight steps finish, checkpoint, exit."""
        ...


class RateMeter:
    """Counts over a sliding time window: updates/s and samples/s of the last ``window`` s."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._events: deque[tuple[float, int, float]] = deque()
        self._lock = threading.Lock()

    def add(self, samples: int, loss: float | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            self._events.append((now, samples, float("nan") if loss is None else loss))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self.window:
            self._events.popleft()

    def rates(self) -> tuple[float, float, float]:
        """(events/s, samples/s, mean loss) over the window; zeros when idle."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            if not self._events:
                return 0.0, 0.0, float("nan")
            span = max(now - self._events[0][0], 1e-3) if len(self._events) > 1 else self.window
            span = min(max(span, 1e-3), self.window)
            n = len(self._events)
            samples = sum(e[1] for e in self._events)
            losses = [e[2] for e in self._events if e[2] == e[2]]
            mean = sum(losses) / len(losses) if losses else float("nan")
            return n / span, samples / span, mean


class RefusalLog:
    """Calls refused (the control plane's: bad or missing token, admin without auth, by status
    code; the RPC layer's: by the name it would not unpickle): counted for metrics, and logged
    at most ``burst`` lines per ``interval`` seconds, the rest summed up in the next line, so
    that a scanner or a misconfigured client cannot fill the server's log."""

    OTHER = "other"
    """The key of refusals past ``max_keys`` distinct keys."""

    def __init__(self, burst: int = 5, interval: float = 60.0, *, max_keys: int | None = None,
                 key_chars: int | None = None) -> None:
        self.burst = burst
        self.interval = interval
        self.max_keys = max_keys
        """At most this many distinct keys, ``OTHER`` included (the rest count under it): keys a
        caller chooses (a refused name) must not grow the counts, or a metric's labels, without
        bound."""
        self.key_chars = key_chars
        """Keys are cut to this many characters."""
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._window_start = -float("inf")
        self._logged = 0
        self._suppressed = 0

    def refused(self, code: str) -> tuple[bool, int]:
        """Count one refusal under ``code`` (a gRPC status, a refused name); (whether to log it,
        refusals suppressed since the last line logged)."""
        now = time.monotonic()
        with self._lock:
            code = self._key(code)
            self._counts[code] = self._counts.get(code, 0) + 1
            if now - self._window_start >= self.interval:
                self._window_start, self._logged = now, 0
            if self._logged >= self.burst:
                self._suppressed += 1
                return False, 0
            self._logged += 1
            suppressed, self._suppressed = self._suppressed, 0
            return True, suppressed

    def _key(self, code: str) -> str:
        if self.key_chars is not None:
            code = code[:self.key_chars]
        if self.max_keys is not None and code not in self._counts and len(self._counts) >= self.max_keys - 1:
            return self.OTHER
        return code

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


CONTROL_REFUSALS = RefusalLog()
"""The process's control-plane refusals (one control plane per process)."""
RPC_REFUSALS = RefusalLog(max_keys=50, key_chars=100)
"""Globals the process's RPC layer refused to unpickle, by name (``psserver.common.rpc_allowlist``)."""
