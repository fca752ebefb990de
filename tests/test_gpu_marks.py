"""Every GPU test is collected by ``pytest -m gpu`` (what ``benchmarks/gpu_paths.sh tests`` runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.gpu import cuda_marks, needs_gpu
from tests.procs import ROOT


class Item:
    def __init__(self, *marks: pytest.MarkDecorator) -> None:
        self.marks = [m.mark for m in marks]

    def iter_markers(self, name: str):
        return (m for m in self.marks if m.name == name)


def test_a_skip_for_want_of_a_gpu_is_recognised_and_the_shared_marks_carry_gpu():
    assert needs_gpu(Item(*cuda_marks()))
    assert needs_gpu(Item(*cuda_marks(2)))
    assert needs_gpu(Item(pytest.mark.skipif(True, reason="needs 2 CUDA GPUs")))
    assert not needs_gpu(Item(pytest.mark.skipif(False, reason="checks the error on a host without CUDA")))
    assert [m.name for m in cuda_marks()] == ["gpu", "skipif"]


def test_collecting_the_gpu_mark_finds_the_servers_gpu_tests():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--collect-only",
                           "-m", "gpu", "tests/end_to_end/test_gpu.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test_gpu.py::test_shard_runs_on_its_device" in done.stdout, done.stdout
    assert "test_cuda_device_without_cuda_is_a_clear_error" not in done.stdout, done.stdout
