"""The model's buffers on the server (BatchNorm statistics): kept beside the parameters,
averaged from what the trainers send (a sync round's mean), or rank 0's, loaded by every
trainer with its parameters, in-process without RPC."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from psserver.common.tensors import flatten, persistent_buffers, unflatten_into
from psserver.config import OptimizerConfig, ServerConfig
from psserver.server.engine.buffers import ServerBuffers
from psserver.server.engine.engine import StepEngine
from psserver.server.steps.pull import PullServer
from psserver.server.steps.pushpull import PushPullServer
from psserver.trainer.steps.pushpull import PushPullTrainer
from tests.end_to_end.joins import give_replica, join_request

BN_MLP = "tests.server.engine.test_buffers:BNMLP"


class BNMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Flatten(1)
        self.fc = nn.Linear(784, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc(self.flat(x)))))


def test_commit_averages_what_was_sent():
    a, b = torch.zeros(3), torch.zeros(2, dtype=torch.int64)
    buffers = ServerBuffers([a, b], "average")
    assert buffers.numel == 5
    buffers.receive("t1", torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64))
    buffers.receive("t2", torch.tensor([3.0, 2.0, 1.0, 5.0, 7.0], dtype=torch.float64))
    assert not buffers.receive("t3", torch.tensor([float("nan")] * 5, dtype=torch.float64))
    buffers.commit(["t1"])
    assert a.tolist() == [1.0, 2.0, 3.0] and b.tolist() == [4, 6]
    buffers.commit()
    assert a.tolist() == [2.0, 2.0, 2.0] and b.tolist() == [4, 6]  # 4.5 and 6.5 round to even
    buffers.forget("t1")
    buffers.commit()
    assert a.tolist() == [3.0, 2.0, 1.0]
    with pytest.raises(ValueError, match=r"buffers of \(4,\) torch.float64 for a model of 5 buffer values"):
        buffers.check(torch.zeros(4, dtype=torch.float64))
    flat = flatten([a, b])
    unflatten_into(flat * 2, [a, b])
    assert b.dtype == torch.int64 and b.tolist() == [10, 14]


def test_persistent_buffers_in_state_dict_order():
    model = BNMLP()
    model.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert [b.data_ptr() for b in persistent_buffers(model)] == [
        model.bn.running_mean.data_ptr(), model.bn.running_var.data_ptr(), model.bn.num_batches_tracked.data_ptr()]


def batches(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 1, 28, 28, generator=g) * (1 + seed), torch.randint(0, 10, (16,), generator=g))
            for _ in range(n)]


def make_trainer(engine: StepEngine, half, rank: int, overlap: str = "off") -> PushPullTrainer:
    from tests.end_to_end.test_trainer_compute import Channel

    channel = Channel(half, "cpu", "fp32")
    channel.name = f"t{rank}"
    request = join_request(rank, channel.name, model=BN_MLP, overlap=overlap)
    channel.info = {"model": BN_MLP, **half.join_info(channel.name, request)}
    give_replica(channel, BN_MLP)
    engine.trainer_joined(channel.name)
    return PushPullTrainer(channel)


@pytest.mark.parametrize("policy", ["average", "rank0"])
def test_sync_rounds_set_the_mean_of_their_trainers_buffers(policy):
    cfg = ServerConfig(model=BN_MLP, devices=["cpu"], update="sync", sync_trainers=2, buffers=policy,
                       optimizer=OptimizerConfig(name="sgd", lr=0.01))
    engine = StepEngine(cfg, [torch.device("cpu")])
    try:
        half = PushPullServer(engine)
        trainers = [make_trainer(engine, half, r) for r in (0, 1)]
        assert [t.send_buffers for t in trainers] == ([True, True] if policy == "average" else [True, False])
        server_bn = engine.shards[0].module.bn
        before = flatten(persistent_buffers(server_bn))
        for (x0, y0), (x1, y1) in zip(batches(3, 0), batches(3, 1), strict=True):
            # Each trainer loads the server's statistics, then its forward moves them its way.
            threads = [threading.Thread(target=t.step, args=batch) for t, batch in
                       zip(trainers, [(x0, y0), (x1, y1)], strict=True)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        for t in trainers:
            t.flush()
        sent = [flatten(t.buffers) for t in trainers]
        want = torch.stack(sent).mean(0) if policy == "average" else sent[0]
        got = flatten(persistent_buffers(server_bn))
        assert torch.allclose(got[:-1], want[:-1], atol=1e-6) and got[-1] == want[-1].round() == 3
        assert not torch.allclose(got, before)
        # Both trainers started every step from the server's statistics: after the last round
        # they differ only by their last batch (rank 1's data is scaled, so its variances grow).
        assert not torch.allclose(sent[0], sent[1])
        # Evaluation runs on the server's buffers, whatever the replica's own were.
        t = trainers[1]
        t.evaluate(torch.randn(4, 1, 28, 28))
        assert torch.allclose(flatten(t.buffers), got)
    finally:
        engine.close()


def test_an_overlapped_trainer_keeps_its_own_statistics_between_steps():
    """--overlap on: the reply that lands during step t carries the statistics this trainer
    handed in the step before, made before its last forward; loading them would undo that
    forward's moves. The replica keeps its own, so each forward goes on from the last, and what
    the server ends with is the trainer's."""
    cfg = ServerConfig(model=BN_MLP, devices=["cpu"], update="async", optimizer=OptimizerConfig(name="sgd", lr=0.01))
    engine = StepEngine(cfg, [torch.device("cpu")])
    try:
        trainer = make_trainer(engine, PushPullServer(engine), 0, overlap="on")
        assert trainer.overlap and trainer.send_buffers
        bn, server_bn = trainer.model.bn, engine.shards[0].module.bn
        for t, (x, y) in enumerate(batches(5, 0), start=1):
            trainer.step(x, y)
            assert int(bn.num_batches_tracked) == t  # one forward's move a step, none undone
            assert int(server_bn.num_batches_tracked) == t - 1  # handed in with step t's call
            if t >= 2:
                assert not torch.allclose(bn.running_mean, server_bn.running_mean)
        trainer.flush()
        assert torch.equal(flatten(persistent_buffers(server_bn)), flatten(trainer.buffers))
        assert int(server_bn.num_batches_tracked) == 5
        trainer.close()
    finally:
        engine.close()


def test_a_model_without_buffers_sends_none():
    engine = StepEngine(ServerConfig(model="mlp", devices=["cpu"], optimizer=OptimizerConfig()), [torch.device("cpu")])
    try:
        assert engine.buffers is None
        assert "buffers" not in PushPullServer(engine).join_info("t", join_request())
        with pytest.raises(ValueError, match="holds no buffers"):
            PullServer(engine).check_buffers(torch.zeros(3))
    finally:
        engine.close()


def test_a_constant_mask_of_minus_inf_is_taken_and_a_statistic_gone_bad_is_not():
    mask = nn.Transformer.generate_square_subsequent_mask(3).double()
    stat = torch.zeros(2)
    buffers = ServerBuffers([mask, stat], "average")
    same = flatten([mask, torch.tensor([1.0, 2.0])])
    assert buffers.receive("t1", same)
    buffers.commit()
    assert torch.equal(mask, nn.Transformer.generate_square_subsequent_mask(3).double()) and stat.tolist() == [1, 2]
    bad_stat = flatten([mask, torch.tensor([float("inf"), 2.0])])
    assert not buffers.receive("t2", bad_stat)  # inf where the server's is finite
    flipped = same.clone()
    flipped[1] = float("inf")  # +inf where the mask holds -inf: not the constant
    assert not buffers.receive("t2", flipped)
    nan = same.clone()
    nan[1] = float("nan")
    assert not buffers.receive("t2", nan)


def test_buffers_that_did_not_change_since_the_last_send_do_not_go_up_again():
    """A constant buffer (a mask) goes up with the first update only; a statistic that moves
    goes up with every one."""
    cfg = ServerConfig(model=BN_MLP, devices=["cpu"], update="async", optimizer=OptimizerConfig(name="sgd", lr=0.01))
    engine = StepEngine(cfg, [torch.device("cpu")])
    try:
        trainer = make_trainer(engine, PushPullServer(engine), 0)
        first = trainer.owed_buffers()
        assert first is not None and trainer.owed_buffers() is None  # nothing moved since
        x, _ = batches(1, 0)[0]
        trainer.model.train()(x)  # BatchNorm's statistics move
        assert trainer.owed_buffers() is not None and trainer.owed_buffers() is None
    finally:
        engine.close()
