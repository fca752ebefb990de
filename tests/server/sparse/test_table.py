"""Embedding tables on a server, without RPC: the id index, rows created on first touch,
admission, eviction, time-to-live, the row-wise optimizers and checkpoints."""

from __future__ import annotations

import pytest
import torch

from psserver.server.sparse.index import IdIndex
from psserver.server.sparse.table import EmbeddingTable, TableSpec


def test_the_index_finds_inserts_and_removes_batches_of_ids_of_any_size():
    g = torch.Generator().manual_seed(0)
    ids = torch.unique(torch.randint(0, 2**62, (50_000,), generator=g))
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    index = IdIndex(16)
    for chunk, start in zip(ids.split(7_000), range(0, ids.numel(), 7_000), strict=True):
        index.insert(chunk, torch.arange(start, start + chunk.numel()))
    assert index.size == ids.numel() and index.capacity >= 2 * ids.numel()
    assert torch.equal(index.find(ids), torch.arange(ids.numel()))
    assert bool((index.find(torch.tensor([1, 2, 3, 2**63 - 1])) == -1).all())
    index.remove(ids[::2])
    found = index.find(ids)
    assert bool((found[::2] == -1).all()) and torch.equal(found[1::2], torch.arange(1, ids.numel(), 2))
    index.insert(ids[::2], torch.zeros(ids[::2].numel(), dtype=torch.int64))  # into deleted slots
    assert index.size == ids.numel() and bool((index.find(ids[::2]) == 0).all())
    # Sequential ids (a real id space often is one) spread as well.
    seq = IdIndex(16)
    seq.insert(torch.arange(10_000), torch.arange(10_000))
    assert torch.equal(seq.find(torch.arange(10_000)), torch.arange(10_000))


def spec(**kw) -> TableSpec:
    return TableSpec(**{"name": "t", "dim": 4, "max_rows": 1000, **kw})


def test_rows_are_created_on_first_touch_from_the_same_initial_values_everywhere():
    a, b = EmbeddingTable(spec(seed=3, init_std=0.1)), EmbeddingTable(spec(seed=3, init_std=0.1))
    ids = torch.tensor([2**62 + 5, 7, 123456789012])
    rows = a.lookup(ids)
    assert a.num_rows == 3 and rows.shape == (3, 4)
    assert torch.equal(b.lookup(ids.flip(0)), rows.flip(0))  # by id, not by order or server
    assert torch.equal(a.lookup(ids, train=False), rows)
    assert 0.02 < float(rows.std()) < 0.3
    many = EmbeddingTable(spec(init_std=1.0, max_rows=100_000)).lookup(torch.arange(20_000))
    assert abs(float(many.mean())) < 0.02 and abs(float(many.std()) - 1.0) < 0.02  # N(0, std)
    c = EmbeddingTable(spec(seed=4, init_std=0.1))
    assert not torch.equal(c.lookup(ids), rows)
    assert EmbeddingTable(spec()).lookup(torch.tensor([1]), train=False).abs().sum() == 0  # evaluation creates nothing


def test_an_id_becomes_a_row_after_it_was_seen_n_times_and_reads_the_default_before():
    t = EmbeddingTable(spec(admit_after=3, init_std=0.1))
    ids = torch.tensor([11, 12])
    for _ in range(2):
        assert t.lookup(ids).abs().sum() == 0 and t.num_rows == 0
        t.apply(ids, torch.ones(2, 4))  # dropped: no row
    rows = t.lookup(ids)
    assert t.num_rows == 2 and rows.abs().sum() > 0
    assert t.counters.admissions_refused == 4 and t.counters.created == 2


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_row_bound_holds_and_the_policy_picks_who_goes(policy):
    t = EmbeddingTable(spec(max_rows=100, eviction=policy))
    hot = torch.arange(10)
    for step in range(50):
        t.lookup(hot)
        t.lookup(torch.arange(1000 + 20 * step, 1000 + 20 * (step + 1)))  # a stream of cold ids
        t.end_step()
        assert t.num_rows <= 100
    assert bool((t.index.find(hot) >= 0).all())  # touched every step (lru) and most often (lfu)
    assert t.counters.evicted >= 1000 - 100 and t.num_rows == t.index.size


def test_rows_untouched_for_the_ttl_expire():
    t = EmbeddingTable(spec(ttl_steps=8))
    t.lookup(torch.tensor([1, 2]))
    for _ in range(12):
        t.lookup(torch.tensor([1]))
        t.end_step()
    assert t.index.find(torch.tensor([1, 2])).tolist()[1] == -1 and t.num_rows == 1 and t.counters.expired == 1


def test_lazy_adam_is_adam_on_the_rows_a_step_touched_and_leaves_the_others():
    t = EmbeddingTable(spec(optimizer="lazy_adam", lr=0.01, init_std=0.1))
    ids = torch.tensor([5, 6, 7])
    start = t.lookup(ids)
    ref = torch.nn.Parameter(start[:2].clone())
    opt = torch.optim.Adam([ref], lr=0.01, eps=1e-8)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = torch.randn(2, 4, generator=g)
        t.apply(ids[:2], grads)
        ref.grad = grads
        opt.step()
    torch.testing.assert_close(t.lookup(ids[:2], train=False), ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(t.lookup(ids[2:], train=False), start[2:])  # untouched: no decay, no state
    assert int(t.state["t"][t.index.find(ids[2:])]) == 0


def test_rowwise_adagrad_keeps_one_accumulator_per_row():
    t = EmbeddingTable(spec(optimizer="rowwise_adagrad", lr=0.1, init_std=0.0))
    ids = torch.tensor([1])
    t.lookup(ids)
    g = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    t.apply(ids, g)
    t.apply(ids, g)
    acc = 2 * float((g ** 2).mean())
    expected = -0.1 * g / (float((g ** 2).mean()) ** 0.5) - 0.1 * g / acc ** 0.5
    torch.testing.assert_close(t.lookup(ids, train=False), expected)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "lazy_adam"])
def test_a_checkpoint_restores_rows_and_optimizer_state_bit_for_bit(optimizer):
    t = EmbeddingTable(spec(optimizer=optimizer, admit_after=2, init_std=0.1, ttl_steps=50))
    g = torch.Generator().manual_seed(2)
    for _ in range(10):
        ids = torch.unique(torch.randint(0, 40, (16,), generator=g))
        t.lookup(ids)
        t.apply(ids, torch.randn(ids.numel(), 4, generator=g))
        t.end_step()
    saved = t.state_dict()
    u = EmbeddingTable(t.spec)
    u.load_state_dict(saved)
    assert u.num_rows == t.num_rows and u.step == t.step
    ids = torch.arange(40)
    assert torch.equal(u.lookup(ids, train=False), t.lookup(ids, train=False))
    for table in (t, u):  # and they go on the same way
        table.lookup(ids)
        table.apply(ids, torch.ones(40, 4))
    assert torch.equal(u.lookup(ids, train=False), t.lookup(ids, train=False))


def _held(table: EmbeddingTable) -> dict[int, torch.Tensor]:
    live = (table.ids >= 0).nonzero().squeeze(1)
    return {int(i): w for i, w in zip(table.ids[live].tolist(), table.weights[live], strict=True)}


def test_a_readers_deltas_bring_its_copy_to_the_table_rows_written_and_dropped_since_only():
    table = EmbeddingTable(TableSpec("t", dim=4, max_rows=8, eviction="lru"), initial_capacity=8)
    table.lookup(torch.arange(6))
    table.end_step()
    first = table.changes_since(-1)
    assert first.full and sorted(first.ids.tolist()) == list(range(6)) and first.gone.numel() == 0
    held = {int(i): r.clone() for i, r in zip(first.ids.tolist(), first.rows, strict=True)}
    table.apply(torch.tensor([1, 4]), torch.ones(2, 4))
    table.end_step()
    table.lookup(torch.arange(6, 11))  # 11 ids for 8 rows: the least recently used go
    table.end_step()
    delta = table.changes_since(first.step)
    assert not delta.full and delta.step == first.step + 2
    written, gone = set(delta.ids.tolist()), set(delta.gone.tolist())
    assert {1, 4} <= written | gone and written >= set(range(6, 11)) - gone  # stepped, created
    assert not {0, 2, 3, 5} & written  # rows neither stepped nor created again are not sent again
    for i in delta.gone.tolist():
        held.pop(i, None)
    held.update({int(i): r for i, r in zip(delta.ids.tolist(), delta.rows, strict=True)})
    assert held.keys() == _held(table).keys() and all(torch.equal(held[i], r) for i, r in _held(table).items())
    assert table.changes_since(delta.step).ids.numel() == 0  # nothing written since


def test_after_a_restore_a_delta_from_before_it_starts_over():
    table = EmbeddingTable(TableSpec("t", dim=2, max_rows=100))
    table.lookup(torch.arange(3))
    table.end_step()
    before = table.changes_since(-1).step
    again = EmbeddingTable(table.spec)
    again.load_state_dict(table.state_dict())
    assert again.changes_since(before - 1).full
    assert not again.changes_since(before).full and again.changes_since(before).ids.numel() == 0
