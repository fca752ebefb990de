"""``--dataset pysource``: the standard library's sources as next-byte samples."""

from __future__ import annotations

import pytest
import torch

from psserver.data import load_dataset
from psserver.data.text import HELD_OUT_EVERY, load_pysource, stdlib_sources
from psserver.errors import DataError
from psserver.models.llama import BYTE_LM, LLAMA_TINY


def _tree(root, files: dict[str, bytes]):
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def test_a_target_is_its_sample_shifted_by_one_byte_and_held_out_files_never_train(tmp_path):
    files = {f"m{i:02d}.py": bytes([65 + i]) * 40 for i in range(20)}
    files |= {"test/big.py": b"T" * 1000, "site-packages/x.py": b"S" * 1000, "notes.txt": b"N" * 1000}
    root = _tree(tmp_path, files)
    assert [p.name for p in stdlib_sources(root)] == sorted(f for f in files if "/" not in f and f.endswith(".py"))
    train, held = load_pysource(8, 80, 8, root)
    x, y = train.tensors
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (80, 8)
    stream = torch.cat([x.reshape(-1), y[-1, -1:]])
    assert torch.equal(y.reshape(-1), stream[1:])
    train_bytes, held_bytes = set(x.unique().tolist()), set(held.tensors[0].unique().tolist())
    assert held_bytes == {65, 65 + HELD_OUT_EVERY} and not train_bytes & held_bytes
    with pytest.raises(DataError, match="hold 4 held-out samples of 8 bytes, 5 asked"):
        load_pysource(8, 4, 5, _tree(tmp_path / "small", {f"m{i}.py": b"ab" * 20 for i in range(2)}))


def test_byte_lm_reads_the_running_interpreters_sources_and_other_models_are_refused():
    class Config:
        dataset, synthetic_train, synthetic_eval = "pysource", 64, 16

    train, held = load_dataset(Config, BYTE_LM.input_shape, BYTE_LM.num_classes, BYTE_LM.input_dtype)
    assert len(train) == 64 and len(held) == 16 and train.tensors[0].shape[1] == BYTE_LM.input_shape[0]
    with pytest.raises(DataError, match="byte-level language model"):
        load_dataset(Config, LLAMA_TINY.input_shape, LLAMA_TINY.num_classes, LLAMA_TINY.input_dtype)
