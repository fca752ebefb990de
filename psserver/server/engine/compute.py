"""One thread for the server's model compute on CPU.

Why: PyTorch's CPU kernels parallelise with OpenMP, and libgomp keeps one team of worker
threads per thread that ever started a parallel region. Once those teams hold more threads
than there are CPUs, libgomp cuts the spin-wait of idle workers from ~300,000 iterations to
100, so each of the hundreds of parallel regions in a step wakes its workers through the
kernel. RPC handlers run on a pool of threads (16 by default), so without this every handler
thread grows its own team: measured on the 2-core VM, the same mnist_cnn step ran 15-25%
slower, at 1.6 instead of 2.0 cores, as soon as a second thread had run a step
(``docs/benchmarks.md``, "What bought what"). The handlers therefore do their bookkeeping
and waiting on their RPC thread and hand the tensor work to this one thread.

On GPUs the kernels are asynchronous and CPU threading barely matters, while stages on
different devices gain from overlapping callers: there ``run`` calls inline.

Trainer compute's work here is an optimizer step and copies in and out of flat buffers:
memory-bound, and on a host whose cores the trainers use, an OpenMP team spinning between
regions takes them from the trainers (measured on the 2-core VM with ``--step pushpull``: 22-59
ms per exchange with the server's 2-thread team, 3-5 ms with one thread). Such work runs with
``threads=1``: no team wakes, and the team of server-compute work sleeps once idle.

What stays outside: ``--step plain``. ``dist_autograd`` runs its backward on PyTorch's own
threads, which this module cannot reach, so its server has several teams whatever it does;
its forward and update stay on the RPC thread (measured: handing them over only added
latency). ``--step chained``, the evaluation, the model's construction, restores,
checkpoints' copies and sync rounds applied on a trainer's departure run here. A server that
has served ``plain`` trainers keeps their teams, so one job's trainers should share one
``--step``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")


class ComputeThread:
    """Runs callables one at a time on a dedicated thread (``inline``: on the caller's)."""

    def __init__(self, *, inline: bool = False, name: str = "psserver-compute") -> None:
        self.inline = inline
        self._threads: int | None = None  # intra-op threads of this thread's last callable
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self._thread.start()

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` on the compute thread, with the server's intra-op threads;
        its result or its exception."""
        return self.run_with(None, fn, *args, **kwargs)

    def run_with(self, threads: int | None, fn: Callable[..., T], *args, **kwargs) -> T:
        """``run``, with ``threads`` intra-op threads (None: the server's ``--compute-threads``)."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn(*args, **kwargs)  # inline: GPU stages, or already on the compute thread
        if self._closed:
            raise RuntimeError("psserver is stopping: its compute thread has stopped")
        future: Future = Future()
        self._queue.put((future, threads, fn, args, kwargs))
        return future.result()

    def _use_threads(self, threads: int | None) -> None:
        """OpenMP's thread count is per thread: set this one's when the callable asks another."""
        if threads != self._threads:
            torch.set_num_threads(threads if threads is not None else self._default_threads)
            self._threads = threads

    def _loop(self) -> None:
        self._default_threads = torch.get_num_threads()  # the server's, set before it started
        while True:
            item = self._queue.get()
            if item is None:
                self._refuse_rest()
                return
            future, threads, fn, args, kwargs = item
            try:
                self._use_threads(threads)
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, raised there
                future.set_exception(e)
            del future, fn, args, kwargs, item  # no tensor outlives its call here

    def _refuse_rest(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].set_exception(RuntimeError("psserver is stopping: its compute thread has stopped"))

    def close(self, timeout: float = 30.0) -> None:
        """Finish what is queued, then stop (later calls raise)."""
        if self._thread is None or self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("compute thread still busy after %.0fs at shutdown", timeout)
