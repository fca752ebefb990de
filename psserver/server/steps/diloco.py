"""``--step diloco``: local steps on the trainer, the outer optimizer on the server.

A trainer takes H inner steps with its own inner optimizer (its state never leaves it), then
sends its pseudo-gradient, the global weights it last received (its *anchor*) minus its local
weights: a gradient's sign, so the server's optimizer applies it as it applies any gradient,
and that optimizer is DiLoCo's outer one (Douillard et al., 2023). The rounds are the server's
updaters': ``--outer sync`` averages K pseudo-gradients per outer step (``SyncUpdater``),
``--outer async`` applies each as it arrives (``AsyncUpdater``; ``delayed_nesterov`` keeps its
momentum from amplifying stale ones). The reply is the new global weights, which become the
trainer's weights and its anchor.

The call is pushpull's ``exchange``, a window being one numbered step of it: the number is the
trainer's inner steps at the window's end, so a pseudo-gradient sent again after a server
process restarted is applied once. The model's buffers go up and come down with it, by the
server's ``--buffers`` rule. Each call also carries the window's size and how long its inner
steps took: with ``--dynamic-local-steps`` the reply sizes the trainer's next window by its
speed against the fastest trainer's (``psserver.server.engine.local_steps``).
"""

from __future__ import annotations

import logging

import torch

from psserver.common.fragments import fragment_groups
from psserver.common.messages import QuantizedFlat
from psserver.common.quantize import dequantize, nbytes
from psserver.server.engine.local_steps import LocalStepPlanner
from psserver.server.steps.base import register
from psserver.server.steps.pushpull import PushPullServer

log = logging.getLogger(__name__)


class DiLoCoServer(PushPullServer):
    ops = ("exchange", "exchange_fragment", "parameters", "probe", "fall_back")

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.planner: LocalStepPlanner | None = LocalStepPlanner() if engine.config.dynamic_local_steps else None
        self._groups: dict[int, list[list[int]]] = {}  # fragment count -> its groups
        self._count_of: dict[str, int] = {}  # trainer -> the fragment count it streams with

    def join_info(self, trainer: str, request) -> dict:
        return {**super().join_info(trainer, request), "outer": self.engine.config.outer,
                "dynamic_local_steps": self.planner is not None}

    def _overlap(self, request) -> dict:
        if request.overlap == "on":
            raise ValueError("--overlap on: not with --step diloco (a window's local steps need no server)")
        return {"on": False, "reason": ""}

    @property
    def _takes_parts(self) -> bool:
        return False  # a pseudo-gradient is made whole, after the window

    def exchange(self, trainer: str, grads: list[torch.Tensor] | None, samples: int | None,
                 norm: float | None = None, rows: dict | None = None, buffers: torch.Tensor | None = None,
                 done: int | None = None, number: int | None = None, rest: list | None = None,
                 absent: list | None = None, window: dict | None = None):
        """pushpull's ``exchange`` with ``grads`` a window's pseudo-gradient (None: none owed:
        the trainer's first call) and ``window`` ``{"steps": inner steps, "seconds": their time,
        "base": the trainer's H}``. Returns ``(parameters, {"local_steps": the trainer's next
        window (None: its own H), "outer_step": the server's outer steps})``; None when
        ``samples`` is None (the trainer's last window, handed in before it leaves)."""
        if rows is not None or rest is not None:
            raise ValueError("--step diloco sends a whole dense pseudo-gradient per window")
        if grads is not None:
            grads, travelled = self._decoded(grads)
            self.engine.updater.note_bytes(trainer, travelled)
        base = self._window(trainer, window) if grads is not None else None
        params = super().exchange(trainer, grads, samples, norm, None, buffers, done, number, None, absent)
        if samples is None:
            return None
        steps = None if self.planner is None or base is None else self.planner.steps_for(trainer, base)
        return params, {"local_steps": steps, "outer_step": self.engine.global_step}

    def exchange_fragment(self, trainer: str, index: object, count: object, grads: object, number: object,
                          done: int | None = None, window: dict | None = None, buffers: torch.Tensor | None = None,
                          norm: float | None = None):
        """Streaming DiLoCo (``train --fragments F``): the pseudo-gradient of fragment ``index``
        of ``count`` (``psserver.common.fragments``), one flat buffer of its parameters (with
        several server processes: of the pieces this one holds) in the wire dtype or quantized,
        stepped by the outer optimizer as a gradient that leaves the other parameters out (sync:
        in a round of K, each parameter averaged over the pseudo-gradients that carry it).
        Numbered as a window of ``exchange``; ``done``: the samples the fragment's window trained
        on (fragment 0 carries the window's; others 0), ``buffers`` go up with fragment 0;
        ``norm``: the whole fragment's, when this is one server process's part of it
        (``--max-grad-norm`` clips the fragment as one). Returns ``(the fragment's new global
        weights [, the model's buffers with fragment 0], {"outer_step": ...})``."""
        engine = self.engine
        if engine.tables is not None:
            raise ValueError("--fragments: a model without embedding tables")
        if self.planner is not None:
            raise ValueError("--fragments: not with the server's --dynamic-local-steps (each fragment keeps its "
                             "place in the window)")
        params = self._fragment(trainer, index, count)
        norm = self._norm(norm)
        self._number(number)
        self._samples(done)
        self._window(trainer, window)
        flat, travelled = self._fragment_values(grads, sum(engine.params[i].numel() for i in params))
        engine.updater.note_bytes(trainer, travelled)
        buffers = self.check_buffers(buffers) if index == 0 else None
        grads_of: dict = {}
        offset = 0
        for i in params:
            p = engine.params[i]
            grads_of[p] = flat[offset:offset + p.numel()].view_as(p).to(p.device, p.dtype)
            offset += p.numel()
        apply = engine.take_gradient(trainer, number, done or 0)
        if apply and done is not None:
            engine.set_samples(trainer, done)

        def push() -> None:
            if apply:
                engine.submit(trainer, grads_of, norm, buffers)

        def pull():
            engine.open_step(trainer, 0)
            values = engine.parameters_of(params, self.wire_dtype(trainer), on_device=self.on_device(trainer))
            out = [values, engine.flat_buffers()] if index == 0 and engine.buffers is not None else [values]
            return out, {"outer_step": engine.global_step}

        return self.finish_then_start(trainer, push, pull)

    def _fragment(self, trainer: str, index: object, count: object) -> list[int]:
        """The parameters of fragment ``index`` of ``count`` (``ValueError``: no such fragment,
        or another count than this trainer's first)."""
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (index, count)) \
                or not 1 <= count <= len(self.engine.params) or not 0 <= index < count:
            raise ValueError(f"fragment {index!r} of {count!r}: a fragment is 0 <= index < count, the count at most "
                             f"the model's {len(self.engine.params)} parameters")
        first = self._count_of.setdefault(trainer, count)
        if first != count:
            raise ValueError(f"fragment {index} of {count}: this trainer streams {first} fragments")
        groups = self._groups.get(count)
        if groups is None:
            if len(self._groups) >= 8:
                self._groups.clear()
            groups = self._groups[count] = fragment_groups([p.numel() for p in self.engine.params], count)
        return groups[index]

    @staticmethod
    def _norm(norm: object) -> float | None:
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))):
            raise ValueError(f"a fragment's norm is a number, got {norm!r}")
        return None if norm is None else float(norm)

    @staticmethod
    def _fragment_values(grads: object, numel: int) -> tuple[torch.Tensor, int]:
        """A fragment's pseudo-gradient as fp32 values, checked (``ValueError``), and its bytes on the wire."""
        if isinstance(grads, QuantizedFlat):
            return dequantize(grads, numel), nbytes(grads)
        if not isinstance(grads, torch.Tensor) or grads.dim() != 1 or not grads.is_floating_point() \
                or grads.numel() != numel:
            raise ValueError(f"a fragment's pseudo-gradient is one flat float tensor of its {numel} values")
        return grads.float(), grads.numel() * grads.element_size()

    def _decoded(self, grads: object) -> tuple[object, int]:
        """A pseudo-gradient sent quantized (``train --compress``) as fp32 buffers, each of its
        shard's size and checked before it is decoded (``ValueError`` for one that is not well
        formed), others as they came (pushpull's checks: ``grads_from_flat``); and the bytes it
        travelled as."""
        if not isinstance(grads, list):
            return grads, 0
        shards = self.engine.shards
        if any(isinstance(g, QuantizedFlat) for g in grads) and len(grads) != len(shards):
            raise ValueError(f"{len(grads)} pseudo-gradient buffers for {len(shards)} shards")
        out, travelled = [], 0
        for i, g in enumerate(grads):
            if isinstance(g, QuantizedFlat):
                out.append(dequantize(g, shards[i].num_params))
                travelled += nbytes(g)
            else:
                out.append(g)
                travelled += g.numel() * g.element_size() if isinstance(g, torch.Tensor) else 0
        return out, travelled

    def _window(self, trainer: str, window: object) -> int | None:
        """The base H of the window ``trainer`` hands in, its speed noted (``ValueError``: not a window)."""
        if window is None:
            return None
        if not isinstance(window, dict) or set(window) != {"steps", "seconds", "base"}:
            raise ValueError("a window is {'steps': int, 'seconds': float, 'base': int}")
        steps, seconds, base = window["steps"], window["seconds"], window["base"]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (steps, base)) \
                or not isinstance(seconds, float):
            raise ValueError(f"a window's steps and base are ints >= 1 and its seconds a float, got {window!r}")
        if self.planner is not None and seconds > 0:
            self.planner.observe(trainer, steps, seconds)
        return base

    def trainer_gone(self, trainer: str, evicted: bool) -> None:
        self._count_of.pop(trainer, None)
        if self.planner is not None:
            self.planner.forget(trainer)
        super().trainer_gone(trainer, evicted)


register("diloco", DiLoCoServer)
