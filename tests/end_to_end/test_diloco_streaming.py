"""Streaming DiLoCo's two halves in one process, without RPC: fragments synced on their
staggered schedule, merged after their overlap, against a local loop written out by hand."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from psserver.common.fragments import fragment_groups, fragment_offsets
from psserver.config import OptimizerConfig, TrainerConfig
from psserver.errors import UsageError
from psserver.server.steps.diloco import DiLoCoServer
from psserver.trainer.rejoin import save_owed, take_owed
from psserver.trainer.steps.diloco import DiLoCoTrainer
from tests.end_to_end.diloco_halves import Channel, batches, diloco_engine, server_weights


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.parametrize("overlap,mix", [(0, None), (1, 0.5), (2, 0.25)])
def test_one_trainer_under_outer_sgd_lr1_is_its_inner_loop_with_each_fragment_mixed_after_its_overlap(overlap, mix):
    """Outer SGD at lr 1 hands a lone trainer's fragment back as it sent it, so the replica is
    the inner loop with, tau steps after each fragment's send, ``local <- alpha * local +
    (1 - alpha) * sent`` (tau 0: nothing changes): written out here on a copy of the model."""
    h, count, steps = 9, 3, 30
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0))
    try:
        config = TrainerConfig(local_steps=h, inner_optimizer="adamw", inner_lr=1e-2, fragments=count,
                               fragment_overlap=overlap, fragment_mix=mix)
        half = DiLoCoTrainer(Channel(DiLoCoServer(engine), "t", 0, config))
        half.open()
        local = copy.deepcopy(half.model)
        inner = torch.optim.AdamW(local.parameters(), lr=1e-2, weight_decay=0.0)
        params = list(local.parameters())
        groups = fragment_groups([p.numel() for p in params], count)
        offsets = fragment_offsets(h, count)
        alpha = 0.5 if mix is None else mix
        sent: dict[int, tuple[int, list[torch.Tensor]]] = {}  # fragment -> (merge step, its values sent)
        sends = 0
        for t, (x, y) in enumerate(batches(steps), start=1):
            half.step(x, y)
            half.after_step()
            inner.zero_grad()
            half.loss_fn(local(x), y).backward()
            inner.step()
            with torch.no_grad():
                for f, (due, values) in list(sent.items()):
                    if t >= due:
                        for i, v in zip(groups[f], values, strict=True):
                            params[i].mul_(alpha).add_(v, alpha=1 - alpha)
                        del sent[f]
                for f in range(count):
                    if t % h == offsets[f]:
                        sends += 1
                        if overlap:
                            sent[f] = (t + overlap, [params[i].detach().clone() for i in groups[f]])
            assert (flat(half.params) - flat(params)).abs().max() <= 1e-6, f"step {t}"
        assert engine.global_step == sends == half.syncs
    finally:
        engine.close()


def test_fragments_over_two_server_processes_are_the_inner_loop_under_outer_sgd_lr1_and_each_holds_its_part():
    """Two server processes, the model partitioned over them: each fragment's sync is one call
    to each, its part of the fragment (a group of the pieces that server holds). Under outer
    SGD at lr 1 and no overlap a lone trainer is its inner loop, each server's outer steps are
    the fragments' sends, and each holds its pieces of the replica's weights. (Outer async: a
    sync round of several servers is decided by server 0 over RPC, which the e2e tests run.)"""
    h, count, steps = 8, 2, 20
    engines = [diloco_engine(OptimizerConfig(name="sgd", lr=1.0), mode="async", servers=2, rank=r) for r in (0, 1)]
    try:
        config = TrainerConfig(local_steps=h, inner_optimizer="adamw", inner_lr=1e-2, fragments=count,
                               fragment_overlap=0)
        halves = [DiLoCoServer(e) for e in engines]
        half = DiLoCoTrainer(Channel(halves[0], "t", 0, config, others=(halves[1],)))
        half.open()
        assert all(half.stream.groups[s] for s in (0, 1))
        local = copy.deepcopy(half.model)
        inner = torch.optim.AdamW(local.parameters(), lr=1e-2, weight_decay=0.0)
        for t, (x, y) in enumerate(batches(steps), start=1):
            half.step(x, y)
            half.after_step()
            inner.zero_grad()
            half.loss_fn(local(x), y).backward()
            inner.step()
            assert (flat(half.params) - flat(local.parameters())).abs().max() <= 1e-6, f"step {t}"
        half.flush()  # fragment 0's 4 steps since its send at 16 (fragment 1 went at 20)
        sends = sum(1 for t in range(1, steps + 1) for o in fragment_offsets(h, count) if t % h == o) + 1
        assert [e.global_step for e in engines] == [sends, sends] and half.syncs == sends
        for server, e in enumerate(engines):
            assert torch.equal(server_weights(e), e.plan.split(list(half.params))[server])
    finally:
        for e in engines:
            e.close()


class LostReply:
    """A fragment sync whose reply never came: the server ran the call (``applied``) or never saw it."""

    def __init__(self, channel: Channel, applied: bool) -> None:
        if applied:
            channel.call("exchange_fragment", *channel.lost_args)

    def wait(self) -> None:
        raise RuntimeError("the server process went away")


@pytest.mark.parametrize("applied", [True, False], ids=["applied-before", "never-arrived"])
def test_a_fragment_sync_whose_reply_was_lost_is_sent_again_by_the_next_process_image_and_applied_once(
        applied, tmp_path, monkeypatch):
    """Fragment 1 goes out at inner step 2 (H = 4, F = 2, tau 1) and its reply is lost; the
    trainer's next process image (its owed window through the file of its user's only) sends it
    again under its number: applied once whether the dead call had reached the server or not,
    and its reply is the fragment's global weights in the new replica."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0), mode="async")
    try:
        config = TrainerConfig(local_steps=4, inner_optimizer="adamw", inner_lr=1e-2, fragments=2, fragment_overlap=1)
        server = DiLoCoServer(engine)
        channel = Channel(server, "t_1", 0, config)
        half = DiLoCoTrainer(channel)
        half.open()
        first, second = batches(3)[:2], batches(3)[2]
        for x, y in first:
            half.step(x, y)
        real = channel.call_async

        def lose(op, *args):
            channel.lost_args = args
            return LostReply(channel, applied)

        channel.call_async = lose
        half.after_step()  # step 2: fragment 1 goes out
        half.step(*second)
        with pytest.raises(RuntimeError, match="went away"):
            half.after_step()  # step 3: its merge finds the reply lost
        channel.call_async = real
        owed = take_owed(save_owed(half.owed_window()))
        assert owed["fragment"] == 1 and engine.global_step == (1 if applied else 0)
        server.trainer_gone("t_1", evicted=True)
        again = DiLoCoTrainer(Channel(server, "t_2", 0, config, steps_before=3))
        again.send_again(owed)
        assert engine.global_step == 1  # once, either way
        part = again.stream.parts(1)[0]
        values = torch.cat([t.reshape(-1) for t in part])
        server_values = torch.cat([engine.params[i].detach().reshape(-1) for i in again.stream.groups[0][1]])
        assert torch.equal(values, server_values) and torch.equal(again.stream.anchor[1][0], server_values)
    finally:
        engine.close()


def test_a_fragment_sync_moves_only_its_fragment_and_a_flush_hands_in_every_fragment():
    h, count = 4, 2
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=0.5))
    try:
        half = DiLoCoTrainer(Channel(DiLoCoServer(engine), "t", 0, TrainerConfig(
            local_steps=h, fragments=count, fragment_overlap=0)))
        half.open()
        groups = fragment_groups([p.numel() for p in half.params], count)
        before = [p.detach().clone() for p in engine.params]
        data = batches(h + 1)
        for x, y in data[:h // 2]:  # fragment 1's place (H/F): only its parameters move on the server
            half.step(x, y)
            half.after_step()
        assert engine.global_step == 1
        moved = {i for i, (p, b) in enumerate(zip(engine.params, before, strict=True)) if not torch.equal(p, b)}
        assert moved and moved <= set(groups[1])
        for x, y in data[h // 2:]:
            half.step(x, y)
            half.after_step()
        assert engine.global_step == 2  # fragment 0 at step H
        half.flush()  # one step since each fragment went out: both go again
        assert engine.global_step == 4
        assert torch.equal(flat(half.params), server_weights(engine))
    finally:
        engine.close()


def test_a_flush_right_after_a_scheduled_send_hands_in_every_other_fragment():
    """Numbers increase across the schedule's sends and a flush's at the same step: fragment 1
    goes out at step 2 (H/F), the flush then sends fragment 0, which is applied, not taken for
    a window sent again."""
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0))
    try:
        half = DiLoCoTrainer(Channel(DiLoCoServer(engine), "t", 0, TrainerConfig(
            local_steps=4, fragments=2, fragment_overlap=0)))
        half.open()
        for x, y in batches(2):
            half.step(x, y)
            half.after_step()
        assert engine.global_step == 1
        half.flush()
        assert engine.global_step == 2
        assert torch.equal(flat(half.params), server_weights(engine))
    finally:
        engine.close()


def test_the_librarys_own_syncs_each_hand_in_every_fragment():
    """``ps.sync()`` in a loop of its own: each counts one step and flushes every fragment."""
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0))
    try:
        half = DiLoCoTrainer(Channel(DiLoCoServer(engine), "t", 0, TrainerConfig(local_steps=4, fragments=2)))
        half.open()
        for done in (2, 4, 6):
            with torch.no_grad():
                half.params[0].add_(0.01)
                half.params[-1].add_(0.01)
            half.inner_step_done(8)
            half.sync()
            assert engine.global_step == done
    finally:
        engine.close()


def test_a_trainer_keeps_the_fragment_count_it_started_with():
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0))
    try:
        server = DiLoCoServer(engine)
        half = DiLoCoTrainer(Channel(server, "t", 0, TrainerConfig(local_steps=4, fragments=2, fragment_overlap=0)))
        half.open()
        for x, y in batches(2):
            half.step(x, y)
            half.after_step()
        with pytest.raises(ValueError, match="this trainer streams 2 fragments"):
            server.exchange_fragment("t", 0, 3, torch.zeros(3), 10**6)
    finally:
        engine.close()


@pytest.mark.parametrize("compress", ["none", "int8"])
def test_two_sync_trainers_make_one_round_per_fragment_window_and_end_on_the_servers_weights(compress):
    """Sync K = 2: each fragment's window of both trainers is one round (outer step); after the
    flush both replicas hold the server's weights."""
    h, count, steps = 6, 2, 24
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=0.7, momentum=0.9, args={"nesterov": True}), k=2)
    try:
        server = DiLoCoServer(engine)
        halves = [DiLoCoTrainer(Channel(server, f"t{r}", r, TrainerConfig(
            local_steps=h, fragments=count, fragment_overlap=1, compress=compress))) for r in range(2)]
        errors: list[BaseException] = []

        def run(half: DiLoCoTrainer, seed: int) -> None:
            try:
                half.open()
                for x, y in batches(steps, seed=seed):
                    half.step(x, y)
                    half.after_step()
                half.flush()
            except BaseException as e:  # noqa: BLE001 - reported by the test's thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(half, 10 + r)) for r, half in enumerate(halves)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads)
        # fragment 0 at 6, 12, 18, 24; fragment 1 at 3, 9, 15, 21 and again at the flush (3 steps since)
        assert [half.syncs for half in halves] == [9, 9]
        assert engine.global_step == 9
        for half in halves:
            fragment1 = fragment_groups([p.numel() for p in half.params], count)[1]
            for i in fragment1:
                assert torch.equal(half.params[i].detach(), engine.params[i].detach())
    finally:
        engine.close()


@pytest.mark.parametrize("args,error", [
    ((2, 2, torch.zeros(3), 1), "fragment 2 of 2"),
    ((0, 99, torch.zeros(3), 1), "fragment 0 of 99"),
    ((0, 2, torch.zeros(3), 1), "one flat float tensor"),
    ((0, 2, torch.zeros(3, dtype=torch.int64), 1), "one flat float tensor"),
    ((0, 2, "x", 1), "one flat float tensor"),
    ((True, 2, torch.zeros(3), 1), "fragment True of 2"),
    ((0, 2, None, 0), "number"),
    ((0, 2, None, 2**62 + 1), "number"),
])
def test_a_malformed_fragment_is_refused_in_one_line(args, error):
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0))
    try:
        server = DiLoCoServer(engine)
        engine.trainer_joined("t")
        with pytest.raises(ValueError, match=error):
            server.exchange_fragment("t", *args)
        assert engine.global_step == 0
    finally:
        engine.close()


@pytest.mark.parametrize("config,error", [
    ({"local_steps": 4, "fragments": 2, "fragment_overlap": 2}, "below H/F = 2"),
    ({"local_steps": 2, "fragments": 3}, "at most one fragment per inner step"),
])
def test_a_schedule_that_cannot_stream_is_refused_before_a_step(config, error):
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0))
    try:
        with pytest.raises(UsageError, match=error):
            DiLoCoTrainer(Channel(DiLoCoServer(engine), "t", 0, TrainerConfig(**config)))
    finally:
        engine.close()
