"""Streaming DiLoCo on the trainer (``train --fragments F``): the model in F fragments, each
synced every H inner steps at its own place in the window, its exchange overlapping the inner
steps that follow (Douillard et al., 2025, arXiv 2501.18512).

Fragment f syncs after the inner steps t with ``t % H == f*H/F``: its pseudo-gradient (its
anchor minus its local weights) goes out without waiting, the trainer takes ``overlap`` (tau)
more inner steps, and then the fragment's new global weights come in, mixed with the local
ones that moved meanwhile: ``local <- alpha * local + (1 - alpha) * global`` (tau 0: the reply is
waited for and replaces them, as whole-model DiLoCo does); they become its anchor. With tau < H/F
one exchange at most is in flight, so a trainer's calls reach the server in order, each ending
the call before it, as every step protocol's do; and the peak bytes on the wire are 1/F of
a whole sync's. Why fragments are whole parameters and how they are made:
``psserver.common.fragments``; the server's half: ``DiLoCoServer.exchange_fragment``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from psserver.common.fragments import fragment_groups, fragment_offsets, pack, unpack_into
from psserver.common.quantize import ErrorFeedback, nbytes
from psserver.common.tensors import unflatten_into
from psserver.errors import UsageError

log = logging.getLogger(__name__)

DEFAULT_OVERLAP = 1
DEFAULT_MIX = 0.5


class StreamingWindows:
    """The fragments' windows of one DiLoCo trainer half: when each syncs, what it sends, how
    its reply is merged."""

    def __init__(self, half: Any, count: int, overlap: int | None, mix: float | None) -> None:
        """``half``: the DiLoCo trainer half it works for (``psserver.trainer.steps.diloco``,
        which imports this module)."""
        self.half = half
        channel = half.channel
        if len(channel.servers) > 1:
            raise UsageError(f"--fragments: a server of one process (this one has {len(channel.servers)}, which take "
                             "each window whole, split by partition)")
        if channel.info.get("dynamic_local_steps"):
            raise UsageError("--fragments: not with the server's --dynamic-local-steps")
        self.count = count
        self.overlap = DEFAULT_OVERLAP if overlap is None else overlap
        self.mix = DEFAULT_MIX if mix is None else float(mix)
        self.offsets: list[int] = []
        self.set_local_steps(half.local_steps)
        try:
            self.groups = fragment_groups([p.numel() for p in half.params], count)
        except ValueError as e:
            raise UsageError(f"--fragments: {e}") from None
        self.params = [[half.params[i] for i in group] for group in self.groups]
        self.anchor: list[torch.Tensor] = []
        """Each fragment's global weights as last received (fp32, flat)."""
        self.steps = [0] * count
        """Inner steps since each fragment last went out."""
        self.seconds = [0.0] * count
        self.samples = 0
        """Samples since fragment 0 last went out (each window's samples are counted once, with it)."""
        self.taken = 0
        """Inner steps taken since the session opened (the schedule's clock)."""
        self.pending: tuple[int, Any, int] | None = None
        """The fragment in flight: (index, future of its reply, the step at which it is merged)."""
        self._feedback: dict[int, ErrorFeedback] = {}

    def set_local_steps(self, h: int) -> None:
        """H, and each fragment's place in the window (``UsageError``: F and tau do not fit in it)."""
        count = self.count
        if count > h:
            raise UsageError(f"--fragments {count} with {h} local steps: at most one fragment per inner step")
        if self.overlap * count >= h:
            raise UsageError(f"--fragment-overlap {self.overlap} with --fragments {count} and {h} local steps: the "
                             f"overlap must be below H/F = {h / count:g} (one fragment's sync in flight at a time)")
        self.offsets = fragment_offsets(h, count)

    def open(self) -> None:
        """The replica holds the global weights: every fragment's anchor."""
        self.anchor = [pack(params) for params in self.params]

    def inner_step_done(self, samples: int, seconds: float) -> None:
        self.taken += 1
        for f in range(self.count):
            self.steps[f] += 1
            self.seconds[f] += seconds
        self.samples += samples

    def after_step(self) -> None:
        """After each inner step (counted: :meth:`inner_step_done`): merge the fragment whose
        overlap has run, send the one whose place in the window it is."""
        if self.pending is not None and self.taken >= self.pending[2]:
            self._merge()
        h = self.half.local_steps
        for f in range(self.count):
            if self.taken % h == self.offsets[f] and self.steps[f]:
                self._send(f)
                if self.overlap == 0:
                    self._merge()

    def flush(self) -> None:
        """Hand in every fragment's local steps so far and take its global weights whole (before
        evaluating or leaving): the replica then holds the server's weights of these syncs."""
        if self.pending is not None:  # no inner step since it went out: its reply is the global weights
            self._merge(replace=not self.steps[self.pending[0]])
        for f in range(self.count):
            if self.steps[f]:
                self._send(f, flushing=True)
                self._merge(replace=True)

    def _send(self, f: int, flushing: bool = False) -> None:
        half = self.half
        with torch.no_grad():
            delta = self.anchor[f] - pack(self.params[f])
        if half.bits is not None:
            sent: object = self._feedback.setdefault(f, ErrorFeedback(half.bits)).compress(delta)
            half.sync_bytes = nbytes(sent)
        else:
            sent = delta.to(half.wire_dtype)
            half.sync_bytes = sent.numel() * sent.element_size()
        if not half.syncs:
            log.info("diloco: streaming %d fragments, one every %d inner steps, each merged %d steps after it is "
                     "sent%s; %d bytes of pseudo-gradient the first", self.count, half.local_steps // self.count,
                     self.overlap, f" (alpha {self.mix:g})" if self.overlap else "", half.sync_bytes)
        # Numbered by the inner steps at its end, then by the schedule's sends before a flush's,
        # then by fragment: increasing across every call of this rank, so sent twice, applied once.
        number = (half.seq + self.taken) * 2 * self.count + (self.count if flushing else 0) + f + 1
        window = {"steps": self.steps[f], "seconds": float(self.seconds[f]), "base": half.base_steps}
        done = self.samples if f == 0 else 0
        buffers = half.owed_buffers() if f == 0 else None
        future = half.channel.call_async("exchange_fragment", f, self.count, sent, number, done, window, buffers)
        self.pending = (f, future, self.taken + self.overlap)
        self.steps[f], self.seconds[f] = 0, 0.0
        if f == 0:
            self.samples = 0
        half.syncs += 1

    def _merge(self, replace: bool = False) -> None:
        assert self.pending is not None
        f, future, _ = self.pending
        self.pending = None
        reply, told = future.wait()
        values = reply[0].float()
        keep = 0.0 if replace or self.overlap == 0 else self.mix
        unpack_into(values, self.params[f], keep)
        if f == 0 and len(reply) > 1 and self.half.buffers and not keep:
            # Mixed after an overlap, the replica keeps its own: the server's are of before the
            # overlap's forwards (running statistics, counts), which loading would undo.
            unflatten_into(reply[1], self.half.buffers)
        self.anchor[f] = values.to(self.anchor[f].device)
        self.half.outer_step = int(told["outer_step"])

