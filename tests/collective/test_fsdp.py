"""FSDP2 with gloo processes: accuracy, FSDP+TP on a 2x2 mesh, sharded checkpoints that reshard."""

from __future__ import annotations

import pytest

from psserver.collective.checkpoint import MARKER, complete_checkpoints

from .helpers import MNIST, check_ok, loss_falls, needs_mnist, results, run_cli


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(280)
@needs_mnist
def test_fsdp_mnist_accuracy(result_pattern):
    # Two epochs: as DDP's (tests/collective/test_ddp.py), 0.9755 in every run here.
    proc = run_cli(["--mode", "fsdp", "--nproc-per-node", "2", "--dataset", "mnist", "--data-dir", str(MNIST),
                    "--train-split", "8000", "--epochs", "2", "--no-control", "--result-file", str(result_pattern)],
                   timeout=260)
    check_ok(proc)
    r0, r1 = results(result_pattern, 2)
    assert r0["accuracy"] >= 0.96, r0["accuracy"]
    assert r0["param_hash"] == r1["param_hash"]  # hash of the gathered (full) parameters
    # Per-block sharding: every parameter is a DTensor sharded over the 2 ranks.
    assert r0["layouts"]["7.weight"]["placements"] == ["S(0)"]
    assert r0["layouts"]["7.weight"]["local_shape"] == [64, 9216]
    assert any(ln.startswith("rank 0 accuracy ") for ln in proc.stdout.splitlines())


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_fsdp_tp_2x2_mesh_trains_decoder(result_pattern):
    proc = run_cli(["--mode", "fsdp", "--nproc-per-node", "4", "--tp-size", "2", "--model", "llama_tiny",
                    "--max-steps", "30", "--no-control", "--result-file", str(result_pattern)], timeout=180)
    check_ok(proc)
    rs = results(result_pattern, 4)
    assert loss_falls(rs[0]["losses"]), rs[0]["losses"]
    assert len({r["param_hash"] for r in rs}) == 1
    layouts = rs[0]["layouts"]
    wq = layouts["1.attention.wq.weight"]
    assert wq["mesh"] == ["dp", "tp"] and wq["placements"][-1] == "S(0)"  # column-parallel
    assert layouts["1.attention.wo.weight"]["placements"][-1] == "S(1)"  # row-parallel
    assert layouts["2.feed_forward.w2.weight"]["placements"][-1] == "S(1)"
    assert wq["local_shape"] == [16, 64]  # 64x64 over 2 (tp) x 2 (dp)
    # Only the TP-planned projections carry the tp dimension; norms and embeddings are FSDP only.
    assert layouts["0.tok.weight"]["mesh"] == ["dp"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_checkpoint_save_2_resume_2_and_1(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--mode", "fsdp", "--model", "mlp", "--no-control", "--checkpoint-dir", str(ckpt),
              "--checkpoint-every", "10", "--max-steps", "20"]
    saved = tmp_path / "save-{rank}.json"
    check_ok(run_cli([*common, "--nproc-per-node", "2", "--result-file", str(saved)], timeout=100))
    found = complete_checkpoints(ckpt)
    assert [step for step, _ in found] == [10, 20]
    assert (found[-1][1] / MARKER).is_file() and not list(ckpt.glob("*.tmp"))
    want = results(saved, 2)
    assert want[0]["param_hash"] == want[1]["param_hash"]

    two = tmp_path / "two-{rank}.json"
    check_ok(run_cli([*common, "--nproc-per-node", "2", "--resume", "--result-file", str(two)], timeout=100))
    one = tmp_path / "one-{rank}.json"
    check_ok(run_cli([*common, "--resume", "--result-file", str(one)], timeout=100))  # 1 rank: resharded
    r2, r1 = results(two, 2), results(one, 1)
    assert r2[0]["steps"] == r1[0]["steps"] == 20 and r2[0]["losses"] == []  # nothing left to train
    assert r2[0]["param_hash"] == r2[1]["param_hash"] == r1[0]["param_hash"] == want[0]["param_hash"]
    assert r1[0]["accuracy"] == pytest.approx(want[0]["accuracy"])

    # Resume from the step-10 checkpoint on 1 rank and train on: it continues from step 10.
    more = tmp_path / "more-{rank}.json"
    check_ok(run_cli([*common, "--resume", str(found[0][1]), "--result-file", str(more)], timeout=100))
    assert results(more, 1)[0]["steps"] == 20 and len(results(more, 1)[0]["losses"]) == 10


def test_partial_checkpoints_are_never_latest(tmp_path):
    (tmp_path / "step-00000005").mkdir()
    (tmp_path / "step-00000005" / MARKER).write_text("{}")
    (tmp_path / "step-00000009.tmp").mkdir()  # a save that died before the rename
    (tmp_path / "step-00000010").mkdir()  # renamed, marker not yet written
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [5]
