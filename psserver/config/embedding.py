"""Configuration of the embedding tables a recommendation model keeps on the servers."""

from __future__ import annotations

from dataclasses import dataclass

from psserver.config.options import check_choices, option

EVICTION_POLICIES = ("lru", "lfu")
ROW_OPTIMIZERS = ("rowwise_adagrad", "lazy_adam")


@dataclass
class EmbeddingConfig:
    """Every table of the model, on every server process (``psserver serve --embedding-*``)."""

    dim: int | None = option(None, flag="--embedding-dim", metavar="D", help="width of a row (default: the model's)")
    """Width of a row (``--embedding-dim``); None: the model's default."""
    max_rows: int = option(10_000_000, flag="--embedding-max-rows", metavar="N",
                           help="rows per table per server process at most; past it rows are evicted "
                                "(default {default})")
    """Rows one server process keeps per table at most; past it the least recently (``lru``)
    or least often (``lfu``) touched rows are evicted, down to 95 %."""
    eviction: str = option("lru", flag="--embedding-eviction", choices=EVICTION_POLICIES,
                           help="which rows go past the bound: least recently (lru) or least often (lfu) touched "
                                "(default {default})")
    """``lru`` or ``lfu``."""
    ttl_steps: int = option(0, flag="--embedding-ttl", metavar="STEPS",
                            help="evict rows untouched for this many steps (default {default}: never)")
    """Evict rows no step touched for this many of the server's steps (0: never)."""
    admit_after: int = option(1, flag="--embedding-admit-after", metavar="N",
                              help="an id becomes a row once N training batches held it; before, it reads a shared "
                                   "default row (default {default}: at once)")
    """An id becomes a row the Nth time a training batch holds it; until then it reads the
    table's shared default row (zeros) and its gradient is dropped (1: at once)."""
    optimizer: str = option("rowwise_adagrad", flag="--embedding-optimizer", choices=ROW_OPTIMIZERS,
                            help="row-wise optimizer of the tables (default {default}); the dense part uses "
                                 "--optimizer")
    """Row-wise optimizer of the tables (``rowwise_adagrad`` or ``lazy_adam``): state only for
    rows that exist, applied only to the rows a step touched. The dense part keeps ``--optimizer``."""
    lr: float = option(0.05, flag="--embedding-lr", help="its learning rate (default {default})")
    """Learning rate of the tables' optimizer."""
    init_std: float = option(0.01, flag="--embedding-init-std", help="std of a new row's values (default {default})")
    """A new row is N(0, init_std), drawn from a hash of (seed, table, id): the same wherever
    and whenever it is created."""

    prefill_rows: int = option(0, flag="--embedding-prefill", metavar="N",
                               help="create N rows per table at start, as if trainers had touched them (benchmarks; "
                                    "default {default})")
    """Create this many rows in every table at start, as if trainers had touched them
    (benchmarks and tests of a server that already holds many rows)."""

    def __post_init__(self) -> None:
        if self.dim is not None and not 1 <= self.dim <= 4096:
            raise ValueError(f"--embedding-dim must be in 1..4096, got {self.dim}")
        if self.max_rows < 1:
            raise ValueError(f"--embedding-max-rows must be >= 1, got {self.max_rows}")
        check_choices(self)
        if self.ttl_steps < 0:
            raise ValueError(f"--embedding-ttl must be >= 0 steps, got {self.ttl_steps}")
        if self.admit_after < 1:
            raise ValueError(f"--embedding-admit-after must be >= 1, got {self.admit_after}")
        if not self.lr > 0:
            raise ValueError(f"--embedding-lr must be positive, got {self.lr}")
        if not 0 <= self.prefill_rows <= self.max_rows:
            raise ValueError(f"--embedding-prefill must be in 0..--embedding-max-rows ({self.max_rows}), got "
                             f"{self.prefill_rows}")
        if not self.init_std >= 0:
            raise ValueError(f"--embedding-init-std must be >= 0, got {self.init_std}")
