"""``psserver train --entry`` and ``psserver.connect``: bad input is one line and exit 2 (or a
``UsageError``), found before anything is sent."""

from __future__ import annotations

import pytest

import psserver
from psserver.cli import main
from tests.procs import free_port

SERVER = ["--server", "127.0.0.1:1", "--connect-timeout", "1"]


@pytest.mark.parametrize("argv,says", [
    (["--entry", "no_such_module:train"], "module 'no_such_module' is not importable"),
    (["--entry", "tests.trainer.loops"], "is not MODULE:ATTR"),
    (["--entry", "tests.trainer.loops:LR"], "is a float, not a function taking ps"),
    (["--entry", "tests.trainer.loops:through_step", "--entry-args", "[1]"], "--entry-args"),
    (["--entry", "tests.trainer.loops:through_step", "--entry-args", '{"nope": 1}'], "does not accept"),
    (["--entry-args", "{}"], "--entry-args needs --entry"),
    (["--mode", "ddp", "--entry", "tests.trainer.loops:through_step"], "--mode ps"),
])
def test_a_bad_entry_is_one_line_and_exit_2(capsys, argv, says):
    assert main(["train", *SERVER, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("kwargs,says", [
    ({"address": "127.0.0.1:notaport"}, "port"),
    ({"address": "127.0.0.1:70000"}, "port"),
    ({"rank": -1}, "--rank must be in 0..65535"),
    ({"rank": 2, "num_trainers": 2}, "must be < --num-trainers"),
    ({"device": "tpu"}, "unsupported --device"),
    ({"wire_dtype": "fp8"}, "--wire-dtype"),
    ({"token_file": "/nonexistent/token"}, "token"),
    ({"overlap": "sometimes"}, "--overlap must be one of auto, on, off"),
    ({"overlap": "on", "step": "pull"}, "--overlap on is for --step pushpull"),
])
def test_connect_refuses_bad_arguments_in_one_line(kwargs, says):
    with pytest.raises(psserver.UsageError, match=says) as e:
        psserver.connect(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.timeout(60)
def test_a_connection_says_what_to_call_first():
    with psserver.connect(f"127.0.0.1:{free_port()}", connect_timeout=1) as ps:
        for call in (ps.step, lambda: ps.lr, lambda: ps.global_step, lambda: ps.evaluate([])):
            with pytest.raises(psserver.UsageError, match=r"join first \(ps.replica\(model\)"):
                call()
        with pytest.raises(psserver.UsageError, match=r"call ps\.replica"):
            psserver.DistributedOptimizer(ps, [])
        with pytest.raises(psserver.UsageError, match=r"takes an nn\.Module"):
            ps.replica("not a model")
        with pytest.raises(psserver.UsageError, match="cannot reach a psserver"):
            ps.replica(torch_module())
    with psserver.connect(f"127.0.0.1:{free_port()}", connect_timeout=1, overlap="on") as ps:
        with pytest.raises(psserver.UsageError, match=r"overlap='on' is for ps\.train_step"):
            ps.replica(torch_module())


def torch_module():
    import torch

    return torch.nn.Linear(2, 2)
