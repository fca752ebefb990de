"""A version's buffer is used again only once nothing holds it: not its tensors, not its bytes
being sent, not a view of them."""

from __future__ import annotations

import torch

from psserver.common.versions import BufferPool, Version, pack, packed_views


def test_a_buffer_comes_back_only_when_nothing_holds_it():
    pool = BufferPool()
    buf = pool.take(64)
    ident = id(buf)
    view = memoryview(buf)
    del buf
    assert id(pool.take(64)) != ident  # a view of it is held
    del view
    assert id(pool.take(64)) == ident and pool.reused == 1
    held = torch.frombuffer(pool.take(64), dtype=torch.uint8)  # the first free one: it
    assert id(pool.take(64)) != ident  # a tensor of it is held
    del held
    assert id(pool.take(64)) == ident
    assert pool.take(32).nbytes == 32  # another size: a new one


def test_a_versions_buffer_is_reused_once_the_version_and_its_bytes_are_let_go(monkeypatch):
    pool = BufferPool()
    monkeypatch.setattr("psserver.common.versions.POOL", pool)
    state, packed = pack({"w": torch.full((4,), 1.0)})
    version = Version(1, 0.0, state, packed)
    encoded = version.encoded("")
    buffer = packed.data
    del state, packed, version
    again, _ = packed_views([("w", torch.float32, (4,))])
    assert again["w"].data_ptr() != torch.frombuffer(buffer, dtype=torch.float32).data_ptr()  # its bytes are held
    assert bytes(encoded.data) == torch.full((4,), 1.0).numpy().tobytes()
    del encoded, buffer, again
    state, _packed = pack({"w": torch.full((4,), 2.0)})
    assert pool.reused == 1 and torch.equal(state["w"], torch.full((4,), 2.0))
