"""The recommendation models' dense parts (``mf``, ``dlrm_tiny``): the rows come from servers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psserver.models import ModelSpec, TableDef, build_model, check_spec, get_model_spec
from psserver.models.recsys import MatrixFactorization, TinyDLRM


def rows_for(name: str, batch: int, dim: int, *, grad: bool = False) -> list[torch.Tensor]:
    spec = get_model_spec(name)
    return [torch.randn(batch, dim + t.extra_dims, requires_grad=grad) for t in spec.tables]


def test_registry_fields():
    mf, dlrm = get_model_spec("mf"), get_model_spec("dlrm_tiny")
    assert mf.sparse and dlrm.sparse and not get_model_spec("mlp").sparse
    assert mf.tables == (TableDef("user", 0, 1), TableDef("item", 1, 1))
    assert (mf.embedding_dim, mf.dense_features, mf.loss, mf.metric) == (32, 0, "mse", "rmse")
    assert (mf.input_shape, mf.num_classes, mf.input_dtype) == ((2,), 1, torch.long)
    assert "MovieLens" in mf.description
    assert [(t.name, t.column, t.extra_dims) for t in dlrm.tables] == [(f"c{i}", i, 0) for i in range(4)]
    assert (dlrm.embedding_dim, dlrm.dense_features, dlrm.loss, dlrm.metric) == (16, 4, "bce", "auc")
    assert (dlrm.input_shape, dlrm.num_classes, dlrm.input_dtype) == ((4,), 1, torch.long)


@pytest.mark.parametrize("name", ["mf", "dlrm_tiny"])
def test_build_with_an_embedding_dim_and_run(name):
    spec = get_model_spec(name)
    for dim in (None, 8):
        model = build_model(name, seed=1, embedding_dim=dim)
        width = dim or spec.embedding_dim
        assert list(model.parameters()) and list(model.children())
        out = model(rows_for(name, 5, width), torch.randn(5, spec.dense_features))
        assert out.shape == (5,) and out.dtype == torch.float32
        assert model.penalty(rows_for(name, 5, width)).shape == ()
    a, b = build_model(name, seed=3), build_model(name, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_mf_prediction_is_mean_plus_biases_plus_dot():
    model = build_model("mf", embedding_dim=3)
    assert isinstance(model, MatrixFactorization) and float(model.mu.detach()) == 3.5
    user = torch.tensor([[0.1, 0.2, 0.3, 0.5], [1.0, 0.0, 0.0, -0.25]])
    item = torch.tensor([[1.0, -1.0, 2.0, 0.25], [0.5, 9.0, 9.0, 0.0]])
    expected = torch.tensor([3.5 + 0.5 + 0.25 + (0.1 - 0.2 + 0.6), 3.5 - 0.25 + 0.0 + 0.5])
    torch.testing.assert_close(model([user, item], torch.zeros(2, 0)), expected)
    # Evaluation clamps to the rating range; training does not (its gradient would vanish).
    far = [torch.tensor([[3.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, -9.0]]), torch.tensor([[3.0, 0, 0, 1], [0, 0, 0, 0]])]
    torch.testing.assert_close(model(far, torch.zeros(2, 0)), torch.tensor([14.5, -5.5]))
    torch.testing.assert_close(model.eval()(far, torch.zeros(2, 0)), torch.tensor([5.0, 1.0]))
    assert MatrixFactorization(3, rating_range=(0.0, 10.0)).eval()(far, torch.zeros(2, 0))[0] == 10.0


def test_mf_penalty_is_l2_of_the_rows_per_sample():
    model = build_model("mf", embedding_dim=2)
    user, item = torch.ones(4, 3), torch.full((4, 3), 2.0)
    assert float(model.penalty([user, item])) == pytest.approx(0.05 * (3 + 12))
    assert float(MatrixFactorization(2, l2=0.0).penalty([user, item])) == 0.0


def test_gradients_reach_the_rows_and_the_parameters():
    for name in ("mf", "dlrm_tiny"):
        spec = get_model_spec(name)
        model = build_model(name, embedding_dim=4)
        rows = rows_for(name, 6, 4, grad=True)
        loss = model(rows, torch.randn(6, spec.dense_features)).pow(2).mean() + model.penalty(rows)
        loss.backward()
        assert all(r.grad is not None and r.grad.abs().sum() > 0 for r in rows), name
        assert all(p.grad is not None for p in model.parameters()), name


def test_dlrm_interacts_the_bottom_output_with_every_table():
    model = build_model("dlrm_tiny", embedding_dim=8)
    assert isinstance(model, TinyDLRM) and model.pairs == 10
    assert model.top[0].in_features == 8 + 10 and model.bottom[0].in_features == 4
    assert float(model.penalty(rows_for("dlrm_tiny", 3, 8))) == 0.0
    # Each table's rows change the logit (through the dot products, not only the top MLP's bias).
    rows, dense = rows_for("dlrm_tiny", 3, 8), torch.randn(3, 4)
    base = model(rows, dense)
    for i in range(4):
        changed = [r.clone() for r in rows]
        changed[i] = changed[i] + 1.0
        assert not torch.allclose(model(changed, dense), base), i
    # Per sample: a batch of one gives the same logit as its row in a batch.
    torch.testing.assert_close(model([r[1:2] for r in rows], dense[1:2]), base[1:2])


def test_rows_of_the_wrong_width_are_one_readable_error():
    with pytest.raises(ValueError, match=r"mf takes 2 tables of rows \[batch, \[9, 9\]\]"):
        build_model("mf", embedding_dim=8)([torch.zeros(2, 8), torch.zeros(2, 8)], torch.zeros(2, 0))
    with pytest.raises(ValueError, match="dlrm_tiny takes 4 tables"):
        build_model("dlrm_tiny", embedding_dim=8)([torch.zeros(2, 8)] * 3, torch.zeros(2, 4))


def test_spec_check_refuses_bad_loss_metric_and_tables():
    def spec(**kw) -> ModelSpec:
        fields = {"name": "test_recsys_bad", "build": lambda dim=0: nn.Linear(1, 1), "input_shape": (2,),
                  "num_classes": 1, "description": "", "input_dtype": torch.long, "embedding_dim": 4,
                  "tables": (TableDef("a", 0),)}
        return ModelSpec(**(fields | kw))

    for kw, match in [({"loss": "hinge"}, "unknown loss 'hinge'"), ({"metric": "f1"}, "unknown metric 'f1'"),
                      ({"tables": (TableDef("a", 2),)}, "table columns"),
                      ({"tables": (TableDef("a", 0), TableDef("a", 1))}, "names must be distinct"),
                      ({"input_dtype": torch.float32}, "integer ids"), ({"embedding_dim": 0}, "embedding_dim")]:
        with pytest.raises(ValueError, match=match):
            check_spec(spec(**kw))
