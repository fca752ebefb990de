"""Held-out metrics by name (``psserver.utils.metrics``) and training losses by name."""

from __future__ import annotations

import math

import pytest
import torch

from psserver.models.losses import LOSSES, get_loss
from psserver.utils.metrics import METRICS, accuracy, auc, get_metric, rmse


def test_auc_is_the_mann_whitney_statistic_with_ties_counted_half():
    labels = torch.tensor([0, 0, 1, 1, 0, 1])
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.4, 0.4])
    pairs = [(p, q) for p in range(6) if labels[p] for q in range(6) if not labels[q]]
    brute = sum(1.0 if scores[p] > scores[q] else 0.5 if scores[p] == scores[q] else 0.0 for p, q in pairs)
    assert auc(scores, labels) == pytest.approx(brute / len(pairs))
    assert auc(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0])) == 1.0
    assert auc(torch.tensor([2.0, 1.0]), torch.tensor([0.0, 1.0])) == 0.0
    with pytest.raises(ValueError, match="both positive and negative"):
        auc(torch.tensor([1.0, 2.0]), torch.tensor([1, 1]))


def test_auc_is_still_importable_from_the_click_log():
    from psserver.data.clicks import auc as clicks_auc

    assert clicks_auc is auc


def test_rmse():
    assert rmse(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0])) == 0.0
    assert rmse(torch.tensor([[1.0], [3.0]]), torch.tensor([2.0, 2.0])) == pytest.approx(1.0)  # [n, 1] outputs
    assert rmse(torch.tensor([0.0, 0.0]), torch.tensor([3, 4])) == pytest.approx(math.sqrt(12.5))
    with pytest.raises(ValueError, match="one output per target"):
        rmse(torch.zeros(3), torch.zeros(2))
    assert math.isnan(rmse(torch.zeros(0), torch.zeros(0)))


def test_accuracy_takes_the_argmax_over_classes():
    outputs = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    assert accuracy(outputs, torch.tensor([1, 0, 0, 0])) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="accuracy needs"):
        accuracy(torch.zeros(4), torch.zeros(4, dtype=torch.long))
    assert math.isnan(accuracy(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)))


def test_metrics_and_losses_by_name():
    assert METRICS == {"accuracy": accuracy, "rmse": rmse, "auc": auc}
    assert get_metric("rmse") is rmse
    with pytest.raises(ValueError, match=r"unknown metric 'f1'; known: accuracy, auc, rmse"):
        get_metric("f1")
    assert set(LOSSES) == {"cross_entropy", "mse", "bce"}
    with pytest.raises(ValueError, match=r"unknown loss 'hinge'"):
        get_loss("hinge")


def test_losses_take_float_targets_and_any_output_dtype():
    out = torch.tensor([0.0, 2.0], dtype=torch.bfloat16, requires_grad=True)
    mse = get_loss("mse")(out, torch.tensor([1, 2]))
    assert mse.dtype == torch.float32 and float(mse.detach()) == pytest.approx(0.5)
    mse.backward()
    assert out.grad is not None
    bce = get_loss("bce")(torch.zeros(4, 1), torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert float(bce) == pytest.approx(math.log(2))
    ce = get_loss("cross_entropy")(torch.tensor([[10.0, -10.0]]), torch.tensor([0]))
    assert float(ce) < 1e-6
