import pytest
import torch

from psserver.checkpoint import (
    Checkpointer,
    CheckpointError,
    checkpoint_path,
    list_checkpoints,
    load_latest,
    read_checkpoint,
    write_checkpoint,
)


def state(step):
    return {"global_step": step, "w": torch.full((100,), float(step))}


def test_round_trip_and_pruning(tmp_path):
    ck = Checkpointer(tmp_path, keep=2)
    for step in (10, 20, 30):
        ck.save(step, state(step), wait=False)
    ck.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000000030.pt", "ckpt-000000000020.pt"]
    assert ck.last.step == 30
    assert torch.equal(read_checkpoint(checkpoint_path(tmp_path, 30))["w"], torch.full((100,), 30.0))


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "header", "empty"])
def test_damaged_file_is_rejected_and_older_used(tmp_path, damage, caplog):
    write_checkpoint(checkpoint_path(tmp_path, 1), state(1))
    bad = checkpoint_path(tmp_path, 2)
    write_checkpoint(bad, state(2))
    data = bytearray(bad.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "bitflip":
        data[-10] ^= 0x01
    elif damage == "header":
        data[:5] = b"XXXXX"
    else:
        data = bytearray()
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        read_checkpoint(bad)
    path, loaded = load_latest(tmp_path)
    assert path == checkpoint_path(tmp_path, 1) and loaded["global_step"] == 1
    assert "skipping invalid checkpoint" in caplog.text


def test_temporary_files_are_never_taken(tmp_path):
    write_checkpoint(checkpoint_path(tmp_path, 5), state(5))
    (tmp_path / ".ckpt-000000000009.pt.tmp-123").write_bytes(b"partial")
    assert load_latest(tmp_path)[1]["global_step"] == 5
    assert load_latest(tmp_path / "missing") is None
