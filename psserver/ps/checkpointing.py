"""What a parameter-server checkpoint holds, how a server resumes from one, and when one is written.

A step never writes a checkpoint itself: an optimizer step only marks one *due*
(``note_step``), and the endpoint calls ``maybe_save`` once the call that made the step has
returned from the step's code, holding no lock. The copy of the state then takes the
updater's lock on the compute thread, so no lock is ever taken twice in the opposite order.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from psserver import __version__
from psserver.checkpoint import Checkpointer, CheckpointError, load_latest, read_checkpoint
from psserver.config import OptimizerConfig, ServerConfig
from psserver.ps.engine import StepEngine
from psserver.telemetry import CheckpointInfo

log = logging.getLogger(__name__)


class CheckpointPolicy:
    """Snapshots and restores the engine, on a step count, a timer, a request and at stop."""

    def __init__(self, config: ServerConfig, engine: StepEngine) -> None:
        self.config = config
        self.engine = engine
        ck = config.checkpoint
        self.checkpointer = Checkpointer(ck.directory, ck.keep) if ck.directory is not None else None
        self._steps_at_checkpoint = 0
        self._last_time = time.monotonic()
        self._due = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None

    @property
    def last(self) -> CheckpointInfo | None:
        return self.checkpointer.last if self.checkpointer is not None else None

    # ---- when ---------------------------------------------------------------------------------

    def note_step(self, step: int, samples: int) -> None:  # noqa: ARG002 - a StepEngine listener
        every = self.config.checkpoint.every_steps
        if self.checkpointer is not None and every and step - self._steps_at_checkpoint >= every:
            self._due = True

    def maybe_save(self) -> None:
        """Write the checkpoint a step made due (in the background after the copy)."""
        if not self._due:
            return
        with self._lock:
            if not self._due:
                return
            self._due = False
            try:
                self.save(wait=False)
            except (OSError, RuntimeError):
                log.exception("checkpoint at step %d failed", self.engine.global_step)

    def start(self) -> None:
        """Checkpoints every ``--checkpoint-interval`` seconds while steps are made."""
        interval = self.config.checkpoint.interval_s
        if self.checkpointer is None or interval <= 0:
            return
        self._timer = threading.Thread(target=self._periodic, args=(interval,), name="psserver-periodic-ckpt",
                                       daemon=True)
        self._timer.start()

    def _periodic(self, interval: float) -> None:
        while not self._stop.wait(min(1.0, interval)):
            if time.monotonic() - self._last_time >= interval and self.engine.global_step > self._steps_at_checkpoint:
                try:
                    self.save(wait=False)
                except (OSError, RuntimeError):
                    log.exception("periodic checkpoint failed")

    def stop(self) -> None:
        """The last checkpoint (the server has drained) and every write finished."""
        self._stop.set()
        if self._timer is not None:
            self._timer.join(timeout=10)
        if self.checkpointer is None:
            return
        if self.engine.global_step > 0:
            try:
                self.save(wait=True)
            except (OSError, RuntimeError):
                log.exception("final checkpoint failed")
        self.checkpointer.wait()

    # ---- what ---------------------------------------------------------------------------------

    def save(self, *, wait: bool) -> CheckpointInfo:
        if self.checkpointer is None:
            raise RuntimeError("checkpoints are not configured (start the server with --checkpoint-dir)")
        state = self.snapshot()
        self._steps_at_checkpoint = state["global_step"]
        self._last_time = time.monotonic()
        return self.checkpointer.save(state["global_step"], state, wait=wait)

    def snapshot(self) -> dict:
        """A consistent CPU copy of everything a resume needs (updates pause only for the copy)."""
        cfg, engine = self.config, self.engine
        shards, step, samples = engine.copy_state()
        optimizer = engine.optimizer_config
        return {
            "model": cfg.model,
            "model_config": {"seed": cfg.seed, "stages": len(engine.shards), "input_shape": engine.spec.input_shape},
            "param_shapes": engine.param_shapes(),
            "shards": shards,
            "optimizer_config": asdict(optimizer) if optimizer else None,
            "update": {"mode": cfg.update, "sync_trainers": cfg.sync_trainers},
            "global_step": step,
            "samples_seen": samples,
            "rng": torch.get_rng_state(),
            "cuda_rng": [torch.cuda.get_rng_state(d) for d in engine.devices if d.type == "cuda"],
            "time": time.time(),
            "version": __version__,
        }

    def restore(self) -> int | None:
        """Apply ``--resume``; the global step resumed at, or None for a fresh start."""
        ck = self.config.checkpoint
        if ck.resume is None:
            return None
        if ck.resume == "latest":
            found = load_latest(ck.directory)
            if found is None:
                log.warning("--resume: no valid checkpoint in %s, starting fresh", ck.directory)
                return None
            path, state = found
        else:
            path = Path(ck.resume)
            state = read_checkpoint(path)
        self._restore(state, path)
        return self.engine.global_step

    def _restore(self, state: dict, path: Path) -> None:
        cfg, engine = self.config, self.engine
        if state.get("model") != cfg.model:
            raise CheckpointError(
                f"checkpoint {path} is for model {state.get('model')!r}, this server runs {cfg.model!r}")
        if len(state["shards"]) != len(engine.shards):
            raise CheckpointError(
                f"checkpoint {path} has {len(state['shards'])} stage(s), this server has {len(engine.shards)}: "
                "resume with the same number of --devices"
            )
        if [list(map(tuple, x)) for x in state.get("param_shapes", [])] != [list(x) for x in engine.param_shapes()]:
            raise CheckpointError(f"checkpoint {path} has parameter shapes that do not match model {cfg.model}")
        saved = OptimizerConfig(**state["optimizer_config"]) if state.get("optimizer_config") else None
        optimizer = engine.optimizer_config
        if optimizer is None:
            optimizer = saved
        elif saved is not None and saved.name != optimizer.name:
            raise CheckpointError(f"checkpoint {path} was trained with {saved.name}, server asked for {optimizer.name}")
        engine.load_state(state["shards"], optimizer, int(state["global_step"]), int(state["samples_seen"]))
        self._steps_at_checkpoint = engine.global_step
        if state.get("rng") is not None:
            torch.set_rng_state(state["rng"])
        if self.checkpointer is not None:
            self.checkpointer.last = CheckpointInfo(str(path), engine.global_step, state.get("time", 0.0))
        log.info("resumed from %s: global step %d, %d samples seen", path, engine.global_step, engine.samples_seen)

