"""``serve --update diloco`` and ``train --local-steps``: the outer optimizer's defaults, and bad
combinations refused in one line (exit 2) before anything starts."""

from __future__ import annotations

import argparse

import pytest

from psserver.cli.serve import ServeCommand, server_config_from_args
from psserver.config import OptimizerConfig, ServerConfig, TrainerConfig
from tests.procs import cli


def test_the_outer_optimizer_defaults_to_nesterov_sgd_and_async_to_its_delayed_form():
    sync = ServerConfig(update="diloco", sync_trainers=4)
    assert sync.optimizer == OptimizerConfig(name="sgd", lr=0.7, momentum=0.9, args={"nesterov": True})
    assert sync.updater_mode == "sync" and sync.rounds
    run = ServerConfig(update="diloco", outer="async", sync_trainers=4)
    assert run.optimizer == OptimizerConfig(name="delayed_nesterov", lr=0.7, momentum=0.9, args={"period": 4})
    assert run.updater_mode == "async" and not run.rounds
    assert ServerConfig(update="diloco", optimizer=OptimizerConfig(name="adam")).optimizer.name == "adam"


def test_local_steps_ask_for_the_diloco_protocol():
    config = TrainerConfig(local_steps=5, inner_optimizer="SGD", inner_lr=0.1)
    assert (config.step, config.compute) == ("diloco", "trainer")
    assert config.inner_optimizer_config == OptimizerConfig(name="sgd", lr=0.1)
    paper = TrainerConfig(local_steps=500, inner_lr=4e-4, inner_weight_decay=0.1,
                          inner_optimizer_args={"betas": [0.9, 0.95]})
    assert paper.inner_optimizer_config == OptimizerConfig(name="adamw", lr=4e-4, weight_decay=0.1,
                                                           args={"betas": [0.9, 0.95]})


@pytest.mark.parametrize(("argv", "line"), [
    (["serve", "--update", "diloco", "--lr", "0.5", "--momentum", "0.5", "--outer", "bad"], "invalid choice: 'bad'"),
    (["serve", "--dynamic-local-steps"], "--dynamic-local-steps is for --update diloco --outer async"),
    (["serve", "--update", "diloco", "--dynamic-local-steps"], "--dynamic-local-steps needs --outer async"),
    (["serve", "--update", "diloco", "--model", "mlp", "--compute", "server"], "trainers take the local steps"),
    (["serve", "--update", "diloco", "--model", "mf"], "keeps embedding tables"),
    (["train", "--local-steps", "0"], "--local-steps must be an integer >= 1"),
    (["train", "--local-steps", "5", "--step", "pushpull"], "--local-steps is for --step diloco"),
    (["train", "--inner-optimizer", "nope"], "--inner-optimizer: unknown optimizer 'nope'"),
    (["train", "--inner-lr", "0"], "--inner-lr must be a positive number"),
    (["train", "--compress", "int8", "--step", "pushpull"], "--compress int8 is for --step diloco"),
    (["train", "--compress", "int2"], "invalid choice: 'int2'"),
    (["train", "--inner-weight-decay", "-1"], "--inner-weight-decay must be a number >= 0"),
    (["train", "--fragments", "0"], "--fragments must be an integer >= 1"),
    (["train", "--fragments", "2", "--step", "pushpull"], "--fragments is for --step diloco"),
    (["train", "--fragment-overlap", "1"], "--fragment-overlap and --fragment-mix are for --fragments 2 or more"),
    (["train", "--fragments", "2", "--fragment-mix", "1"], "--fragment-mix must be a number in [0, 1)"),
    (["train", "--inner-optimizer-args", '{"nope": 1}'], "--inner-optimizer-args: adamw takes no argument 'nope'"),
])
def test_bad_combinations_are_one_line_exit_2(argv, line):
    done = cli(argv)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert line in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_serve_takes_the_outer_lr_alone_over_the_defaults():
    parser = argparse.ArgumentParser()
    ServeCommand().add_arguments(parser)
    args = parser.parse_args(["--update", "diloco", "--lr", "0.5"])
    config = server_config_from_args(args)
    assert config.optimizer == OptimizerConfig(name="sgd", lr=0.5, momentum=0.9, args={"nesterov": True})
