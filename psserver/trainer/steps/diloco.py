"""The trainer half of ``--step diloco``: local steps with the trainer's own inner optimizer,
and every H of them one call that sends the pseudo-gradient (anchor minus local weights) and
brings back the new global weights, which become the replica's weights and its new anchor.

The protocol, its order of work and why: its server half, ``psserver.server.steps.diloco``.
A trainer that dies loses its local steps since its last sync, and nothing else: the global
weights and the outer optimizer's state live on the server. ``psserver train`` steps through
:meth:`DiLoCoTrainer.step`; the library (``ps.local_sgd``, ``ps.sync``) through
:meth:`DiLoCoTrainer.inner_step_done` and :meth:`DiLoCoTrainer.sync`.
"""

from __future__ import annotations

import logging
import time

import torch

from psserver.common.messages import QuantizedFlat
from psserver.common.quantize import ErrorFeedback, bits_of, nbytes
from psserver.config.optimizer import make_optimizer
from psserver.config.trainer import DEFAULT_LOCAL_STEPS
from psserver.models.calling import call_model, input_batch_size
from psserver.trainer.steps.base import register
from psserver.trainer.steps.pushpull import PushPullTrainer
from psserver.trainer.streaming import StreamingWindows

log = logging.getLogger(__name__)


class DiLoCoTrainer(PushPullTrainer):
    def __init__(self, channel) -> None:
        super().__init__(channel)
        config = channel.config
        self.base_steps: int = config.local_steps or DEFAULT_LOCAL_STEPS
        """H: inner steps per window, as this trainer asked."""
        self.local_steps: int = self.base_steps
        """This window's H (with ``--dynamic-local-steps``, as the server's last reply sized it)."""
        self.inner_config = config.inner_optimizer_config
        self.inner: torch.optim.Optimizer | None = None
        """``psserver train``'s inner optimizer, made at its first step (a library user brings
        their own). torch's first optimizer imports its compiler (4.1 s of a 7.5 s run of 128
        mlp steps here): that is before the window's clock starts, never in its speed."""
        self.anchor: list[torch.Tensor] = []
        """The global weights the replica last received, one tensor per parameter."""
        self.window_steps = 0
        """Inner steps taken since the last sync."""
        self.window_samples = 0
        self.window_seconds = 0.0
        """Time its inner steps took (the syncs not counted): the trainer's speed, for the server."""
        self.outer_step = 0
        """The server's outer steps, as of the last sync's reply."""
        self.syncs = 0
        """Windows handed in by this trainer."""
        self._since: float | None = None  # when the inner step being taken started
        self.bits = bits_of(config.compress)
        """The pseudo-gradient's code width with ``--compress`` (None: the wire dtype)."""
        self._feedback: dict[tuple[int, int], ErrorFeedback] = {}
        """One residual per buffer sent (server process, shard): each sync's rounding, carried."""
        self.sync_bytes = 0
        """What the last sync's pseudo-gradient put on the wire."""
        self.stream: StreamingWindows | None = None
        """Streaming DiLoCo's fragments (``--fragments`` > 1; None: the whole model every H steps)."""
        if config.fragments > 1:
            self.stream = StreamingWindows(self, config.fragments, config.fragment_overlap, config.fragment_mix)

    def open(self) -> None:
        """The server's global weights (and buffers) into the replica; the first window starts."""
        self._land(self._call(None, 0, None, None))
        self._loaded = False
        if self.stream is not None:
            self.stream.open()

    def owed_samples(self) -> int | None:
        return None  # a window whose sync failed is never made again: it is sent again as it was (owed_window)

    # ---- a window ----------------------------------------------------------------------------

    def train_step(self, x, y: torch.Tensor) -> float:
        """``psserver train``'s step: forward, backward and the inner optimizer's step on one
        batch (the window's sync follows in :meth:`after_step`, once the step is counted)."""
        if not self.anchor:
            self.open()
        if self.inner is None:
            self.inner = make_optimizer(self.params, self.inner_config)
            log.info("diloco: inner %s, %d local steps per window (outer: the server's optimizer, %s)",
                     self.inner_config.describe(), self.local_steps, self.channel.info.get("outer"))
        started = time.monotonic()
        loss = self.loss_fn(call_model(self.model, x), y)
        self.inner.zero_grad(set_to_none=True)
        loss.backward()
        self.inner.step()
        self.inner_step_done(input_batch_size(x), time.monotonic() - started)
        return float(loss.detach())

    def after_step(self) -> None:
        self.advance()

    def advance(self) -> None:
        """After an inner step: the sync it ends the window of (streaming: the fragments' sends
        and merges it is the place of)."""
        if self.stream is not None:
            if not self.anchor:
                self.open()
            self.stream.after_step()
        elif self.due:
            self.sync()

    def inner_step_done(self, samples: int, seconds: float | None = None) -> None:
        """Count an inner step of ``samples`` that took ``seconds`` (None: since the last one
        ended, or since the window began)."""
        now = time.monotonic()
        if seconds is None:
            seconds = 0.0 if self._since is None else now - self._since
        self._since = now
        self.window_steps += 1
        self.window_samples += samples
        self.window_seconds += seconds
        if self.stream is not None:
            self.stream.inner_step_done(samples, seconds)

    def add_samples(self, samples: int) -> None:
        """Samples of the window not counted with a step (the library's ``ps.sync(samples=...)``)."""
        self.window_samples += samples
        if self.stream is not None:
            self.stream.samples += samples

    @property
    def due(self) -> bool:
        """Whether the window has taken its local steps (streaming: never a whole window's sync)."""
        return self.stream is None and self.window_steps >= self.local_steps

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """anchor - local weights, one tensor per parameter: the sign of a gradient, so the
        server's optimizer steps against it as against any gradient."""
        with torch.no_grad():
            return [a - p.detach() for a, p in zip(self.anchor, self.params, strict=True)]

    def sync(self) -> int:
        """Hand in the window's pseudo-gradient (none: nothing to hand in) and take the new
        global weights as the replica's and the anchor; the server's outer steps after it."""
        if not self.anchor:  # nothing received yet: the first window starts now
            self.open()
            return self.outer_step
        if self.window_steps == 0:
            return self.outer_step
        if self.stream is not None:  # every fragment handed in now
            self.stream.flush()
            self.window_steps = self.window_samples = 0
            self.window_seconds = 0.0
            return self.outer_step
        flat = self.flat_grads(self.pseudo_gradient())
        norm = None if len(self.channel.servers) == 1 else self.norm_of(flat)
        if self.bits is not None:
            flat = [[self._feedback.setdefault((i, j), ErrorFeedback(self.bits)).compress(t)
                     for j, t in enumerate(buffers)] for i, buffers in enumerate(flat)]
        self.sync_bytes = sum(nbytes(t) if isinstance(t, QuantizedFlat) else t.numel() * t.element_size()
                              for buffers in flat for t in buffers)
        if not self.syncs:
            fp32 = 4 * sum(t.numel if isinstance(t, QuantizedFlat) else t.numel() for buffers in flat for t in buffers)
            log.info("diloco: %d bytes of pseudo-gradient a sync (%s; %.1fx fewer than fp32)", self.sync_bytes,
                     self.channel.config.compress if self.bits else str(self.wire_dtype).removeprefix("torch."),
                     fp32 / max(1, self.sync_bytes))
        self.seq += self.window_steps  # numbered by the inner steps at the window's end: sent twice, applied once
        window = {"steps": self.window_steps, "seconds": float(self.window_seconds), "base": self.base_steps}
        buffers = self.owed_buffers()
        self.sending = {"flat": flat, "number": self.seq, "done": self.window_samples, "window": window,
                         "buffers": buffers, "norm": norm}
        self._land(self._call(flat, 0, self.window_samples, window, buffers=buffers, norm=norm))
        self.sending = None
        self.syncs += 1
        self.window_steps = self.window_samples = 0
        self.window_seconds = 0.0
        return self.outer_step

    def _call(self, flat: list[list] | None, samples: int | None, done: int | None,
              window: dict | None, buffers: torch.Tensor | None = None, norm: float | None = None) -> list:
        """One ``exchange`` per server process (the pseudo-gradient's piece for each, the buffers
        to server 0; ``norm``: the whole pseudo-gradient's, for several); their replies, server 0's first."""
        number = self.seq if flat is not None else None
        servers = len(self.channel.servers)
        # Frozen parameters have no pseudo-gradient, as a torch optimizer sees no .grad for them:
        # a zero one would let the outer optimizer's weight decay shrink them (one server
        # process: indices in the model's order).
        frozen = [i for i, p in enumerate(self.params) if not p.requires_grad] if flat is not None else []
        args = []
        for i in range(servers):
            args.append((None if flat is None else flat[i], samples, norm, None, buffers if i == 0 else None,
                         done if i == 0 else None, number, None, frozen if servers == 1 and frozen else None,
                         window))
        if servers == 1:
            return [self.channel.call("exchange", *args[0])]
        return self.channel.call_each("exchange", args)

    def _land(self, replies: list) -> None:
        """The new global weights into the replica and the anchor; the next window's size."""
        self.load([params for params, _ in replies])
        _, told = replies[0]
        self.outer_step = int(told["outer_step"])
        steps = told.get("local_steps")
        if steps is not None and steps != self.local_steps:
            log.info("diloco: %d local steps per window (the server sized it by this trainer's speed)", steps)
            self.local_steps = int(steps)
        with torch.no_grad():
            if not self.anchor:
                self.anchor = [p.detach().clone() for p in self.params]
            else:
                for a, p in zip(self.anchor, self.params, strict=True):
                    a.copy_(p)
        self._since = time.monotonic()  # the next window's first inner step is timed from here

    sending: dict | None = None
    """The window of the sync in flight: what a failed one carried, for :meth:`owed_window`."""

    def owed_window(self) -> dict | None:
        """The window a failed sync carried (the server may have applied it or not), as plain
        types and tensors, for the trainer's next process image to send again under its number
        (:meth:`send_again`); None: none in flight. Streaming: the fragment's sync in flight."""
        if self.sending is None:
            return None
        w = self.sending
        flat = [[{"data": t.data, "scales": t.scales, "bits": t.bits, "numel": t.numel, "block": t.block}
                 if isinstance(t, QuantizedFlat) else t.detach().cpu() for t in server] for server in w["flat"]]
        return {**w, "flat": flat, "buffers": None if w["buffers"] is None else w["buffers"].cpu()}

    def send_again(self, owed: dict) -> None:
        """A window an earlier process image of this trainer handed in without its answer, sent
        again under its number: applied if the server had not, once if it had; the reply's
        global weights become the replica's (streaming: the fragment's)."""
        if not self.anchor:
            self.open()
        flat = [[QuantizedFlat(**t) if isinstance(t, dict) else t.to(self.device) for t in server]
                for server in owed["flat"]]
        if "fragment" in owed:
            if self.stream is None or not self.stream.send_again({**owed, "flat": flat}):
                log.warning("diloco: the fragment sync owed from before this trainer rejoined is lost: it streams "
                            "%s now, %d fragments then", self.stream.count if self.stream else "no fragments",
                            owed["count"])
                return
            log.info("diloco: sent again fragment %d's window (number %d) whose sync failed before this trainer "
                     "rejoined", owed["fragment"], owed["number"])
            return
        number, self.seq = self.seq, int(owed["number"])
        self.sending = {**owed, "flat": flat}
        self._land(self._call(flat, 0, int(owed["done"]), dict(owed["window"]), buffers=owed["buffers"],
                              norm=owed["norm"]))
        self.sending = None
        self.seq = max(number, self.seq)
        log.info("diloco: sent again the window (inner steps up to %d) whose sync failed before this trainer "
                 "rejoined", int(owed["number"]))

    def flush(self) -> None:
        """Hand in the window's local steps so far (before evaluating or leaving): a sync."""
        if self.window_steps and self.anchor:
            self.sync()

    def evaluate(self, x) -> torch.Tensor:
        """The replica's outputs: after :meth:`flush`, the global weights of the last sync (a
        trainer that never synced: the server's current ones)."""
        if self.anchor:
            self._loaded = True  # loading the server's newer weights would move the anchor's replica
        return super().evaluate(x)

    def push_pull(self, samples: int) -> None:
        raise NotImplementedError("--step diloco: ps.sync() or ps.local_sgd(optimizer), not ps.step()")


register("diloco", DiLoCoTrainer)
