"""The optimizer's configuration (``psserver.config.optimizer``): any ``torch.optim`` optimizer
by name, its own arguments checked before anything trains, and the ones the server cannot run
refused with the reason."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from psserver.config.optimizer import OptimizerConfig, make_optimizer
from tests.procs import cli


@pytest.mark.parametrize("name", ["sgd", "NAdam", "radam", "adamax", "adadelta", "asgd", "rprop", "adafactor"])
def test_any_torch_optimizer_is_taken_by_name_in_any_case(name):
    config = OptimizerConfig(name=name, lr=0.01)
    assert config.name == name.lower()
    opt = make_optimizer([torch.zeros(2, requires_grad=True)], config)
    assert type(opt).__name__.lower() == name.lower()


def test_its_own_arguments_reach_the_optimizer_and_survive_a_round_trip():
    config = OptimizerConfig(name="adam", lr=0.01, weight_decay=0.1, args={"betas": [0.8, 0.95], "eps": 1e-6,
                                                                            "amsgrad": True})
    group = make_optimizer([torch.zeros(2, requires_grad=True)], config, fused=True).param_groups[0]
    assert (list(group["betas"]), group["eps"], group["amsgrad"], group["weight_decay"], group["fused"]) == \
        ([0.8, 0.95], 1e-6, True, 0.1, True)
    assert OptimizerConfig(**asdict(config)) == config  # as a join request and a checkpoint carry it
    assert "betas=[0.8, 0.95]" in config.describe()
    nesterov = OptimizerConfig("sgd", 0.1, 0.9, args={"nesterov": True})
    sgd = make_optimizer([torch.zeros(2, requires_grad=True)], nesterov)
    assert sgd.param_groups[0]["nesterov"] and sgd.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize(("kw", "message"), [
    ({"name": "lbfgs"}, "re-evaluates the loss"),
    ({"name": "sparseadam"}, "sparse gradients only"),
    ({"name": "adamm"}, "unknown optimizer 'adamm'; known: adadelta"),
    ({"name": "adam", "momentum": 0.9}, "--momentum: adam takes none"),
    ({"name": "rprop", "weight_decay": 0.1}, "--weight-decay: rprop takes none"),
    ({"args": {"lr": 0.1}}, "may not set 'lr': use --lr"),
    ({"args": {"fused": False}}, "may not set 'fused': the server decides it"),
    ({"args": {"nesterov": True}}, "adam takes no argument 'nesterov'; it takes betas"),
    ({"args": {"betas": [0.9, 1.5]}}, "adam refuses them: Invalid beta parameter"),
    ({"args": {"betas": "fast"}}, "adam's betas is a list of 2, got 'fast'"),
    ({"args": {"amsgrad": "yes"}}, "adam's amsgrad is true or false, got 'yes'"),
    ({"name": "rmsprop", "args": {"centered": "no"}}, "rmsprop's centered is true or false, got 'no'"),
    ({"args": {"eps": "1e-8"}}, "adam's eps is a number, got '1e-8'"),
    ({"args": [1]}, "must be a JSON object"),
    ({"lr": float("nan")}, "learning rate must be a finite number"),
    ({"lr": 0}, "learning rate must be positive"),
])
def test_what_the_server_cannot_run_is_refused_with_the_reason(kw, message):
    with pytest.raises(ValueError) as e:
        OptimizerConfig(**kw)
    assert message in str(e.value)


def test_the_cli_takes_optimizer_args_and_refuses_bad_ones_in_one_line():
    r = cli(["serve", "--port", "1", "--no-control", "--optimizer", "adam", "--optimizer-args", '{"betas": [0.9, 2]}'])
    assert r.returncode == 2 and "adam refuses them: Invalid beta parameter at index 1: 2" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli(["serve", "--port", "1", "--no-control", "--optimizer-args", '{"amsgrad": "yes"}'])
    assert r.returncode == 2 and r.stderr.strip().endswith("adam's amsgrad is true or false, got 'yes'"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli(["serve", "--port", "1", "--no-control", "--optimizer", "adam", "--optimizer-args", "{not json"])
    assert r.returncode == 2 and "--optimizer-args is not JSON" in r.stderr, r.stderr


def test_a_users_torch_optimizer_becomes_the_configuration_that_builds_it_again():
    # Horovod's users hand their optimizer over: its class and hyperparameters travel
    model = torch.nn.Linear(3, 2)
    sgd = OptimizerConfig.from_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True))
    assert sgd == OptimizerConfig("sgd", 0.1, 0.9, 0.0, {"nesterov": True})
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    config = OptimizerConfig.from_optimizer(adamw)
    assert config == OptimizerConfig("adamw", 3e-4, 0.0, 0.1, {"betas": [0.9, 0.95]})
    rebuilt = make_optimizer(list(model.parameters()), config).param_groups[0]
    assert all(rebuilt[k] == v for k, v in adamw.param_groups[0].items() if k != "params")
    assert OptimizerConfig.from_optimizer(torch.optim.Adam(model.parameters())) == OptimizerConfig()
    with pytest.raises(ValueError, match="2 parameter groups; the server's optimizer is one over the whole model"):
        OptimizerConfig.from_optimizer(torch.optim.Adam([{"params": [model.weight]},
                                                         {"params": [model.bias], "weight_decay": 0.0}]))

    class Mine(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match=r"torch\.optim only"):
        OptimizerConfig.from_optimizer(Mine(model.parameters(), lr=0.1))
