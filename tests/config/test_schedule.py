"""``--lr-schedule``, ``--lr-schedule-args``, ``--warmup-steps``: bad input is one line and exit
code 2, before the server starts."""

from __future__ import annotations

import pytest

from psserver.cli import main
from psserver.config import LRScheduleConfig, ServerConfig
from psserver.config.schedule import REFUSED, scheduler_names
from tests.procs import cli, free_port

SERVE = ["serve", "--no-control", "--model", "mlp", "--devices", "cpu"]


def test_the_names_are_torchs_schedulers_but_those_the_server_cannot_step():
    names = scheduler_names()
    assert {"CosineAnnealingLR", "StepLR", "LinearLR", "ExponentialLR", "OneCycleLR", "CyclicLR",
            "CosineAnnealingWarmRestarts", "PolynomialLR", "MultiStepLR", "ConstantLR"} <= set(names)
    assert not set(names) & set(REFUSED) and "LRScheduler" not in names and "_LRScheduler" not in names


def test_a_valid_schedule_and_what_it_says():
    assert not LRScheduleConfig().enabled and LRScheduleConfig().describe() == ""
    assert ServerConfig(model="mlp").lr_schedule == LRScheduleConfig()
    c = LRScheduleConfig(" CosineAnnealingLR", {"T_max": 200}, 50)
    assert c.enabled and c.name == "CosineAnnealingLR"
    assert c.describe() == "CosineAnnealingLR(T_max=200) after a linear warm-up of 50 steps"
    assert LRScheduleConfig(warmup_steps=10).describe() == "linear warm-up over 10 steps, then constant"


@pytest.mark.parametrize("argv,message", [
    (["--lr-schedule", "CosineAnnealing"],
     "--lr-schedule 'CosineAnnealing' is not a torch.optim.lr_scheduler class the server can step; known: "
     "ConstantLR, CosineAnnealingLR, CosineAnnealingWarmRestarts, CyclicLR, ExponentialLR, LinearLR, MultiStepLR, "
     "OneCycleLR, PolynomialLR, StepLR (or MODULE:ATTR)"),
    (["--lr-schedule", "ReduceLROnPlateau"],
     "--lr-schedule ReduceLROnPlateau is not supported: it steps on a metric (a validation loss) that the server "
     "does not have"),
    (["--lr-schedule", "SequentialLR"],
     "--lr-schedule SequentialLR is not supported: it takes other schedulers as arguments: build it in a function "
     "(optimizer, **args) -> scheduler of yours and give --lr-schedule MODULE:ATTR"),
    (["--lr-schedule", "LambdaLR", "--lr-schedule-args", '{"lr_lambda": 1}'],
     "--lr-schedule LambdaLR is not supported: it takes functions as arguments: build it in a function "),
    (["--lr-schedule", "StepLR", "--lr-schedule-args", '{"step_size": 10'],
     "--lr-schedule-args is not JSON (Expecting ',' delimiter at character 16)"),
    (["--lr-schedule", "StepLR", "--lr-schedule-args", "[10]"],
     "--lr-schedule-args must be a JSON object of keyword arguments"),
    (["--lr-schedule", "CosineAnnealingLR", "--lr-schedule-args", '{"T_max": 10, "eta_mn": 0.0}'],
     "--lr-schedule CosineAnnealingLR does not accept these arguments: got an unexpected keyword argument 'eta_mn'"),
    (["--lr-schedule", "StepLR", "--lr-schedule-args", '{"optimizer": 1, "step_size": 3}'],
     "--lr-schedule StepLR does not accept these arguments: multiple values for argument 'optimizer'"),
    (["--lr-schedule", "StepLR"],
     "--lr-schedule StepLR does not accept these arguments: missing a required argument: 'step_size'"),
    (["--lr-schedule", "StepLR", "--lr-schedule-args", '{"step_size": 3, "gamma": NaN}'],
     "--lr-schedule-args: NaN is not a value an argument may take"),
    (["--lr-schedule", "StepLR", "--lr-schedule-args", '{"step_size": 3, "gamma": 1e999}'],
     "--lr-schedule-args: a number out of range (infinity) is not a value an argument may take"),
    (["--lr-schedule", "StepLR", "--lr-schedule-args", '{"step_size": 5, "gamma": "x"}'],
     "--lr-schedule StepLR: gamma is a number, got 'x'"),  # it failed only at step 5
    (["--lr-schedule", "CosineAnnealingLR", "--lr-schedule-args", '{"T_max": 0}'],
     "--lr-schedule CosineAnnealingLR {'T_max': 0}: its first step failed: ZeroDivisionError"),
    (["--warmup-steps", "-5"], "--warmup-steps must be an integer >= 0, got -5"),
    (["--lr-schedule-args", '{"T_max": 5}'], "--lr-schedule-args needs --lr-schedule (the scheduler they are for)"),
    (["--lr-schedule", "nosuchpkg.sched:Cosine"],
     "--lr-schedule nosuchpkg.sched:Cosine: module 'nosuchpkg.sched' is not importable (no module named 'nosuchpkg'"),
    (["--lr-schedule", "torch.optim.lr_scheduler:NoSuch"],
     "--lr-schedule torch.optim.lr_scheduler:NoSuch: 'torch.optim.lr_scheduler' has no attribute 'NoSuch'"),
], ids=["unknown-name", "plateau", "sequential", "lambda", "bad-json", "not-an-object", "unknown-arg",
        "optimizer-arg", "missing-arg", "nan", "inf", "string-gamma", "zero-t-max", "negative-warmup",
        "args-without-schedule", "unimportable", "no-attribute"])
def test_bad_schedules_are_one_line_and_exit_2(capsys, argv, message):
    assert main([*SERVE, "--port", str(free_port()), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("psserver serve: error: ") and message in err[0], err[0]


def test_a_warmup_that_is_not_a_number_is_argparses_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main([*SERVE, "--warmup-steps", "ten"])
    assert e.value.code == 2
    assert "argument --warmup-steps: invalid int value: 'ten'" in capsys.readouterr().err


def test_arguments_the_class_refuses_fail_at_start_in_one_line():
    """OneCycleLR takes the arguments' names but not their combination: the server tries the
    schedule before it serves, and stops with one line."""
    r = cli([*SERVE, "--port", str(free_port()), "--lr-schedule", "OneCycleLR", "--lr-schedule-args",
             '{"max_lr": 0.1}'])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "psserver serve: error: --lr-schedule OneCycleLR raised ValueError: You must define either total_steps OR "
        "(epochs AND steps_per_epoch) (at "), r.stderr
