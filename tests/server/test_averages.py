"""``ps.allreduce`` on the server: rounds of small tensors over the live trainers, in-process
(threads stand for the trainers' RPC calls)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from psserver.server.averages import Averages


def run_all(averages: Averages, live: list[str], calls: dict[str, tuple], timeout: float = 5.0) -> dict:
    """Each trainer's call on a thread of its own; what each got back (or raised)."""
    got: dict[str, object] = {}

    def one(trainer: str, args: tuple) -> None:
        try:
            got[trainer] = averages.reduce(trainer, *args, len(live), live=lambda: list(live), timeout=timeout)
        except (ValueError, RuntimeError) as e:
            got[trainer] = e

    threads = [threading.Thread(target=one, args=(t, a)) for t, a in calls.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return got


@pytest.mark.parametrize(("op", "want"), [("average", [2.0, 20.0]), ("sum", [6.0, 60.0]), ("min", [1.0, 10.0]),
                                         ("max", [3.0, 30.0])])
def test_every_live_trainer_gets_the_same_reduction(op, want):
    averages = Averages()
    live = ["a", "b", "c"]
    calls = {t: ("loss", torch.tensor([v, 10 * v]), op) for t, v in zip(live, (1.0, 2.0, 3.0), strict=True)}
    got = run_all(averages, live, calls)
    assert all(g.tolist() == want for g in got.values()), got
    assert averages._rounds == {}  # every round taken is gone


def test_rounds_of_one_name_follow_each_other_and_a_trainer_that_left_is_not_waited_for():
    averages = Averages()
    live = ["a", "b"]
    first = run_all(averages, live, {"a": ("m", torch.tensor(1.0), "average"),
                                     "b": ("m", torch.tensor(3.0), "average")})
    assert {float(v) for v in first.values()} == {2.0}
    # b leaves while a waits in the next round: a gets its own value.
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.setdefault("a", averages.reduce(
        "a", "m", torch.tensor(5.0), "average", 2, live=lambda: list(live), timeout=10)))
    waiter.start()
    while not averages._rounds:  # a's round is open
        time.sleep(0.01)
    live.remove("b")
    averages.trainer_gone("b")
    waiter.join(10)
    assert float(result["a"]) == 5.0


def test_a_round_waits_for_the_jobs_trainers_that_have_not_joined_yet():
    averages = Averages()
    live = ["a"]
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.setdefault("a", averages.reduce(
        "a", "m", torch.tensor(1.0), "average", 2, live=lambda: list(live), timeout=10)))
    waiter.start()
    live.append("b")  # the second trainer joins later, then calls
    got = averages.reduce("b", "m", torch.tensor(3.0), "average", 2, live=lambda: list(live), timeout=10)
    waiter.join(10)
    assert float(got) == float(result["a"]) == 2.0


def test_a_round_nobody_completes_names_who_is_missing_and_bad_values_are_refused():
    averages = Averages()
    got = run_all(averages, ["a", "b"], {"a": ("m", torch.tensor(1.0), "average")}, timeout=0.3)
    assert isinstance(got["a"], RuntimeError) and "b did not take part within 0.3s" in str(got["a"])
    assert averages._rounds == {}
    for name, value, op, message in [
        ("m", torch.zeros(2 ** 21), "average", "at most"), ("m", torch.zeros(2, dtype=torch.complex64), "sum", "real"),
        ("m", "1.0", "sum", "real CPU tensor"), ("m", torch.zeros(1), "median", "op must be one of"),
        ("x" * 300, torch.zeros(1), "sum", "a name is a str"), (5, torch.zeros(1), "sum", "a name is a str"),
    ]:
        with pytest.raises(ValueError, match=message):
            averages.reduce("a", name, value, op, 1, live=lambda: ["a"], timeout=1)
    # A trainer whose call does not fit the open round's shape is told, in one line.
    got = run_all(averages, ["a", "b"], {"a": ("s", torch.zeros(2), "sum"), "b": ("s", torch.zeros(3), "sum")},
                  timeout=0.3)
    told = [str(g) for g in got.values() if isinstance(g, ValueError)]
    assert len(told) == 1 and "every trainer calls it alike" in told[0], got


def test_a_trainer_that_left_before_the_round_is_not_waited_for():
    """Rank 0 left (Ctrl-C) before rank 1's next round: the job's 2 ranks have both joined
    once, so rank 1's round completes with itself (it waited 30 s and raised)."""
    averages = Averages()
    got = averages.reduce("b", "m", torch.tensor(3.0), "average", 2, live=lambda: ["b"], timeout=5,
                          ranks_seen=lambda: 2)
    assert float(got) == 3.0
    with pytest.raises(RuntimeError, match="1 of the job's 2 trainers \\(not joined yet\\)"):
        averages.reduce("b", "m", torch.tensor(3.0), "average", 2, live=lambda: ["b"], timeout=0.2,
                        ranks_seen=lambda: 1)
