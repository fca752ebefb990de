"""``--loss``: a name, or ``MODULE:ATTR`` (a callable or an nn.Module class); bad ones in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psserver.config import TrainerConfig
from psserver.errors import UserCodeError
from psserver.models.losses import LOSSES, loss_name, resolve_loss
from tests.userproject import write_package

SOURCE = '''
    import torch
    from torch import nn


    def l1(output, target):
        return (output - target).abs().mean()


    class Smooth(nn.Module):
        def forward(self, output, target):
            return nn.functional.smooth_l1_loss(output, target)


    class NeedsArgs(nn.Module):
        def __init__(self, weight):
            super().__init__()


    class NotAModule:
        pass


    THRESHOLD = 0.5
'''


@pytest.fixture
def userloss(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(write_package(tmp_path, "userloss", {"losses": SOURCE})))
    return "userloss.losses"


def test_names_and_the_default():
    assert resolve_loss(None) is LOSSES["cross_entropy"]
    assert resolve_loss(None, "mse") is LOSSES["mse"]
    assert resolve_loss("bce", "mse") is LOSSES["bce"]
    assert resolve_loss("torch.nn.functional:cross_entropy").__wrapped__ is torch.nn.functional.cross_entropy
    assert loss_name("userloss.losses:l1") == "l1" and loss_name(None, "mse") == "mse"


def test_references(userloss):
    out, target = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0])
    assert float(resolve_loss(f"{userloss}:l1")(out, target)) == 1.5
    smooth = resolve_loss(f"{userloss}:Smooth")
    assert isinstance(smooth, nn.Module) and float(smooth(out, target)) == pytest.approx(1.0)
    assert isinstance(resolve_loss("torch.nn:CrossEntropyLoss"), nn.CrossEntropyLoss)


@pytest.mark.parametrize(("reference", "match"), [
    ("hinge", r"unknown loss 'hinge'; known: bce, cross_entropy, mse, next_token_cross_entropy \(or MODULE:ATTR"),
    ("nowhere:l1", r"--loss nowhere:l1: module 'nowhere' is not importable"),
    ("userloss.losses:l2", r"'userloss.losses' has no attribute 'l2'"),
    ("userloss.losses:NeedsArgs", r"--loss userloss.losses:NeedsArgs does not accept these arguments"),
    ("userloss.losses:NotAModule", r"is the class NotAModule, not an nn.Module class"),
    ("userloss.losses:THRESHOLD", r"is a float, not a callable \(output, target\) -> scalar or an nn.Module class"),
])
def test_bad_losses_are_one_line_at_configuration(userloss, reference, match):
    with pytest.raises(UserCodeError, match=match) as e:
        TrainerConfig(loss=reference)
    assert "\n" not in str(e.value)


def test_next_token_loss_is_the_mean_over_every_position_of_every_sample():
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 256), torch.randint(0, 256, (3, 5))
    by_hand = -torch.stack([logits[i, t].log_softmax(0)[targets[i, t]] for i in range(3) for t in range(5)]).mean()
    assert torch.allclose(LOSSES["next_token_cross_entropy"](logits, targets), by_hand, atol=1e-6)
