"""Each script of ``examples/`` runs to the result its docstring states, against a
``psserver serve`` the test starts (as its docstring starts it)."""

from __future__ import annotations

import itertools
import os
import re
import sys

import pytest

from tests.procs import MNIST_DIR, ROOT

EXAMPLES = ROOT / "examples"


def example(procs, name: str, port: int, rank: int, trainers: int, *extra: str):
    return procs.start(["--server", f"127.0.0.1:{port}", "--rank", str(rank), "--num-trainers", str(trainers),
                        "--data-dir", str(MNIST_DIR), *extra], f"{name}-{rank}",
                       prefix=[sys.executable, str(EXAMPLES / f"{name}.py")])


def accuracy(proc, rank: int) -> float:
    m = re.search(rf"^rank {rank} accuracy (\d\.\d+)$", proc.output(), re.M)
    assert m, proc.tail()
    return float(m.group(1))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_custom_cnn_with_its_own_loop_two_trainers(procs, port):
    """The server learns SmallCNN (BatchNorm and all) from the first trainer; both reach 0.95."""
    server = procs.server(port)
    trainers = [example(procs, "custom_cnn", port, r, 2) for r in range(2)]
    for r, t in enumerate(trainers):
        assert t.wait(240) == 0, t.tail()
        assert accuracy(t, r) >= 0.95
    assert "learnt from the first trainer" in server.output()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_wrapper_with_accumulation_and_amp(procs, port):
    procs.server(port)
    t = example(procs, "accumulate_amp", port, 0, 1)
    assert t.wait(240) == 0, t.tail()
    assert accuracy(t, 0) >= 0.90
    assert "Traceback" not in t.output()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_rpc_tutorial_with_its_own_model_loss_and_optimizer(procs, port):
    """The README's recipe: the server holds the tutorial's Net (log-probabilities, nll_loss on
    the trainers), has no --optimizer, and runs the SGD at lr 0.03 the trainers'
    DistributedOptimizer names; one epoch over 8,000 images reaches the tutorial's accuracy
    (0.93-0.94 measured, 34 s on 2 cores)."""
    path = os.pathsep.join([str(EXAMPLES), str(ROOT), os.environ.get("PYTHONPATH", "")])  # PYTHONPATH=examples
    server = procs.server(port, "--model", "rpc_tutorial:Net", env={"PYTHONPATH": path})
    trainers = [example(procs, "rpc_tutorial", port, r, 2) for r in range(2)]
    for r, t in enumerate(trainers):
        assert t.wait(240) == 0, t.tail()
        assert accuracy(t, r) >= 0.90
        assert "Traceback" not in t.output()
    assert "optimizer sgd(lr=0.03, momentum=0, weight_decay=0) (set by a trainer's DistributedOptimizer)" \
        in server.output()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_recommendation_model_with_tables_on_the_server_from_its_own_loop(procs, port):
    procs.server(port, "--model", "dlrm_tiny", "--embedding-optimizer", "lazy_adam", "--embedding-lr", "0.01",
                 "--lr", "0.003")
    trainers = [procs.start(["--server", f"127.0.0.1:{port}", "--rank", str(r), "--num-trainers", "2"],
                            f"recommendation-{r}", prefix=[sys.executable, str(EXAMPLES / "recommendation.py")])
                for r in range(2)]
    for r, t in enumerate(trainers):
        assert t.wait(300) == 0, t.tail()
        m = re.search(rf"^rank {r} auc (\d\.\d+)$", t.output(), re.M)
        assert m and float(m.group(1)) >= 0.75, t.tail()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_rollout_workers_act_with_fresh_versions_while_two_trainers_train(procs, port, tmp_path):
    """Four readers (one host's shared copy) each act with a version every 10 global steps, never
    an older one than they had, and see the reward the trainers' policy earns rise."""
    token = tmp_path / "read.token"
    token.write_text("rollout-read-token")
    server = procs.server(port, "--read-token-file", str(token), control_port=0)
    control = "{}:{}".format(*server.wait_for(r"control plane listening on (\S+):(\d+)", timeout=30).groups())
    script = [sys.executable, str(EXAMPLES / "rl_rollouts.py")]
    workers = [procs.start(["rollout", "--control", control, "--read-token-file", str(token), "--worker", str(w),
                            "--every", "10", "--idle", "10"], f"rollout-{w}", prefix=script) for w in range(4)]
    for w in workers:  # connected and waiting before any training: they see the policy from its first steps
        w.wait_for(r"waiting for the first version", timeout=120)
    trainers = [procs.start(["trainer", "--server", f"127.0.0.1:{port}", "--rank", str(r), "--num-trainers", "2",
                             "--steps", "150"], f"trainer-{r}", prefix=script) for r in range(2)]
    for t in trainers:
        assert t.wait(180) == 0, t.tail()
    for w, proc in enumerate(workers):
        assert proc.wait(60) == 0, proc.tail()
        acted = [(int(s), float(r)) for s, r in re.findall(rf"^worker {w} acted with version (\d+): reward (\S+)$",
                                                            proc.output(), re.M)]
        steps = [s for s, _ in acted]
        assert len(acted) >= 3 and all(b - a >= 10 for a, b in itertools.pairwise(steps)), acted
        assert acted[-1][1] >= 0.8 and acted[-1][1] > acted[0][1], acted
        assert "Traceback" not in proc.output()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_reader_serves_fresh_rows_while_the_recommendation_example_trains(procs, port, tmp_path):
    token = tmp_path / "read.token"
    token.write_text("serving-read-token")
    server = procs.server(port, "--model", "dlrm_tiny", "--embedding-optimizer", "lazy_adam", "--embedding-lr",
                          "0.01", "--lr", "0.003", "--read-token-file", str(token), control_port=0)
    control = "{}:{}".format(*server.wait_for(r"control plane listening on (\S+):(\d+)", timeout=30).groups())
    trainer = procs.start(["--server", f"127.0.0.1:{port}", "--rank", "0", "--num-trainers", "1", "--epochs", "20"],
                          "recommendation-0", prefix=[sys.executable, str(EXAMPLES / "recommendation.py")])
    trainer.wait_for(r"epoch 0 step 50", timeout=120)  # training, its rows being written
    serving = procs.start(["--control", control, "--read-token-file", str(token), "--seconds", "8"], "serving",
                          prefix=[sys.executable, str(EXAMPLES / "serving_rows.py")])
    assert serving.wait(120) == 0, serving.tail()
    m = re.search(r"^served (\d+) requests .*p99 (\S+) ms, .* at global steps (\d+) to (\d+)$", serving.output(), re.M)
    assert m and int(m.group(1)) >= 20 and int(m.group(4)) > int(m.group(3)), serving.tail()
    assert "rows changed while serving: yes" in serving.output()
