"""``psserver train --entry`` and ``psserver.connect``: bad input is one line and exit 2 (or a
``UsageError``), found before anything is sent."""

from __future__ import annotations

import json
import sys

import pytest

import psserver
from psserver.cli import main
from tests.procs import free_port
from tests.userproject import write_package

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


ENTRIES = """
class Boom(BaseException):
    pass


def returns(ps, value):
    return eval(value)


def raises(ps):
    raise Boom("out of tokens")
"""


@pytest.fixture
def entries(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(write_package(tmp_path, "userentry", {"loops": ENTRIES})))
    yield "userentry.loops"
    for name in [m for m in sys.modules if m.startswith("userentry")]:
        del sys.modules[name]


@pytest.mark.parametrize("value,code,says", [
    ("None", 0, None),
    ("3", 3, None),
    ("10**30", 2, "returned an int of 31 digits: return None or an exit code in 0..255"),
    ("-1", 2, "returned -1: return None or an exit code in 0..255"),
    ("256", 2, "returned 256: return None or an exit code in 0..255"),
    ("'done'", 2, "returned str: return None or an exit code in 0..255"),
])
def test_what_an_entry_returns_is_its_exit_code_or_one_line(capsys, entries, value, code, says):
    argv = ["train", *SERVER, "--entry", f"{entries}:returns", "--entry-args", json.dumps({"value": value})]
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [] if says is None else len(err) == 1 and err[0].endswith(says), err


def test_a_base_exception_of_an_entry_is_one_line(capsys, entries):
    assert main(["train", *SERVER, "--entry", f"{entries}:raises"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--entry {entries}:raises raised Boom: out of tokens (at " in err[0], err


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
