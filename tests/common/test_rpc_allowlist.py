"""The RPC layer's allow-list (``psserver.common.rpc_allowlist``, installed by
``psserver.common.torch_rpc.restrict_unpickler``).

Unit tests read pickles through the restricted deserializer in this process, as torch's C++
handler would; the end-to-end test has a stranger join the RPC group of a real server while a
real trainer trains, and ask both to run what is no part of psserver's RPC surface.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import json
import logging
import os
import re
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
import torch.distributed.rpc.internal as rpc_internal
from torch.distributed.optim.functional_adam import _FunctionalAdam
from torch.distributed.optim.optimizer import (
    _functional_local_optimizer_step,
    _local_optimizer_step,
    _new_functional_local_optimizer,
    _new_local_optimizer,
)
from torch.distributed.rpc._utils import _update_group_membership

from psserver.common import calls, rendezvous, rpc_allowlist, torch_rpc
from psserver.common.messages import JoinRequest, Report
from psserver.common.rpc_allowlist import RefusedCall
from psserver.server.endpoint import NotAMember
from psserver.telemetry import RPC_REFUSALS, RefusalLog
from tests.end_to_end import stranger
from tests.end_to_end.joins import join_request
from tests.procs import ROOT, env, free_port, slow_steps
from tests.test_metrics import FakeTarget, scrape, value

NOT_RPC = {"install", "current"}
"""Public functions of the RPC surface's module that are no RPC (the server's own plumbing)."""


@pytest.fixture
def read():
    """``read(obj)``: ``obj`` pickled by torch's RPC pickler, then read as an incoming message
    (``internal.deserialize``, which torch's C++ handler calls) with the restriction on; torch's
    own deserializer is back after the test."""
    pickler = rpc_internal._internal_rpc_pickler
    saved = vars(pickler).get("deserialize"), rpc_internal._unpickler
    torch_rpc.restrict_unpickler()
    torch_rpc.restrict_unpickler()  # idempotent
    assert rpc_internal._unpickler is torch_rpc.RestrictedUnpickler
    yield lambda obj: rpc_internal.deserialize(*rpc_internal.serialize(obj))
    if saved[0] is None:
        del pickler.deserialize
    else:
        pickler.deserialize = saved[0]
    rpc_internal._unpickler = saved[1]


class Reduced:
    """Pickles as ``fn(*args)``: a pickle as a hostile peer would write it."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def call(fn, *args):
    return rpc_internal.PythonUDF(fn, args, {})


def qualified(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


# ---- unit tests ------------------------------------------------------------------------


@pytest.mark.parametrize("fn,args", [
    (builtins.exec, ("open('pwned', 'w').write('x')",)),
    (builtins.eval, ("1 + 1",)),
    (os.system, ("touch pwned",)),
    (os.getpid, ()),
    (builtins.open, ("pwned", "w")),
    (subprocess.Popen, (["true"],)),
    (builtins.getattr, ("x", "upper")),
    (functools.partial(os.system, "touch pwned"), ()),
    (torch.load, ("pwned",)),
    (calls.install, (None,)),  # public, but unplugging the endpoint is no RPC
    (SystemExit, ()),  # an exception class, but not one a reply may raise in its caller
], ids=lambda v: v.__name__ if hasattr(v, "__name__") else None)
def test_refuses_what_is_no_part_of_psservers_rpc_surface(read, fn, args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = "functools.partial" if isinstance(fn, functools.partial) else qualified(fn)
    before = rpc_allowlist.refused_counts().get(name, 0)
    with pytest.raises(RefusedCall, match=re.escape(repr(name))):
        read(call(fn, *args))
    assert rpc_allowlist.refused_counts()[name] == before + 1
    assert not (tmp_path / "pwned").exists()
    assert not hasattr(rpc_internal._thread_local_tensor_tables, "recv_tables")  # put back after a refusal


def test_refuses_a_hostile_pickle_inside_the_arguments(read):
    """What runs while a message is read: a partial of os.system, a storage (torch.load), the
    pickler's other receivers, torch's RRef proxies."""
    from torch.distributed.rpc.rref_proxy import _local_invoke
    from torch.storage import _load_from_bytes

    pickler = rpc_internal._InternalRPCPickler
    for hostile, name in [
        (Reduced(functools.partial, os.system, "touch pwned"), "functools.partial"),
        (Reduced(_load_from_bytes, b"x"), "torch.storage._load_from_bytes"),
        (Reduced(getattr, pickler, "_script_module_receiver"),
         "builtins.getattr(torch.distributed.rpc.internal._InternalRPCPickler, '_script_module_receiver')"),
        (Reduced(getattr, Report, "__init__"), "builtins.getattr(psserver.common.messages.Report, '__init__')"),
        (Reduced(getattr, "x", "upper"), "builtins.getattr(<builtins.str object>, 'upper')"),
        (Reduced(_local_invoke, None, "step", (), {}), "torch.distributed.rpc.rref_proxy._local_invoke"),
    ]:
        with pytest.raises(RefusedCall, match=re.escape(repr(name))):
            read(call(calls.heartbeat, "trainer_0_1", hostile))


def test_accepts_what_psserver_and_torch_send(read):
    report = Report(3, 192, 0.5, 100.0, accuracy=0.9)
    x = torch.randn(4, 3)
    msg = read(call(calls.call, "trainer_0_1", "exchange", ([x, None], 64), report))
    assert msg.func is calls.call
    assert msg.args[2][0][0].equal(x) and msg.args[3] == report
    request = join_request(0, "trainer_0_1", optimizer={"name": "adam", "lr": 0.01}, wire_dtype="bf16", values=True)
    got = read(call(calls.join, request)).args[0]
    assert isinstance(got, JoinRequest) and got.layout == request.layout and got.model == "mlp"
    assert all(a.equal(b) for a, b in zip(got.values, request.values, strict=True))
    for fn in (calls.heartbeat, calls.leave, rendezvous.ping, calls.SharedOptimizer):
        assert read(call(fn)).func is fn
    # A peer's join or leave runs torch's, then puts back the devices and reply maps it wipes.
    assert read(call(_update_group_membership)).func is torch_rpc.update_group_membership
    # DistributedOptimizer's calls run as the server's own (its one shared optimizer), whatever class they name
    assert read(call(_new_local_optimizer)).func is calls.new_local_optimizer
    assert read(call(_new_functional_local_optimizer)).func is calls.new_local_optimizer
    assert read(call(_local_optimizer_step)).func is calls.local_optimizer_step
    assert read(call(_functional_local_optimizer_step)).func is calls.local_optimizer_step
    assert read([torch.optim.SGD, _FunctionalAdam]) == [torch.optim.SGD, _FunctionalAdam]
    data = [torch.nn.Parameter(torch.ones(2)), torch.bfloat16, torch.device("cpu"), torch.Size([2, 3]),
            OrderedDict(a=1), {"step": "pushpull", "ids": {1, 2}}, (b"\x00", 1.5, None, True)]
    got = read(data)
    assert isinstance(got[0], torch.nn.Parameter) and got[0].equal(data[0])
    assert got[1:] == data[1:]


def test_remote_exceptions_still_arrive_as_exceptions(read):
    """A failed call's reply names the exception's type: the caller rebuilds it from its message."""
    for exc in (ValueError, RuntimeError, KeyError, NotAMember, torch.distributed.DistStoreError,
                RefusedCall):
        reply = read(rpc_internal.RemoteException("On psserver: it failed", exc))
        assert reply.exception_type is exc
        with pytest.raises(exc, match="it failed"):
            rpc_internal._handle_exception(reply)


def test_a_peer_join_this_worker_cannot_take_in_is_an_error_reply_not_a_traceback(monkeypatch, capfd, caplog):
    """A server that dies while a peer joins takes the store the join reads: the joiner's call
    fails with the store's error, and this worker logs one line (torch prints a traceback for a
    call that raises)."""
    def store_gone(*args):
        raise torch.distributed.DistNetworkError("Failed to recv, got 0 bytes.\nDid the remote server crash?")

    monkeypatch.setattr("torch.distributed.rpc._utils._update_group_membership", store_gone)
    udf = rpc_internal.PythonUDF(torch_rpc.update_group_membership, (None, [], {}, True), {})
    with caplog.at_level(logging.WARNING, logger=torch_rpc.__name__):
        reply = rpc_internal._run_function(udf)
    assert capfd.readouterr().err == ""
    assert [r.getMessage() for r in caplog.records] == [
        "a peer's join could not be taken in (Failed to recv, got 0 bytes.)"]
    with pytest.raises(torch.distributed.DistNetworkError, match="Failed to recv"):
        rpc_internal._handle_exception(reply)


def test_every_public_function_of_the_surface_is_rpc_or_deliberately_not():
    public = {name for name, fn in inspect.getmembers(calls, inspect.isfunction)
              if fn.__module__ == calls.__name__ and not name.startswith("_")}
    surface = {name for module, name in rpc_allowlist.ALLOWED if module == calls.__name__}
    surface |= {name for module, name in rpc_allowlist.REPLACED.values() if module == calls.__name__}
    assert public - NOT_RPC == surface - {"SharedOptimizer"}, "a new function: allow it, or add it to NOT_RPC"
    assert not NOT_RPC & surface


def test_refusals_are_counted_bounded_and_their_log_rate_limited(monkeypatch, caplog):
    """A flood of names costs a few log lines and a bounded set of counters."""
    refusals = RefusalLog(burst=2, interval=3600.0, max_keys=3, key_chars=12)
    monkeypatch.setattr(rpc_allowlist, "RPC_REFUSALS", refusals)
    with caplog.at_level(logging.WARNING, logger=rpc_allowlist.__name__):
        for name in ["a" * 30 + "\nWARNING a forged log line", "s1", "s2", "s3", "s4", "s5"]:
            with pytest.raises(RefusedCall):
                rpc_allowlist.find_global("posix", name)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\n" not in line for line in lines), lines
    assert rpc_allowlist.refused_counts() == {"posix.aaaaaa": 1, "posix.s1": 1, "other": 4}  # 12 characters, 3 keys
    refusals.interval = 0.0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=rpc_allowlist.__name__), pytest.raises(RefusedCall):
        rpc_allowlist.find_global("os", "getpid")
    assert "4 more refused RPC messages not logged" in caplog.records[0].getMessage()
    assert "'os.getpid'" in caplog.records[1].getMessage()


def test_refusals_are_a_prometheus_counter(read):
    from psserver.exporters import build_registry

    with pytest.raises(RefusedCall):
        read(call(builtins.exec, "1"))
    registry, _ = build_registry(FakeTarget())
    assert registry.get_sample_value("psserver_rpc_refusals_total", {"name": "builtins.exec"}) == \
        RPC_REFUSALS.counts()["builtins.exec"] >= 1


# ---- a stranger in the group of a real server -----------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_stranger_in_the_rpc_group_runs_nothing(procs, port, tmp_path):
    """The ten-line attack on an open server: ``init_rpc`` against its store joins the group,
    and then nothing the stranger sends runs, on the server or on the trainer; the trainer
    trains on, finishes and the server stops cleanly."""
    metrics = free_port()
    server = procs.server(port, "--model", "mlp", "--metrics-port", str(metrics))
    trainer = procs.trainer(port, 0, "--epochs", "1000", "--max-steps", "600",
                            env=slow_steps(0.02))  # 12 s at least
    trainer.wait_for(r"joined psserver \S+ as trainer_0_1", timeout=60)
    pwned = tmp_path / "pwned"
    r = subprocess.run([sys.executable, "-m", "tests.end_to_end.stranger", str(port), str(pwned)], capture_output=True,
                       text=True, timeout=90, cwd=ROOT, env=env(TP_SOCKET_IFNAME="lo"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert trainer.running(), "the trainer finished before the stranger was done: slow it down"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"psserver", "trainer_0_1"} <= set(out["members"]), out
    refused = [name for name in stranger.attempts(str(pwned)) if name != "ping"]
    for worker in ("psserver", "trainer_0_1"):
        results = out["results"][worker]
        assert results["ping"] == {"ok": True, "value": "True"}, results  # in the group, and heard
        for name in refused:
            assert not results[name]["ok"] and "RefusedCall" in results[name]["error"], (worker, name, results[name])
    assert not pwned.exists()
    samples = scrape(metrics)
    for name in ("posix.getpid", "builtins.exec", "posix.system", "pathlib.Path.write_text", "functools.partial",
                 "builtins.getattr"):
        assert value(samples, "psserver_rpc_refusals_total", name=name) == 1
    assert trainer.wait(90) == 0, trainer.tail()
    assert procs.stop(server) == 0, server.tail()
    logged = re.findall(r"WARNING psserver\.common\.rpc_allowlist: refused an RPC message naming '([^']+)'",
                        server.output())
    assert logged == ["posix.getpid", "builtins.exec", "posix.system", "pathlib.Path.write_text",
                      "functools.partial"], server.tail()  # 5 a minute: builtins.getattr was counted, not logged
    assert "refused an RPC message naming 'posix.getpid'" in trainer.output()
