"""``psserver export``: a checkpoint as the trained model's plain state_dict, from one server
process or gathered from several, loadable with ``strict=True`` into the model's own class."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file

from psserver.cli import main
from tests.procs import MNIST_ARGS, cli, free_port, start_servers
from tests.server.engine.test_buffers import BN_MLP, BNMLP

STEPS = 20


def export(ckpt, out) -> dict[str, torch.Tensor]:
    r = cli(["export", str(ckpt), "--out", str(out)])
    assert r.returncode == 0, r.stderr
    assert f"exported step {STEPS}:" in r.stdout
    return load_file(out) if out.suffix == ".safetensors" else torch.load(out, weights_only=True)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_servers_export_what_one_server_exports(procs, port, tmp_path, mnist_dir):
    """A user's model with BatchNorm brought by the trainer (the servers have no ``--model``), one
    trainer, ``--update sync``: the export of two server processes (server 0 cut the model by
    the plan and gave server 1 its pieces; parameters gathered from both partitions, buffers
    from server 0) equals the export of one server to 1e-6, and loads strictly into the class."""
    common = ["--update", "sync", "--sync-trainers", "1", "--optimizer", "adam", "--lr", "0.01"]
    train = ["--model", BN_MLP, "--num-trainers", "1", "--max-steps", str(STEPS), "--batch-size", "32",
             *MNIST_ARGS]
    one = procs.server(port, *common, "--checkpoint-dir", str(tmp_path / "one"))
    t = procs.trainer(port, 0, *train)
    assert t.wait(120) == 0, t.tail()
    assert procs.stop(one) == 0, one.tail()
    port2 = free_port()
    servers = start_servers(procs, port2, 2, *common, ckpt=tmp_path / "two")
    t2 = procs.trainer(port2, 0, *train)
    assert t2.wait(120) == 0, t2.tail()
    servers[1].wait_for(r"partition of model tests.server.engine.test_buffers:BNMLP learnt from server 0: "
                        r"\d+ of its \d+ "
                        "parameters", timeout=10)
    assert procs.stop(servers[0]) == 0, servers[0].tail()
    assert servers[1].wait(30) == 0, servers[1].tail()

    single = export(tmp_path / "one", tmp_path / "one.safetensors")
    several = export(tmp_path / "two", tmp_path / "two.pt")
    assert set(single) == set(several) == set(BNMLP().state_dict())
    for key, value in single.items():
        assert torch.allclose(value.double(), several[key].double(), atol=1e-6, rtol=0), key
    assert single["bn.num_batches_tracked"] == STEPS and not torch.allclose(single["bn.running_var"], torch.ones(16))
    model = BNMLP()
    model.load_state_dict(several, strict=True)
    meta = json.loads((tmp_path / "two.json").read_text())
    assert meta["model"] == BN_MLP and meta["step"] == STEPS and meta["tables"] is None
    assert len(meta["fingerprint"]) == 64 and meta["format"] == "torch"

    # Resumed, each server takes the layout and its partition from its own checkpoint files.
    port3 = free_port()
    again = start_servers(procs, port3, 2, *common, "--resume", ckpt=tmp_path / "two")
    again[1].wait_for(r"resumed from \S+: global step 20", timeout=30)
    more = procs.trainer(port3, 0, "--model", BN_MLP, "--num-trainers", "1", "--max-steps", "5", *MNIST_ARGS)
    assert more.wait(120) == 0, more.tail()
    assert procs.stop(again[0]) == 0, again[0].tail()
    assert again[1].wait(30) == 0, again[1].tail()
    r = cli(["export", str(tmp_path / "two"), "--out", str(tmp_path / "three.pt")])
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "three.json").read_text())["step"] == STEPS + 5


@pytest.mark.parametrize(("args", "message"), [
    (["{tmp}/nothere", "--out", "{tmp}/m.pt"], "{tmp}/nothere does not exist"),
    (["{tmp}", "--out", "{tmp}/m.pt"], "{tmp} holds no valid checkpoint"),
    (["{tmp}/empty.pt", "--out", "{tmp}/m.pt"], "{tmp}/empty.pt is not a psserver checkpoint"),
    (["{tmp}", "--out", "{tmp}/m.bin"], "--out {tmp}/m.bin: name a .safetensors or a .pt file"),
    (["{tmp}", "--out", "{tmp}/sub.pt"], "--out {tmp}/sub.pt is a directory"),
    (["{tmp}", "--out", "{tmp}/no/m.pt"], "directory {tmp}/no does not exist"),
    (["{tmp}/fifo", "--out", "{tmp}/m.pt"], "{tmp}/fifo is not a regular file"),  # not a read that waits forever
    (["{tmp}/loop", "--out", "{tmp}/m.pt"], "{tmp}/loop is a symlink that cannot be resolved (a symlink loop)"),
    (["{tmp}/dangling", "--out", "{tmp}/m.pt"],
     "{tmp}/dangling is a symlink that cannot be resolved (No such file or directory: {tmp}/nothere)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "sub.pt").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothere")
    assert main(["export", *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.format(tmp=tmp_path) in err[0], err


@pytest.fixture(scope="module")
def server_state() -> dict:
    """What a server of ``mlp`` on the CPU writes into a checkpoint."""
    from psserver.config import ServerConfig
    from psserver.server.server import ParameterServer

    server = ParameterServer(ServerConfig(model="mlp", devices=["cpu"]))
    try:
        return server.policy.snapshot()
    finally:
        server.engine.close()


def _module(state: dict, **changes) -> dict:
    return {**state, "shards": [{**state["shards"][0], "module": {**state["shards"][0]["module"], **changes}}]}


@pytest.mark.parametrize(("craft", "message"), [
    (lambda s: {}, " is not a psserver checkpoint: it has no global_step"),
    (lambda s: {k: v for k, v in s.items() if k != "shards"}, " is not a psserver checkpoint: it has no shards"),
    (lambda s: {**s, "global_step": "x"}, " is not a psserver checkpoint: its global_step is 'x', not a count"),
    (lambda s: {**s, "shards": [{"module": [1, 2]}]},
     " is not a psserver checkpoint: shard 0 holds no module state (tensors by name)"),
    (lambda s: {**s, "partition": 4}, " is not a psserver checkpoint: its partition field is 4, not a dict"),
    (lambda s: {**s, "tables": {"tables": {"t": 1}}},
     " is not a psserver checkpoint: its tables are not ids and weights by table name"),
    (lambda s: _module(s, **{"5.bias": torch.zeros(3)}),
     ": cannot export it: 5.bias: a tensor of shape (3,) for an entry of (10,)"),
    (lambda s: _module(s, **{"1.weight": s["shards"][0]["module"]["1.weight"].to_sparse()}),
     " is not a psserver checkpoint: its shards.0.module.1.weight is a sparse_coo tensor, not a dense real tensor"),
    (lambda s: _module(s, **{"1.bias": s["shards"][0]["module"]["1.bias"].to(torch.complex64)}),
     " is not a psserver checkpoint: its shards.0.module.1.bias is a complex64 tensor, not a dense real tensor"),
    (lambda s: {**s, "tables": {"tables": {"t": {"ids": torch.zeros(2), "weights": torch.zeros(2, 3)}}}},
     " is not a psserver checkpoint: its table 't' has ids that are a float32 tensor, not dense integers"),
    (lambda s: {**s, "tables": {"tables": {"t": {"ids": torch.zeros(2, dtype=torch.long),
                                                 "weights": torch.zeros(2, 3).to_sparse()}}}},
     " is not a psserver checkpoint: its table 't' has weights that are a sparse_coo tensor, not dense floats"),
], ids=["empty", "no-shards", "step-not-a-count", "module-not-tensors", "partition-not-a-dict", "tables-not-rows",
        "wrong-shape", "sparse", "complex", "table-ids-float", "table-weights-sparse"])
def test_a_wrong_payload_with_a_valid_checksum_is_one_line_exit_2(tmp_path, capsys, server_state, craft, message):
    """Made by hand or by another program: the checksum holds, the content is not a server's
    (a KeyError or TypeError, an internal error, before)."""
    from psserver.checkpoint import checkpoint_path, verify, write_checkpoint

    path = checkpoint_path(tmp_path, 7)
    write_checkpoint(path, craft(server_state))
    verify(path)
    for out in ("m.pt", "m.safetensors"):
        with warnings.catch_warnings(record=True) as caught:  # torch's own (a sparse tensor's) are not shown
            warnings.simplefilter("always")
            assert main(["export", str(path), "--out", str(tmp_path / out)]) == 2
        assert [str(w.message) for w in caught] == []
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"psserver export: error: {path}{message}"], err
        assert not (tmp_path / out).exists()


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _layout(state: dict, key: str, shape: list) -> dict:
    layout = {**state["layout"], "entries": [[e[0], shape if e[0] == key else e[1], *e[2:]]
                                             for e in state["layout"]["entries"]]}
    return {**state, "layout": layout}


@pytest.mark.parametrize(("craft", "message"), [
    (lambda s: _layout(_module(s, **{"5.bias": torch.zeros(1).expand(10_000_000)}), "5.bias", [10_000_000]),
     " is not a psserver checkpoint: its shards.0.module.5.bias is a view of 40000000 bytes over 4 bytes of data"),
    (lambda s: {**s, "version": _nested(5000)}, " is not a psserver checkpoint: its version.0.0.0... is nested more"),
    (lambda s: _layout(s, "1.weight", [10**12]),
     " is not a psserver checkpoint: its layout has 1000000034442 elements"),
], ids=["expanded", "nested", "layout-huge"])
@pytest.mark.parametrize("command", ["export", "serve"])
def test_a_payload_larger_or_deeper_than_its_file_is_one_line_exit_2(tmp_path, capsys, server_state, craft, message,
                                                                       command):
    """An expanded tensor in a small file was materialised at full size by export (6.2 GB for
    500M elements); a layout of 10^12 elements was allocated by the resume (internal error), a
    payload nested 5,000 deep a RecursionError in both (internal error, exit 1)."""
    import sys

    from psserver.checkpoint import checkpoint_path, write_checkpoint

    path = checkpoint_path(tmp_path, 7)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # torch.save pickles recursively
    try:
        write_checkpoint(path, craft(server_state))
    finally:
        sys.setrecursionlimit(limit)
    argv = (["export", str(path), "--out", str(tmp_path / "m.pt")] if command == "export"
            else ["serve", "--no-control", "--resume", str(path)])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"psserver {command}: error: {path}{message}"), err
    assert not (tmp_path / "m.pt").exists()


class CallsOsSystem:
    def __reduce__(self):
        return (os.system, ("true",))


def test_export_of_a_directory_stops_at_an_unsafe_newest_checkpoint(tmp_path, capsys, server_state):
    """It took the older checkpoint silently when torch worded the refusal otherwise."""
    from psserver.checkpoint import checkpoint_path, write_checkpoint

    write_checkpoint(checkpoint_path(tmp_path, 7), server_state, run="r")
    newest = checkpoint_path(tmp_path, 8)
    write_checkpoint(newest, {**server_state, "global_step": 8, "version": CallsOsSystem()}, run="r")
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"psserver export: error: refusing {newest}: its payload would load posix.system, which a psserver "
                   "checkpoint never holds (tampered with, or not written by psserver)"], err
    assert not (tmp_path / "m.pt").exists()


def _partitions(state: dict, num_servers: int) -> list[dict]:
    """``state`` (one server's, whole model) as the files of ``num_servers`` server processes."""
    from psserver.common.partition import make_plan
    from psserver.models.layout import ModelLayout

    layout = ModelLayout.from_dict(state["layout"])
    module = state["shards"][0]["module"]
    plan = make_plan([e.numel for e in layout.parameters], num_servers)
    flats = plan.split([module[e.key] for e in layout.parameters])
    return [{**state, "global_step": 7,
             "partition": {"server_rank": s, "num_servers": num_servers, "plan": plan.to_dict()},
             "shards": [{"module": {"piece.0": flats[s].clone()}, "optimizer": None}],
             "param_shapes": [[("piece.0", tuple(flats[s].shape))]], "buffers": []}
            for s in range(num_servers)]


def test_partitions_are_gathered_in_process_and_a_layout_they_do_not_hold_is_refused(tmp_path, capsys, server_state):
    """Nothing of the layout's size is made before the partitions add up to it."""
    from psserver.checkpoint import checkpoint_path, write_checkpoint

    parts = _partitions(server_state, 2)
    for s, part in enumerate(parts):
        write_checkpoint(checkpoint_path(tmp_path / "ok" / f"server-{s}", 7), part, run="r")
    assert main(["export", str(tmp_path / "ok"), "--out", str(tmp_path / "m.pt")]) == 0
    exported = torch.load(tmp_path / "m.pt", weights_only=True)
    for key, value in server_state["shards"][0]["module"].items():
        assert torch.equal(exported[key], value), key
    bigger = {**server_state["layout"], "entries": [*server_state["layout"]["entries"],
                                                    ["extra", [1000], "float32", "parameter", True]]}
    for s, part in enumerate(parts):
        write_checkpoint(checkpoint_path(tmp_path / "bad" / f"server-{s}", 7), {**part, "layout": bigger}, run="r")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "bad"), "--out", str(tmp_path / "n.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its partitions hold 235146 parameter elements, its layout 236146" in err[0], err


def test_an_export_of_a_scripts_model_says_what_its_name_is(tmp_path, capsys, server_state):
    """``__main__:Net`` (a class of a script run by its path) imports by no name: the JSON says so."""
    from psserver.checkpoint import checkpoint_path, write_checkpoint

    write_checkpoint(checkpoint_path(tmp_path, 7), {**server_state, "model": "__main__:Net"}, run="r")
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m.pt")]) == 0
    meta = json.loads((tmp_path / "m.json").read_text())
    assert meta["model"] == "__main__:Net" and "Net was defined in the script that trained it" in meta["model_note"]
    write_checkpoint(checkpoint_path(tmp_path, 8), {**server_state, "global_step": 8}, run="r")
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m.pt")]) == 0
    assert "model_note" not in json.loads((tmp_path / "m.json").read_text())
