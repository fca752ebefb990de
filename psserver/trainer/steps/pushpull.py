"""The trainer half of ``--step pushpull``: one call per step pushes the flat gradient of the
last step (one buffer per server shard, large buckets sent ahead while backward runs) and
pulls the flat parameters of the next.

The protocol, its order of work and why: its server half, ``psserver.server.steps.pushpull``.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from psserver.common.tensors import Part
from psserver.errors import UsageError
from psserver.models.calling import call_model, input_batch_size
from psserver.trainer.compute.rows import RowBatch
from psserver.trainer.steps.base import register
from psserver.trainer.steps.trainer_compute import TrainerComputeHalf

log = logging.getLogger(__name__)

Rows = dict[str, torch.Tensor]

Owed = tuple[list[list[torch.Tensor]] | None, list[Rows] | None, torch.Tensor | None, list[Part] | None, list[int]]

"""What a trainer owes the servers after a step: the flat gradient (a list per server; None:
sent in parts), the row gradients (a dict per server; None: no tables), its buffers (None: none
it sends), when parts of its gradient went ahead while backward ran the parts left, and the
parameters it has no gradient for (``TrainerComputeHalf.absent``)."""



class PushPullTrainer(TrainerComputeHalf):
    def __init__(self, channel) -> None:
        super().__init__(channel)
        # Owed to the server(s): the flat gradient, one list per server, with tables the row
        # gradients, one {table: rows} per server, and the replica's buffers (for server 0).
        self._grads: Owed | None = None
        self._owed: tuple[int, int] | None = None  # (number, samples) of the step whose gradient is owed
        self._in_flight: tuple[int, int] | None = None  # the same, of the gradient in the call under way
        self.seq = channel.steps_before
        """The number of the last gradient made: the rank's steps, across rejoins."""
        self._open_rows: tuple[RowBatch, list[torch.Tensor]] | None = None  # the library's batch of rows
        agreed = channel.info.get("overlap") or {"on": False, "reason": "the server decides nothing of it"}
        self.overlap: bool = bool(agreed["on"])
        """Whether :meth:`train_step` computes while the exchange that hands in the step before
        is in flight (``--overlap``; the server agreed, by its update mode)."""
        if self.table_columns is None and agreed.get("reason"):
            log.info("overlap %s: %s", "on" if self.overlap else "off", agreed["reason"])
        self.send_parts = bool(channel.info.get("parts")) and not self.overlap and self.plan is None \
            and self.table_columns is None
        """Whether this trainer's own backward sends its large buckets ahead of the step's call
        (the server takes parts: one server, no tables; not while overlapping, which hides the
        whole call)."""
        self._primed = False  # the replica holds a step's reply: the next step may compute on it
        self._said_no_gradient = False
        self._exchanger: ThreadPoolExecutor | None = None
        self.row_payload = 0
        """Bytes of the tables' traffic its steps needed at least: each unique id once, its row
        down and its gradient up (benchmarks compare what crossed the network with it)."""

    def owed_samples(self) -> int | None:
        """The samples of the step whose gradient was not handed in (owed, or in the call that
        failed; None: none): a trainer that loses its server counts that step as not done, and
        makes it again."""
        owed = self._owed if self._grads is not None else self._in_flight
        return None if owed is None else owed[1]

    def _take_owed(self) -> tuple[Owed | None, int | None, int | None]:
        """The owed gradient, its number and samples, now in flight: sent once, whatever the
        call's fate (``_handed_in`` once the call returned)."""
        grads, owed, self._grads, self._owed = self._grads, self._owed, None, None
        self._in_flight = owed if grads is not None else None
        return (grads, *owed) if grads is not None and owed is not None else (grads, None, None)

    def _handed_in(self) -> None:
        self._in_flight = None

    def _exchange(self, grads: Owed | None, samples: int | None, batch: RowBatch | None = None,
                  done: int | None = None, number: int | None = None) -> list:
        """One ``exchange`` per server process, all in flight at once; their replies in order
        (``done``: the samples of the step whose gradient goes; ``number``: that step's number)."""
        dense, rows, buffers, rest, absent = grads if grads is not None else (None, None, None, None, [])
        if self.plan is None and self.table_columns is None:
            # (grads, samples, norm, rows, buffers, done, number, rest, absent): trailing Nones left off
            call = [None if dense is None else dense[0], samples, None, None, buffers, done, number, rest,
                    absent or None]
            while len(call) > 2 and call[-1] is None:
                call.pop()
            return [self.channel.call("exchange", *call)]
        assert rest is None, "a gradient in parts goes to one server process without tables"
        servers = len(self.channel.servers)
        # Several servers each see a part of the step: they all decide on the whole step's norm.
        norm = None if dense is None or servers == 1 else self.norm_of(dense, rows)
        args = []
        for i in range(servers):
            a: tuple = (None if dense is None else dense[i], samples, norm)
            if self.table_columns is not None:
                a += ({"grads": None if rows is None else rows[i],
                       "ids": None if batch is None else batch.requests[i]},)
            if i == 0 and (buffers is not None or done is not None):  # server 0 holds the buffers
                a += (None,) * (4 - len(a)) + (buffers, done)
            if number is not None:  # every server dedupes its own part
                a += (None,) * (6 - len(a)) + (number,)
            args.append(a)
        if servers == 1:
            return [self.channel.call("exchange", *args[0])]
        return self.channel.call_each("exchange", args)

    def train_step(self, x, y: torch.Tensor) -> float:
        grads, number, done = self._take_owed()
        if self.table_columns is None:
            samples = input_batch_size(x)
            if self.overlap and self._primed:
                return self._overlapped_step(x, y, grads, samples, done, number)
            self.load(self._exchange(grads, samples, done=done, number=number))
            self._primed = True
            self._handed_in()
            loss = self.loss_fn(call_model(self.model, x), y)
            if self.send_parts:
                dense, rest = self.backward_parts(loss, self.seq + 1)
            else:
                dense, rest = self.backward_flat(loss), None
            self._owe((dense, None, self.owed_buffers(), rest, self.absent), samples)
            return float(loss.detach())
        ids, dense = x
        batch = RowBatch(ids, self.table_columns, len(self.channel.servers))
        replies = self._exchange(grads, int(ids.shape[0]), batch, done=done, number=number)
        self._handed_in()
        self.row_payload += batch.num_ids * 8
        self.load([reply[0] for reply in replies])
        rows = batch.assemble([reply[1] for reply in replies], self.device, requires_grad=True)
        self.row_payload += 2 * sum(r.numel() for r in rows) * self.wire_dtype.itemsize
        per_sample = batch.per_sample(rows)
        loss = self.loss_fn(self.model(per_sample, dense), y) + self.model.penalty(per_sample)
        got = self.grads_of(loss, tuple(rows))
        n = len(self.params)
        row_grads = [torch.zeros_like(r) if g is None else g for r, g in zip(rows, got[n:], strict=True)]
        self._owe((self.flat_grads(list(got[:n])), batch.split_grads(row_grads, self.wire_dtype),
                   self.owed_buffers(), None, []), int(ids.shape[0]))
        return float(loss.detach())

    def _overlapped_step(self, x, y: torch.Tensor, grads: Owed | None, samples: int, done: int | None,
                         number: int | None) -> float:
        """One step computed on the parameters the replica holds (the reply before the last)
        while the exchange that hands in the step before, and fetches the next step's
        parameters, is in flight on a helper thread. The gradient buffers alternate
        (``GradBuckets`` of depth 2): this backward never writes what is being sent. When the
        exchange fails, this step's gradient is dropped with it: both steps are made again."""
        if self._exchanger is None:
            self._exchanger = ThreadPoolExecutor(max_workers=1, thread_name_prefix="psserver-exchange")
        call = self._exchanger.submit(self._exchange, grads, samples, None, done, number)
        try:
            loss = self.loss_fn(call_model(self.model, x), y)
            flat = self.backward_flat(loss)
            absent = self.absent
            buffers = self.owed_buffers()
            replies = call.result()
        except BaseException:
            # The exchange ends before anything else is sent (this step failed, the exchange
            # failed, or an interrupt came while waiting): handed in if it was answered.
            with contextlib.suppress(BaseException):
                self._land(call.result())
            raise
        self._land(replies)
        self._owe((flat, None, buffers, None, absent), samples)
        return float(loss.detach())

    def _land(self, replies: list) -> None:
        """An exchange answered: its gradient is handed in, its parameters go into the replica.
        A trainer that sends its buffers (BatchNorm's statistics) keeps its own: the reply's
        were made from the ones it sent two steps ago, before its last forward."""
        self._handed_in()
        self.load(replies, keep_buffers=self.send_buffers)

    def close(self) -> None:
        if self._exchanger is not None:
            self._exchanger.shutdown(wait=True)
            self._exchanger = None
        super().close()

    def _owe(self, grads: Owed, samples: int) -> None:
        """The gradient of the step just made (of ``samples``), handed in with the next call."""
        self.seq += 1
        self._grads, self._owed = grads, (self.seq, samples)

    def flush(self) -> None:
        grads, number, done = self._take_owed()
        if grads is not None:
            self._exchange(grads, None, done=done, number=number)
            self._handed_in()

    # ---- the library's step (psserver.trainer.connection): its user runs forward and backward

    def open(self) -> None:
        """Start the first step: the server's parameters (and buffers) into the replica. With
        embedding tables the first :meth:`rows` does it (a step opens with its batch's ids)."""
        if self.table_columns is None:
            self.load(self._exchange(None, 0))
            self._loaded = False

    def push_pull(self, samples: int) -> None:
        """End the open step with the gradient its user's backward left in ``.grad`` (of
        ``samples`` samples) and start the next on the parameters that come back; the gradients
        are zeroed. With embedding tables the gradient (the rows' too) is owed instead, and the
        next :meth:`rows` hands it in with the next batch's ids: one round trip per step still."""
        dense = self.flat_grads([p.grad for p in self.params])
        if len(self.absent) == len(self.params) and not self._said_no_gradient:
            self._said_no_gradient = True
            log.warning("ps.step(): no parameter of the replica has a gradient (no backward since the last step?): "
                        "the server's optimizer steps with none, which changes no parameter")
        for p in self.params:
            p.grad = None
        if self.table_columns is None:
            self.seq += 1  # the user's loop makes this step again if the call fails (its position is not counted)
            try:
                self.load(self._exchange((dense, None, self.owed_buffers(), None, self.absent), 0, done=samples,
                                         number=self.seq))
            except BaseException:
                self.seq -= 1
                raise
            self._loaded = False
            return
        if self._open_rows is None:
            raise UsageError("ps.step with embedding tables: ask ps.rows(ids) for the batch's rows first")
        batch, rows = self._open_rows
        self._open_rows = None
        row_grads = [torch.zeros_like(r) if r.grad is None else r.grad for r in rows]
        self._owe((dense, batch.split_grads(row_grads, self.wire_dtype), self.owed_buffers(), None, []), samples)

    def rows(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """The rows of a batch's ids (``[batch, tables]`` int64, column t for table t) as the
        model takes them, one ``[batch, width]`` tensor per table; this exchange hands in the
        gradient owed, starts the batch's step and loads the fresh dense parameters."""
        if self.table_columns is None:
            raise UsageError("this server holds no embedding tables")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < len(self.table_columns) \
                or ids.dtype.is_floating_point:
            raise ValueError(f"ids must be an integer tensor [batch, {len(self.table_columns)}] (column t: table t)")
        grads, number, done = self._take_owed()
        batch = RowBatch(ids, self.table_columns, len(self.channel.servers))
        replies = self._exchange(grads, int(ids.shape[0]), batch, done=done, number=number)
        self._handed_in()
        self.load([reply[0] for reply in replies])
        self._loaded = False
        rows = batch.assemble([reply[1] for reply in replies], self.device, requires_grad=True)
        self._open_rows = batch, rows
        return batch.per_sample(rows)


register('pushpull', PushPullTrainer)
