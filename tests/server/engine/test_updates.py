"""Update modes and shard concurrency, in-process (no RPC): the logic under the server."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from torch import nn

from psserver.config import OptimizerConfig
from psserver.server.engine.engine import make_updater
from psserver.server.engine.shard import Shard, warm_optimizers
from psserver.server.engine.sync_updates import SyncUpdater
from psserver.server.engine.updates import AsyncUpdater, SSPUpdater, Updater


def make_shard():
    torch.manual_seed(0)
    shard = Shard(0, nn.Sequential(nn.Linear(4, 3)), torch.device("cpu"))
    shard.init_optimizer(OptimizerConfig(name="sgd", lr=1.0))
    return shard


def grads(shard, value):
    return {p: torch.full_like(p, value) for p in shard.params}


def test_async_applies_each_gradient():
    shard = make_shard()
    before = shard.params[0].detach().clone()
    steps = []
    up = AsyncUpdater([shard], lambda s, n: steps.append((s, n)))
    up.submit("a", grads(shard, 1.0), 8)
    up.submit("b", grads(shard, 1.0), 8)
    assert steps == [(1, 8), (2, 8)]
    assert torch.allclose(shard.params[0], before - 2.0)


def test_sync_averages_k_gradients_and_barrier_follows_membership():
    shard = make_shard()
    before = shard.params[0].detach().clone()
    steps = []
    up = SyncUpdater([shard], lambda s, n: steps.append((s, n)), k=2)
    for t in ("a", "b", "c"):
        up.trainer_joined(t)
    up.submit("a", grads(shard, 1.0), 4)
    assert steps == []  # waits for a second gradient
    up.submit("b", grads(shard, 3.0), 4)
    assert steps == [(1, 8)]
    assert torch.allclose(shard.params[0], before - 2.0)  # mean of 1 and 3
    # A trainer waits for its round; the round completes when another contributes.
    up.submit("a", grads(shard, 1.0), 4)
    released = threading.Event()

    def waiter():
        up.wait_turn("a", timeout=10)
        released.set()

    th = threading.Thread(target=waiter)
    th.start()
    assert not released.wait(0.3)
    # "b" and "c" are lost: the barrier shrinks to the one live trainer and applies.
    up.trainer_gone("b")
    up.trainer_gone("c")
    assert released.wait(5)
    th.join()
    assert steps[-1] == (2, 4)
    # A trainer that joins grows it again.
    up.trainer_joined("d")
    up.submit("a", grads(shard, 1.0), 4)
    assert len(steps) == 2
    up.submit("d", grads(shard, 1.0), 4)
    assert len(steps) == 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_on_step_runs_with_the_lock_free(mode):
    """A listener may copy the shards under the updater's lock from another thread (as a
    checkpoint does on the compute thread): the updater must not hold it while it calls back.
    Holding it was the sync-mode checkpoint deadlock."""
    shard = make_shard()
    seen = []

    def take_and_release(got: list) -> None:
        if up.lock.acquire(timeout=5):
            up.lock.release()
            got.append(True)
        else:
            got.append(False)

    def on_step(step, samples):
        got: list[bool] = []
        th = threading.Thread(target=take_and_release, args=(got,))
        th.start()
        th.join()
        seen.append(got[0])

    up = AsyncUpdater([shard], on_step) if mode == "async" else SyncUpdater([shard], on_step, k=2)
    up.trainer_joined("a")
    up.trainer_joined("b")
    up.submit("a", grads(shard, 1.0), 4)
    up.submit("b", grads(shard, 1.0), 4)
    up.trainer_gone("b")
    up.submit("a", grads(shard, 1.0), 4)  # a round of one, applied at once
    assert seen == [True] * (3 if mode == "async" else 2)


def test_sync_after_a_restart_waits_for_the_trainers_of_before_then_goes_on_without_them():
    """Restarted from its state in memory where 2 trainers trained: the first one back does not
    make a round alone (a run without the restart would not have); once the other is back the
    round is theirs. A trainer that never comes back holds the rounds only until the timeout."""
    shard = make_shard()
    steps = []
    up = SyncUpdater([shard], lambda s, n: steps.append((s, n)), k=2)
    up.await_rejoins(2, timeout=30)
    up.trainer_joined("a")
    up.submit("a", grads(shard, 1.0), 4)
    assert steps == []  # "b" trained before the restart: the round waits for it
    up.trainer_joined("b")
    up.submit("b", grads(shard, 3.0), 4)
    assert steps == [(1, 8)]

    up = SyncUpdater([shard], lambda s, n: steps.append((s, n)), k=2)
    up.await_rejoins(2, timeout=0.3)
    up.trainer_joined("a")
    up.submit("a", grads(shard, 1.0), 4)
    assert steps == [(1, 8)]
    deadline = time.monotonic() + 10
    while len(steps) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert steps == [(1, 8), (1, 4)]  # "b" is not back after 0.3 s: "a"'s round goes alone
    up.submit("a", grads(shard, 1.0), 4)
    assert steps[-1] == (2, 4)  # and from then on the barrier follows membership


def test_sync_at_a_fresh_start_waits_for_k_trainers_for_a_while_after_the_first_joins():
    """Two trainers launched together join a little apart: the first one's gradients wait for
    the second's, so every round has the K asked for. One that never comes holds the rounds
    only for the bound, counted from the first join (not from the server's start)."""
    shard = make_shard()
    steps = []
    up = SyncUpdater([shard], lambda s, n: steps.append((s, n)), k=2)
    up.await_first_trainers(timeout=30)
    time.sleep(0.1)  # however long before the first trainer comes
    up.trainer_joined("a")
    up.submit("a", grads(shard, 1.0), 4)
    assert steps == []  # the round waits for the second trainer
    up.trainer_joined("b")
    up.submit("b", grads(shard, 3.0), 4)
    assert steps == [(1, 8)]

    steps.clear()
    up = SyncUpdater([shard], lambda s, n: steps.append((s, n)), k=2)
    up.await_first_trainers(timeout=0.3)
    time.sleep(0.5)  # longer than the bound before anyone joins: it has not started
    up.trainer_joined("a")
    up.submit("a", grads(shard, 1.0), 4)
    assert steps == []
    deadline = time.monotonic() + 10
    while not steps and time.monotonic() < deadline:
        time.sleep(0.05)
    assert steps == [(1, 4)]  # 0.3 s after "a" joined without "b": "a"'s round goes alone
    up.submit("a", grads(shard, 1.0), 4)
    assert steps[-1] == (2, 4)  # and from then on the barrier follows membership
    one = SyncUpdater([shard], lambda s, n: None, k=1)
    one.await_first_trainers(timeout=30)
    assert one.required() == 1  # K = 1 waits for no one


def test_sync_refuses_two_gradients_from_one_trainer_in_a_round():
    shard = make_shard()
    up = SyncUpdater([shard], lambda s, n: None, k=2)
    up.trainer_joined("a")
    up.trainer_joined("b")
    up.submit("a", grads(shard, 1.0), 1)
    with pytest.raises(RuntimeError, match="two gradients"):
        up.submit("a", grads(shard, 1.0), 1)


def test_clone_forward_survives_a_concurrent_step():
    """The classic PS example goes wrong here: a step between forward and backward."""
    shard = make_shard()
    x = torch.randn(5, 4, requires_grad=True)  # an activation, as from an earlier stage
    weight = shard.params[0].detach().clone()  # what both forwards below compute with
    out_a = shard.forward(x, clone=True)
    # Another trainer's step changes the weights in place before "a" runs its backward.
    shard.apply(grads(shard, 0.5))
    out_a.sum().backward()
    assert shard.params[0].grad is not None  # gradient reached the leaf through the clone
    assert torch.allclose(x.grad, weight.sum(0).expand(5, 4))  # from the weights of its forward
    # Without the clone the backward reads the stepped weights. The fused optimizers (the
    # server's: FUSED) do not bump the parameters' version counter, so autograd does not even
    # refuse (a per-tensor step would: "modified by an inplace operation"): the gradient is
    # silently that of weights the forward never saw.
    x.grad, shard.params[0].grad = None, None
    out_b = shard.forward(x, clone=False)
    shard.apply(grads(shard, 0.5))
    out_b.sum().backward()
    assert not torch.allclose(x.grad, weight.sum(0).expand(5, 4))
    assert torch.allclose(x.grad, shard.params[0].detach().sum(0).expand(5, 4))


# ---- ssp: bounded staleness, and every mode's clocks and staleness ---------------------------


def step(up: Updater, trainer: str, shard, value: float = 0.0) -> None:
    """One whole step of ``trainer`` as the engine drives it: open, gradient, applied."""
    up.step_opened(trainer)
    up.submit(trainer, grads(shard, value), 1)


def clock(up: Updater, trainer: str) -> int:
    p = up.progress(trainer)
    assert p is not None
    return p.clock


class Waiter:
    """``wait_turn`` on a thread of its own, as an RPC thread calls it."""

    def __init__(self, up: Updater, trainer: str, timeout: float = 30.0) -> None:
        self.released = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                up.wait_turn(trainer, timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                self.error = e
            self.released.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def blocked(self, for_s: float = 0.3) -> bool:
        return not self.released.wait(for_s)

    def done(self, timeout: float = 10.0) -> bool:
        ok = self.released.wait(timeout)
        self.thread.join(timeout)
        return ok and self.error is None


def ssp(staleness: int, *trainers: str) -> tuple[SSPUpdater, Shard]:
    """An ssp updater whose ``trainers`` joined and take part, all at clock 0 (as if each had
    asked for its first step: entering without a grant, so the tests decide who starts)."""
    shard = make_shard()
    up = SSPUpdater([shard], lambda s, n: None, staleness)
    for t in trainers:
        up.trainer_joined(t)
    with up._clocks:  # noqa: SLF001 - the entry a first request makes, without the request
        for t in trainers:
            up._enter(t)  # noqa: SLF001
    return up, shard


def start(up: Updater, trainer: str, shard=None) -> None:
    """Ask for the next step, waiting as an RPC thread would (it must be granted at once
    here), open it, and with ``shard`` hand in its gradient too."""
    up.wait_turn(trainer, timeout=0.5)
    up.step_opened(trainer)
    if shard is not None:
        up.submit(trainer, grads(shard, 0.0), 1)


def test_make_updater_builds_each_mode():
    shard = make_shard()
    assert type(make_updater("async", [shard], lambda s, n: None, 2)) is AsyncUpdater
    assert type(make_updater("sync", [shard], lambda s, n: None, 2)) is SyncUpdater
    up = make_updater("ssp", [shard], lambda s, n: None, 2, staleness=3)
    assert isinstance(up, SSPUpdater) and up.mode == "ssp" and up.staleness == 3
    with pytest.raises(ValueError, match="unknown update mode"):
        make_updater("hogwild", [shard], lambda s, n: None, 2)


@pytest.mark.timeout(30)
def test_ssp_with_staleness_0_is_bulk_synchronous():
    """S = 0: every trainer starts step k together, once all of them asked for it."""
    up, shard = ssp(0, "a", "b")
    assert not up.try_start("a")  # b has not asked for step 1
    w = Waiter(up, "a")
    assert w.blocked()
    assert up.try_start("b")  # b asks: both start step 1 at once
    assert w.done()
    assert up.clocks() == {"a": 1, "b": 1}
    for t in ("a", "b"):
        up.step_opened(t)  # the granted step opens: the clock does not tick twice
    assert up.clocks() == {"a": 1, "b": 1}
    up.submit("a", grads(shard, 1.0), 1)
    assert not up.try_start("a")  # b is still in its step 1
    w = Waiter(up, "a")
    up.submit("b", grads(shard, 1.0), 1)
    assert w.blocked()  # b's step ended, but b has not asked for step 2 yet
    assert up.clocks() == {"a": 1, "b": 1}
    start(up, "b")  # b asks: both start step 2
    assert w.done() and up.clocks() == {"a": 2, "b": 2}


@pytest.mark.timeout(30)
def test_ssp_fast_trainer_waits_at_the_bound_until_the_slow_one_starts_a_step():
    up, shard = ssp(2, "fast", "slow")
    for _ in range(2):  # steps 1 and 2 need slow at step >= -1, 0
        assert up.try_start("fast")
        up.step_opened("fast")
        up.submit("fast", grads(shard, 0.0), 1)
    assert up.clocks() == {"fast": 2, "slow": 0}
    assert not up.try_start("fast")  # step 3 needs slow at its step 1
    w = Waiter(up, "fast")
    assert w.blocked()
    assert up.try_start("slow")  # slow starts step 1: fast may start step 3, in the same instant
    assert w.done()
    assert up.clocks() == {"fast": 3, "slow": 1}  # S apart, never more
    up.step_opened("fast")
    up.submit("fast", grads(shard, 0.0), 1)
    assert not up.try_start("fast")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staleness", [0, 2])
def test_ssp_invariant_holds_with_threads_racing(staleness):
    """Four trainers of different speeds; a sampler reads the clocks at random instants: the
    live ones never differ by more than S, and every update lands."""
    names = ("t0", "t1", "t2", "t3")
    up, shard = ssp(staleness, *names)
    spread: list[int] = []
    stop = threading.Event()

    def train(name: str, delay: float, steps: int) -> None:
        for _ in range(steps):
            up.wait_turn(name, timeout=20)
            up.step_opened(name)
            time.sleep(delay)
            up.submit(name, grads(shard, 0.0), 1)

    def sample() -> None:
        while not stop.is_set():
            clocks = up.clocks().values()
            spread.append(max(clocks) - min(clocks))
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=train, args=(f"t{i}", 0.002 * i * i, 30)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(40)
    stop.set()
    sampler.join(5)
    assert not any(th.is_alive() for th in threads)
    assert len(spread) > 100 and max(spread) == staleness, (max(spread), len(spread))
    assert up.global_step == 120


@pytest.mark.timeout(30)
def test_ssp_waiter_released_when_the_slowest_leaves_or_the_server_closes():
    up, shard = ssp(1, "fast", "slow", "other")
    start(up, "fast", shard)
    start(up, "other", shard)
    start(up, "slow")  # it dies in its step 1
    start(up, "fast", shard)  # step 2: slow and other at step 1
    w = Waiter(up, "fast")  # step 3 needs slow (and other) at step 2
    assert w.blocked()
    start(up, "other")
    assert w.blocked()
    up.trainer_gone("slow")  # evicted after --trainer-timeout: it bounds nobody any more
    assert w.done()
    gone = up.progress("slow")
    assert gone is not None and gone.clock == 1 and gone.done == 0  # kept for status, as it left
    up.step_opened("slow")  # a late call of the gone trainer tracks nothing and bounds nobody
    assert up.progress("slow") == gone and "slow" not in up.clocks()
    up.step_opened("fast")
    up.submit("fast", grads(shard, 0.0), 1)
    w = Waiter(up, "fast")  # step 4 needs other at step 3
    assert w.blocked()
    up.close()
    assert w.done()
    up.wait_turn("fast", timeout=0.1)  # closed: nobody waits any more
    assert up.try_start("fast")


@pytest.mark.timeout(30)
def test_ssp_wait_is_bounded_by_its_timeout():
    up, _ = ssp(0, "fast", "slow")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ssp: fast waited 0.3s to start its step 1 for slow to reach its "
                                           r"step 1 \(--staleness 0\); it is at 0"):
        up.wait_turn("fast", timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 5
    assert not up.try_start("slow")  # the one that gave up does not count as asking any more
    assert up.clocks() == {"fast": 0, "slow": 0}


@pytest.mark.timeout(30)
def test_ssp_a_joining_trainer_holds_nobody_and_enters_at_the_slowest_clock():
    up, shard = ssp(0, "a", "b")
    up.trainer_joined("c")  # joined, still loading its data: it bounds nobody
    for _ in range(3):  # a and b in lockstep, never waiting for c
        w = Waiter(up, "a")
        start(up, "b")
        assert w.done()
        up.step_opened("a")
        for t in ("a", "b"):
            up.submit(t, grads(shard, 0.0), 1)
    assert up.progress("c") is None
    w = Waiter(up, "a")  # a asks for step 4; b is still between steps
    assert w.blocked()
    assert not up.try_start("c")  # c's first request: it enters at the slowest clock, 3, asking for 4
    c = up.progress("c")
    assert (c.clock, c.done) == (3, 3)
    assert w.blocked()  # b has not asked: nobody starts step 4 without it
    wc = Waiter(up, "c")
    start(up, "b")  # the last to ask: a, b and c start step 4 together
    assert w.done() and wc.done()
    assert up.clocks() == {"a": 4, "b": 4, "c": 4}
    # With S = 1 a trainer that enters while the slowest is mid-step starts at once.
    up, shard = ssp(1, "a", "b")
    for _ in range(4):
        start(up, "a", shard)
        start(up, "b", shard)
    start(up, "a", shard)
    start(up, "b")  # b is in its step 5
    up.trainer_joined("d")
    assert up.try_start("d") and up.try_start("a")
    assert up.clocks() == {"a": 6, "b": 5, "d": 6}
    # A trainer never joined (a late call) is bounded by nobody and tracked nowhere.
    up.wait_turn("stranger", timeout=0.1)
    assert up.progress("stranger") is None
    # Alone on an idle server, a new incarnation starts at 0 and at once.
    up2 = SSPUpdater([make_shard()], lambda s, n: None, 0)
    up2.trainer_joined("only")
    assert up2.try_start("only") and up2.clocks() == {"only": 1}


def test_async_staleness_counts_the_updates_between_a_step_and_its_update():
    """A opens on step 0, B makes two whole steps, A's update lands on step 2: staleness 2."""
    shard = make_shard()
    up = AsyncUpdater([shard], lambda s, n: None)
    up.trainer_joined("a")
    up.trainer_joined("b")
    assert up.progress("a") is None  # no step yet
    up.step_opened("a")
    step(up, "b", shard)
    step(up, "b", shard)
    up.submit("a", grads(shard, 0.0), 1)
    a, b = up.progress("a"), up.progress("b")
    assert (a.clock, a.done, a.staleness, a.max_staleness) == (1, 1, 2, 2)
    # b entered at a's clock (1: the slowest of those taking part), then made two steps.
    assert (b.clock, b.done, b.staleness, b.max_staleness) == (3, 3, 0, 0)
    step(up, "a", shard)  # on the current weights this time
    a = up.progress("a")
    assert (a.staleness, a.max_staleness, a.clock) == (0, 2, 2)
    assert up.global_step == 4


def test_an_overlapping_trainers_staleness_counts_from_the_reply_before():
    """A trainer with lag 1 computes each step on the parameters of its step before's start:
    alone, every update after its first is one step stale (its own previous one)."""
    shard = make_shard()
    up = AsyncUpdater([shard], lambda s, n: None)
    up.trainer_joined("a")
    up.set_lag("a", 1)
    staleness = []
    for _ in range(4):
        up.step_opened("a")
        up.submit("a", grads(shard, 0.0), 1)
        staleness.append(up.progress("a").staleness)
    assert staleness == [0, 1, 1, 1]
    up.trainer_gone("a")
    up.trainer_joined("a")  # a new incarnation: no lag until it says so
    up.step_opened("a")
    up.submit("a", grads(shard, 0.0), 1)
    assert up.progress("a").staleness == 0
    with pytest.raises(ValueError):
        up.set_lag("a", 2)


def test_ssp_holds_an_overlapping_trainer_one_step_tighter():
    """S = 2 and lag 1: the overlapping trainer may start step k only once the other started
    k - 1, so the parameters it computes step k on (its step k - 1's) hold the other's updates
    up to k - 3 = k - S - 1, as without overlap."""
    up, shard = ssp(2, "fast", "slow")
    up.set_lag("fast", 1)
    assert up.try_start("fast")  # step 1 needs slow at 0
    up.step_opened("fast")
    up.submit("fast", grads(shard, 0.0), 1)
    assert up.clocks() == {"fast": 1, "slow": 0}
    assert not up.try_start("fast")  # step 2 needs slow at its step 1 (without lag: at 0)
    w = Waiter(up, "fast")
    assert w.blocked()
    assert up.try_start("slow")
    assert w.done() and up.clocks() == {"fast": 2, "slow": 1}


def test_progress_of_given_up_steps_and_untracked_trainers():
    shard = make_shard()
    up = AsyncUpdater([shard], lambda s, n: None)
    up.trainer_joined("a")
    up.step_opened("a")
    up.step_closed("a")  # given up
    up.step_closed("a")  # idempotent
    up.step_opened("a")
    up.step_opened("a")  # the open one is given up by the next
    a = up.progress("a")
    assert (a.clock, a.done, a.opened_at) == (3, 2, 0)
    up.submit("nobody", grads(shard, 0.0), 1)  # applied, tracked nowhere
    assert up.progress("nobody") is None and up.global_step == 1


def test_a_step_opened_by_a_gradient_made_elsewhere_reads_nothing():
    """A rejoined overlapping trainer's first call hands in the gradient it owed (its step
    opened as it arrives, ``read=False``) and brings the weights its next step computes on (it
    is not overlapping yet): that update is not one step staler than the truth."""
    shard = make_shard()
    up = AsyncUpdater([shard], lambda s, n: None)
    up.trainer_joined("a")
    up.set_lag("a", 1)
    staleness = []
    up.step_opened("a", read=False)  # the gradient owed from before the rejoin
    up.submit("a", grads(shard, 0.0), 1)
    for _ in range(3):
        up.step_opened("a")
        up.submit("a", grads(shard, 0.0), 1)
        staleness.append(up.progress("a").staleness)
    assert staleness == [0, 1, 1]  # reading from the first call's weights: [1, 1, 1]


def test_sync_staleness_is_zero_when_every_trainer_is_in_the_round():
    shard = make_shard()
    up = SyncUpdater([shard], lambda s, n: None, k=2)
    up.trainer_joined("a")
    up.trainer_joined("b")
    for _ in range(3):
        for t in ("a", "b"):
            up.wait_turn(t, timeout=5)
            up.step_opened(t)
        for t in ("a", "b"):
            up.submit(t, grads(shard, 0.0), 1)
    assert up.global_step == 3
    for t, entered_at in (("a", 0), ("b", 1)):  # b took part once a had started its step 1
        p = up.progress(t)
        assert (p.clock, p.done, p.staleness, p.max_staleness) == (entered_at + 3, entered_at + 3, 0, 0)


def leader_and_follower(trainers):
    """Server 0's sync updater (K=2) and a follower's, both told of ``trainers``: the updaters,
    their shards, the (step, samples) each applied, and the rounds server 0 decided."""
    leader_shard, shard = make_shard(), make_shard()
    leader_steps, steps = [], []
    leader = SyncUpdater([leader_shard], lambda s, n: leader_steps.append((s, n)), k=2)
    follower = make_updater("sync", [shard], lambda s, n: steps.append((s, n)), 2, follower=True)
    decided = []
    leader.round_listeners.append(lambda r, names: decided.append((r, names)))
    for t in trainers:
        leader.trainer_joined(t)
        follower.trainer_joined(t)
    return leader, follower, leader_shard, shard, leader_steps, steps, decided


def test_a_follower_applies_the_rounds_server_0_decides_in_their_order():
    """Several server processes, sync: server 0's rounds, whatever order gradients and
    decisions arrive in here; a round waits for its gradients, never for a trainer that is gone."""
    leader, follower, leader_shard, shard, _, steps, decided = leader_and_follower("abc")
    # Server 0: c and a make round 1; b waits for round 2.
    for t, v in (("c", 3.0), ("a", 1.0), ("b", 5.0)):
        leader.submit(t, grads(leader_shard, v), 4)
    assert decided == [(1, ["a", "c"])]
    # Here b's gradient arrives first, then round 1's decision, then a's and c's gradients.
    follower.submit("b", grads(shard, 5.0), 4)
    follower.decide(*decided[0])
    assert steps == []
    follower.submit("a", grads(shard, 1.0), 4)
    assert steps == []  # c's is still on its way
    follower.submit("c", grads(shard, 3.0), 4)
    assert steps == [(1, 8)]
    assert torch.equal(shard.params[0], leader_shard.params[0])
    # a and c go on; round 2 is b's and a's. A decision ahead of its turn waits for round 2.
    leader.submit("a", grads(leader_shard, 2.0), 4)
    leader.trainer_gone("c")  # round 2 had a and b: complete
    assert decided[1] == (2, ["a", "b"])
    follower.trainer_gone("c")
    # Round 3's decision comes early (it names x, which never reached this server): it waits.
    follower.decide(3, ["b", "x"])
    follower.submit("a", grads(shard, 2.0), 4)
    follower.decide(*decided[1])
    assert steps == [(1, 8), (2, 8)]
    assert torch.equal(shard.params[0], leader_shard.params[0])
    # wait_turn returns once a trainer's gradient is in an applied round.
    follower.wait_turn("a", timeout=1.0)
    # Round 3 applies once b's gradient is here, without x's.
    follower.submit("b", grads(shard, 1.0), 4)
    assert steps[-1] == (3, 4)


def test_the_optimizer_warm_up_imports_what_the_first_optimizer_needs_in_the_background():
    thread = warm_optimizers()
    assert thread.daemon  # never holds a stopping server up
    thread.join(120)
    assert not thread.is_alive()
    assert "torch._dynamo" in sys.modules  # what a first optimizer's param group imports


@pytest.mark.parametrize("order", ["decision first", "departure first"])
@pytest.mark.parametrize("trainers", [2, 3], ids=["round closes as it leaves", "round open as it leaves"])
def test_a_follower_keeps_the_gradient_of_a_trainer_that_left_for_the_round_that_holds_it(order, trainers):
    """Server 0 keeps a gone trainer's gradient in its round; its word of the departure and the
    round's decision reach a follower by separate calls, in either order: the follower applies
    the same round, with the same gradients, and stays at server 0's step and weights."""
    leader, follower, leader_shard, shard, leader_steps, steps, decided = leader_and_follower("abc"[:trainers])
    leader.submit("a", grads(leader_shard, 1.0), 4)
    follower.submit("a", grads(shard, 1.0), 4)
    leader.trainer_gone("a")  # its last call answered, it leaves before its round closed
    word = leader.departure("a")

    def depart():
        follower.leaving("a", *word)
        follower.trainer_gone("a")

    if trainers == 3:  # b's gradient closes round 1, which holds a's
        leader.submit("b", grads(leader_shard, 3.0), 4)
        follower.submit("b", grads(shard, 3.0), 4)
    assert len(decided) == 1
    if order == "departure first":
        depart()
        follower.decide(*decided[0])
    else:
        follower.decide(*decided[0])
        depart()
    assert steps == leader_steps and leader.global_step == follower.global_step == 1
    assert torch.equal(shard.params[0], leader_shard.params[0])


def test_a_follower_drops_a_gradient_server_0_never_had_once_the_trainer_left():
    leader, follower, _, shard, _, _, _ = leader_and_follower("ab")
    follower.submit("a", grads(shard, 1.0), 4)  # it died before its call to server 0
    leader.trainer_gone("a")
    follower.leaving("a", *leader.departure("a"))
    follower.trainer_gone("a")
    follower.submit("b", grads(shard, 1.0), 4)
    follower.decide(1, ["b"])
    assert follower.global_step == 1 and "a" not in follower._pending
