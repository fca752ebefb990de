"""Held-out metrics by name (``psserver.utils.eval_metrics``) and training losses by name."""

from __future__ import annotations

import math

import pytest
import torch

from psserver.models.losses import LOSSES, get_loss
from psserver.utils.eval_metrics import METRICS, accuracy, auc, get_metric, rmse


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
    assert set(LOSSES) == {"cross_entropy", "mse", "bce", "next_token_cross_entropy"}
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


METRIC_SOURCE = '''
    import torch


    def top2(outputs, targets):
        return float((outputs.topk(2, dim=1).indices == targets[:, None]).any(1).double().mean())


    def broken(outputs, targets):
        raise ZeroDivisionError("division by zero")


    def words(outputs, targets):
        return "high"


    class Metric:
        pass
'''


@pytest.fixture
def usermetric(tmp_path, monkeypatch):
    from tests.userproject import write_package

    monkeypatch.syspath_prepend(str(write_package(tmp_path, "usermetric", {"m": METRIC_SOURCE})))
    return "usermetric.m"


def test_metrics_by_name_loss_and_reference(usermetric):
    from psserver.utils.eval_metrics import resolve_metric

    out, y = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]]), torch.tensor([1, 0])
    assert resolve_metric(None, "rmse") == ("rmse", rmse)
    assert resolve_metric("accuracy", "rmse") == ("accuracy", accuracy)
    name, fn = resolve_metric("loss", "accuracy", get_loss("cross_entropy"))
    assert name == "loss" and fn(out, y) == pytest.approx(float(torch.nn.functional.cross_entropy(out, y)))
    name, fn = resolve_metric(f"{usermetric}:top2", "accuracy")
    assert name == "top2" and fn(out, y) == 0.5


@pytest.mark.parametrize(("reference", "match"), [
    ("f1", r"unknown metric 'f1'; known: accuracy, auc, rmse, loss \(or MODULE:ATTR"),
    ("nowhere:top2", r"--metric nowhere:top2: module 'nowhere' is not importable"),
    ("usermetric.m:Metric", r"--metric usermetric.m:Metric is a class, not a callable \(outputs, targets\) -> float"),
])
def test_bad_metrics_are_one_line_at_configuration(usermetric, reference, match):
    from psserver.config import TrainerConfig
    from psserver.errors import UserCodeError

    with pytest.raises(UserCodeError, match=match):
        TrainerConfig(metric=reference)


def test_a_failing_user_metric_is_one_line(usermetric):
    from psserver.errors import UserCodeError
    from psserver.utils.eval_metrics import resolve_metric

    out, y = torch.zeros(2, 3), torch.tensor([1, 0])
    with pytest.raises(UserCodeError, match=r"--metric usermetric.m:broken raised ZeroDivisionError: division by zero "
                                           r"\(at .*m.py:\d+\)"):
        resolve_metric("usermetric.m:broken", "accuracy")[1](out, y)
    with pytest.raises(UserCodeError, match=r"--metric usermetric.m:words returned a str, not a number"):
        resolve_metric("usermetric.m:words", "accuracy")[1](out, y)
