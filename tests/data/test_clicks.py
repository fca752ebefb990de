"""The synthetic click log: deterministic, sparse in a 2^40 id space, Zipf-skewed, learnable."""

from __future__ import annotations

import torch

from psserver.data.clicks import ClickLogSpec, auc, click_logit, make_synthetic_clicks


def test_the_log_is_deterministic_sparse_skewed_and_learnable():
    spec = ClickLogSpec(fields=4, dense=4, vocab=20_000, id_space=1 << 40, seed=0)
    train, held_out = make_synthetic_clicks(spec, 20_000, 5_000)
    again, _ = make_synthetic_clicks(spec, 20_000, 5_000)
    assert all(torch.equal(a, b) for a, b in zip(train.tensors, again.tensors, strict=True))
    ids, dense, click = train.tensors
    assert ids.dtype == torch.int64 and ids.shape == (20_000, 4) and dense.shape == (20_000, 4)
    assert int(ids.min()) >= 0 and int(ids.max()) < 1 << 40 and int(ids.max()) > 1 << 36  # spread over the space
    _, counts = torch.unique(ids[:, 0], return_counts=True)
    top = counts.sort(descending=True).values
    assert int(top[: len(top) // 100].sum()) > 0.3 * 20_000  # 1 % of the ids: over 30 % of the traffic
    assert 0.15 < float(click.mean()) < 0.6
    # The hidden model separates clicks well; chance does not.
    h_ids, h_dense, h_click = held_out.tensors
    assert auc(click_logit(spec, h_ids, h_dense), h_click) >= 0.85
    assert abs(auc(torch.rand(5_000), h_click) - 0.5) < 0.05
    # Field ids differ by field and by seed.
    assert not torch.equal(ids[:, 0], ids[:, 1])
    other, _ = make_synthetic_clicks(ClickLogSpec(seed=1), 100, 10)
    assert not torch.equal(other.tensors[0], ids[:100])
