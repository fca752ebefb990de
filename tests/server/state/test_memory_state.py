"""The server's state in shared memory, in-process: a server built again on the segment a
dead one left holds every update it had applied, bit for bit; a torn update, another run's
segment and a stale one are told apart."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
import torch

from psserver.cli import main
from psserver.config import LRScheduleConfig, MemoryStateConfig, OptimizerConfig, ServerConfig
from psserver.control.convert import status_to_proto
from psserver.control.render import render_status
from psserver.server.server import ParameterServer
from psserver.server.state.arena import Arena, ArenaError, Journal
from psserver.server.state.memory import MemoryState, MemoryStateError, scan, state_layout


def server_config(state_dir, key="run-a", **kw) -> ServerConfig:
    kw.setdefault("optimizer", OptimizerConfig("adam", 0.01))
    kw.setdefault("model", "mlp")
    return ServerConfig(devices=["cpu"], memory_state=MemoryStateConfig(state_dir, key), **kw)


def train(server: ParameterServer, steps: int, seed: int = 0) -> None:
    engine = server.engine
    engine.trainer_joined("t")
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        engine.open_step("t", 8)
        engine.submit("t", {p: torch.randn(p.shape, generator=g) for p in engine.trainable})


def state_of(server: ParameterServer) -> dict:
    """What the server holds. The optimizers' ``lr`` is left out: the schedule writes it before
    every update (the learning rate of the next one is ``learning_rate``, compared)."""
    shards, step, samples, _, schedule, _ = server.engine.copy_state()
    for shard in shards:
        for group in shard["optimizer"]["param_groups"]:
            group.pop("lr")
    return {"shards": shards, "step": step, "samples": samples, "lr": server.engine.learning_rate,
            "schedule": None if schedule is None else schedule["steps"]}


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_the_arena_holds_the_tensors_themselves(tmp_path):
    p = torch.nn.Parameter(torch.randn(5, 3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones_like(p)
    opt.step()
    buf = opt.state[p]["momentum_buffer"]
    before, version = (p.detach().clone(), buf.clone()), p._version
    arena, slots = Arena.create(tmp_path / "a.bin", [p, buf, torch.tensor(7)], Journal(1, 0, 0, 3, 24))
    # The same objects, their values, and no in-place change autograd would see.
    assert torch.equal(p.detach(), before[0]) and torch.equal(buf, before[1]) and p._version == version
    p.grad = torch.ones_like(p)
    opt.step()  # in place: into the file
    again = Arena.open(tmp_path / "a.bin")
    assert torch.equal(again.view(slots[0]), p.detach()) and torch.equal(again.view(slots[1]), buf)
    assert again.view(slots[2]).item() == 7
    assert again.journal() == Journal(1, 0, 0, 3, 24) and not again.journal().torn
    arena.set_rank(0, 3)  # rank 0's gradient 3 applied before
    arena.begin(1, 4, 32, [(0, 4), (5, 2)])
    assert again.journal().torn and again.ranks(torn=True) == {0: 4, 5: 2}  # died while it applied: it counts
    arena.end(1, 4, 32)
    assert again.journal() == Journal(1, 1, 1, 4, 32, 4, 32) and again.ranks(torn=False) == {0: 4, 5: 2}
    (tmp_path / "junk.bin").write_bytes(b"\0" * 32768)
    with pytest.raises(ArenaError, match="not a psserver state file"):
        Arena.open(tmp_path / "junk.bin")
    (tmp_path / "short.bin").write_bytes(b"PSSTATE1")
    with pytest.raises(ArenaError, match="shorter than its header"):
        Arena.open(tmp_path / "short.bin")


def test_a_gradient_whose_update_never_began_is_not_counted_as_applied(tmp_path):
    """The writer died after it wrote an update's gradient numbers, before its begin mark: the
    update is not torn (nothing of it was applied), so its gradients count as not applied, and
    the one in flight, sent again, lands; once begun (torn), it counts as applied."""
    arena, _ = Arena.create(tmp_path / "a.bin", [torch.zeros(3)], Journal(1, 0, 0, 3, 24))
    arena.begin(1, 4, 8, [(0, 4)])
    arena.end(1, 4, 8)
    arena.set_rank(0, -5)  # the next update's number, written; its begin mark never came
    again = Arena.open(tmp_path / "a.bin")
    assert not again.journal().torn and again.ranks(torn=False) == {0: 4}
    assert again.ranks(torn=True) == {0: 5}


@pytest.mark.parametrize("update", ["async", "sync"])
def test_a_server_built_again_on_a_dead_ones_segment_holds_every_applied_update(state_dir, update):
    """The first server is abandoned as a SIGKILL would leave it (no stop, no release)."""
    config = server_config(state_dir, update=update, sync_trainers=1,
                           lr_schedule=LRScheduleConfig("StepLR", {"step_size": 3, "gamma": 0.5}))
    first = ParameterServer(config)
    train(first, 7)
    want = state_of(first)
    assert want["step"] == 7 and want["samples"] == 56
    files = sorted(p.name for p in (state_dir / "run-a" / "server-0").iterdir())
    assert files == ["meta.json", "owner.json", "tensors-2.bin"]  # the model; its optimizer state (step 1)
    first.engine.compute.close()  # (its threads only: the segment stays as a dead process leaves it)

    second = ParameterServer(config)
    try:
        assert_same(state_of(second), want)
        assert second.engine.samples_seen == 56
        train(second, 5, seed=1)  # and it goes on writing there
        want = state_of(second)
    finally:
        second.engine.compute.close()
    third = ParameterServer(config)
    try:
        assert_same(state_of(third), want)
        assert third.engine.global_step == 12 and third.engine.learning_rate == 0.01 * 0.5 ** 4
    finally:
        third.engine.close()


def test_a_torn_update_counts_as_applied_and_says_so(state_dir, caplog):
    config = server_config(state_dir)
    first = ParameterServer(config)
    train(first, 3)
    first.memory.begin(4, 8, [(0, 9)])  # killed mid-apply: begin written, end never
    first.engine.compute.close()
    with caplog.at_level(logging.WARNING):
        second = ParameterServer(config)
    try:
        assert second.engine.global_step == 4 and second.engine.samples_seen == 32
        assert second.engine.sequences.applied == {0: 9}  # its trainer's gradient is not taken again
        assert "the server died while applying the update of global step 4" in caplog.text
        train(second, 1)
        assert not second.memory.arena.journal().torn
    finally:
        second.engine.close()


def test_a_fresh_run_never_maps_another_runs_state_and_reports_it_stale(state_dir, caplog):
    first = ParameterServer(server_config(state_dir, key="old-run"))
    train(first, 2)
    first.engine.compute.close()
    owner = state_dir / "old-run" / "server-0" / "owner.json"
    dead = json.loads(owner.read_text())
    dead.update(pid=2**22 + 1, supervisor=None)  # beyond pid_max: no such process
    owner.write_text(json.dumps(dead))
    with caplog.at_level(logging.WARNING):
        fresh = ParameterServer(server_config(state_dir, key=None))
    try:
        assert fresh.engine.global_step == 0
        (stale,) = fresh.memory.stale
        assert stale.key == "old-run" and not stale.alive
        assert "stale state of a job that is gone" in caplog.text and "--remove-stale-state" in caplog.text
        status = status_to_proto(fresh.view.get_status())
        (shown,) = status.stale_state
        assert shown.path == str(state_dir / "old-run" / "server-0") and shown.bytes > 0 and shown.pid == 2**22 + 1
        assert status.memory_state.startswith(f"{state_dir / fresh.memory.key / 'server-0'}, generation 1, ")
        text = render_status(status)
        assert f"stale       {shown.path} (" in text and "--remove-stale-state deletes it" in text
        assert {s.key for s in scan(state_dir)} == {"old-run", fresh.memory.key}
    finally:
        fresh.engine.close()
    cleaner = ParameterServer(dataclasses.replace(
        server_config(state_dir, key=None), memory_state=MemoryStateConfig(state_dir, None, remove_stale=True)))
    try:
        assert not (state_dir / "old-run").exists() and cleaner.memory.stale == []
    finally:
        cleaner.engine.close()


def test_a_live_runs_segment_is_left_alone(state_dir):
    first = ParameterServer(server_config(state_dir, key="live-run"))  # this process owns it
    try:
        other = MemoryState(MemoryStateConfig(state_dir, "other"), 0)
        other.prepare()
        assert other.stale == [] and (state_dir / "live-run").exists()
    finally:
        first.engine.close()


def test_a_clean_stop_releases_the_segment(state_dir):
    server = ParameterServer(server_config(state_dir))
    train(server, 2)
    server.engine.close()
    server.memory.release()
    assert not (state_dir / "run-a").exists()


def test_a_clean_stop_removes_the_default_directory_once_empty(state_dir, monkeypatch):
    """``/dev/shm/psserver`` (the default, psserver's own) goes with the last state in it; a
    directory the user named stays."""
    from psserver.server.state import memory as memory_state

    default = state_dir / "default"
    monkeypatch.setattr(memory_state, "DEFAULT_STATE_DIR", str(default))
    servers = [ParameterServer(server_config(default, key=key)) for key in ("run-a", "run-b")]
    for i, server in enumerate(servers):
        server.engine.close()
        server.memory.release()
        assert default.exists() == (i == 0), i  # run-b's state is still there after run-a's stop
    named = ParameterServer(server_config(state_dir / "named"))
    named.engine.close()
    named.memory.release()
    assert (state_dir / "named").is_dir() and not any((state_dir / "named").iterdir())


def test_a_model_on_a_gpu_or_a_sync_group_is_not_kept_and_says_why():
    """Device memory dies with its process, and a sync round across servers cannot be rebuilt:
    the state in memory is off there, with the reason its status line and WARNING give (a
    server on a GPU: ``tests/end_to_end/test_gpu.py``)."""
    from types import SimpleNamespace

    from psserver.config import ServerConfig
    from psserver.server.state.memory import unsupported_reason

    def engine(devices, update="async", plan=None, **config):
        return SimpleNamespace(devices=[torch.device(d) for d in devices], plan=plan,
                               config=ServerConfig(update=update, **config))

    assert unsupported_reason(engine(["cpu"])) is None
    assert unsupported_reason(engine(["cpu"], "sync")) is None
    assert unsupported_reason(engine(["cuda:0"])) == "the model lives on cuda:0, not in host memory"
    assert unsupported_reason(engine(["cpu", "cuda:1"])) == "the model lives on cpu, cuda:1, not in host memory"
    assert unsupported_reason(engine(["cpu"], "sync", plan=object())).startswith("several server processes in sync")
    assert unsupported_reason(engine(["cpu"], "async", plan=object())) is None
    # DiLoCo's rounds are sync's: outer sync across processes is not kept, outer async is.
    assert unsupported_reason(engine(["cpu"], "diloco", plan=object())).startswith("several server processes")
    assert unsupported_reason(engine(["cpu"], "diloco", plan=object(), outer="async")) is None


def test_an_unreadable_segment_is_one_line(state_dir):
    first = ParameterServer(server_config(state_dir))
    first.engine.close()
    seg = state_dir / "run-a" / "server-0"
    (seg / "meta.json").write_bytes(b"{not json")
    with pytest.raises(MemoryStateError, match=r"cannot be read .*move it away"):
        ParameterServer(server_config(state_dir))


def test_the_state_flags(tmp_path, port):
    (tmp_path / "file").write_text("")
    assert main(["serve", "--port", str(port), "--state-dir", str(tmp_path / "file"), "--no-control"]) == 2
    assert main(["serve", "--port", str(port), "--state-dir", str(tmp_path), "--state-key", "../x",
                 "--no-control"]) == 2
    assert main(["serve", "--port", str(port), "--remove-stale-state", "--no-control"]) == 2


def test_a_full_memory_filesystem_turns_the_state_off_not_the_server(state_dir, caplog, monkeypatch):
    def full(fd, offset, size):  # noqa: ARG001
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with caplog.at_level(logging.ERROR):
        server = ParameterServer(server_config(state_dir))
    try:
        assert server.memory.disabled.startswith("cannot write")
        assert "No space left on device; it needs" in caplog.text
        train(server, 2)  # trains on, in the process's own memory
        assert server.engine.global_step == 2 and server.engine.sequences.durable is None
    finally:
        server.engine.close()


def test_a_filesystem_full_at_a_later_generation_leaves_nothing_to_map(state_dir, monkeypatch):
    """Generation 1 was placed; the optimizer's state (after step 1) no longer fits. The tensors
    still live in generation 1 and change without its journal: a restart must not map it."""
    server = ParameterServer(server_config(state_dir))
    allocate = os.posix_fallocate

    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    try:
        train(server, 3)
        assert server.memory.disabled.startswith("cannot write") and server.engine.global_step == 3
        assert not (state_dir / "run-a" / "server-0" / "meta.json").exists()
    finally:
        server.engine.compute.close()
    monkeypatch.setattr(os, "posix_fallocate", allocate)
    again = ParameterServer(server_config(state_dir))
    try:
        assert again.engine.global_step == 0  # a fresh start (or the checkpoint), not a torn map
    finally:
        again.engine.close()


def test_a_gradient_sent_again_after_a_restart_is_applied_once(state_dir):
    """A trainer's step 3 was applied, then the process died before its reply: the trainer
    rejoins (its position: 2 steps) and sends step 3's gradient again."""
    config = server_config(state_dir, update="sync", sync_trainers=1)
    first = ParameterServer(config)
    engine = first.engine
    engine.trainer_joined("trainer_0_1")
    engine.sequences.joined("trainer_0_1", 0, 0)
    g = torch.Generator().manual_seed(0)
    for number in (1, 2, 3):
        engine.open_step("trainer_0_1", 8)
        assert engine.take_gradient("trainer_0_1", number, 8)
        engine.submit("trainer_0_1", {p: torch.randn(p.shape, generator=g) for p in engine.trainable})
    want = state_of(first)
    engine.compute.close()

    second = ParameterServer(config)
    try:
        engine = second.engine
        assert engine.sequences.applied == {0: 3}
        engine.trainer_joined("trainer_0_2")
        engine.sequences.joined("trainer_0_2", 0, 2)
        assert not engine.take_gradient("trainer_0_2", 3, 8)  # no step opened, nothing applied
        assert_same(state_of(second), want)
        assert engine.take_gradient("trainer_0_2", 4, 8)  # its step opened here, on its behalf
        engine.submit("trainer_0_2", {p: torch.randn(p.shape, generator=g) for p in engine.trainable})
        assert engine.global_step == 4 and engine.sequences.applied == {0: 4}
        engine.trainer_gone("trainer_0_2")
        engine.trainer_joined("trainer_0_3")
        engine.sequences.joined("trainer_0_3", 0, 0)  # a fresh trainer of rank 0: its numbers start again
        assert engine.sequences.applied == {} and second.memory.arena.ranks(torn=False) == {}
        assert engine.take_gradient("trainer_0_3", 1, 8)
    finally:
        engine.close()


def train_tables(server: ParameterServer, steps: int, seed: int = 0, ids: int = 4000) -> None:
    """Steps of an embedding model: rows served (created on first touch), their gradients and
    the dense ones applied, as a trainer's steps go through the engine."""
    engine, tables = server.engine, server.engine.tables
    engine.trainer_joined("t")
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        engine.open_step("t", 8)
        request = {n: torch.unique(torch.randint(0, ids, (600,), generator=g)) for n in tables.tables}
        tables.serve("t", request)
        grads = {p: torch.randn(p.shape, generator=g) for p in engine.trainable}
        grads.update(tables.row_grads("t", {n: torch.randn(request[n].numel(), t.spec.dim, generator=g)
                                            for n, t in tables.tables.items()}))
        engine.submit("t", grads)


def rows_of(server: ParameterServer) -> dict:
    """Every row with its optimizer state and clocks, by id (slots may differ)."""
    out = {}
    for name, t in server.engine.tables.state_dict()["tables"].items():
        order = torch.argsort(t["ids"])
        out[name] = {"ids": t["ids"][order], "weights": t["weights"][order], "last_step": t["last_step"][order],
                     "hits": t["hits"][order], "state": {k: v[order] for k, v in t["state"].items()},
                     "step": t["step"], "sketch": t["sketch"]}
    return out


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "lazy_adam"])
def test_embedding_rows_and_their_optimizer_state_outlive_the_process(state_dir, optimizer):
    """mf's tables grow from 1024 slots as lookups create rows (new generations), and a server
    built again on the segment holds every row, its optimizer state and the tables' clocks,
    bit for bit, and the admission sketch."""
    config = server_config(state_dir, model="mf", embedding=dataclasses.replace(
        ServerConfig(model="mf").embedding, optimizer=optimizer, admit_after=2))
    first = ParameterServer(config)
    train_tables(first, 12)
    want, dense = rows_of(first), state_of(first)
    assert want["user"]["ids"].numel() > 1024  # grown: the segment was rebound to larger tensors
    assert first.memory.arena.generation > 2
    first.engine.compute.close()  # abandoned as a SIGKILL leaves it

    second = ParameterServer(config)
    try:
        assert_same(rows_of(second), want)
        assert_same(state_of(second), dense)
        train_tables(second, 3, seed=1)
        want = rows_of(second)
    finally:
        second.engine.compute.close()
    third = ParameterServer(config)
    try:
        assert_same(rows_of(third), want)
        assert third.engine.global_step == 15
    finally:
        third.engine.close()


def test_a_row_whose_creation_was_cut_short_is_a_free_slot(state_dir):
    """A lookup killed while creating rows wrote their values but not yet their ids: after a
    restart those slots are free, and the rows are created again, from the same initial values,
    at their next touch."""
    config = server_config(state_dir, model="mf")
    first = ParameterServer(config)
    train_tables(first, 2)
    table = first.engine.tables.tables["user"]
    fresh = torch.tensor([10_000_001, 10_000_002])
    slots = table._take_slots(2)  # noqa: SLF001 - what _create does up to the ids
    table.weights[slots] = table.initial_rows(fresh)
    rows = table.num_rows
    first.engine.compute.close()
    second = ParameterServer(config)
    try:
        again = second.engine.tables.tables["user"]
        assert again.num_rows == rows and bool((again.index.find(fresh) < 0).all())
        assert torch.equal(again.lookup(fresh), table.initial_rows(fresh))
    finally:
        second.engine.close()


def test_the_state_is_laid_out_with_each_tensor_once_in_a_fixed_order():
    a, b = torch.zeros(2), torch.ones(3)
    structure, tensors = state_layout({"m": {"w": a}, "o": [{"x": b, "y": a}, (b, 1)], "n": 2, "s": torch.Size([4])})
    assert tensors == [a, b]
    assert structure["m"]["w"] == structure["o"][0]["y"] != structure["o"][0]["x"] == structure["o"][1][0]
    assert (structure["o"][1][1], structure["n"], structure["s"]) == (1, 2, (4,))
