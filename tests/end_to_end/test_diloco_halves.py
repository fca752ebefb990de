"""The two halves of ``--step diloco`` in one process, without RPC: the trainer half's windows
against the server half's outer optimizer, checked against a local loop and by hand."""

from __future__ import annotations

import copy
import os
import threading
from typing import Any

import pytest
import torch

from psserver.common.messages import QuantizedFlat
from psserver.common.quantize import dequantize, nbytes
from psserver.config import OptimizerConfig, TrainerConfig
from psserver.server.steps.diloco import DiLoCoServer
from psserver.trainer.steps.diloco import DiLoCoTrainer
from tests.end_to_end.diloco_halves import Channel, batches, diloco_engine, server_weights


@pytest.mark.parametrize("h", [1, 5])
def test_one_trainer_with_outer_sgd_lr1_equals_a_local_loop_of_its_inner_optimizer(h):
    """θ - (anchor - local) = local: one trainer's DiLoCo under outer SGD (lr 1, no momentum)
    is its inner loop, the inner AdamW's state carried across windows on the trainer."""
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0))
    try:
        half = DiLoCoTrainer(Channel(DiLoCoServer(engine), "t", 0,
                                     TrainerConfig(local_steps=h, inner_optimizer="adamw", inner_lr=1e-2)))
        half.open()
        local = copy.deepcopy(half.model)
        inner = torch.optim.AdamW(local.parameters(), lr=1e-2, weight_decay=0.0)  # the flags: weight decay 0
        data = batches(4 * h)
        for x, y in data:
            half.step(x, y)
            half.after_step()
            inner.zero_grad()
            half.loss_fn(local(x), y).backward()
            inner.step()
        assert engine.global_step == 4 and half.syncs == 4
        want = torch.cat([p.detach().reshape(-1) for p in local.parameters()])
        assert (server_weights(engine) - want).abs().max() <= 1e-6
        assert (torch.cat([p.detach().reshape(-1) for p in half.params]) - want).abs().max() <= 1e-6
    finally:
        engine.close()


def test_a_frozen_parameter_is_left_out_of_the_outer_step():
    """A parameter the trainer froze (requires_grad False) has no pseudo-gradient, as a torch
    optimizer sees no .grad for it: the outer optimizer's weight decay leaves it as it was."""
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0, weight_decay=0.5))
    try:
        half = DiLoCoTrainer(Channel(DiLoCoServer(engine), "t", 0, TrainerConfig(local_steps=2)))
        half.open()
        frozen = half.params[0]
        frozen.requires_grad_(False)
        before = server_weights(engine).clone()
        for x, y in batches(4):
            half.step(x, y)
            half.after_step()
        after, n = server_weights(engine), frozen.numel()
        assert engine.global_step == 2
        assert torch.equal(after[:n], before[:n])
        assert not torch.equal(after[n:], before[n:])  # the others did move (decayed and stepped)
    finally:
        engine.close()


def test_pseudo_gradient_is_anchor_minus_local_weights():
    """Local weights 2 above the anchor give -2: a gradient's sign (the server steps against it)."""
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0))
    try:
        half = DiLoCoTrainer(Channel(DiLoCoServer(engine), "t", 0, TrainerConfig(local_steps=1)))
        half.open()
        with torch.no_grad():  # values whose difference is exact in fp32
            for p, a in zip(half.params, half.anchor, strict=True):
                a.fill_(0.25)
                p.fill_(2.25)
        assert all(torch.equal(d, torch.full_like(d, -2.0)) for d in half.pseudo_gradient())
    finally:
        engine.close()


def test_outer_nesterov_on_three_trainers_averaged_pseudo_gradients_is_the_hand_computation():
    """Two rounds of K = 3: ḡ the mean of the three Δ = anchor - local; b₁ = ḡ₁, θ₁ = θ₀ - η(ḡ₁ + μb₁);
    b₂ = μb₁ + ḡ₂, θ₂ = θ₁ - η(ḡ₂ + μb₂)."""
    lr, mu = 0.7, 0.9
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=lr, momentum=mu, args={"nesterov": True}), k=3)
    try:
        server = DiLoCoServer(engine)
        halves = [DiLoCoTrainer(Channel(server, f"t{i}", i, TrainerConfig(local_steps=2, inner_optimizer="sgd",
                                                                           inner_lr=0.05))) for i in range(3)]
        for half in halves:
            half.open()
        inner = [torch.optim.SGD(half.params, lr=0.05) for half in halves]
        theta = server_weights(engine).clone()
        b = None
        for rnd in range(2):
            deltas = []
            for i, half in enumerate(halves):
                for x, y in batches(2, seed=10 * rnd + i):  # the library's way: the loop's own optimizer
                    inner[i].zero_grad()
                    half.loss_fn(half.model(x), y).backward()
                    inner[i].step()
                    half.inner_step_done(len(x), 0.01)
                deltas.append(torch.cat([d.reshape(-1) for d in half.pseudo_gradient()]))
            threads = [threading.Thread(target=half.sync) for half in halves]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            g = torch.stack(deltas).mean(0)
            b = g.clone() if b is None else mu * b + g
            theta = theta - lr * (g + mu * b)
            assert engine.global_step == rnd + 1
            assert (server_weights(engine) - theta).abs().max() <= 1e-6
            for half in halves:  # the reply is every replica's weights and anchor
                got = torch.cat([p.detach().reshape(-1) for p in half.params])
                assert torch.equal(got, server_weights(engine))
                assert torch.equal(torch.cat([a.reshape(-1) for a in half.anchor]), got)
    finally:
        engine.close()


def test_a_window_sent_again_under_its_number_is_applied_once():
    """The server process restarted, and the trainer sends again the window whose reply it never
    got: its number (the inner steps at the window's end) says it was applied."""
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0))
    try:
        server = DiLoCoServer(engine)
        half = DiLoCoTrainer(Channel(server, "t", 0, TrainerConfig(local_steps=3)))
        for x, y in batches(3):
            half.step(x, y)
            half.after_step()
        assert engine.global_step == 1 and half.seq == 3
        before = server_weights(engine).clone()
        delta = [[torch.ones(s.num_params) for s in engine.shards]]
        window = {"steps": 3, "seconds": 0.1, "base": 3}
        server.exchange("t", delta[0], 0, None, None, None, 24, 3, None, None, window)
        assert engine.global_step == 1 and torch.equal(server_weights(engine), before)
    finally:
        engine.close()


def test_dynamic_local_steps_size_a_slow_trainers_window_by_its_speed():
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=0.5), k=2, mode="async", dynamic=True)
    try:
        server = DiLoCoServer(engine)
        fast, slow = (DiLoCoTrainer(Channel(server, n, r, TrainerConfig(local_steps=8))) for r, n in enumerate("fs"))
        for half, seconds in ((fast, 0.01), (slow, 0.04)):  # slow: a quarter of fast's inner step rate
            half.open()
            for _ in range(8):
                half.inner_step_done(8, seconds)
            half.sync()
        assert engine.global_step == 2
        assert slow.local_steps == 2 and slow.base_steps == 8
        fast.inner_step_done(8, 0.01)
        fast.sync()
        assert fast.local_steps == 8
    finally:
        engine.close()


@pytest.mark.parametrize("compress,bits", [("int8", 8), ("int4", 4)])
def test_a_quantized_pseudo_gradient_is_what_the_server_applies_and_its_rounding_is_carried(compress, bits):
    """--compress: each sync sends Q(Δ + e), the server applies exactly its decoded values (outer
    SGD lr 1: θ' = θ - deQ), the trainer keeps e' = (Δ + e) - deQ for the next sync, and the
    buffer costs a quarter (int8) or an eighth (4 bits) of fp32, plus a scale per 256 values."""
    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0))
    try:
        channel = Channel(DiLoCoServer(engine), "t", 0, TrainerConfig(local_steps=2, compress=compress))
        sent: list[tuple[QuantizedFlat, torch.Tensor]] = []
        call = channel.call

        def spy(op: str, *args: Any) -> Any:
            if op == "exchange" and args[0] is not None:  # the replica still holds its local weights
                sent.append((args[0][0], torch.cat([p.detach().reshape(-1) for p in half.params])))
            return call(op, *args)

        channel.call = spy
        half = DiLoCoTrainer(channel)
        half.open()
        carried = torch.zeros_like(server_weights(engine))
        for x, y in batches(6):
            before = server_weights(engine).clone()
            syncs = len(sent)
            half.step(x, y)
            half.after_step()
            if len(sent) == syncs:
                continue
            q, local = sent[-1]
            assert isinstance(q, QuantizedFlat) and q.bits == bits
            decoded = dequantize(q)
            assert torch.equal(server_weights(engine), before - decoded)
            (feedback,) = half._feedback.values()
            # Δ + e (what was coded) = deQ + e' (what was sent, and what is carried)
            assert torch.allclose((before - local) + carried, decoded + feedback.residual, atol=1e-6)
            carried = feedback.residual.clone()
            assert half.sync_bytes == nbytes(q) < decoded.numel() * 4 / (3.9 if bits == 8 else 7.5)
        assert engine.global_step == len(sent) == 3 and carried.abs().max() > 0
        assert engine.updater.progress("t").received_bytes == sum(nbytes(q) for q, _ in sent)  # status, metrics
    finally:
        engine.close()


def test_a_window_whose_sync_failed_is_sent_again_by_the_next_process_image_and_applied_once(tmp_path):
    """The sync's call fails (the server lost before it answered): the window it carried, saved
    for the next process image, is sent again there under its number: applied when the server
    had not, and once more it is a window sent again, not applied."""
    from psserver.trainer.rejoin import save_owed, take_owed

    engine = diloco_engine(OptimizerConfig(name="sgd", lr=1.0))
    try:
        server = DiLoCoServer(engine)
        channel = Channel(server, "t", 0, TrainerConfig(local_steps=2, compress="int8"))
        half = DiLoCoTrainer(channel)
        half.open()
        data = batches(2)
        half.step(*data[0])
        half.after_step()
        lost = channel.call
        channel.call = lambda op, *args: (_ for _ in ()).throw(RuntimeError("server lost"))
        half.step(*data[1])
        with pytest.raises(RuntimeError, match="server lost"):
            half.after_step()
        channel.call = lost
        assert engine.global_step == 0
        path = save_owed(half.owed_window())
        again = DiLoCoTrainer(Channel(server, "t2", 0, TrainerConfig(local_steps=2, compress="int8")))
        again.send_again(take_owed(path))
        assert engine.global_step == 1 and engine.samples_seen == 16
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in again.params]), server_weights(engine))
        again.send_again(half.owed_window())  # its number was applied: not again
        assert engine.global_step == 1
    finally:
        engine.close()


def test_an_owed_window_file_another_user_could_write_is_not_taken(tmp_path):
    from psserver.trainer.rejoin import save_owed, take_owed

    path = save_owed({"number": 3})
    os.chmod(path, 0o666)
    assert take_owed(path) is None and not os.path.exists(path)
    assert take_owed(save_owed({"number": 3})) == {"number": 3}
