"""Collective training reads the same data as a parameter-server trainer: an image folder
through DataLoader workers, sharded by rank; --loss/--metric are refused in one line."""

from __future__ import annotations

import pytest

from tests.procs import MNIST_DIR
from tests.userproject import write_mnist_pngs

from .helpers import check_ok, loss_falls, results, run_cli


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_ddp_trains_an_image_folder_with_workers(tmp_path, result_pattern):
    if not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"real MNIST split not found at {MNIST_DIR}")
    images = write_mnist_pngs(tmp_path / "images", 2000, 300)
    proc = run_cli(["--mode", "ddp", "--nproc-per-node", "2", "--model", "mnist_cnn", "--dataset", "imagefolder",
                    "--data-dir", str(images), "--data-workers", "1", "--epochs", "2", "--no-control",
                    "--result-file", str(result_pattern)], timeout=220)
    check_ok(proc)
    r0, r1 = results(result_pattern, 2)
    assert r0["steps"] == r1["steps"] == 2 * 16  # 1,000 images per rank, batch 64
    assert r0["param_hash"] == r1["param_hash"]
    assert loss_falls(r0["losses"]), r0["losses"]
    assert r0["accuracy"] > 0.8, r0["accuracy"]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--loss", "--metric"])
def test_loss_and_metric_are_parameter_server_flags(flag):
    proc = run_cli(["--mode", "ddp", "--nproc-per-node", "2", flag, "mse", "--no-control"], timeout=50)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--loss and --metric apply to --mode ps" in errors[0], proc.stderr
