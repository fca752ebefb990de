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
a whole sync's. With several server processes a fragment's sync is one call to each, all in
flight at once, each carrying the fragment's part that server holds. Why fragments are whole
parameters (or whole pieces of the partition plan) and how they are made:
``psserver.common.fragments``; the server's half: ``DiLoCoServer.exchange_fragment``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from psserver.common.fragments import fragment_groups, fragment_offsets, pack, server_pieces, unpack_into
from psserver.common.messages import QuantizedFlat
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
        if channel.info.get("dynamic_local_steps"):
            raise UsageError("--fragments: not with the server's --dynamic-local-steps")
        self.count = count
        self.overlap = DEFAULT_OVERLAP if overlap is None else overlap
        self.mix = DEFAULT_MIX if mix is None else float(mix)
        self.offsets: list[int] = []
        self.set_local_steps(half.local_steps)
        self.servers = len(channel.servers)
        try:
            # Each server's part of every fragment: a group of the pieces it holds (one server:
            # its parameters whole), the same groups its server half makes of them.
            self.groups = [fragment_groups([t.numel() for t in server_pieces(half.params, half.plan, s)], count)
                           for s in range(self.servers)]
        except ValueError as e:
            where = f" on each of {self.servers} server processes" if self.servers > 1 else ""
            raise UsageError(f"--fragments{where}: {e}") from None
        self.anchor: list[list[torch.Tensor]] = []
        """Each fragment's global weights as last received (fp32, flat), one per server process."""
        self.steps = [0] * count
        """Inner steps since each fragment last went out."""
        self.seconds = [0.0] * count
        self.samples = 0
        """Samples since fragment 0 last went out (each window's samples are counted once, with it)."""
        self.taken = 0
        """Inner steps taken since the session opened (the schedule's clock)."""
        self.pending: tuple[int, Any, int] | None = None
        """The fragment in flight: (index, future of its replies, the step at which it is merged)."""
        self._feedback: dict[tuple[int, int], ErrorFeedback] = {}

    def parts(self, f: int) -> list[list[torch.Tensor]]:
        """Fragment ``f``'s tensors on each server process, views into the replica's parameters."""
        return [[pieces[i] for i in self.groups[s][f]]
                for s, pieces in enumerate(server_pieces(self.half.params, self.half.plan, s)
                                           for s in range(self.servers))]

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
        self.anchor = [[pack(part) for part in self.parts(f)] for f in range(self.count)]

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
        sent: list[object] = []
        squares = 0.0
        with torch.no_grad():
            for s, part in enumerate(self.parts(f)):
                delta = self.anchor[f][s] - pack(part)
                squares += float(delta.square().sum())
                if half.bits is not None:
                    sent.append(self._feedback.setdefault((f, s), ErrorFeedback(half.bits)).compress(delta))
                else:
                    sent.append(delta.to(half.wire_dtype))
        half.sync_bytes = sum(nbytes(t) if isinstance(t, QuantizedFlat) else t.numel() * t.element_size()
                              for t in sent)
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
        # Several servers each clip their part by the whole fragment's norm, as one would the fragment.
        norm = math.sqrt(squares) if self.servers > 1 else None
        # What a lost reply leaves owed: the trainer's next process image sends it again, under its number.
        half.sending = {"fragment": f, "count": self.count, "flat": [[t] for t in sent], "number": number,
                         "done": done, "window": window, "buffers": buffers, "norm": norm}
        future = self._call(f, sent, number, done, window, buffers, norm)
        self.pending = (f, future, self.taken + self.overlap)
        self.steps[f], self.seconds[f] = 0, 0.0
        if f == 0:
            self.samples = 0
        half.syncs += 1

    def _call(self, f: int, sent: list, number: int, done: int, window: dict, buffers: torch.Tensor | None,
              norm: float | None) -> Any:
        """Fragment ``f``'s sync, one call to each server process with its part, all in flight at
        once (the window's samples and the buffers to server 0, as a whole-model sync's): a
        future of their replies."""
        args = [(f, self.count, part, number, done if s == 0 else None, window, buffers if s == 0 else None, norm)
                for s, part in enumerate(sent)]
        if norm is None:
            args = [a[:-1] for a in args]
        channel = self.half.channel
        return channel.call_each_async("exchange_fragment", args) if self.servers > 1 \
            else _Listed(channel.call_async("exchange_fragment", *args[0]))

    def _merge(self, replace: bool = False) -> None:
        assert self.pending is not None
        f, future, _ = self.pending
        self.pending = None
        replies = future.wait()
        self.half.sending = None
        self._land(f, replies, 0.0 if replace or self.overlap == 0 else self.mix)

    def _land(self, f: int, replies: list, keep: float) -> None:
        """Fragment ``f``'s global weights from its replies into the replica (``keep``: the share
        of the local values kept) and its anchor; with fragment 0 replaced, the buffers."""
        anchor = []
        for (reply, _), part in zip(replies, self.parts(f), strict=True):
            values = reply[0].float()
            unpack_into(values, part, keep)
            anchor.append(values.to(self.half.device))
        reply, told = replies[0]
        if f == 0 and len(reply) > 1 and self.half.buffers and not keep:
            # Mixed after an overlap, the replica keeps its own: the server's are of before the
            # overlap's forwards (running statistics, counts), which loading would undo.
            unflatten_into(reply[1], self.half.buffers)
        self.anchor[f] = anchor
        self.half.outer_step = int(told["outer_step"])

    def send_again(self, owed: dict) -> bool:
        """A fragment's sync an earlier process image of this trainer sent without its answer
        (``owed``: as :meth:`_send` left it, decoded), sent again under its number: applied if
        the server had not, once if it had; its reply's global weights replace the fragment's.
        False when this trainer streams another fragment count (the window is then lost)."""
        if owed["count"] != self.count or len(owed["flat"]) != self.servers:
            return False
        f = int(owed["fragment"])
        replies = self._call(f, [server[0] for server in owed["flat"]], int(owed["number"]), owed["done"],
                             dict(owed["window"]), owed["buffers"], owed["norm"]).wait()
        self._land(f, replies, 0.0)
        return True


class _Listed:
    """One server's reply future as the list of replies ``call_each_async`` gives."""

    def __init__(self, future: Any) -> None:
        self.future = future

    def wait(self) -> list:
        return [self.future.wait()]
