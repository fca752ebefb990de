"""The tables of one server process and a trainer's batch of rows, without RPC."""

from __future__ import annotations

import pytest
import torch

from psserver.common.partition import owner
from psserver.config import EmbeddingConfig
from psserver.models import TableDef
from psserver.server.engine.guard import GradientGuard
from psserver.server.sparse.tables import RowGrads, SparseTables
from psserver.trainer.compute.rows import RowBatch

DEFS = (TableDef("user", 0, 1), TableDef("item", 1, 0))


def tables(rank: int = 0, servers: int = 1, **kw) -> SparseTables:
    return SparseTables(DEFS, EmbeddingConfig(**kw), 4, seed=0, server_rank=rank, num_servers=servers)


def test_owner_spreads_ids_evenly_and_is_stable() -> None:
    ids = torch.randint(0, 1 << 40, (40_000,))
    own = owner(ids, 4)
    counts = torch.bincount(own, minlength=4)
    assert counts.min() > 9_000 and counts.max() < 11_000
    assert torch.equal(own, owner(ids.clone(), 4))
    assert not owner(ids, 1).any()


def test_rows_of_a_batch_go_to_their_servers_and_come_back_in_place() -> None:
    servers = [tables(r, 3) for r in range(3)]
    ids = torch.tensor([[5, 7], [9, 7], [5, 11], [2**40 + 3, 7]])
    batch = RowBatch(ids, [("user", 0), ("item", 1)], 3)
    assert batch.num_ids == 3 + 2
    replies = [s.serve("t", req) for s, req in zip(servers, batch.requests, strict=True)]
    rows = batch.assemble(replies, torch.device("cpu"), requires_grad=True)
    assert [tuple(r.shape) for r in rows] == [(3, 5), (2, 4)]
    per = batch.per_sample(rows)
    # A row is its id's initial values wherever it was created.
    single = tables()
    want = single.serve("t", {"user": ids[:, 0].unique(), "item": ids[:, 1].unique()})
    assert torch.equal(rows[0].detach(), want["user"]) and torch.equal(rows[1].detach(), want["item"])
    assert torch.equal(per[1][1], per[1][0])  # id 7, twice
    loss = sum(p.sum() for p in per)
    grads = torch.autograd.grad(loss, rows)
    assert grads[1][torch.searchsorted(batch.unique[1], torch.tensor(7))].tolist() == [3.0] * 4  # summed per id
    split = batch.split_grads(list(grads), torch.float32)
    for server, req, g in zip(servers, batch.requests, split, strict=True):
        keyed = server.row_grads("t", g)
        assert {k.table: k.ids.tolist() for k in keyed} == {n: v.tolist() for n, v in req.items()}


def test_a_step_updates_only_the_rows_it_touched() -> None:
    t = tables(optimizer="lazy_adam", lr=0.1)
    t.serve("a", {"user": torch.tensor([1, 2, 3]), "item": torch.tensor([10])})
    before = t.state_dict()
    t.serve("b", {"user": torch.tensor([2]), "item": torch.tensor([11])})
    grads = t.row_grads("b", {"user": torch.ones(1, 5), "item": torch.ones(1, 4)})
    t.apply(grads)
    after = t.state_dict()["tables"]["user"]
    b = before["tables"]["user"]
    order = b["ids"].tolist()
    changed = [i for i in range(3) if not torch.equal(after["weights"][after["ids"].tolist().index(order[i])],
                                                      b["weights"][i])]
    assert [order[i] for i in changed] == [2]
    assert int(after["state"]["t"][after["ids"].tolist().index(2)]) == 1
    assert t.status()[0].updates == 1


def test_gradients_of_rows_count_in_the_guard() -> None:
    t = tables()
    t.serve("a", {"user": torch.tensor([1]), "item": torch.tensor([2])})
    grads = t.row_grads("a", {"user": torch.full((1, 5), 1.0), "item": torch.full((1, 4), float("nan"))})
    assert GradientGuard(None, 3).check("a", grads) is None
    t.serve("a", {"user": torch.tensor([1]), "item": torch.tensor([2])})
    grads = t.row_grads("a", {"user": torch.full((1, 5), 3.0), "item": torch.zeros(1, 4)})
    clipped = GradientGuard(1.0, 3).check("a", grads)
    assert clipped is not None
    (key, g), _ = clipped.items()
    assert isinstance(key, RowGrads) and float(g.norm()) == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize("request_, why", [
    ([1, 2], "must map table names"),
    ({"nope": torch.tensor([1])}, "no embedding table"),
    ({"user": torch.tensor([1.0])}, "1-D int64"),
    ({"user": torch.tensor([[1]])}, "1-D int64"),
    ({"user": torch.tensor([-1])}, ">= 0"),
    ({"user": torch.tensor([4, 4])}, "unique"),
])
def test_bad_row_requests_are_refused(request_, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        tables().serve("t", request_)


def test_ids_of_another_server_and_misfit_gradients_are_refused() -> None:
    ids = torch.arange(100)
    theirs = ids[owner(ids, 2) == 1][:3]
    with pytest.raises(ValueError, match="another server holds"):
        tables(0, 2).serve("t", {"user": theirs})
    t = tables()
    with pytest.raises(ValueError, match="served no rows"):
        t.row_grads("t", {"user": torch.zeros(1, 5)})
    t.serve("t", {"user": torch.tensor([1, 2])})
    with pytest.raises(ValueError, match="shape"):
        t.row_grads("t", {"user": torch.zeros(3, 5)})


def test_state_round_trips_bit_for_bit_and_prefill_creates_owned_rows() -> None:
    t = tables(0, 2, optimizer="lazy_adam")
    t.prefill(1000)
    assert all(s.rows == 1000 for s in t.status())
    ids, _ = t.tables["user"].index.items()
    assert not owner(ids, 2).any()
    state = t.state_dict()
    u = tables(0, 2, optimizer="lazy_adam")
    u.load_state_dict(state)
    again = u.state_dict()
    for name in ("user", "item"):
        a, b = state["tables"][name], again["tables"][name]
        order_a, order_b = torch.argsort(a["ids"]), torch.argsort(b["ids"])
        assert torch.equal(a["weights"][order_a], b["weights"][order_b])
    with pytest.raises(ValueError, match="not this server's"):
        tables(0, 2, dim=8).load_state_dict(state)


def test_a_sync_round_sums_the_rows_trainers_share_into_one_step() -> None:
    """Two trainers' row gradients in one sync round: an id both touched takes one lazy-Adam
    step with the average of their gradients, as a dense parameter would."""
    from psserver.server.engine.sync_updates import SyncUpdater

    t, ref = tables(optimizer="lazy_adam"), tables(optimizer="lazy_adam")
    steps = []
    updater = SyncUpdater([], lambda step, samples: steps.append(step), 2)
    updater.tables = t
    for name in ("a", "b"):
        updater.trainer_joined(name)
    ga, gb = torch.full((2, 5), 1.0), torch.full((2, 5), 3.0)
    t.serve("a", {"user": torch.tensor([1, 2])})
    t.serve("b", {"user": torch.tensor([2, 3])})
    updater.submit("a", t.row_grads("a", {"user": ga}), 8)
    assert t.status()[0].updates == 0  # the round waits for b
    updater.submit("b", t.row_grads("b", {"user": gb}), 8)
    assert steps == [1]
    ref.serve("r", {"user": torch.tensor([1, 2, 3])})
    ref.apply(ref.row_grads("r", {"user": torch.tensor([[1.0] * 5, [4.0] * 5, [3.0] * 5])}), scale=0.5)
    got, want = t.state_dict()["tables"]["user"], ref.state_dict()["tables"]["user"]
    for key in ("weights", "ids"):
        assert torch.equal(got[key][torch.argsort(got["ids"])], want[key][torch.argsort(want["ids"])])
    assert got["state"]["t"].tolist() == [1, 1, 1]
