"""``--step pushpull``: trainer compute, one round trip per step, one flat buffer per shard.

Each call pushes the flat gradient of the trainer's step *t* (one buffer per server shard) and
pulls the flat parameters for its step *t+1*: the server applies the update, then copies the
parameters out at one step, both on its compute thread. The order of work is that of ``pull``
(the update of step *t* lands before the parameters of step *t+1* are read), with one round
trip instead of three and no autograd context on either side. A last call without a batch
hands in the final gradient, before the trainer evaluates or leaves; a trainer that dies in
between contributes nothing for that step.

Each gradient carries its number, the trainer's step it ends (``psserver.server.engine.journal``):
a trainer whose server process died rejoins the restarted one and sends again the gradient
whose reply it never got, which is applied only if the dead process had not applied it.

A step's gradient may come in parts: the trainer sends each large bucket as soon as its
backward has filled it (``part``, ``psserver.server.engine.gradient_parts``), and the call that ends the step
carries the rest, so most of the gradient is on its way while backward still runs.

A model with embedding tables (``psserver.server.sparse``) rides the same call: it carries the row
gradients of step *t* (the server remembers which ids it served) and the unique ids of step
*t+1*'s batch that this server owns, and its reply carries their rows beside the dense
parameters. One request per server per step, the rows' bytes grow with the batch, not the table.
"""

from __future__ import annotations

import logging
import threading

import torch

from psserver.config.ps import OVERLAP_MODES
from psserver.server.engine.engine import check_samples
from psserver.server.engine.gradient_parts import GradientParts
from psserver.server.steps.base import register
from psserver.server.steps.trainer_compute import TrainerComputeServer

log = logging.getLogger(__name__)

MAX_NUMBER = 2**62
"""The largest gradient number taken: the server's state in memory records numbers as int64."""



class PushPullServer(TrainerComputeServer):
    ops = ("exchange", "part", "parameters", "rows", "probe", "fall_back")
    device_replies = True

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._parts_lock = threading.Lock()
        self._parts: dict[str, GradientParts] = {}

    def check_join(self, request) -> None:
        super().check_join(request)
        self._overlap(request)

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
        if cfg.rounds:
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
        # The copies are tensor work: on the compute thread, as every other (psserver.server.engine.compute).
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
                                                             [s.device for s in shards], shards)
            return parts

    @staticmethod
    def _number(number: object) -> int:
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= MAX_NUMBER:
            raise ValueError(f"a gradient's number must be an int in [1, 2**62], got {number!r}")
        return number

    @staticmethod
    def _samples(done: object) -> None:
        """``ValueError`` unless ``done`` is None or a step's samples (an int in [0, 2**40])."""
        if done is not None:
            check_samples(done)

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
        self._samples(done)
        self._samples(samples)  # before any part of the step is taken: a bad count changes nothing
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


register('pushpull', PushPullServer)
