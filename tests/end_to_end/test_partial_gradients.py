"""Parameters a step has no gradient for (frozen, or unused by that step) are left out of the
server's update, as a torch optimizer skips a None ``.grad``: with weight decay and Adam's
momentum they would otherwise move. Through the library's ``ps.step()`` the run equals a local
loop; through ``psserver train``'s own step a frozen layer stays as it was."""

from __future__ import annotations

import json

import pytest
import torch

from tests.end_to_end import partial_model as pm

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
SERVER = ["--update", "sync", "--sync-trainers", "1", "--optimizer", "adamw", "--lr", str(pm.LR),
          "--weight-decay", str(pm.DECAY)]
ENTRY = "tests.end_to_end.partial_model"


def _entry(procs, port: int, name: str, out) -> int:
    t = procs.trainer(port, 0, "--num-trainers", "1", "--entry", f"{ENTRY}:{name}",
                      "--entry-args", json.dumps({"out": str(out)}))
    assert t.wait(120) == 0, t.tail()
    return 0


@pytest.mark.timeout(240)
def test_through_ps_step_frozen_and_unused_parameters_move_as_in_a_local_loop(procs, port, tmp_path):
    procs.server(port, *SERVER)
    _entry(procs, port, "through_step", tmp_path / "state.pt")
    state, reference = torch.load(tmp_path / "state.pt"), pm.local()
    assert torch.equal(state["frozen.weight"], pm.PartlyTrained().frozen.weight.detach())
    assert max(float((state[k] - reference[k]).abs().max()) for k in reference) < 1e-6


@pytest.mark.timeout(240)
def test_through_psserver_train_a_frozen_layer_stays_as_it_was(procs, port, tmp_path):
    procs.server(port, *SERVER)
    t = procs.trainer(port, 0, "--num-trainers", "1", "--model", f"{ENTRY}:PartlyTrained",
                      "--dataset", f"{ENTRY}:splits", "--batch-size", str(pm.BATCH), "--epochs", "1")
    assert t.wait(120) == 0, t.tail()
    _entry(procs, port, "read_back", tmp_path / "state.pt")
    state, initial = torch.load(tmp_path / "state.pt"), pm.PartlyTrained().state_dict()
    assert torch.equal(state["frozen.weight"], initial["frozen.weight"])
    assert torch.equal(state["frozen.bias"], initial["frozen.bias"])
    assert not torch.equal(state["body.weight"], initial["body.weight"])  # it trained
