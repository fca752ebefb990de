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

A step's gradient may come in parts: the trainer sends each large bucket as soon as its
backward has filled it (``part``, ``psserver.ps.engine.parts``), and the call that ends the step
carries the rest, so most of the gradient is on its way while backward still runs.

A model with embedding tables (``psserver.ps.sparse``) rides the same call: it carries the row
gradients of step *t* (the server remembers which ids it served) and the unique ids of step
*t+1*'s batch that this server owns, and its reply carries their rows beside the dense
parameters. One request per server per step, the rows' bytes grow with the batch, not the table.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from psserver.config.ps import OVERLAP_MODES
from psserver.errors import UsageError
from psserver.models.calling import call_model, input_batch_size
from psserver.ps.engine.parts import GradientParts, Part
from psserver.ps.protocols.base import StepProtocol, register
from psserver.ps.protocols.trainer_compute import TrainerComputeHalf, TrainerComputeServer
from psserver.ps.sparse.batch import RowBatch

log = logging.getLogger(__name__)

Rows = dict[str, torch.Tensor]
Owed = tuple[list[list[torch.Tensor]] | None, list[Rows] | None, torch.Tensor | None, list[Part] | None, list[int]]
"""What a trainer owes the servers after a step: the flat gradient (a list per server; None:
sent in parts), the row gradients (a dict per server; None: no tables), its buffers (None: none
it sends), when parts of its gradient went ahead while backward ran the parts left, and the
parameters it has no gradient for (``TrainerComputeHalf.absent``)."""


class PushPullServer(TrainerComputeServer):
    ops = ("exchange", "part", "parameters", "rows", "probe", "fall_back")
    device_replies = True

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._parts_lock = threading.Lock()
        self._parts: dict[str, GradientParts] = {}

    def join_info(self, trainer: str, request) -> dict:
        overlap = self._overlap(request)  # a refusal before anything is kept of the trainer
        info = {**super().join_info(trainer, request), "overlap": overlap, "parts": self._takes_parts}
        self.engine.sequences.joined(trainer, request.rank, request.steps)
        self.engine.updater.set_lag(trainer, int(overlap["on"]))
        return info

    def _overlap(self, request) -> dict:
        """Whether the trainer computes a step while the call that hands in the one before is
        in flight, and why (``ValueError``: asked for where it cannot be)."""
        want = request.overlap
        if want not in OVERLAP_MODES:
            raise ValueError(f"unknown --overlap {str(want)[:20]!r}; known: {', '.join(OVERLAP_MODES)}")
        cfg = self.engine.config
        why_not = None
        if cfg.update == "sync":
            why_not = "sync mode: every step waits for its round's update"
        elif cfg.update == "ssp" and cfg.staleness < 1:
            why_not = "ssp with --staleness 0 is bulk-synchronous"
        elif self.engine.tables is not None:
            why_not = "embedding tables: a step's rows come with its batch"
        elif cfg.num_servers > 1:
            why_not = "several server processes"
        if want == "on" and why_not is not None:
            raise ValueError(f"--overlap on: not with {why_not}")
        if want == "off":
            return {"on": False, "reason": "--overlap off"}
        if why_not is not None:
            return {"on": False, "reason": why_not}
        if want == "auto" and not str(request.device).startswith("cuda"):
            return {"on": False, "reason": "a CPU trainer (--overlap on pipelines it too)"}
        if want == "auto" and cfg.update == "ssp":  # one step staler fell under a bar in a test: asked for only
            return {"on": False, "reason": "ssp (--overlap on pipelines it, held one step tighter)"}
        bound = f", held one step tighter under --staleness {cfg.staleness}" if cfg.update == "ssp" else ""
        return {"on": True, "reason": f"{cfg.update}: each step computes on the reply before the last{bound}"}

    def part(self, trainer: str, number: object, parts: object) -> None:
        """Parts of the gradient of ``trainer``'s step ``number`` (``[(shard, start, values)]``),
        sent while its backward ran; the ``exchange`` that ends the step brings the rest."""
        gradient, number, parts = self._gradient_parts(trainer), self._number(number), self._part_list(parts)
        # The copies are tensor work: on the compute thread, as every other (psserver.ps.engine.compute).
        self.engine.compute.run_with(self.compute_threads, gradient.put, number, parts)

    @property
    def _takes_parts(self) -> bool:
        """A gradient in parts fills one server's flat buffers (several servers' and the tables'
        layouts are their own)."""
        return self.engine.tables is None and self.engine.config.num_servers == 1

    def _gradient_parts(self, trainer: str) -> GradientParts:
        if not self._takes_parts:
            raise ValueError("a gradient in parts: only with one server process and no embedding tables")
        with self._parts_lock:
            parts = self._parts.get(trainer)
            if parts is None:
                shards = self.engine.shards
                parts = self._parts[trainer] = GradientParts([s.num_params for s in shards], self.wire_dtype(trainer),
                                                             [s.device for s in shards])
            return parts

    @staticmethod
    def _number(number: object) -> int:
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            raise ValueError(f"a gradient's number must be an int >= 1, got {number!r}")
        return number

    @staticmethod
    def _part_list(parts: object) -> list:
        if not isinstance(parts, list):
            raise ValueError("gradient parts come as a list of (shard, start, values)")
        return parts

    def trainer_gone(self, trainer: str, evicted: bool) -> None:
        with self._parts_lock:
            self._parts.pop(trainer, None)
        super().trainer_gone(trainer, evicted)

    def exchange(self, trainer: str, grads: list[torch.Tensor] | None, samples: int | None,
                 norm: float | None = None, rows: dict | None = None, buffers: torch.Tensor | None = None,
                 done: int | None = None, number: int | None = None, rest: list | None = None,
                 absent: list | None = None):
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
        before, sent again after this server process restarted, is not applied again. ``rest``:
        the gradient came in parts (``part``) and these are the last of them (``grads`` is None).
        ``absent``: the parameters (indices in the model's order) the step has no gradient for,
        left out of the update as a torch optimizer skips a None ``.grad`` (one server process)."""
        if norm is not None and not isinstance(norm, float):
            raise ValueError(f"gradient norm must be a float, got {type(norm).__name__}")
        if done is not None and (not isinstance(done, int) or done < 0):
            raise ValueError(f"a step's samples must be an int >= 0, got {done!r}")
        if number is not None:
            self._number(number)
        if rest is not None:
            if grads is not None or number is None:
                raise ValueError("a gradient in parts ends with its numbered call, which carries no whole gradient")
            parts, rest = self._gradient_parts(trainer), self._part_list(rest)
            # The parts' buffers: applied before this call answers.
            grads = self.engine.compute.run_with(self.compute_threads, lambda: parts.finish(number, rest))
        row_grads, ids = self._row_request(rows)
        buffers = self.check_buffers(buffers)
        skip = self.engine.absent_parameters(absent)
        if grads is not None and number is not None and not self.engine.take_gradient(trainer, number, done or 0):
            grads = row_grads = buffers = None
        if done is not None and grads is not None:
            self.engine.set_samples(trainer, done)
        return self.finish_then_start(
            trainer, lambda: grads is not None and self._push(trainer, grads, norm, row_grads, buffers, skip),
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
              buffers: torch.Tensor | None, skip: list) -> None:
        try:
            unflat: dict = self.engine.grads_from_flat(grads)
            for p in skip:
                del unflat[p]
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
        params = self.with_buffers(self.engine.flat_parameters(wire, on_device=self.on_device(trainer)))
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


PROTOCOL = register(StepProtocol("pushpull", PushPullTrainer, PushPullServer))
