"""Helpers of the collective tests: free ports, ``psserver train`` in subprocesses, results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MNIST = REPO.parent / "shared" / "data" / "mnist"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), MASTER_ADDR="127.0.0.1",
               GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore", PSSERVER_LOG_LEVEL="WARNING")
    env.update(extra)
    return env


def run_cli(args: list[str], timeout: float, prefix: list[str] | None = None, env: dict | None = None,
            ) -> subprocess.CompletedProcess:
    """``python -m psserver train ARGS`` (or ``prefix`` + ARGS), bounded in time."""
    cmd = (prefix or [sys.executable, "-m", "psserver", "train"]) + args
    return subprocess.run(cmd, cwd=REPO, env=env or worker_env(), capture_output=True, text=True, timeout=timeout)


def results(pattern: Path, n: int) -> list[dict]:
    return [json.loads(Path(str(pattern).format(rank=r)).read_text()) for r in range(n)]


def loss_falls(losses: list[float], k: int = 5) -> bool:
    return sum(losses[-k:]) / k < 0.7 * sum(losses[:k]) / k


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"


needs_mnist = pytest.mark.skipif(not MNIST.is_dir(), reason=f"MNIST not found in {MNIST}")
