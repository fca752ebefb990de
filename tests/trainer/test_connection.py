"""``Connection`` without a server: what it does around the calls of its step protocol, with a
stand-in session (the library against a real server: ``test_library.py``)."""

from __future__ import annotations

import copy
import io
import logging
import math
import threading
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, TensorDataset

import psserver
from psserver.utils.eval_metrics import concat_outputs
from tests.trainer import loops


class Protocol:
    """The calls the connection makes of a step protocol: ``evaluate`` the model's outputs, as
    the trainer's protocol returns them (a tuple or dict kept); ``push_pull`` records the
    samples each step hands in."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.pushed: list[int] = []

    def open(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def push_pull(self, samples: int) -> None:
        self.pushed.append(samples)
        for p in self.model.parameters():
            p.grad = None

    def evaluate(self, x):
        with torch.no_grad():
            return self.model(x)


class StandInSession:
    step_protocol = "pushpull"
    report = None
    name = "trainer_0_1"

    def __init__(self, model: torch.nn.Module) -> None:
        self.info = {"update": "async"}
        self.progress = (0, 0.01, 0)  # global step, lr, staleness
        self.protocol = Protocol(model)
        self.lock = threading.Lock()  # a real session's heartbeat thread holds one

    def leave(self) -> None:
        pass


@pytest.fixture
def connection(monkeypatch):
    """A connection whose join makes a stand-in session of the model (no server)."""
    ps = psserver.connect("127.0.0.1:1", num_trainers=1, handle_signals=False)
    monkeypatch.setattr(ps, "_join", StandInSession)
    yield ps
    ps.close()


@pytest.fixture
def joined():
    """A connection whose session is a stand-in (no server; nothing is sent)."""
    ps = psserver.connect("127.0.0.1:1", handle_signals=False)
    ps.session = StandInSession(loops.DictNet())
    yield ps
    ps.close()


def held_out() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (4, 3)]


def test_outputs_concatenate_as_the_model_returns_them():
    Out = namedtuple("Out", "loss logits")
    a = {"logits": torch.ones(2, 3), "extra": (torch.zeros(2), [torch.ones(2, 1)]), "loss": torch.tensor(1.0)}
    b = {"logits": torch.zeros(1, 3), "extra": (torch.ones(1), [torch.zeros(1, 1)]), "loss": torch.tensor(2.0)}
    whole = concat_outputs([a, b])
    assert whole["logits"].shape == (3, 3) and whole["extra"][0].tolist() == [0, 0, 1]
    assert whole["extra"][1][0].shape == (3, 1) and whole["loss"].tolist() == [1.0, 2.0]
    named = concat_outputs([Out(torch.tensor(0.5), torch.ones(2, 3)), Out(torch.tensor(1.5), torch.ones(4, 3))])
    assert isinstance(named, Out) and named.logits.shape == (6, 3)
    with pytest.raises(psserver.UsageError, match="differ between held-out batches"):
        concat_outputs([{"a": torch.ones(1)}, {"b": torch.ones(1)}])


def test_a_dict_output_goes_to_a_callable_metric_whole(joined):
    seen = []

    def metric(outputs, targets):
        seen.append((outputs["logits"].shape, targets.shape))
        return loops.dict_accuracy(outputs, targets)

    score = joined.evaluate(held_out(), metric=metric)
    assert 0.0 <= score <= 1.0 and seen == [((7, 3), (7,))]


@pytest.mark.parametrize("metric", [None, "accuracy", "rmse"])
def test_a_builtin_metric_of_a_dict_output_is_one_line_saying_to_pass_a_callable(joined, metric):
    with pytest.raises(psserver.UsageError, match=r"model returns a dict: pass a metric callable") as e:
        joined.evaluate(held_out(), metric=metric)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("metric", "message"), [
    ("auc", "metric auc: auc needs one score per label, got 21 and 7"),
    ("rmse", "metric rmse: rmse needs one output per target, got 21 and 7"),
])
def test_a_builtin_metric_that_does_not_fit_the_outputs_is_one_line(metric, message):
    # a 3-class model scored by a metric of one output per sample
    ps = psserver.connect("127.0.0.1:1", handle_signals=False)
    ps.session = StandInSession(loops.tiny_net())
    try:
        with pytest.raises(psserver.UsageError) as e:
            ps.evaluate(held_out(), metric=metric)
    finally:
        ps.close()
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kw", [
    {"address": 5}, {"address": b"127.0.0.1:1"}, {"device": None}, {"device": 0}, {"config": 5},
    {"rank": "0"}, {"rank": 1.5}, {"rank": True}, {"rank": 10**30}, {"num_trainers": "2"},
    {"num_trainers": 10**30}, {"connect_timeout": "5"}, {"connect_timeout": None}, {"rpc_timeout": 1e308},
    {"token_file": 5}, {"address": ""}, {"address": "  "}, {"reconnect": "yes"}, {"reconnect": 1},
    {"handle_signals": "no"},
])
def test_connect_refuses_an_argument_of_the_wrong_type_or_size_in_one_line(kw):
    with pytest.raises(psserver.UsageError) as e:
        psserver.connect(**{"address": "127.0.0.1:1", "handle_signals": False, **kw})
    assert str(e.value).startswith("psserver.connect: ") and "\n" not in str(e.value)


def test_a_replica_can_be_deep_copied_averaged_and_saved_whole(connection):
    model = connection.replica(loops.tiny_net())
    twin = copy.deepcopy(model)
    averaged = AveragedModel(model)
    averaged.update_parameters(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(5, 8)
    with torch.no_grad():
        for other in (twin, averaged, loaded):
            assert torch.equal(other(x), model(x))
    twin(torch.randn(7, 8)).sum().backward()  # the copy's forwards are not this connection's
    model(x).sum().backward()
    connection.step()
    assert connection.session.protocol.pushed == [5]


def test_a_step_counts_the_batch_of_its_first_training_forward_once(connection):
    """Siamese (two forwards a step), frozen-BN fine-tuning (eval mode, grad on), validation
    (no grad) before a training forward, and a step without any forward."""
    model = connection.replica(loops.tiny_net())
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    (model(a) - model(b)).pow(2).sum().backward()
    connection.step()
    model.eval()
    model(torch.randn(6, 8)).sum().backward()
    connection.step()
    with torch.no_grad():
        model(torch.randn(100, 8))
    model(torch.randn(2, 8))  # eval mode, grad on, but a training forward of the pass comes
    model.train()
    model(torch.randn(3, 8)).sum().backward()
    connection.step()
    connection.step()
    connection.step(samples=11)
    assert connection.session.protocol.pushed == [4, 6, 3, 0, 11]
    assert connection.samples == 24


@pytest.mark.parametrize("wrapper", [False, True])
def test_each_backward_pass_before_a_step_counts_its_micro_batch(connection, wrapper):
    # accumulation: K forward/backward passes, then one update, with or without the wrapper
    model = connection.replica(loops.tiny_net())
    opt = psserver.DistributedOptimizer(connection, model.named_parameters(), backward_passes_per_step=4) \
        if wrapper else None
    for x in torch.randn(16, 8).chunk(4):
        model(x).sum().backward()
    opt.step() if opt is not None else connection.step()
    model.eval()  # frozen-BN fine-tuning: passes in eval mode count too
    for x in torch.randn(10, 8).chunk(2):
        model(x).sum().backward()
    opt.step() if opt is not None else connection.step()
    assert connection.session.protocol.pushed == [16, 10]


class Recurrent(nn.Module):
    """An LSTM fed ``(T, B, D)``: dim 0 of its input is time, not the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0][-1]


@pytest.mark.parametrize("pass_samples", [False, True])
def test_counting_more_samples_than_the_sampler_handed_out_warns_once(connection, caplog, pass_samples):
    model = connection.replica(Recurrent())
    data = TensorDataset(torch.randn(32, 10, 8))
    sampler = connection.sampler(data)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    with caplog.at_level(logging.WARNING, logger="psserver.trainer.connection"):
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for (x,) in loader:
                model(x.transpose(0, 1)).sum().backward()  # (T=10, B=4, D)
                connection.step(samples=len(x) if pass_samples else None)
    warnings = [r.getMessage() for r in caplog.records if "ps.sampler has handed out" in r.getMessage()]
    if pass_samples:
        assert warnings == [] and connection.samples == 64
    else:
        assert len(warnings) == 1 and "counted 10 samples in epoch 0" in warnings[0], warnings
        assert "pass ps.step(samples=...)" in warnings[0]


def test_a_loop_whose_count_is_the_batch_does_not_warn(connection, caplog):
    model = connection.replica(loops.tiny_net())
    data = TensorDataset(torch.randn(30, 8))
    sampler = connection.sampler(data)
    with caplog.at_level(logging.WARNING, logger="psserver.trainer.connection"):
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for (x,) in DataLoader(data, batch_size=8, sampler=sampler):
                model(x).sum().backward()
                connection.step()
    assert "handed out" not in caplog.text and connection.samples == 60


@pytest.mark.parametrize("bad", [-5, 2.5, math.nan, "16", True, torch.tensor(3.0)])
def test_a_bad_samples_argument_is_a_usage_error_and_nothing_is_sent(connection, bad):
    model = connection.replica(loops.tiny_net())
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(psserver.UsageError, match=r"ps\.step: samples must be an int >= 0"):
        connection.step(samples=bad)
    connection.step(samples=torch.tensor(4))  # an int tensor is an int
    assert connection.session.protocol.pushed == [4] and connection.samples == 4


@pytest.mark.parametrize("rank", [0, 1])
def test_a_sampler_before_the_join_needs_num_trainers_on_every_rank(monkeypatch, rank):
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    data = TensorDataset(torch.arange(10))
    with psserver.connect("127.0.0.1:1", rank=rank, handle_signals=False) as ps:
        with pytest.raises(psserver.UsageError, match=r"call ps\.replica\(model\) first.*num_trainers"):
            ps.sampler(data)
        with pytest.raises(psserver.UsageError, match="num_trainers"):
            _ = ps.num_trainers
    with psserver.connect("127.0.0.1:1", rank=rank, num_trainers=2, handle_signals=False) as ps:
        assert ps.sampler(data).num_replicas == 2 and ps.num_trainers == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    with psserver.connect("127.0.0.1:1", rank=rank, handle_signals=False) as ps:
        assert ps.sampler(data).num_replicas == 3


def test_a_sampler_after_the_join_takes_the_shard_count_of_the_servers_answer(monkeypatch):
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    with psserver.connect("127.0.0.1:1", handle_signals=False) as ps:
        monkeypatch.setattr(ps, "_join", StandInSession)
        ps.replica(loops.tiny_net())
        ps.session.info = {"update": "sync", "sync_trainers": 4}
        assert ps.sampler(TensorDataset(torch.arange(10))).num_replicas == 4


def test_a_compiled_model_joins_as_the_module_it_wraps_and_stays_compiled(monkeypatch):
    joined_with = []

    def join(model):
        joined_with.append(model)
        return StandInSession(model)

    with psserver.connect("127.0.0.1:1", num_trainers=1, handle_signals=False) as ps:
        monkeypatch.setattr(ps, "_join", join)
        net = loops.tiny_net()
        compiled = torch.compile(net)  # inductor, on the CPU
        model = ps.replica(compiled)
        assert model is compiled and ps.model is compiled and joined_with == [net]
        assert not any("_orig_mod" in k for k in ps.session.protocol.model.state_dict())
        model(torch.randn(4, 8)).sum().backward()
        ps.step()
        assert ps.session.protocol.pushed == [4]


def test_ps_step_between_wrapper_steps_counts_the_passes_anew(connection):
    model = connection.replica(loops.tiny_net())
    psserver.DistributedOptimizer(connection, model.named_parameters())
    opt = psserver.DistributedOptimizer(connection, model.named_parameters())  # a second one, same setting
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        connection.step()  # not opt.step(): the wrapper's count starts again
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert connection.session.protocol.pushed == [4, 4, 4]


def test_with_the_wrapper_each_backward_pass_counts_its_micro_batch(connection):
    model = connection.replica(loops.tiny_net())
    opt = psserver.DistributedOptimizer(connection, model.named_parameters(), backward_passes_per_step=4)
    for x in torch.randn(16, 8).chunk(4):
        model(x).sum().backward()
    opt.step()
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    (model(a) - model(b)).pow(2).sum().backward()  # siamese: one pass of one batch
    opt.step()
    assert connection.session.protocol.pushed == [16, 4]


def test_a_reported_loss_that_diverges_while_finite_is_told_once(connection, caplog):
    model = connection.replica(loops.tiny_net())
    with caplog.at_level(logging.WARNING, logger="psserver.trainer.connection"):
        for loss in (2.3, 0.4, -30.0, -3e4, -8.07e8):
            model(torch.randn(4, 8)).sum().backward()
            connection.step(loss=torch.tensor(loss))
    told = [r.getMessage() for r in caplog.records]
    assert told == [told[0]] and told[0].startswith("loss -3e+04, from 2.3 at first: training is diverging"), told


def test_an_eviction_surfacing_in_the_users_own_dist_autograd_call_is_one_exception(connection, monkeypatch):
    """The RPC tutorial's loop: after an eviction its dist_autograd.backward fails inside torch
    ("Could not find autograd context", C++ frames): the ``with`` block turns it into Evicted,
    its context suppressed; a RuntimeError of a trainer the server still counts stays as it is."""
    from psserver.errors import Evicted
    from psserver.trainer import connection as module

    def recover(session, config, error, *rest):
        raise Evicted("trainer_0_1 was evicted by the psserver at 127.0.0.1:1 (missed heartbeats)")

    monkeypatch.setattr(module, "recover", recover)
    monkeypatch.setattr(module, "diagnose", lambda session, error: "evicted")
    connection.replica(loops.tiny_net())
    with pytest.raises(Evicted) as e, connection:
        raise RuntimeError("Could not find autograd context with id: 12\nException raised from ... (C++ frames)")
    assert e.value.__suppress_context__ and "evicted" in str(e.value)

    ps = psserver.connect("127.0.0.1:1", num_trainers=1, handle_signals=False)
    monkeypatch.setattr(ps, "_join", StandInSession)
    monkeypatch.setattr(module, "diagnose", lambda session, error: module.FAILED)
    ps.replica(loops.tiny_net())
    with pytest.raises(RuntimeError, match="Could not find autograd context"), ps:
        raise RuntimeError("Could not find autograd context with id: 13")
