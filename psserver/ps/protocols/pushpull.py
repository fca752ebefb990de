"""``--step pushpull``: trainer compute, one round trip per step, one flat buffer per shard.

Each call pushes the flat gradient of the trainer's step *t* (one buffer per server shard) and
pulls the flat parameters for its step *t+1*: the server applies the update, then copies the
parameters out at one step, both on its compute thread. The order of work is that of ``pull``
(the update of step *t* lands before the parameters of step *t+1* are read), with one round
trip instead of three and no autograd context on either side. A last call without a batch
hands in the final gradient, before the trainer evaluates or leaves; a trainer that dies in
between contributes nothing for that step.

Each gradient carries its number, the trainer's step it ends (``psserver.ps.engine.sequences``):
a trainer whose server process died rejoins the restarted one and sends again the gradient
whose reply it never got, which is applied only if the dead process had not applied it.

A model with embedding tables (``psserver.ps.sparse``) rides the same call: it carries the row
gradients of step *t* (the server remembers which ids it served) and the unique ids of step
*t+1*'s batch that this server owns, and its reply carries their rows beside the dense
parameters. One request per server per step, the rows' bytes grow with the batch, not the table.
"""

from __future__ import annotations

import torch

from psserver.errors import UsageError
from psserver.models.calling import call_model, input_batch_size
from psserver.ps.protocols.base import StepProtocol, register
from psserver.ps.protocols.trainer_compute import TrainerComputeHalf, TrainerComputeServer
from psserver.ps.sparse.batch import RowBatch

Rows = dict[str, torch.Tensor]
Owed = tuple[list[list[torch.Tensor]], list[Rows] | None, torch.Tensor | None]
"""What a trainer owes the servers after a step: the flat gradient (a list per server), the row
gradients (a dict per server; None: no tables) and its buffers (None: none it sends)."""


class PushPullServer(TrainerComputeServer):
    ops = ("exchange", "parameters", "rows")

    def join_info(self, trainer: str, request) -> dict:
        info = super().join_info(trainer, request)
        self.engine.sequences.joined(trainer, request.rank, request.steps)
        return info

    def exchange(self, trainer: str, grads: list[torch.Tensor] | None, samples: int | None,
                 norm: float | None = None, rows: dict | None = None, buffers: torch.Tensor | None = None,
                 done: int | None = None, number: int | None = None):
        """Apply ``grads`` (the flat gradient of ``trainer``'s open step; None: none owed), then
        return the flat parameters for its next step of ``samples`` (None: it is done). With
        several server processes ``grads`` is this server's partition and ``norm`` the whole
        gradient's norm. With embedding tables ``rows`` is ``{"grads": {table: row gradients of
        the open step} | None, "ids": {table: ids of the next step} | None}`` and the reply is
        ``(parameters, {table: rows})``. With the model's buffers (server 0), ``buffers`` are the
        trainer's after the open step's forward, and the parameters it gets end with the server's.
        ``done``: the samples of the open step, for a trainer that learnt them only after opening
        it (the library's, which opens its next step before its user reads the next batch).
        ``number``: the trainer's step that ``grads`` ends (None: not numbered): one applied
        before, sent again after this server process restarted, is not applied again."""
        if norm is not None and not isinstance(norm, float):
            raise ValueError(f"gradient norm must be a float, got {type(norm).__name__}")
        if done is not None and (not isinstance(done, int) or done < 0):
            raise ValueError(f"a step's samples must be an int >= 0, got {done!r}")
        if number is not None and (not isinstance(number, int) or number < 1):
            raise ValueError(f"a gradient's number must be an int >= 1, got {number!r}")
        row_grads, ids = self._row_request(rows)
        buffers = self.check_buffers(buffers)
        if grads is not None and number is not None and not self.engine.take_gradient(trainer, number, done or 0):
            grads = row_grads = buffers = None
        if done is not None and grads is not None:
            self.engine.set_samples(trainer, done)
        return self.finish_then_start(
            trainer, lambda: grads is not None and self._push(trainer, grads, norm, row_grads, buffers),
            None if samples is None else lambda: self._pull(trainer, samples, ids))

    def _row_request(self, rows: dict | None) -> tuple[object, object]:
        tables = self.engine.tables
        if tables is None:
            if rows is not None:
                raise ValueError(f"model {self.engine.config.model} has no embedding tables")
            return None, None
        if not isinstance(rows, dict) or set(rows) != {"grads", "ids"}:
            raise ValueError(f"model {self.engine.config.model} keeps embedding tables: a step carries "
                             "{'grads': ..., 'ids': ...}")
        return rows["grads"], rows["ids"]

    def _push(self, trainer: str, grads: list[torch.Tensor], norm: float | None, row_grads: object,
              buffers: torch.Tensor | None) -> None:
        try:
            unflat: dict = self.engine.grads_from_flat(grads)
            if self.engine.tables is not None:
                unflat.update(self.engine.tables.row_grads(trainer, row_grads))
        except BaseException:
            self.engine.drop_step(trainer)
            raise
        self.engine.submit(trainer, unflat, norm, buffers)

    def _pull(self, trainer: str, samples: int, ids: object):
        tables = self.engine.tables
        rows = tables.serve(trainer, ids) if tables is not None else None  # a bad request opens no step
        self.engine.open_step(trainer, samples)
        wire = self.wire_dtype(trainer)
        params = self.with_buffers(self.engine.flat_parameters(wire))
        if rows is None:
            return params
        return params, {name: r.to(wire) for name, r in rows.items()}


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
        dense, rows, buffers = grads if grads is not None else (None, None, None)
        if self.plan is None and self.table_columns is None:
            tail: tuple = () if buffers is None and done is None and number is None else (None, None, buffers, done,
                                                                                         number)
            return [self.channel.call("exchange", None if dense is None else dense[0], samples, *tail)]
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
            self.load(self._exchange(grads, samples, done=done, number=number))
            self._handed_in()
            loss = self.loss_fn(call_model(self.model, x), y)
            self._owe((self.flat_grads(list(torch.autograd.grad(loss, self.params, allow_unused=True))), None,
                       self.owed_buffers()), samples)
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
        got = torch.autograd.grad(loss, self.params + rows, allow_unused=True)
        n = len(self.params)
        row_grads = [torch.zeros_like(r) if g is None else g for r, g in zip(rows, got[n:], strict=True)]
        self._owe((self.flat_grads(list(got[:n])), batch.split_grads(row_grads, self.wire_dtype),
                   self.owed_buffers()), int(ids.shape[0]))
        return float(loss.detach())

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
        for p in self.params:
            p.grad = None
        if self.table_columns is None:
            self.seq += 1  # the user's loop makes this step again if the call fails (its position is not counted)
            try:
                self.load(self._exchange((dense, None, self.owed_buffers()), 0, done=samples, number=self.seq))
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
        self._owe((dense, batch.split_grads(row_grads, self.wire_dtype), self.owed_buffers()), samples)

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


PROTOCOL = register(StepProtocol("pushpull", PushPullTrainer, PushPullServer))
