"""Versions for readers: one copy of the model per version however many read, none while no
reader asks, at most one per interval, and each of one whole step."""

from __future__ import annotations

import threading
import time

import torch

from psserver.server.versions import Versions, encode


class Model:
    """A "model" whose every tensor holds its global step, updated under one lock as the
    server's update lock: a version that mixes two steps shows at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.step = 0
        self.state = {"w": torch.zeros(3, 4), "b": torch.zeros(5), "n": torch.zeros((), dtype=torch.int64)}
        self.copies = 0

    def train(self, steps: int, versions: Versions | None = None) -> None:
        for _ in range(steps):
            with self.lock:
                self.step += 1
                for t in self.state.values():
                    t.fill_(self.step)
            if versions is not None:
                versions.on_step(self.step, 1)

    def copy(self) -> tuple[int, dict[str, torch.Tensor]]:
        with self.lock:
            self.copies += 1
            return self.step, {k: v.clone() for k, v in self.state.items()}


def versions_of(model: Model, interval: float = 0.0) -> Versions:
    return Versions(model.copy, lambda: model.step, interval, lambda: "toy")


def test_no_copy_until_a_reader_asks_and_one_per_version_however_many_read():
    model = Model()
    versions = versions_of(model)
    model.train(5, versions)
    assert model.copies == 0
    reads = [versions.read(None, 1.0) for _ in range(4)]
    assert {r.step for r in reads} == {5} and model.copies == 1
    assert all(float(t.max()) == float(t.min()) == 5 for t in reads[0].state.values())


def test_wait_for_a_newer_step_with_a_timeout():
    model = Model()
    versions = versions_of(model)
    assert versions.read(None, 1.0).step == 0
    t0 = time.monotonic()
    assert versions.read(0, 0.2) is None and time.monotonic() - t0 >= 0.2
    threading.Timer(0.1, model.train, (1, versions)).start()
    newer = versions.read(0, 5.0)
    assert newer is not None and newer.step == 1


def test_going_back_to_a_checkpoint_starts_a_new_history_and_serves_no_version_of_before():
    model = Model()
    versions = versions_of(model)
    model.train(5, versions)
    before = versions.read(None, 1.0)
    with model.lock:  # every server went back to the checkpoint of step 2
        model.step = 2
        for t in model.state.values():
            t.fill_(2)
    versions.new_history()
    assert versions.history != before.history
    t0 = time.monotonic()
    again = versions.read(before.step, 5.0, before.history)  # a reader waiting past step 5 of before
    assert again.step == 2 and again.history == versions.history and time.monotonic() - t0 < 1
    assert float(again.state["w"].max()) == 2 and versions.read(None, 1.0).step == 2


def test_at_most_one_copy_per_interval_and_every_version_is_one_step():
    model = Model()
    versions = versions_of(model, interval=0.05)
    stop = threading.Event()

    def train():
        while not stop.is_set():
            model.train(1, versions)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        seen, t0 = [], time.monotonic()
        step = -1
        while time.monotonic() - t0 < 0.5:
            v = versions.read(step, 2.0)
            assert v is not None and v.step > step
            assert all(float(t.min()) == float(t.max()) == v.step for t in v.state.values())  # no torn version
            step = v.step
            seen.append(v.step)
    finally:
        stop.set()
        trainer.join()
    assert len(seen) >= 3
    assert model.copies <= 0.5 / 0.05 + 2  # the interval bounds the copies, not the steps


def test_readers_are_kept_by_name_with_their_step_and_age():
    model = Model()
    versions = versions_of(model)
    model.train(2, versions)
    v = versions.read(None, 1.0)
    versions.read_done("rollout-0", "ipv4:127.0.0.1:5", v)
    versions.read_done("rollout-0", "ipv4:127.0.0.1:5", v)
    versions.read_done("rollout-1", "ipv4:127.0.0.1:6", v)
    readers = versions.readers()
    assert [(r.name, r.step, r.reads) for r in readers] == [("rollout-0", 2, 2), ("rollout-1", 2, 1)]
    assert all(0 <= r.age_s < 5 for r in readers)
    ages = versions.age_histogram()
    assert ages.count == 3 and ages.counts[-1] == 3


def test_encoding_halves_floats_in_bfloat16_and_keeps_integers():
    state = {"w": torch.randn(4, 4), "n": torch.arange(3)}
    full, half = encode(state, None), encode(state, torch.bfloat16)
    assert [m[1] for m in full.metas] == ["float32", "int64"] and [m[1] for m in half.metas] == ["bfloat16", "int64"]
    assert len(half.data) == 4 * 4 * 2 + 3 * 8 and len(full.data) == 4 * 4 * 4 + 3 * 8
