"""The server's learning-rate schedule, in-process: the lr of every update equals what a local
``opt.step(); sched.step()`` loop has at that iteration, in every update mode, across a
checkpoint, for torch's schedulers and a user's."""

from __future__ import annotations

import dataclasses
import logging
import sys

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L

from psserver.checkpoint import load_checkpoint, write_checkpoint
from psserver.config import CheckpointConfig, LRScheduleConfig, OptimizerConfig, ServerConfig
from psserver.config.optimizer import make_optimizer
from psserver.errors import UserCodeError
from psserver.server.engine.engine import StepEngine, make_updater
from psserver.server.engine.lr_schedule import LRSchedule
from psserver.server.engine.shard import Shard
from psserver.server.server import ParameterServer

# A scheduler stepped before its optimizer warns (torch would then skip a value): never here.
pytestmark = pytest.mark.filterwarnings("error:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")

TOL = 1e-9
SGD = OptimizerConfig(name="sgd", lr=0.1)


def local_lrs(config: LRScheduleConfig, optimizer: OptimizerConfig, steps: int,
              keys: tuple[str, ...] = ("lr",)) -> list[dict]:
    """What a local loop uses at each iteration: the scheduler built as the README says, on a
    local optimizer of the same kind, ``opt.step(); sched.step()`` after each iteration."""
    p = torch.zeros(3, requires_grad=True)
    opt = make_optimizer([p], optimizer)
    n = config.warmup_steps
    warmup = L.LinearLR(opt, start_factor=1 / n, end_factor=1.0, total_iters=n - 1) if n else None
    if config.name is None:
        sched = warmup
    else:
        main = getattr(L, config.name)(opt, **config.args)
        sched = main if warmup is None else L.SequentialLR(opt, [warmup, main], milestones=[n])
    out = []
    for _ in range(steps):
        out.append({k: opt.param_groups[0][k] for k in keys if k in opt.param_groups[0]})
        p.grad = torch.zeros_like(p)
        opt.step()
        sched.step()
    return out


def drive(schedule: LRSchedule, steps: int, keys: tuple[str, ...] = ("lr",)) -> list[dict]:
    """The hyperparameters ``schedule`` sets into a shard's optimizer at each of ``steps`` updates."""
    p = torch.zeros(3, requires_grad=True)
    shard_opt = make_optimizer([p], schedule.optimizer_config)
    out = []
    for _ in range(steps):
        schedule.apply([shard_opt])
        out.append({k: shard_opt.param_groups[0][k] for k in keys if k in shard_opt.param_groups[0]})
        schedule.step()
    return out


def assert_close(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), t
        for k in g:
            a, b = torch.tensor(g[k], dtype=torch.float64), torch.tensor(w[k], dtype=torch.float64)
            assert torch.all((a - b).abs() <= TOL), (t, k, g[k], w[k])


# ---- the schedule against torch --------------------------------------------------------------


def test_cosine_after_50_warmup_steps_is_torchs_sequential_lr():
    config = LRScheduleConfig("CosineAnnealingLR", {"T_max": 200}, warmup_steps=50)
    got = drive(LRSchedule(config, SGD), 250)
    want = local_lrs(config, SGD, 250)
    assert_close(got, want)
    assert [g["lr"] for g in got[:3]] == pytest.approx([0.1 / 50, 0.2 / 50, 0.3 / 50], abs=TOL)  # (t+1)/N
    assert got[49]["lr"] == pytest.approx(0.1, abs=TOL) and got[50]["lr"] == pytest.approx(0.1, abs=TOL)
    assert got[250 - 1]["lr"] < 0.001  # the cosine's end


@pytest.mark.parametrize("config,optimizer", [
    (LRScheduleConfig("StepLR", {"step_size": 7, "gamma": 0.5}), SGD),
    (LRScheduleConfig("MultiStepLR", {"milestones": [10, 25], "gamma": 0.1}, 5), OptimizerConfig("adam", 0.01)),
    (LRScheduleConfig("ExponentialLR", {"gamma": 0.97}, 10), OptimizerConfig("adamw", 0.003)),
    (LRScheduleConfig("LinearLR", {"start_factor": 0.25, "total_iters": 20}), SGD),
    (LRScheduleConfig("PolynomialLR", {"total_iters": 40, "power": 2.0}, 3), OptimizerConfig("rmsprop", 0.01)),
    (LRScheduleConfig("ConstantLR", {"factor": 0.5, "total_iters": 12}), OptimizerConfig("adagrad", 0.05)),
    (LRScheduleConfig("CosineAnnealingWarmRestarts", {"T_0": 9, "T_mult": 2}, 4), SGD),
    (LRScheduleConfig("OneCycleLR", {"max_lr": 0.5, "total_steps": 60}), OptimizerConfig("sgd", 0.1, momentum=0.9)),
    (LRScheduleConfig("OneCycleLR", {"max_lr": 0.01, "total_steps": 50}, 10), OptimizerConfig("adam", 0.001)),
    (LRScheduleConfig("CyclicLR", {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 5}),
     OptimizerConfig("sgd", 0.05, momentum=0.9)),
    (LRScheduleConfig(None, {}, warmup_steps=25), OptimizerConfig("adam", 0.002)),
    (LRScheduleConfig(None, {}, warmup_steps=1), SGD),
], ids=lambda v: v.describe() if isinstance(v, LRScheduleConfig) else v.name)
def test_every_scheduler_is_torchs_at_every_step(config, optimizer):
    """``lr``, and the momentum (betas) that OneCycleLR and CyclicLR cycle, reach the shards'
    optimizer as the local loop's has them."""
    keys = ("lr", "momentum", "betas")
    assert_close(drive(LRSchedule(config, optimizer), 60, keys), local_lrs(config, optimizer, 60, keys))


@pytest.mark.parametrize("config", [
    LRScheduleConfig("CosineAnnealingLR", {"T_max": 200}, 50),
    LRScheduleConfig("OneCycleLR", {"max_lr": 0.5, "total_steps": 120}),
    LRScheduleConfig("CosineAnnealingWarmRestarts", {"T_0": 7}, 3),
    LRScheduleConfig("CyclicLR", {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 5}),
    LRScheduleConfig(None, {}, 80),
], ids=lambda c: c.describe())
@pytest.mark.parametrize("at", [0, 1, 37, 50, 51])
def test_a_saved_schedule_continues_exactly(tmp_path, config, at):
    """state_dict -> a checkpoint file read with weights_only -> restore: the sequence across
    the save is the uninterrupted one."""
    optimizer = OptimizerConfig("sgd", 0.1, momentum=0.9)
    keys = ("lr", "momentum")
    whole = drive(LRSchedule(config, optimizer), 100, keys)
    first = LRSchedule(config, optimizer)
    before = drive(first, at, keys)
    path = tmp_path / "ckpt-000000000001.pt"
    write_checkpoint(path, {"lr_schedule": first.state_dict()}, run="r" * 32)
    _, state = load_checkpoint(path)  # weights_only=True
    assert state["lr_schedule"]["scheduler"] is not None  # torch's own state, no replay
    again = LRSchedule(config, optimizer)
    again.restore(state["lr_schedule"], at)
    assert again.steps == at
    assert_close(before + drive(again, 100 - at, keys), whole)


def test_another_schedule_at_resume_takes_over_as_if_from_step_0(caplog):
    old = LRSchedule(LRScheduleConfig("StepLR", {"step_size": 5}), SGD)
    drive(old, 30)
    new_config = LRScheduleConfig("CosineAnnealingLR", {"T_max": 100}, 10)
    new = LRSchedule(new_config, SGD)
    with caplog.at_level(logging.WARNING, logger="psserver.server.engine.lr_schedule"):
        new.restore(old.state_dict(), 30)
    assert "takes over at global step 30 as if it had run from step 0" in caplog.text
    assert "StepLR(step_size=5)" in caplog.text
    assert_close(drive(new, 20), local_lrs(new_config, SGD, 50)[30:])
    # Another --lr is another schedule too; a checkpoint without one: the same.
    faster = LRSchedule(new_config, OptimizerConfig("sgd", 0.2))
    faster.restore(new.state_dict(), new.steps)
    assert faster.lr == pytest.approx(2 * new.lr, abs=TOL)
    fresh = LRSchedule(new_config, SGD)
    fresh.restore(None, 50)
    assert fresh.lr == new.lr


def test_a_schedule_that_ends_keeps_its_last_lr(caplog):
    """OneCycleLR raises past its total_steps: the server keeps training at the last lr."""
    schedule = LRSchedule(LRScheduleConfig("OneCycleLR", {"max_lr": 0.5, "total_steps": 10}), SGD)
    with caplog.at_level(logging.ERROR, logger="psserver.server.engine.lr_schedule"):
        lrs = [d["lr"] for d in drive(schedule, 15)]
    assert lrs[:10] == pytest.approx([d["lr"] for d in local_lrs(schedule.config, SGD, 10)], abs=TOL)
    assert lrs[11:] == [lrs[10]] * 4  # torch's step 10 still gives one; its 11th raises
    assert caplog.text.count("failed at step") == 1
    assert schedule.steps == 15


# ---- a user's scheduler ------------------------------------------------------------------------


@pytest.fixture
def userpkg(tmp_path, monkeypatch):
    pkg = tmp_path / "userlr"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "schedules.py").write_text(
        "import math\n"
        "from torch.optim import lr_scheduler as L\n"
        "class Halving(L.LRScheduler):\n"
        "    '''Halves the lr every `every` steps (closed form).'''\n"
        "    def __init__(self, optimizer, every=3, last_epoch=-1):\n"
        "        self.every = every\n"
        "        super().__init__(optimizer, last_epoch)\n"
        "    def get_lr(self):\n"
        "        return [b * 0.5 ** (self.last_epoch // self.every) for b in self.base_lrs]\n"
        "class Opaque:\n"
        "    def __init__(self, k):\n        self.k = k\n"
        "class OpaqueState(Halving):\n"
        "    '''Holds an object a weights_only checkpoint cannot hold.'''\n"
        "    def __init__(self, optimizer, every=3):\n"
        "        self.thing = Opaque(every)\n"
        "        super().__init__(optimizer, every)\n"
        "def warm_cosine(optimizer, total=100, warm=10):\n"
        "    return L.LambdaLR(optimizer,\n"
        "                      lambda t: min(1.0, (t + 1) / warm) * 0.5 * (1 + math.cos(math.pi * t / total)))\n"
        "def not_a_scheduler(optimizer):\n    return 42\n"
        "def plateau(optimizer):\n    return L.ReduceLROnPlateau(optimizer)\n"
        "NUMBER = 3\n"
        "class Going(L.LRScheduler):\n"
        "    '''0.1 until step `at`, then `value` (a string, a negative number, NaN).'''\n"
        "    def __init__(self, optimizer, at=0, value='x'):\n"
        "        self.at, self.value = at, value\n"
        "        super().__init__(optimizer)\n"
        "    def get_lr(self):\n"
        "        v = float(self.value) if self.value in ('inf', 'nan') else self.value\n"
        "        return [0.1 if self.last_epoch < self.at else v for _ in self.base_lrs]\n"
        "def strings(optimizer):\n    return L.LambdaLR(optimizer, lambda t: 1.0 if t < 3 else 'x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m == "userlr" or m.startswith("userlr.")]:
        del sys.modules[name]


def test_a_users_scheduler_class_and_function(userpkg):
    import math

    halving = drive(LRSchedule(LRScheduleConfig("userlr.schedules:Halving", {"every": 4}, 2), SGD), 20)
    # warm-up 0.05, 0.1, then the user's schedule from its step 0.
    want = [0.05, 0.1] + [0.1 * 0.5 ** (t // 4) for t in range(18)]
    assert [d["lr"] for d in halving] == pytest.approx(want, abs=TOL)
    lam = drive(LRSchedule(LRScheduleConfig("userlr.schedules:warm_cosine", {"total": 50}), SGD), 50)
    assert [d["lr"] for d in lam] == pytest.approx(
        [0.1 * min(1.0, (t + 1) / 10) * 0.5 * (1 + math.cos(math.pi * t / 50)) for t in range(50)], abs=TOL)


@pytest.mark.parametrize("name,args", [("userlr.schedules:OpaqueState", {"every": 5}),
                                       ("userlr.schedules:warm_cosine", {"total": 60})])
def test_a_users_scheduler_continues_exactly_after_a_save(tmp_path, userpkg, name, args):
    """A state torch.load(weights_only=True) cannot read (or a function's) is left out of the
    checkpoint: the restore replays the steps instead, to the same sequence."""
    config = LRScheduleConfig(name, args, 4)
    whole = drive(LRSchedule(config, SGD), 60)
    first = LRSchedule(config, SGD)
    before = drive(first, 23)
    path = tmp_path / "ckpt-000000000023.pt"
    write_checkpoint(path, {"lr_schedule": first.state_dict()}, run="r" * 32)
    _, state = load_checkpoint(path)
    again = LRSchedule(config, SGD)
    again.restore(state["lr_schedule"], 23)
    assert_close(before + drive(again, 37), whole)


def test_users_references_that_are_not_schedulers(userpkg):
    with pytest.raises(UserCodeError, match=r"returned a int, not a torch.optim.lr_scheduler.LRScheduler"):
        LRSchedule(LRScheduleConfig("userlr.schedules:not_a_scheduler"), SGD)
    with pytest.raises(UserCodeError, match=r"returned a ReduceLROnPlateau: it steps on a metric"):
        LRSchedule(LRScheduleConfig("userlr.schedules:plateau"), SGD)
    with pytest.raises(ValueError, match=r"--lr-schedule userlr.schedules:NUMBER is a int, not a scheduler"):
        LRScheduleConfig("userlr.schedules:NUMBER")


def test_arguments_the_scheduler_refuses_are_one_line():
    with pytest.raises(UserCodeError, match=r"--lr-schedule OneCycleLR raised ValueError: You must define either "
                                            r"total_steps OR \(epochs AND steps_per_epoch\)"):
        LRSchedule(LRScheduleConfig("OneCycleLR", {"max_lr": 0.1}), SGD)
    with pytest.raises(UserCodeError, match=r"OneCycleLR raised ValueError: optimizer must support momentum"):
        LRSchedule(LRScheduleConfig("OneCycleLR", {"max_lr": 0.1, "total_steps": 10}), OptimizerConfig("adagrad"))


@pytest.mark.parametrize(("name", "args", "match"), [
    ("ExponentialLR", {"gamma": -1}, r"^--lr-schedule ExponentialLR \{'gamma': -1\} gives a negative learning rate "
                                     r"\(-0.1\) at step 1$"),
    ("userlr.schedules:Going", {}, r"^--lr-schedule userlr.schedules:Going \{\} gives lr 'x' \(not a number\) at "
                                   r"step 0$"),
    ("userlr.schedules:Going", {"at": 4, "value": -0.5}, r"gives a negative learning rate \(-0.5\) at step 4$"),
    ("userlr.schedules:Going", {"at": 2, "value": "nan"}, r"gives lr nan at step 2$"),
    ("userlr.schedules:strings", {}, r"^--lr-schedule userlr.schedules:strings \{\}: its step 3 failed: TypeError: "),
])
def test_a_schedule_whose_first_values_no_optimizer_takes_is_refused_at_start(userpkg, name, args, match):
    with pytest.raises(UserCodeError, match=match) as info:
        LRSchedule(LRScheduleConfig(name, args), SGD)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["x", -0.5, "inf"])
def test_a_schedule_that_goes_wrong_later_keeps_the_last_good_lr_and_says_so_once(userpkg, caplog, value):
    schedule = LRSchedule(LRScheduleConfig("userlr.schedules:Going", {"at": 20, "value": value}), SGD)
    with caplog.at_level(logging.WARNING, logger="psserver.server.engine.lr_schedule"):
        lrs = [d["lr"] for d in drive(schedule, 40)]
    assert lrs == [0.1] * 40
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "at step 20: the last good values stay" in warnings[0].getMessage()


# ---- on the server: every update mode, the optimizer's own lr ---------------------------------


def double_shard(index: int = 0) -> Shard:
    torch.manual_seed(index)
    shard = Shard(index, nn.Sequential(nn.Linear(4, 3)).double(), torch.device("cpu"))
    shard.init_optimizer(SGD)
    return shard


@pytest.mark.parametrize("mode", ["async", "ssp", "sync", "follower"])
def test_every_update_mode_applies_the_schedule_once_per_update(mode, caplog):
    """SGD without momentum on float64 weights: an update of gradient 1 moves every weight by
    exactly -lr, so the parameters themselves say which lr each update applied."""
    config = LRScheduleConfig("CosineAnnealingLR", {"T_max": 30}, 10)
    want = [d["lr"] for d in local_lrs(config, SGD, 40)]
    shards = [double_shard(0), double_shard(1)]
    up = make_updater("sync" if mode == "follower" else mode, shards, lambda s, n: None, sync_trainers=2,
                      staleness=1, follower=mode == "follower")
    up.lr_schedule = LRSchedule(config, SGD)
    for t in ("a", "b"):
        up.trainer_joined(t)
    with caplog.at_level(logging.DEBUG, logger="psserver.server.engine.updates"):
        rounds = 0
        while up.global_step < 40:
            before = [p.detach().clone() for s in shards for p in s.params]
            step = up.global_step
            for t in ("a", "b"):  # sync: one round of two gradients; async, ssp: two updates
                up.submit(t, {p: torch.ones_like(p) for s in shards for p in s.params}, 1)
            if mode == "follower":
                rounds += 1
                up.decide(rounds, ["a", "b"])
            moved = [(b - p.detach()) for b, p in zip(before, (p for s in shards for p in s.params), strict=True)]
            n = up.global_step - step
            assert n == (1 if mode in ("sync", "follower") else 2)
            assert all(torch.allclose(m, moved[0].flatten()[0].expand_as(m), atol=1e-12) for m in moved)
            assert moved[0].flatten()[0].item() == pytest.approx(sum(want[step:step + n]), abs=1e-12)
    logged = [float(r.getMessage().split(": ")[1]) for r in caplog.records
              if r.getMessage().startswith("learning rate at step")]
    steps = [int(r.getMessage().split()[4].rstrip(":")) for r in caplog.records
             if r.getMessage().startswith("learning rate at step")]
    assert steps == list(range(40))
    assert logged == pytest.approx(want, abs=TOL)
    assert up.lr_schedule.steps == 40


def test_the_engine_builds_the_schedule_with_the_trainers_optimizer_and_checkpoints_it(tmp_path):
    """No --optimizer on the server: the schedule starts with the first trainer's; a checkpoint
    written by the policy (weights_only) resumes it where it was, in a new server."""
    config = ServerConfig(model="mlp", devices=["cpu"], update="sync", sync_trainers=1,
                          lr_schedule=LRScheduleConfig("CosineAnnealingLR", {"T_max": 200}, 50))
    want = [d["lr"] for d in local_lrs(config.lr_schedule, OptimizerConfig("sgd", 0.2), 81)]
    server = ParameterServer(config)
    try:
        engine = server.engine
        assert engine.learning_rate is None and engine.lr_schedule is None
        engine.agree_optimizer(OptimizerConfig("sgd", 0.2), "trainer_0_0")
        assert engine.learning_rate == pytest.approx(want[0], abs=TOL)
        engine.trainer_joined("t")
        for t in range(30):
            engine.open_step("t", 4)
            engine.submit("t", {p: torch.zeros_like(p) for p in engine.trainable})
            assert engine.shards[0].optimizer.param_groups[0]["lr"] == pytest.approx(want[t], abs=TOL)
            assert engine.learning_rate == pytest.approx(want[t + 1], abs=TOL)
        path = tmp_path / "ckpt-000000000030.pt"
        write_checkpoint(path, server.policy.snapshot(), run="r" * 32)
    finally:
        server.engine.close()
    resumed = ParameterServer(dataclasses.replace(config, checkpoint=CheckpointConfig(resume=str(path))))
    try:
        engine = resumed.engine
        assert engine.global_step == 30 and engine.learning_rate == pytest.approx(want[30], abs=TOL)
        engine.trainer_joined("t")
        for t in range(30, 80):
            engine.open_step("t", 4)
            engine.submit("t", {p: torch.zeros_like(p) for p in engine.trainable})
            assert engine.shards[0].optimizer.param_groups[0]["lr"] == pytest.approx(want[t], abs=TOL)
        status = resumed.view.get_status()
        assert status.learning_rate == pytest.approx(want[80], abs=TOL)
        assert status.lr_schedule == "CosineAnnealingLR(T_max=200) after a linear warm-up of 50 steps"
    finally:
        resumed.engine.close()


def test_a_schedule_the_trainers_optimizer_cannot_take_refuses_that_trainer():
    config = ServerConfig(model="mlp", devices=["cpu"],
                          lr_schedule=LRScheduleConfig("OneCycleLR", {"max_lr": 0.1, "total_steps": 100}))
    engine = StepEngine(config, [torch.device("cpu")])  # tried on the default adam: fine
    try:
        with pytest.raises(UserCodeError, match="optimizer must support momentum"):
            engine.agree_optimizer(OptimizerConfig("adagrad"), "trainer_0_0")
        assert engine.optimizer_config is None and engine.lr_schedule is None
        engine.agree_optimizer(OptimizerConfig("adam", 0.001), "trainer_1_0")
        assert engine.lr_schedule is not None and engine.learning_rate == pytest.approx(0.1 / 25, abs=TOL)
    finally:
        engine.close()


def test_without_a_schedule_status_shows_the_optimizers_lr():
    engine = StepEngine(ServerConfig(model="mlp", devices=["cpu"], optimizer=OptimizerConfig("sgd", 0.03)),
                        [torch.device("cpu")])
    try:
        assert engine.lr_schedule is None and engine.learning_rate == 0.03
    finally:
        engine.close()


def test_a_resume_without_the_schedule_goes_back_to_the_optimizers_lr(tmp_path, caplog):
    scheduled = ServerConfig(model="mlp", devices=["cpu"], optimizer=OptimizerConfig("sgd", 0.1),
                             lr_schedule=LRScheduleConfig("StepLR", {"step_size": 2, "gamma": 0.5}))
    server = ParameterServer(scheduled)
    try:
        engine = server.engine
        engine.trainer_joined("t")
        for _ in range(6):
            engine.open_step("t", 4)
            engine.submit("t", {p: torch.zeros_like(p) for p in engine.trainable})
        assert engine.shards[0].optimizer.param_groups[0]["lr"] == 0.025  # step 5's
        assert engine.learning_rate == 0.0125  # step 6's
        path = tmp_path / "ckpt-000000000006.pt"
        write_checkpoint(path, server.policy.snapshot(), run="r" * 32)
    finally:
        server.engine.close()
    plain = dataclasses.replace(scheduled, lr_schedule=LRScheduleConfig(),
                                checkpoint=CheckpointConfig(resume=str(path)))
    with caplog.at_level(logging.WARNING, logger="psserver.server.engine.engine"):
        resumed = ParameterServer(plain)
    try:
        assert resumed.engine.learning_rate == 0.1
        assert resumed.engine.shards[0].optimizer.param_groups[0]["lr"] == 0.1
        assert ("the checkpoint's learning-rate schedule was StepLR(step_size=2, gamma=0.5); this server has none: "
                "the learning rate is 0.1 from global step 6") in caplog.text
        assert resumed.view.get_status().lr_schedule == ""
    finally:
        resumed.engine.close()


def test_a_resume_that_would_replay_more_than_it_can_in_minutes_is_refused_at_once():
    """A checkpoint at global step 2^52 (valid, forged) with a schedule: refused in one line
    before any replay (it replayed ~10^5 steps a second, for years)."""
    saved = LRSchedule(LRScheduleConfig("StepLR", {"step_size": 10}), SGD)
    drive(saved, 3)
    fresh = LRSchedule(LRScheduleConfig("StepLR", {"step_size": 10}), SGD)
    with pytest.raises(ValueError, match=r"global step 4,503,599,627,370,496 is 4,503,599,627,370,493 steps of the "
                                         r"learning-rate schedule StepLR\(step_size=10\) to replay, more than the "
                                         r"100,000,000 psserver replays"):
        fresh.restore(saved.state_dict(), 2**52)
    assert fresh.steps == 3  # where the saved schedule stood: nothing replayed
