"""The server's compute thread (``psserver.server.engine.compute``): every call runs on one thread, in
order, with its result or exception handed back, and nothing hangs after ``close``."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from psserver.server.engine.compute import ComputeThread


def test_calls_from_many_threads_run_on_one_thread():
    compute = ComputeThread()
    try:
        seen: set[str] = set()

        def work(i: int) -> torch.Tensor:
            seen.add(threading.current_thread().name)
            return torch.full((2,), float(i)) * 2

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: compute.run(work, i), range(40)))
        assert [float(r[0]) for r in results] == [2.0 * i for i in range(40)]
        assert seen == {"psserver-compute"}
        # A call made from the compute thread itself runs inline instead of waiting on itself.
        assert compute.run(lambda: compute.run(threading.current_thread)).name == "psserver-compute"
    finally:
        compute.close()


def test_exceptions_reach_the_caller_and_the_thread_survives():
    compute = ComputeThread()
    try:
        with pytest.raises(ValueError, match="bad shape"):
            compute.run(lambda: (_ for _ in ()).throw(ValueError("bad shape")))
        assert compute.run(lambda a, b=0: a + b, 1, b=2) == 3
    finally:
        compute.close()


@pytest.mark.timeout(30)
def test_close_finishes_queued_work_then_refuses():
    compute = ComputeThread()
    gate = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(compute.run, lambda: gate.wait(10) and "done")
        while compute._queue.qsize():  # the slow call has started
            pass
        closer = pool.submit(compute.close)
        gate.set()
        assert slow.result(10) == "done"
        closer.result(10)
    with pytest.raises(RuntimeError, match="stopping"):
        compute.run(lambda: 1)


def test_inline_runs_on_the_caller():
    compute = ComputeThread(inline=True)
    assert compute.run(threading.current_thread) is threading.current_thread()
    compute.close()


def test_a_callable_may_ask_for_its_own_thread_count_and_the_next_gets_the_servers_back():
    """Trainer compute's updates run with one intra-op thread, server compute with the server's."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    compute = ComputeThread()
    try:
        assert compute.run_with(1, torch.get_num_threads) == 1
        assert compute.run(torch.get_num_threads) == 2
        assert compute.run_with(1, torch.get_num_threads) == 1
        assert compute.run_with(None, torch.get_num_threads) == 2
    finally:
        compute.close()
        torch.set_num_threads(before)
