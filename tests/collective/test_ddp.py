"""DDP with 2 gloo processes: accuracy on MNIST, identical replicas, hooks, DDP knobs."""

from __future__ import annotations

import functools
import operator

import pytest

from .helpers import MNIST, check_ok, loss_falls, needs_mnist, results, run_cli, worker_env

SMALL = ["--model", "mlp", "--max-steps", "30", "--no-control", "--nproc-per-node", "2"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@needs_mnist
def test_ddp_mnist_accuracy_and_identical_replicas(result_pattern):
    # Two epochs: the replicas are seeded and step in lockstep, and scored 0.9755 in every run here.
    proc = run_cli(["--mode", "ddp", "--nproc-per-node", "2", "--dataset", "mnist", "--data-dir", str(MNIST),
                    "--train-split", "8000", "--epochs", "2", "--no-control", "--result-file", str(result_pattern)],
                   timeout=220, env=worker_env(PSSERVER_LOG_LEVEL="INFO"))
    check_ok(proc)
    r0, r1 = results(result_pattern, 2)
    assert r0["accuracy"] >= 0.96, r0["accuracy"]
    assert r0["steps"] == r1["steps"] == 2 * 63  # 4,000 images per rank, batch 64
    assert r0["param_hash"] == r1["param_hash"]
    assert r0["hash_history"] == r1["hash_history"]  # identical after every step, not only at the end
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("rank 0 accuracy ")]
    assert line and abs(float(line[0].split()[-1]) - r0["accuracy"]) < 1e-4
    assert f"accuracy: {r0['accuracy']:.4f}" in proc.stderr  # the log line of rank 0


def _run_small(result_pattern, *flags: str) -> list[dict]:
    proc = run_cli(["--mode", "ddp", *SMALL, "--result-file", str(result_pattern), *flags], timeout=100)
    check_ok(proc)
    return results(result_pattern, 2)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd", "powersgd+fp16"])
def test_comm_hook_trains(hook, result_pattern):
    r0, r1 = _run_small(result_pattern, "--comm-hook", hook, "--powersgd-rank", "2")
    assert len(r0["losses"]) == 30
    assert loss_falls(r0["losses"]), r0["losses"]
    # The hooks all-reduce (compressed) gradients: replicas stay identical. fp16/bf16 cast the
    # all-reduced bucket back, bit for bit; PowerSGD rebuilds each rank's gradient from the
    # all-reduced factors with local matmuls (MKL: last-bit differences with memory alignment),
    # so there the replicas agree to float32 rounding, not bitwise.
    if hook.startswith("powersgd"):
        d0, d1 = (functools.reduce(operator.iadd, r["param_digest"], []) for r in (r0, r1))
        assert len(d0) == len(d1) > 0 and d0 == pytest.approx(d1, rel=1e-5, abs=1e-6)
    else:
        assert r0["param_hash"] == r1["param_hash"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_post_local_sgd_ranks_agree_after_averaging(result_pattern):
    r0, r1 = _run_small(result_pattern, "--comm-hook", "post-localsgd", "--localsgd-start-iter", "8",
                        "--model-averaging-period", "4", "--localsgd-group-size", "1")
    assert loss_falls(r0["losses"]), r0["losses"]
    h0, h1 = r0["hash_history"], r1["hash_history"]
    assert r0["averaged_steps"] == r1["averaged_steps"] == [9, 13, 17, 21, 25, 29]
    for step in range(1, 31):
        same = h0[step - 1] == h1[step - 1]
        if step <= 8 or step in r0["averaged_steps"]:
            assert same, f"ranks differ after step {step}"  # global all-reduce, or just averaged
        else:
            assert not same, f"ranks agree after local step {step}: local SGD is not local"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_static_graph_and_bucket_view_run_the_same(tmp_path):
    runs = {}
    for name, flags in {"plain": [], "static": ["--static-graph"],
                        "view": ["--gradient-as-bucket-view", "--bucket-cap-mb", "1"]}.items():
        runs[name] = _run_small(tmp_path / (name + "-{rank}.json"), *flags)
    for name, (r0, r1) in runs.items():
        assert loss_falls(r0["losses"]), (name, r0["losses"])
        assert r0["param_hash"] == r1["param_hash"], name
    # Same data, same initial weights, same gradients: the knobs change speed, not the result.
    assert runs["static"][0]["losses"] == pytest.approx(runs["plain"][0]["losses"], rel=1e-4)
    assert runs["view"][0]["losses"] == pytest.approx(runs["plain"][0]["losses"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ddp_trains_with_the_models_own_loss_and_reports_its_metric(result_pattern):
    """``byte_lm``: logits at every position under the next-token loss, scored by the held-out
    loss (not cross entropy over dim 1 and accuracy); a model scored by rmse is one line."""
    proc = run_cli(["--mode", "ddp", "--nproc-per-node", "2", "--model", "byte_lm", "--dataset", "pysource",
                    "--train-samples", "256", "--eval-samples", "32", "--batch-size", "4", "--max-steps", "5",
                    "--no-control", "--result-file", str(result_pattern)], timeout=100)
    check_ok(proc)
    r0, r1 = results(result_pattern, 2)
    assert r0["steps"] == r1["steps"] == 5 and r0["param_hash"] == r1["param_hash"]
    assert r0["metric"] == "loss" and r0["loss"] < 5.0  # held-out nats a byte (uniform: 5.55)
    assert f"rank 0 loss {r0['loss']:.4f}" in proc.stdout.splitlines()
    refused = run_cli(["--mode", "ddp", "--model", "mf", "--dataset", "synthetic_clicks", "--max-steps", "2",
                       "--no-control"], timeout=60)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "psserver train: error: --mode ddp reports accuracy or loss; model mf is scored by rmse: train it with "
        "--mode ps"), refused.stderr
