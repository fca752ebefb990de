"""A trainer whose batches turn to NaN next to a healthy one, through the real CLI and RPC:
the shared model stays finite and learns, every poisoned step dropped and counted; one that
sends nothing but NaN is evicted with a reason ``psserver status`` shows."""

from __future__ import annotations

import json
import sys

import pytest

from tests.end_to_end import poisoned_trainer
from tests.procs import MNIST_ARGS, accuracy, cli, free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

POISONED = [sys.executable, "-m", "tests.end_to_end.poisoned_trainer"]
# One epoch (63 steps a trainer): a model the NaNs had reached would score 0.1 or fail to
# evaluate; mnist_cnn learns past this within the epoch.
BAR = 0.9


@pytest.mark.timeout(420)
def test_a_trainer_sending_nan_every_other_step_does_not_poison_the_model(procs, port, mnist_dir, tmp_path):
    ctl = free_port()
    server = procs.server(port, "--max-grad-norm", "50", control_port=ctl)
    common = ["--num-trainers", "2", "--epochs", "1", *MNIST_ARGS]
    healthy = procs.trainer(port, 0, *common)
    poisoned = procs.trainer(port, 1, *common, prefix=POISONED, env={poisoned_trainer.ENV: "2"})
    for t in (healthy, poisoned):
        assert t.wait(300) == 0, t.tail()
    assert accuracy(healthy) >= BAR, healthy.tail()
    assert accuracy(poisoned) >= BAR, poisoned.tail()  # it evaluates the same shared model
    assert "the server dropped a step of this trainer" in poisoned.output()
    assert "dropped a step" not in healthy.output()
    done = cli(["--log-level", "ERROR", "status", "--address", f"127.0.0.1:{ctl}", "--json"])
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    rows = {r["rank"]: r for r in data["trainers"]}
    # Rank 1 poisons every other one of its 63 steps: 31 dropped, never 3 in a row.
    assert rows[1]["nonfinite"] == 31 and rows[0]["nonfinite"] == 0 and rows[1]["reason"] == ""
    assert data["status"]["nonfinite_gradients"] == 31
    # Each trainer's path, and why, in the status and in its log (psserver.common.transport).
    assert {(r["transport"], r["transport_reason"]) for r in rows.values()} == {("cpu", "the trainer runs on the CPU")}
    assert "transport cpu: the trainer runs on the CPU" in healthy.output()
    assert procs.stop(server) == 0
    # 2 x 63 steps, 31 of them dropped: one optimizer step per applied gradient.
    assert "global step 95" in server.output(), server.tail()


@pytest.mark.timeout(180)
def test_a_trainer_that_keeps_sending_nan_is_evicted_with_a_reason(procs, port):
    ctl = free_port()
    server = procs.server(port, "--max-nonfinite-steps", "3", control_port=ctl)
    bad = procs.trainer(port, 0, "--num-trainers", "1", "--epochs", "1", "--dataset", "synthetic", "--max-steps",
                        "50", prefix=POISONED, env={poisoned_trainer.ENV: "1"})
    code = bad.wait(120)
    assert code not in (0, None), bad.tail()
    assert "evicted by the server: sent 3 non-finite gradients in a row" in bad.output()
    assert "Traceback" not in bad.output(), bad.tail()
    done = cli(["--log-level", "ERROR", "status", "--address", f"127.0.0.1:{ctl}", "--json"])
    (row,) = json.loads(done.stdout)["trainers"]
    assert row["state"] == "LOST" and "3 non-finite gradients in a row" in row["reason"]
    assert row["nonfinite"] == 3
    assert "sent 3 non-finite gradients in a row" in cli(
        ["status", "--address", f"127.0.0.1:{ctl}"]).stdout
    assert procs.stop(server) == 0
    assert "global step 0" in server.output(), server.tail()
