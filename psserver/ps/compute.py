"""One thread for the server's model compute on CPU.

Why: PyTorch's CPU kernels parallelise with OpenMP, and libgomp keeps one team of worker
threads per thread that ever started a parallel region. Once those teams hold more threads
than there are CPUs, libgomp cuts the spin-wait of idle workers from ~300,000 iterations to
100, so each of the hundreds of parallel regions in a step wakes its workers through the
kernel. RPC handlers run on a pool of threads (16 by default), so without this every handler
thread grows its own team: measured on the 2-core VM, the same mnist_cnn step ran 15-25%
slower, at 1.6 instead of 2.0 cores, as soon as a second thread had run a step
(``benchmarks/README.md``, "What bought what"). The handlers therefore do their bookkeeping
and waiting on their RPC thread and hand the tensor work to this one thread.

On GPUs the kernels are asynchronous and CPU threading barely matters, while stages on
different devices gain from overlapping callers: there ``run`` calls inline.

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

log = logging.getLogger(__name__)

T = TypeVar("T")


class ComputeThread:
    """Runs callables one at a time on a dedicated thread (``inline``: on the caller's)."""

    def __init__(self, *, inline: bool = False, name: str = "psserver-compute") -> None:
        self.inline = inline
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self._thread.start()

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` on the compute thread; its result or its exception."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        if self._closed:
            raise RuntimeError("psserver is stopping: its compute thread has stopped")
        future: Future = Future()
        self._queue.put((future, fn, args, kwargs))
        return future.result()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._refuse_rest()
                return
            future, fn, args, kwargs = item
            try:
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
