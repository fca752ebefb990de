"""Helpers of the collective tests: ``psserver train`` in subprocesses (through tests.procs), results."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.procs import MNIST_DIR as MNIST
from tests.procs import env, run


def worker_env(**extra: str) -> dict[str, str]:
    """The workers' environment: loopback gloo, quiet logs; no launcher variables unless in ``extra``."""
    return env(**{"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONWARNINGS": "ignore",
                  "PSSERVER_LOG_LEVEL": "WARNING", **extra})


def run_cli(args: list[str], timeout: float, prefix: list[str] | None = None, env: dict | None = None,
            ) -> subprocess.CompletedProcess:
    """``python -m psserver train ARGS`` (or ``prefix`` + ARGS), bounded in time."""
    return run(args if prefix else ["train", *args], timeout=timeout, prefix=prefix, env=env or worker_env())


def results(pattern: Path, n: int) -> list[dict]:
    return [json.loads(Path(str(pattern).format(rank=r)).read_text()) for r in range(n)]


def loss_falls(losses: list[float], k: int = 5) -> bool:
    return sum(losses[-k:]) / k < 0.7 * sum(losses[:k]) / k


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"


needs_mnist = pytest.mark.skipif(not MNIST.is_dir(), reason=f"MNIST not found in {MNIST}")
