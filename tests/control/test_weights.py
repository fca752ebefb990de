"""The weights service over real gRPC: readers get whole versions (never two steps), wait for
newer ones, take bf16 at half the bytes, load them into a model; the read token reads the
weights and nothing else."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
import torch
from torch import nn

from psserver.config.control import ControlConfig
from psserver.control.client import ControlClient, ControlError
from psserver.control.server import ControlServer
from psserver.errors import NoVersion, UsageError
from psserver.reader.reader import Reader
from psserver.server.versions import Versions

from .fakes import TOKEN, FakeTarget, Trained

READ_TOKEN = "reader-only-token"


def latest(server: ControlServer, **options):
    with Reader(server.address, timeout=5, **options) as reader:
        return reader.latest()


def serve(target: FakeTarget, trained: Trained, **config) -> ControlServer:
    return ControlServer(target, ControlConfig(port=0, **config), grace=0.5, weights=trained.versions).start()


def test_every_read_is_one_whole_step_and_waits_see_newer_ones(target, trained):
    trained.start()
    with serve(target, trained) as server, Reader(server.address, name="poller") as reader:
        step = -1
        for _ in range(30):
            version = reader.wait(step, timeout=5)
            assert version is not None and version.step > step and version.model == "linear"
            assert all(float(t.min()) == float(t.max()) == version.step for t in version.state.values())
            step = version.step
        assert 0 <= version.age < 5
        seen = trained.versions.readers()
        assert [r.name for r in seen] == ["poller"] and seen[0].reads == 30 and seen[0].step == step


def test_a_wait_with_no_newer_step_ends_empty_and_bf16_halves_the_bytes(target, trained):
    trained.train_one()
    with serve(target, trained) as server:
        with Reader(server.address) as reader:
            full = reader.latest()
            assert full.step == 1 and reader.wait(1, timeout=0.3) is None
        with Reader(server.address, dtype="bfloat16") as half:
            v = half.latest()
            assert {t.dtype for k, t in v.state.items() if k != "seen"} == {torch.bfloat16}
            assert v.state["seen"].dtype == torch.int64
            model = nn.Linear(300, 200)
            model.register_buffer("seen", torch.zeros((), dtype=torch.int64))
            half.load_into(model, v)
            assert torch.equal(model.weight, torch.ones(200, 300)) and int(model.seen) == 1
            with pytest.raises(UsageError, match=r"^version 1 of linear does not fit this model: missing 0.weight, "
                                                 r"0.bias; unexpected weight, bias, seen$"):
                half.load_into(nn.Sequential(nn.Linear(300, 200)), v)


def test_the_read_token_reads_the_weights_and_nothing_else(target, trained, token_file, tmp_path):
    read_file = tmp_path / "read.token"
    read_file.write_text(READ_TOKEN + "\n")
    trained.train_one()
    with serve(target, trained, auth_token_file=token_file, read_token_file=read_file) as server:
        assert latest(server, token=READ_TOKEN).step == 1
        assert latest(server, token=TOKEN).step == 1  # the control token reads too
        with pytest.raises(UsageError, match="UNAUTHENTICATED: missing bearer token"):
            latest(server)
        with pytest.raises(UsageError, match="UNAUTHENTICATED: invalid bearer token"):
            latest(server, token="guess")
        with ControlClient(server.address, token=READ_TOKEN) as as_reader:
            for call in (as_reader.get_status, as_reader.checkpoint, lambda: as_reader.shutdown("reader")):
                with pytest.raises(ControlError) as refused:
                    call()
                assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert not target.shutdown_requested.is_set()


def test_without_a_control_token_the_read_token_still_cannot_checkpoint_or_stop(target, trained, tmp_path):
    read_file = tmp_path / "read.token"
    read_file.write_text(READ_TOKEN)
    with serve(target, trained, read_token_file=read_file) as server:
        with ControlClient(server.address, token=READ_TOKEN) as as_reader:
            for call in (as_reader.checkpoint, lambda: as_reader.shutdown("reader")):
                with pytest.raises(ControlError) as refused:
                    call()
                assert refused.value.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        assert not target.shutdown_requested.is_set() and not target.checkpoints


def test_the_read_token_must_not_be_the_control_token(token_file):
    with pytest.raises(ValueError, match="the read token is the control token"):
        ControlConfig(port=0, auth_token_file=token_file, read_token_file=token_file)


def test_no_model_and_bad_requests_are_one_line(target):
    def no_model():
        raise NoVersion("the server holds no model yet (the first trainer brings it)")

    source = Versions(no_model, lambda: 0)
    with ControlServer(target, ControlConfig(port=0), grace=0.5, weights=source).start() as server:
        with pytest.raises(UsageError, match=r"FAILED_PRECONDITION: no version to read: the server holds no model yet"):
            latest(server)
    with pytest.raises(UsageError, match=r"^dtype 'int8': one of float32, bfloat16, float16"):
        Reader("127.0.0.1:1", dtype="int8")


def test_an_empty_token_file_is_one_line(tmp_path: Path):
    (tmp_path / "t").write_text("")
    with pytest.raises(UsageError, match="--read-token-file"):
        Reader("127.0.0.1:1", token_file=tmp_path / "t")


def test_row_lookups_come_back_per_id_in_order_with_repeats(target, trained):
    trained.train_one()
    with serve(target, trained) as server, Reader(server.address) as reader:
        got = reader.rows("users", [3, 1, 3, 0])
        assert got.step == 1 and torch.equal(got.values, trained.table[[3, 1, 3, 0]])
        assert reader.rows("users", torch.zeros(0, dtype=torch.int64)).values.shape == (0, 4)
        with pytest.raises(UsageError, match=r"INVALID_ARGUMENT: no embedding table 'items' \(tables: users\)"):
            reader.rows("items", [1])
    with serve(target, trained) as server, Reader(server.address, dtype="bfloat16") as half:
        assert half.rows("users", [2]).values.dtype == torch.bfloat16


def test_row_deltas_over_grpc_keep_a_readers_copy_equal_to_the_table_in_chunks(target):
    """A table of 5,000 rows of 64 (over a MiB: several messages): the first delta is every
    row, the next only what was stepped or dropped since; the reader's copy equals the table's."""
    from psserver.server.sparse.table import EmbeddingTable, TableSpec

    table = EmbeddingTable(TableSpec("items", dim=64, max_rows=5000), initial_capacity=5000)
    table.lookup(torch.arange(5000))
    table.end_step()

    def changes(name: str, since: int):
        if name != "items":
            raise ValueError(f"no table {name!r}")
        return table.changes_since(since)

    versions = Versions(lambda: (0, {}), lambda: 0, 0.0, changes=changes)
    with ControlServer(target, ControlConfig(port=0), grace=0.5, weights=versions).start() as server, \
            Reader(server.address) as reader:
        first = reader.rows_since("items")
        assert first.full and first.ids.numel() == 5000
        held = first.apply_to({})
        table.apply(torch.tensor([7, 4000]), torch.ones(2, 64))
        table.lookup(torch.tensor([9000]))  # past max_rows: the least recently used go (to 95 % of it)
        table.end_step()
        delta = reader.rows_since("items", first.step)
        gone = set(delta.gone.tolist())
        assert not delta.full and set(delta.ids.tolist()) == {7, 4000, 9000} - gone and len(gone) == 251
        delta.apply_to(held)
        live = (table.ids >= 0).nonzero().squeeze(1)
        assert held.keys() == set(table.ids[live].tolist())
        assert all(torch.equal(held[int(i)], table.weights[s]) for i, s in zip(table.ids[live], live, strict=True))
        with pytest.raises(UsageError, match="INVALID_ARGUMENT: no table 'users'"):
            reader.rows_since("users")
        with pytest.raises(UsageError, match="since is a table's clock"):
            reader.rows_since("items", -2)


def test_a_reader_that_stops_reading_is_cancelled_and_frees_its_slot(target, monkeypatch):
    """A reader that takes the header of a 64 MiB version and reads no further fills its flow-
    control window: the server's send stalls, and past STALL_S the read is cancelled, so the one
    read slot is free again (else: RESOURCE_EXHAUSTED for every reader, for ever)."""
    from psserver.control import weights as weights_module
    from psserver.control.v1 import control_pb2 as pb
    from psserver.control.v1 import control_pb2_grpc as pb_grpc

    monkeypatch.setattr(weights_module, "STALL_S", 1.0)
    big = Versions(lambda: (1, {"w": torch.zeros(16 << 20)}), lambda: 1, 0.0)
    with ControlServer(target, ControlConfig(port=0), grace=0.5, weights=big, max_reads=1).start() as server, \
            grpc.insecure_channel(server.address) as channel:
        stalled = pb_grpc.WeightsServiceStub(channel).Read(pb.ReadRequest())
        assert next(stalled).header.step == 1  # and nothing more is read
        with Reader(server.address, timeout=10) as reader:
            for _ in range(100):  # the slot is free once the server gave the stalled read up
                try:
                    version = reader.latest()
                    break
                except UsageError as e:
                    assert "RESOURCE_EXHAUSTED" in str(e)
                    time.sleep(0.1)
            else:
                pytest.fail("the stalled read still holds the only slot after 10 s")
        assert version.step == 1 and version.state["w"].numel() == 16 << 20
        with pytest.raises(grpc.RpcError) as e:
            for _ in stalled:
                pass
        assert e.value.code() == grpc.StatusCode.CANCELLED


def test_row_reads_take_the_read_slots_too(target, trained):
    """Row lookups and deltas copy rows: they are reads, bounded as reads are, so readers never
    take the workers of the status calls."""
    from psserver.control.v1 import control_pb2 as pb
    from psserver.control.v1 import control_pb2_grpc as pb_grpc

    trained.train_one()
    with ControlServer(target, ControlConfig(port=0), grace=0.5, weights=trained.versions, max_reads=1).start() \
            as server, grpc.insecure_channel(server.address) as channel, Reader(server.address) as reader:
        assert reader.rows("users", [1]).step == 1  # the slot is free
        waiting = pb_grpc.WeightsServiceStub(channel).Read(pb.ReadRequest(newer_than=5, timeout_seconds=30))
        deadline = time.monotonic() + 10
        while server.weights.in_flight == 0:  # until the server has the read, waiting for step 6
            assert not waiting.done() and time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(UsageError, match="RESOURCE_EXHAUSTED"):
            reader.rows("users", [1])
        with pytest.raises(UsageError, match="RESOURCE_EXHAUSTED"):
            reader.rows_since("users")
        waiting.cancel()
