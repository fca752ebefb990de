"""``benchmarks/gpu_paths.sh``, the GPU session's script: it parses, refuses a part it does not
know, and without CUDA says so in one line and exits 2 before it writes anything (its parts run
on a GPU host only)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.procs import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_paths.sh"


def test_the_script_parses_and_names_its_parts():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, timeout=30).returncode == 0
    for bad in ([], ["resnet"]):
        r = subprocess.run(["bash", str(SCRIPT), *bad], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            "usage: bash benchmarks/gpu_paths.sh tests|resnet18|mnist|cross-host|resnet50 [OUT]"], bad


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the parts would run")
def test_without_cuda_it_refuses_in_one_line(tmp_path):
    results = ROOT / "benchmarks" / "results" / "gpu-h100"
    before = sorted(results.rglob("*")) if results.exists() else None
    r = subprocess.run(["bash", str(SCRIPT), "tests", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["gpu_paths.sh: no CUDA device here (torch.cuda.is_available() is False)"]
    assert not (tmp_path / "out").exists()
    assert (sorted(results.rglob("*")) if results.exists() else None) == before
