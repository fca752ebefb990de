"""``benchmarks.studies.state_copy``: the host copy of a server's state that a GPU shard's death would
need, measured beside the server's exchange and a local step (here on the CPU, where the tool
runs the same legs but for the page-locked copy)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.studies import state_copy
from psserver.models import build_model
from tests.gpu import needs_cuda


def _run(tmp_path, state_dir, device: str) -> dict:
    state_dir.mkdir()  # on the memory filesystem, as in production: a disk-backed mapping may not pin
    argv = ["--model", "mnist_cnn", "--batch-size", "8", "--device", device, "--rounds", "2", "--steps", "2",
            "--state-dir", str(state_dir), "--results-dir", str(tmp_path / "out")]
    assert state_copy.main(argv) == 0
    assert list(state_dir.iterdir()) == []  # the state files are gone
    stem = f"state-copy-mnist_cnn-b8-{device.replace(':', '')}"
    result = json.loads((tmp_path / "out" / f"{stem}.json").read_text())
    md = (tmp_path / "out" / f"{stem}.md").read_text()
    assert result["command"] in md and "| copy pageable |" in md
    return result


def test_the_copy_holds_the_whole_state_and_is_timed_in_paired_rounds(tmp_path, state_dir):
    result = _run(tmp_path, state_dir, "cpu")
    params = result["params"]
    assert params == 1_199_882  # mnist_cnn
    # Parameters and Adam's two moments in fp32, and one fp32 step counter per parameter tensor.
    tensors = len(list(build_model("mnist_cnn").parameters()))
    assert result["state_bytes"] == 3 * params * 4 + tensors * 4
    assert result["state_tensors"] == 4 * tensors
    assert set(result["per_round_ms"]) == {"local_step", "exchange", "copy_pageable"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["per_round_ms"].values())
    s = result["summary"]
    assert s["copy_pageable_x_local_step"] > 0 and s["copy_pageable_gb_per_s"] > 0


def test_one_copy_is_the_live_state_bit_for_bit(tmp_path):
    t = [torch.randn(5, 3), torch.arange(7, dtype=torch.int64), torch.tensor(3.0)]
    copy = state_copy.HostCopy(tmp_path, "s", t, register=False)
    try:
        for x in t:
            x.add_(1)
        copy.copy()
        assert all(torch.equal(v, x) for v, x in zip(copy.views, t, strict=True))
        assert copy.arena.journal().begin == copy.arena.journal().end == 1
        assert copy.nbytes == 15 * 4 + 7 * 8 + 4
    finally:
        copy.close()


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "must be >= 1"),
    (["--device", "tpu:0"], "not a device"),
    (["--model", "llama_tiny", "--device", "cpu"], "no fixed image-like input"),
    (["--state-dir", "/nonexistent/psserver"], "not a directory"),
])
def test_bad_flags_are_one_line_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        state_copy.main([*argv, "--results-dir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@needs_cuda()
def test_on_a_gpu_the_copy_goes_to_pageable_and_to_page_locked_pages(tmp_path, state_dir):
    result = _run(tmp_path, state_dir, "cuda:0")
    assert set(result["per_round_ms"]) == {"local_step", "exchange", "copy_pageable", "copy_registered"}
    assert result["summary"]["copy_registered_gb_per_s"] > 0
