"""Configuration of the embedding tables a recommendation model keeps on the servers."""

from __future__ import annotations

from dataclasses import dataclass

EVICTION_POLICIES = ("lru", "lfu")
ROW_OPTIMIZERS = ("rowwise_adagrad", "lazy_adam")


@dataclass
class EmbeddingConfig:
    """Every table of the model, on every server process (``psserver serve --embedding-*``)."""

    dim: int | None = None
    """Width of a row (``--embedding-dim``); None: the model's default."""
    max_rows: int = 10_000_000
    """Rows one server process keeps per table at most; past it the least recently (``lru``)
    or least often (``lfu``) touched rows are evicted, down to 95 %."""
    eviction: str = "lru"
    """``lru`` or ``lfu``."""
    ttl_steps: int = 0
    """Evict rows no step touched for this many of the server's steps (0: never)."""
    admit_after: int = 1
    """An id becomes a row the Nth time a training batch holds it; until then it reads the
    table's shared default row (zeros) and its gradient is dropped (1: at once)."""
    optimizer: str = "rowwise_adagrad"
    """Row-wise optimizer of the tables (``rowwise_adagrad`` or ``lazy_adam``): state only for
    rows that exist, applied only to the rows a step touched. The dense part keeps ``--optimizer``."""
    lr: float = 0.05
    """Learning rate of the tables' optimizer."""
    init_std: float = 0.01
    """A new row is N(0, init_std), drawn from a hash of (seed, table, id): the same wherever
    and whenever it is created."""

    prefill_rows: int = 0
    """Create this many rows in every table at start, as if trainers had touched them
    (benchmarks and tests of a server that already holds many rows)."""

    def __post_init__(self) -> None:
        if self.dim is not None and not 1 <= self.dim <= 4096:
            raise ValueError(f"--embedding-dim must be in 1..4096, got {self.dim}")
        if self.max_rows < 1:
            raise ValueError(f"--embedding-max-rows must be >= 1, got {self.max_rows}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"--embedding-eviction must be one of {', '.join(EVICTION_POLICIES)}, "
                             f"got {self.eviction!r}")
        if self.ttl_steps < 0:
            raise ValueError(f"--embedding-ttl must be >= 0 steps, got {self.ttl_steps}")
        if self.admit_after < 1:
            raise ValueError(f"--embedding-admit-after must be >= 1, got {self.admit_after}")
        if self.optimizer not in ROW_OPTIMIZERS:
            raise ValueError(f"--embedding-optimizer must be one of {', '.join(ROW_OPTIMIZERS)}, "
                             f"got {self.optimizer!r}")
        if not self.lr > 0:
            raise ValueError(f"--embedding-lr must be positive, got {self.lr}")
        if not 0 <= self.prefill_rows <= self.max_rows:
            raise ValueError(f"--embedding-prefill must be in 0..--embedding-max-rows ({self.max_rows}), got "
                             f"{self.prefill_rows}")
        if not self.init_std >= 0:
            raise ValueError(f"--embedding-init-std must be >= 0, got {self.init_std}")
