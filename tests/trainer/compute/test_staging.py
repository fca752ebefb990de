"""A staged part's send waits for its copy on the sender thread, not in the autograd hook that
filled it (the hook waited on the copy stream for every part: backward stalled)."""

from __future__ import annotations

import threading

import pytest

from psserver.trainer.compute.staging import AfterCopy


class Copy:
    """A copy that lands when the test says so (a CUDA event's ``synchronize``)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited_on: list[str] = []

    def synchronize(self) -> None:
        self.waited_on.append(threading.current_thread().name)
        assert self.done.wait(10)


class Rpc:
    def __init__(self, value=None, error=None) -> None:
        self.value, self.error = value, error

    def wait(self):
        if self.error is not None:
            raise self.error
        return self.value


def test_a_part_is_sent_once_its_copy_landed_without_the_caller_waiting():
    sender = AfterCopy.sender()
    try:
        first, second, sent = Copy(), Copy(), []
        a = AfterCopy(sender, first, lambda: sent.append("a") or Rpc("a done"))
        b = AfterCopy(sender, second, lambda: sent.append("b") or Rpc(error=RuntimeError("lost the server")))
        assert sent == []  # the caller came back before either copy landed
        second.done.set()
        first.done.set()
        assert a.wait() == "a done"
        with pytest.raises(RuntimeError, match="lost the server"):
            b.wait()
        assert sent == ["a", "b"]  # in the order backward filled them
        assert first.waited_on[0].startswith("psserver-parts") and first.waited_on[0] != threading.current_thread().name
    finally:
        sender.shutdown(wait=True)
