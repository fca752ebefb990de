"""Rank 0 serves the control plane: status (ranks as trainers), checkpoint and drain over gRPC."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from psserver.cli import main
from psserver.collective.checkpoint import complete_checkpoints
from tests.procs import free_port

from .helpers import worker_env

pytest.importorskip("psserver.control.server")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_status_checkpoint_and_stop_over_grpc(tmp_path, capsys, procs, port):
    from psserver.control.client import ControlClient, ControlError
    from psserver.control.v1 import control_pb2 as pb

    metrics_port = free_port()
    proc = procs.start(["train", "--mode", "ddp", "--nproc-per-node", "2", "--model", "mnist_cnn", "--epochs", "1000",
                        "--control-port", str(port), "--allow-unauthenticated-admin", "--metrics-port",
                        str(metrics_port), "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "100000"],
                       "ddp", env=worker_env())
    address = f"127.0.0.1:{port}"
    with ControlClient(address, timeout=5) as client:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline:
            assert proc.running(), proc.tail()
            try:
                status = client.get_status()
                # Each rank reports its own steps; rank 1's report may trail rank 0's.
                ranks = client.list_trainers()
                if (status.global_step >= 10 and status.state == pb.SERVER_STATE_SERVING
                        and len(ranks) == 2 and all(t.steps >= 10 for t in ranks)):
                    break
            except ControlError:
                pass
            time.sleep(0.5)
        assert status is not None and status.global_step >= 10
        assert status.mode == pb.MODE_DDP and status.update_mode == pb.UPDATE_MODE_COLLECTIVE
        assert status.model == "mnist_cnn" and status.num_params > 1_000_000

        trainers = client.list_trainers()
        assert [t.name for t in trainers] == ["rank0", "rank1"]
        assert all(t.steps >= 10 for t in trainers)

        assert main(["status", "--address", address, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["status"]["mode"] == "ddp" and len(shown["trainers"]) == 2

        # The checkpoint schedule reaches Prometheus, for the alert on a checkpoint that falls behind.
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            exposition = r.read().decode()
        assert "\npsserver_checkpoint_every_steps 100000.0\n" in exposition

        info = client.checkpoint(timeout=120)
        assert info.step >= 10 and info.path.endswith(f"step-{info.step:08d}")
        assert info.step in [s for s, _ in complete_checkpoints(tmp_path / "ckpt")]

        client.shutdown(reason="test")
    assert proc.wait(120) == 0, proc.tail()
    steps = [s for s, _ in complete_checkpoints(tmp_path / "ckpt")]
    assert steps and steps[-1] > info.step  # drained: checkpointed where it stopped
    assert "stopped on request" in proc.output()
