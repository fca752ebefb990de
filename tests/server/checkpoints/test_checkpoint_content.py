"""What a checkpoint's payload must hold before a server resumes from it or ``psserver export``
reads it: the optimizer state against the parameters, finite values, sane steps, sizes the file
holds, a bounded nesting. Each payload is a server's own, altered, checked in-process."""

from __future__ import annotations

import copy
from dataclasses import asdict

import pytest
import torch
from torch import nn

from psserver.checkpoint import CheckpointError, checkpoint_path, read_checkpoint, write_checkpoint
from psserver.config import OptimizerConfig
from psserver.config.optimizer import REFUSED, _classes, make_optimizer
from psserver.server.checkpoints.content import check_state
from psserver.server.checkpoints.optimizer_state import MAX_STEPS

OPTIMIZERS = [(name, {}) for name in sorted(_classes()) if name not in REFUSED] + [
    ("adam", {"args": {"amsgrad": True}}), ("sgd", {"momentum": 0.9}),
    ("rmsprop", {"momentum": 0.9, "args": {"centered": True}}),
]
IDS = [f"{name}{'-' + '-'.join(map(str, kw.values())) if kw else ''}" for name, kw in OPTIMIZERS]


@pytest.fixture(scope="module")
def server_state() -> dict:
    """What a server holding a small model (learnt from a trainer's layout) writes into a checkpoint."""
    from psserver.config import ServerConfig
    from psserver.models.layout import ModelLayout, values_of
    from psserver.server.server import ParameterServer

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    server = ParameterServer(ServerConfig(devices=["cpu"]))
    try:
        layout = ModelLayout.of(model)
        server.engine.adopt(layout, values_of(model, layout), "tiny", {})
        return server.policy.snapshot()
    finally:
        server.engine.close()


def trained(state: dict, name: str, **kw) -> dict:
    """``state`` with the optimizer state ``name`` holds after two steps over its parameters."""
    state = copy.deepcopy(state)
    config = OptimizerConfig(name=name, lr=0.01, **kw)
    module = state["shards"][0]["module"]
    params = [module[e[0]].clone().requires_grad_() for e in state["layout"]["entries"] if e[3] == "parameter"]
    optimizer = make_optimizer(params, config, fused=True)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    state["shards"][0]["optimizer"] = optimizer.state_dict()
    state["optimizer_config"] = asdict(config)
    return state


def refused(state: dict, tmp_path) -> str:
    with pytest.raises(CheckpointError) as e:
        check_state(state, tmp_path / "ckpt.pt")
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{tmp_path / 'ckpt.pt'} is not a psserver checkpoint: "), text
    return text.split("is not a psserver checkpoint: ", 1)[1]


def param_state(state: dict, index: int = 0) -> dict:
    return state["shards"][0]["optimizer"]["state"][index]


@pytest.mark.parametrize(("name", "kw"), OPTIMIZERS, ids=IDS)
def test_every_optimizers_own_state_passes_and_a_misshapen_tensor_is_refused(tmp_path, server_state, name, kw):
    """Every optimizer of torch.optim the server builds: its own state passes; each tensor it
    keeps shaped like the parameter, given shape [1] (what the fused Adam wrote past the end
    of, SIGSEGV), is refused naming the field."""
    state = trained(server_state, name, **kw)
    check_state(state, tmp_path / "ckpt.pt")
    own = state["shards"][0]["optimizer"]["state"].get(0, {})  # plain sgd keeps none
    shaped = [k for k, v in own.items() if isinstance(v, torch.Tensor) and v.dim() == 2]
    assert shaped or name == "sgd", param_state(state)
    for key in shaped:
        bad = copy.deepcopy(state)
        param_state(bad)[key] = torch.zeros(1)
        message = f"its shards.0.optimizer.state.0.{key} has shape [1], {name} keeps it "
        assert refused(bad, tmp_path).startswith(message)


def test_an_exp_avg_of_shape_1_is_refused_naming_the_field(tmp_path, server_state):
    state = trained(server_state, "adam")
    param_state(state)["exp_avg"] = torch.zeros(1)
    assert refused(state, tmp_path) == ("its shards.0.optimizer.state.0.exp_avg has shape [1], adam keeps it "
                                        "[3, 4] for parameter t0 of shape [3, 4]")
    state = trained(server_state, "adafactor")  # a reduced dimension: [3, 1], not the parameter's
    param_state(state)["row_var"] = torch.zeros(3, 4)
    assert "row_var has shape [3, 4], adafactor keeps it [3, 1]" in refused(state, tmp_path)


@pytest.mark.parametrize(("name", "kw", "key"), [
    ("adam", {}, "exp_avg_sq"), ("adam", {"args": {"amsgrad": True}}, "max_exp_avg_sq"), ("adagrad", {}, "sum"),
    ("rmsprop", {}, "square_avg"), ("adadelta", {}, "acc_delta"), ("adamax", {}, "exp_inf"),
    ("rprop", {}, "step_size"), ("adam", {}, "step"),
])
def test_a_negative_second_moment_or_step_is_refused(tmp_path, server_state, name, kw, key):
    """A negative exp_avg_sq resumed, and the square root made every step nan."""
    state = trained(server_state, name, **kw)
    value = param_state(state, 1)[key]
    value.view(-1)[0] = -1.0
    assert refused(state, tmp_path).startswith(f"its shards.0.optimizer.state.1.{key} holds negative values")


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: param_state(s)["exp_avg"].view(-1).__setitem__(3, float("nan")),
     "its shards.0.optimizer.state.0.exp_avg holds values that are not finite"),
    (lambda s: param_state(s).__setitem__("step", torch.tensor(float(MAX_STEPS) * 4)),
     f"its shards.0.optimizer.state.0.step is past {MAX_STEPS} steps"),
    (lambda s: param_state(s).__setitem__("step", 3), None),  # an older torch's number is a step too
    (lambda s: param_state(s).__setitem__("exp_avg", param_state(s)["exp_avg"].to(torch.int32)),
     "its shards.0.optimizer.state.0.exp_avg is int32, adam keeps it float32"),
    (lambda s: param_state(s).pop("exp_avg_sq"),
     "its shards.0.optimizer.state.0 (parameter t0) has no exp_avg_sq: adam keeps step, exp_avg, exp_avg_sq"),
    (lambda s: param_state(s).__setitem__("extra", torch.zeros(10**3)),
     "its shards.0.optimizer.state.0 (parameter t0) has 'extra': adam keeps"),
    (lambda s: s["shards"][0]["optimizer"]["state"].__setitem__(99, {}),
     "its shards.0.optimizer.state holds 99, which is none of its parameters' ids"),
    (lambda s: s["shards"][0]["optimizer"]["param_groups"][0].__setitem__("lr", float("nan")),
     "its shards.0.optimizer.param_groups.0.'lr' is nan, not a hyperparameter"),
    (lambda s: s["shards"][0]["optimizer"]["param_groups"][0].__setitem__("lr", -1.0),
     "its shards.0.optimizer.param_groups.0 are hyperparameters adam refuses: Invalid learning rate: -1.0"),
    (lambda s: s["shards"][0]["optimizer"]["param_groups"][0].pop("lr"),
     "its shards.0.optimizer.param_groups.0 has no 'lr', which a step of adam needs"),
    (lambda s: s["shards"][0]["optimizer"]["param_groups"][0].__setitem__("amsgrad", "yes"),
     "its shards.0.optimizer.param_groups.0 are hyperparameters adam refuses: "),
    (lambda s: s["shards"][0]["optimizer"]["param_groups"][0].__setitem__("eps", torch.zeros(10)),
     "its shards.0.optimizer.param_groups.0.'eps' is a float32 tensor, not a hyperparameter"),
    (lambda s: s["shards"][0]["optimizer"]["param_groups"][0]["params"].pop(),
     "its shards.0.optimizer.param_groups.0.params are not 4 distinct parameter ids"),
    (lambda s: s.__setitem__("optimizer_config", None),
     "its shards hold optimizer state but it has no optimizer_config"),
], ids=["nan", "step-huge", "step-number", "int-moment", "missing", "extra", "unknown-id", "lr-nan", "lr-negative",
        "lr-missing", "amsgrad-yes", "eps-tensor", "params-short", "no-config"])
def test_adams_state_is_checked_before_it_is_loaded(tmp_path, server_state, change, message):
    state = trained(server_state, "adam")
    change(state)
    if message is None:
        check_state(state, tmp_path / "ckpt.pt")
    else:
        assert refused(state, tmp_path).startswith(message)


@pytest.mark.parametrize("key", ["global_step", "samples_seen"])
def test_a_step_a_run_never_reaches_is_refused(tmp_path, server_state, key):
    """2**63 - 1 was taken, and every later step failed (int64 overflow)."""
    assert refused({**server_state, key: 2**63 - 1}, tmp_path) == (
        f"its {key} is {2**63 - 1}, past the {MAX_STEPS} a run reaches")
    check_state({**server_state, key: MAX_STEPS}, tmp_path / "ckpt.pt")


def _module(state: dict, **changes) -> dict:
    return {**state, "shards": [{**state["shards"][0], "module": {**state["shards"][0]["module"], **changes}}]}


def _layout(state: dict, key: str, shape: list) -> dict:
    layout = copy.deepcopy(state["layout"])
    next(e for e in layout["entries"] if e[0] == key)[1] = shape
    return {**state, "layout": layout}


@pytest.mark.parametrize(("craft", "message"), [
    (lambda s: _layout(_module(s, **{"2.bias": torch.zeros(1).expand(10_000_000)}), "2.bias", [10_000_000]),
     "its shards.0.module.2.bias is a view of 40000000 bytes over 4 bytes of data (an expanded tensor)"),
    (lambda s: _module(s, **{f"x{i}": s["rng"] for i in range(100)}), "its tensors are views of "),
    (lambda s: _module(s, **{"0.bias": torch.full((3,), float("inf"))}),
     "its shards.0.module.0.bias holds values that are not finite (nan or inf)"),
    (lambda s: _layout(s, "0.weight", [10**12]), "its layout has 1000000000011 elements, more than the "),
    (lambda s: _layout(s, "0.weight", [-5, 3]), "its layout is not a model layout (bad shape of '0.weight': [-5, 3])"),
    (lambda s: _layout(s, "0.weight", [True]), "its layout is not a model layout (bad shape of '0.weight': [True])"),
    (lambda s: {**s, "model_config": {**s["model_config"], "deep": _nested(5000)}},
     "its model_config.deep.0.0... is nested more than 32 deep"),
], ids=["expanded", "shared-views", "inf", "layout-huge", "layout-negative", "layout-bool", "nested"])
def test_sizes_and_nesting_are_bounded_before_anything_is_allocated(tmp_path, server_state, craft, message):
    """A 146 KB file holding ``torch.zeros(1).expand(500_000_000)`` made ``psserver export``
    peak at 6.2 GB; a layout of 10^12 elements was allocated by the resuming server; a payload
    nested 5,000 deep was a RecursionError."""
    assert refused(craft(server_state), tmp_path).startswith(message)


@pytest.mark.timeout(30)
def test_shared_lists_are_walked_once(tmp_path, server_state):
    """A pickle may put one list in another twice: 30 such levels are 2**30 paths (a walk of
    each path never ended), and are 30 lists."""
    check_state({**server_state, "version": _shared(30)}, tmp_path / "ckpt.pt")


@pytest.mark.parametrize(("table", "message"), [
    ({"state": {"sum": torch.tensor([-1.0, 0.0])}},
     "its tables.tables.t.state.sum holds negative values, which sum never has"),
    ({"state": {"v": torch.tensor([[0.0], [-2.0]])}}, "its tables.tables.t.state.v holds negative values"),
    ({"step": 2**63 - 1}, f"its table 't' is at step {2**63 - 1}, not a count a run reaches"),
    ({"weights": torch.tensor([[0.0, float("nan"), 0.0]] * 2)},
     "its tables.tables.t.weights holds values that are not finite"),
], ids=["adagrad-sum", "adam-v", "step", "nan-row"])
def test_an_embedding_tables_state_is_checked(tmp_path, server_state, table, message):
    rows = {"ids": torch.arange(2), "weights": torch.zeros(2, 3), "state": {}, "step": 3, **table}
    assert refused({**server_state, "tables": {"dim": 3, "tables": {"t": rows}}}, tmp_path).startswith(message)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _shared(depth: int) -> list:
    """2**depth paths through ``depth`` lists (each holds the next one twice)."""
    value: list = []
    for _ in range(depth):
        value = [value, value]
    return value


def test_a_servers_own_checkpoint_with_adam_resumes(tmp_path, server_state):
    """The checks refuse nothing a server writes: its snapshot after steps, through the file."""
    path = checkpoint_path(tmp_path, 7)
    write_checkpoint(path, trained(server_state, "adam"))
    check_state(read_checkpoint(path), path)


def test_a_buffer_may_hold_minus_inf_but_not_nan_and_a_parameter_neither(tmp_path):
    """A causal mask of -inf is a constant the model's own checkpoint holds: resumed and exported;
    NaN in a buffer, or inf in a parameter, is refused."""
    from psserver.models.layout import ModelLayout
    from tests.server.engine.test_held_model import Masked

    model = Masked()
    state = {"global_step": 1, "samples_seen": 4, "shards": [{"module": model.state_dict(), "optimizer": None}],
             "layout": ModelLayout.of(model).to_dict()}
    check_state(state, tmp_path / "c.pt")
    state["shards"][0]["module"]["mask"] = torch.full((3, 3), float("nan"))
    with pytest.raises(CheckpointError, match=r"buffer shards\.0\.module\.mask holds nan"):
        check_state(state, tmp_path / "c.pt")
    state["shards"][0]["module"]["mask"] = model.mask
    state["shards"][0]["module"]["fc.bias"] = torch.full((3,), float("-inf"))
    with pytest.raises(CheckpointError, match=r"fc\.bias holds values that are not finite"):
        check_state(state, tmp_path / "c.pt")
