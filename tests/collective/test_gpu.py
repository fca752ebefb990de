"""GPU code paths: NCCL, one process per GPU on cuda:LOCAL_RANK, bf16 mixed precision."""

from __future__ import annotations

import pytest
import torch

from .helpers import check_ok, loss_falls, results, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is false)"),
]
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
NPROC = str(min(2, max(1, NGPU)))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("hook", ["none", "bf16", "powersgd"])
def test_ddp_nccl(hook, result_pattern):
    proc = run_cli(["--mode", "ddp", "--nproc-per-node", NPROC, "--model", "mlp", "--max-steps", "30",
                    "--comm-hook", hook, "--nccl-min-nchannels", "2", "--no-control",
                    "--result-file", str(result_pattern)], timeout=220)
    check_ok(proc)
    rs = results(result_pattern, int(NPROC))
    assert all(r["backend"] == "nccl" for r in rs)
    assert loss_falls(rs[0]["losses"])
    assert len({r["param_hash"] for r in rs}) == 1


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp_mixed_precision_on_gpu(precision, result_pattern):
    proc = run_cli(["--mode", "fsdp", "--nproc-per-node", NPROC, "--model", "llama_tiny", "--max-steps", "30",
                    "--mixed-precision", precision, "--no-control", "--result-file", str(result_pattern)],
                   timeout=220)
    check_ok(proc)
    rs = results(result_pattern, int(NPROC))
    assert rs[0]["backend"] == "nccl" and loss_falls(rs[0]["losses"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(NGPU < 4, reason="FSDP+TP on a 2x2 mesh with NCCL needs 4 GPUs")
def test_fsdp_tp_nccl(result_pattern):
    proc = run_cli(["--mode", "fsdp", "--nproc-per-node", "4", "--tp-size", "2", "--model", "llama_tiny",
                    "--max-steps", "30", "--mixed-precision", "bf16", "--no-control",
                    "--result-file", str(result_pattern)], timeout=220)
    check_ok(proc)
    assert loss_falls(results(result_pattern, 4)[0]["losses"])
