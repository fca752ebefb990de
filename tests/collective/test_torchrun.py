"""The same command under torchrun (env:// from RANK, WORLD_SIZE, ..., elastic c10d rendezvous)."""

from __future__ import annotations

import sys

import pytest

from .helpers import check_ok, loss_falls, results, run_cli, worker_env


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_ddp_under_torchrun_elastic_rendezvous(result_pattern, port):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
                "-m", "psserver", "train"]
    proc = run_cli(["--mode", "ddp", "--model", "mlp", "--max-steps", "30", "--no-control",
                    "--result-file", str(result_pattern)], timeout=160, prefix=torchrun,
                   env=worker_env(TMPDIR=str(result_pattern.parent)))  # torchrun's log directory goes there
    check_ok(proc)
    r0, r1 = results(result_pattern, 2)
    assert r0["world_size"] == r1["world_size"] == 2 and r0["backend"] == "gloo"
    assert r0["param_hash"] == r1["param_hash"]
    assert loss_falls(r0["losses"])
    # Rank 0 alone prints the accuracy, like ps mode's "rank N accuracy X".
    assert [ln for ln in proc.stdout.splitlines() if "accuracy" in ln] == [f"rank 0 accuracy {r0['accuracy']:.4f}"]
