"""A flat gradient filled as backward produces it, bucket by bucket (as DDP's reducer does).

Backward makes the gradients of the last layers first. Each parameter's gradient is copied
(and cast to the wire dtype) into its place in one preallocated flat buffer from a tensor hook,
while autograd goes on with the layers before it; when every parameter of a bucket has its
gradient, the bucket is handed on (``on_ready``: the staged transport starts its copy to pinned
host memory on a side stream). What is left after backward is a few launches, not a copy of the
whole gradient.

Buckets are runs of consecutive parameters, taken from the last: each is one contiguous slice
of the flat buffer, whose layout stays the model's (what the server reads). The first bucket is
small (``FIRST_BUCKET_BYTES``) so that its hand-off starts early, the others up to ``cap_bytes``;
a parameter larger than the cap is a bucket of its own.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

import torch

FIRST_BUCKET_BYTES = 1 << 20
"""The first bucket's size, as DDP's first bucket (1 MiB)."""


def assign_buckets(numels: Sequence[int], itemsize: int, cap_bytes: int,
                   first_bytes: int = FIRST_BUCKET_BYTES) -> list[range]:
    """The buckets of parameters with ``numels`` values each of ``itemsize`` bytes: ranges of
    parameter indices, in the order backward fills them (the last parameters first), each
    ascending and contiguous, together every index once."""
    if cap_bytes <= 0 or itemsize <= 0:
        raise ValueError(f"bucket cap and item size must be > 0, got {cap_bytes} and {itemsize}")
    buckets: list[range] = []
    stop = len(numels)
    size = 0
    limit = min(first_bytes, cap_bytes)
    for i in range(len(numels) - 1, -1, -1):
        nbytes = numels[i] * itemsize
        if size and size + nbytes > limit:
            buckets.append(range(i + 1, stop))
            stop, size, limit = i + 1, 0, cap_bytes
        size += nbytes
    if stop:
        buckets.append(range(stop))
    return buckets


class GradBuckets:
    """The flat gradient of ``params`` (in their order, in ``dtype``, on ``device``), filled by
    hooks during a backward between :meth:`arm` and :meth:`finish`; outside it the hooks do
    nothing (a user's own backward, evaluation). ``on_ready(start, stop)``: a bucket's slice of
    :attr:`flat` (element offsets) holds its gradients, called on the thread that ran the hook.
    ``depth`` buffers take turns (:attr:`index`), one per :meth:`arm`: with 2, a backward fills
    one while the gradient before, in the other, is still being sent."""

    def __init__(self, params: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device | str,
                 cap_bytes: int, on_ready: Callable[[int, int], None] | None = None, depth: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.params = list(params)
        numels = [p.numel() for p in self.params]
        self.offsets = list(itertools.accumulate(numels, initial=0))
        self._flats = [torch.empty(self.offsets[-1], dtype=dtype, device=device) for _ in range(depth)]
        self.index = depth - 1
        """Which buffer the last :meth:`arm` chose."""
        self.flat = self._flats[self.index]
        """The buffer the last :meth:`arm` chose."""
        self.buckets = assign_buckets(numels, self.flat.element_size(), cap_bytes)
        self._bucket_of = {i: b for b, r in enumerate(self.buckets) for i in r}
        self.on_ready = on_ready
        self._lock = threading.Lock()  # hooks may run on autograd's device threads
        self._armed = False
        self._filled: list[bool] = []
        self._pending: list[int] = []
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._removed = False
        self._hook_trainable()
        self.missing: list[int] = []
        """The parameters (indices) the last backward gave no gradient: unused, or frozen."""

    def _hook_trainable(self) -> None:
        """A hook on every parameter that requires grad now (a frozen one cannot take one, and
        one unfrozen later gets its hook at the next :meth:`arm`), until :meth:`remove`."""
        if self._removed:
            return
        for i, p in enumerate(self.params):
            if p.requires_grad and i not in self._hooks:
                self._hooks[i] = p.register_hook(self._hook(i))

    def __len__(self) -> int:
        return len(self.buckets)

    def arm(self) -> None:
        """The next backward fills the next buffer in turn (what it held before is overwritten)."""
        self._hook_trainable()
        with self._lock:
            self.index = (self.index + 1) % len(self._flats)
            self.flat = self._flats[self.index]
            self._armed = True
            self._filled = [False] * len(self.params)
            self._pending = [len(r) for r in self.buckets]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def fill(grad: torch.Tensor) -> None:
            with self._lock:
                if not self._armed or self._filled[i]:
                    return
                self._filled[i] = True
            with torch.no_grad():
                self.flat[self.offsets[i]:self.offsets[i + 1]].view_as(grad).copy_(grad)
            self._count(self._bucket_of[i])
        return fill

    def _count(self, bucket: int) -> None:
        with self._lock:
            self._pending[bucket] -= 1
            ready = self._pending[bucket] == 0
        if ready and self.on_ready is not None:
            r = self.buckets[bucket]
            self.on_ready(self.offsets[r.start], self.offsets[r.stop])

    def finish(self) -> torch.Tensor:
        """The flat gradient after backward: a parameter backward did not reach counts zero
        (its bucket is handed on then; :attr:`missing` names it); the hooks are off until the
        next :meth:`arm`."""
        with self._lock:
            if not self._armed:
                raise RuntimeError("finish() without arm()")
            self._armed = False
            missing = self.missing = [i for i, done in enumerate(self._filled) if not done]
        for i in missing:
            self.flat[self.offsets[i]:self.offsets[i + 1]].zero_()
            self._count(self._bucket_of[i])
        return self.flat

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        self._removed = True
        for h in self._hooks.values():
            h.remove()
        self._hooks = {}


def bucket_cap_bytes(mb: float) -> int:
    """``--bucket-cap-mb`` (checked by the trainer's config) in bytes, at least one."""
    return max(1, int(mb * (1 << 20)))
