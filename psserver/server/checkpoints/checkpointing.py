"""What a parameter-server checkpoint holds, how a server resumes from one, and when one is written.

Checkpoints belong to a run (``psserver.checkpoint``). At start the policy checks that the
directory can be written, removes dead writers' temporary files and picks the run: a fresh
start gets a new run id and is refused in a directory that holds checkpoints unless
``--new-run`` says to start beside them; ``--resume`` continues the run of the checkpoint it
loads (a new run when none loads, when the file predates run ids, or when it is not the newest
of its run: a resumed run never prunes the files of a branch it left).

A step never writes a checkpoint itself: an optimizer step only marks one *due*
(``note_step``), and the endpoint calls ``maybe_save`` once the call that made the step has
returned from the step's code, holding no lock. The copy of the state then takes the
updater's lock on the compute thread, so no lock is ever taken twice in the opposite order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from psserver import __version__
from psserver.checkpoint import (
    LEGACY_RUN,
    CheckpointDirError,
    Checkpointer,
    CheckpointError,
    Header,
    check_writable,
    checkpoint_path,
    find_latest,
    list_checkpoints,
    load_named,
    new_run_id,
    read_header,
    remove_stale_temporaries,
    step_of,
    untrusted_file,
    verify,
)
from psserver.config import OptimizerConfig, ServerConfig
from psserver.models.layout import ModelLayout
from psserver.server.checkpoints.content import check_state, load_error
from psserver.server.engine.engine import StepEngine
from psserver.telemetry import CheckpointInfo

log = logging.getLogger(__name__)

PARTITION_CATCH_UP_S = 10.0
"""How long a server of rank > 0 waits for its own part of the step server 0 checkpoints."""


class CheckpointPolicy:
    """Snapshots and restores the engine, on a step count, a timer, a request and at stop."""

    def __init__(self, config: ServerConfig, engine: StepEngine) -> None:
        self.config = config
        self.engine = engine
        ck = config.checkpoint
        self.directory: Path | None = partition_directory(config)
        """Where this server's files go: ``--checkpoint-dir``, or its ``server-<rank>`` under it
        when several server processes each write their partition."""
        self.run_id = new_run_id()
        """The run this server's checkpoints belong to (``restore`` may continue a saved one)."""
        self.checkpointer = Checkpointer(self.directory, ck.keep, self.run_id) if self.directory is not None else None
        self.before_write: Callable[[int, str], None] | None = None
        """Server 0 of several: has every other server write its partition of checkpoint
        (step, run) before its own file, which makes the checkpoint complete, is written."""
        self.final_ok = True
        """False once the checkpoint at stop failed: the server then exits non-zero."""
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
            except (OSError, RuntimeError) as e:  # the next one retries; stop() reports the last
                log.error("checkpoint at step %d failed: %s", self.engine.global_step, e)

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
                except (OSError, RuntimeError) as e:
                    log.error("periodic checkpoint failed: %s", e)

    def stop(self) -> bool:
        """The last checkpoint (the server has drained) and every write finished; False (and one
        ERROR line) when that last checkpoint could not be written."""
        self._stop.set()
        if self._timer is not None:
            self._timer.join(timeout=10)
        if self.checkpointer is None:
            return True
        if self.engine.global_step > 0:
            try:
                self.save(wait=True)
            except (OSError, RuntimeError) as e:
                self.final_ok = False
                last = self.checkpointer.last
                unsaved = self.engine.global_step - (last.step if last is not None else 0)
                log.error("final checkpoint failed: %s — the last %d step(s) are not saved (%s)", e, unsaved,
                          f"newest checkpoint: {last.path}" if last is not None else "this run has no checkpoint")
        self.checkpointer.wait()
        return self.final_ok

    # ---- what ---------------------------------------------------------------------------------

    def save(self, *, wait: bool) -> CheckpointInfo:
        if self.checkpointer is None:
            raise RuntimeError("checkpoints are not configured (start the server with --checkpoint-dir)")
        if not self.engine.has_model:
            raise RuntimeError("no model yet: the first trainer that joins brings it")
        state = self.snapshot()
        self._steps_at_checkpoint = state["global_step"]
        self._last_time = time.monotonic()
        before = self.before_write
        step, run = state["global_step"], self.checkpointer.run
        return self.checkpointer.save(step, state, wait=wait,
                                      before=None if before is None else lambda: before(step, run))

    # ---- partitions (several server processes) --------------------------------------------

    def save_partition(self, step: int, run: str) -> str:
        """A server of rank > 0: write this partition as part of server 0's checkpoint ``step``
        of ``run`` (server 0 names both; the file is written before this returns)."""
        if self.checkpointer is None:
            raise RuntimeError(f"server {self.config.server_rank} has no --checkpoint-dir")
        self.run_id = self.checkpointer.run = run
        # A trainer's update goes to every server at once: this one's part of step ``step`` may
        # still be on its way when server 0 has applied its own.
        deadline = time.monotonic() + PARTITION_CATCH_UP_S
        while self.engine.global_step < step and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.engine.global_step != step:
            log.warning("partition of checkpoint step %d written at this server's global step %d", step,
                        self.engine.global_step)
        info = self.checkpointer.save(step, self.snapshot(), wait=True)
        return info.path

    def load_partition(self, step: int, run: str) -> None:
        """A server of rank > 0: load this partition of checkpoint ``step`` (the one server 0
        resumes from or rolls back to)."""
        if self.directory is None:
            raise CheckpointError(f"server {self.config.server_rank} has no --checkpoint-dir to load step {step} from")
        path = checkpoint_path(self.directory, step)
        if not path.exists():
            raise CheckpointError(f"server {self.config.server_rank} has no partition of checkpoint step {step} "
                                  f"({path} is missing): the checkpoints of this job are incomplete here")
        _, state = load_named(path)
        self._restore(state, path)
        self.run_id = run
        if self.checkpointer is not None:
            self.checkpointer.run = run

    def reload_latest(self) -> int | None:
        """Server 0 of several, when a lost server comes back: load the newest complete
        checkpoint again (its own file exists only for complete ones); its step, or None."""
        if self.directory is None:
            return None
        self.checkpointer.wait()  # type: ignore[union-attr]
        found = find_latest(self.directory)
        if found is None:
            return None
        header, state = found
        self._restore(state, header.path)
        return int(state["global_step"])

    def _restore_model(self, state: dict, path: Path) -> None:
        """Check the checkpoint's model against the server's; a server without ``--model`` that
        holds none yet takes the checkpoint's layout (no user code needed to resume)."""
        cfg, engine = self.config, self.engine
        saved_args = (state.get("model_config") or {}).get("model_args") or {}
        recorded = state.get("layout")
        if cfg.model is not None:
            if state.get("model") != cfg.model:
                raise CheckpointError(
                    f"checkpoint {path} is for model {state.get('model')!r}, this server runs {cfg.model!r}")
            if saved_args != cfg.model_args:
                raise CheckpointError(f"checkpoint {path} is for --model-args {saved_args}, this server runs "
                                      f"{cfg.model_args}")
        if recorded is None:
            if engine.has_model:
                return
            raise CheckpointError(f"checkpoint {path} records no model layout (written by an older psserver): resume "
                                  f"it with --model {state.get('model')}")
        try:
            layout = ModelLayout.from_dict(recorded)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path}: {e}") from None
        if not engine.has_model:
            engine.adopt(layout, None, state.get("model"), saved_args)
        elif layout.fingerprint() != engine.layout.fingerprint():
            raise CheckpointError(f"checkpoint {path} holds another model than this server's "
                                  f"({engine.layout.difference(layout)})")

    def snapshot(self) -> dict:
        """A consistent CPU copy of everything a resume needs (updates pause only for the copy)."""
        shards, step, samples, tables, lr_schedule, buffers = self.engine.copy_state()
        return self._describe(shards, step, samples, tables, lr_schedule, buffers)

    def live_snapshot(self) -> dict:
        """(the updater's and the tables' locks held) ``snapshot``'s structure holding the
        engine's own tensors, without the RNG (``psserver.server.state.memory`` maps it)."""
        shards, step, samples, tables, lr_schedule, buffers = self.engine.live_state()
        state = self._describe(shards, step, samples, tables, lr_schedule, buffers)
        state["rng"] = state["cuda_rng"] = None
        state["run"] = self.run_id
        return state

    def _describe(self, shards: list[dict], step: int, samples: int, tables: dict | None, lr_schedule: dict | None,
                  buffers: list[torch.Tensor] | None) -> dict:
        cfg, engine = self.config, self.engine
        optimizer = engine.optimizer_config
        return {
            "model": engine.model_ref,
            "model_config": {"seed": cfg.seed, "stages": len(engine.shards),
                             "input_shape": engine.spec.input_shape if engine.spec is not None else None,
                             "model_args": engine.model_args},
            "layout": engine.layout.to_dict() if engine.layout is not None else None,
            "state_keys": engine.state_keys,
            "param_shapes": engine.param_shapes(),
            "shards": shards,
            "tables": tables,
            "buffers": buffers,
            "embedding": None if tables is None else asdict(cfg.embedding),
            "optimizer_config": asdict(optimizer) if optimizer else None,
            "lr_schedule": lr_schedule,
            "update": {"mode": cfg.update, "sync_trainers": cfg.sync_trainers,
                       **({"outer": cfg.outer} if cfg.update == "diloco" else {})},
            "partition": None if engine.plan is None else {
                "server_rank": cfg.server_rank, "num_servers": cfg.num_servers, "plan": engine.plan.to_dict()},
            "global_step": step,
            "samples_seen": samples,
            "rng": torch.get_rng_state(),
            "cuda_rng": [torch.cuda.get_rng_state(d) for d in engine.devices if d.type == "cuda"],
            "time": time.time(),
            "version": __version__,
        }

    def restore(self, memory: tuple[dict, Path] | None = None) -> int | None:
        """Start the run: check the directory, then continue from ``memory`` (the state a dead
        process of this run left in shared memory, and where), else a fresh start,
        ``--new-run`` or ``--resume``; the global step resumed at, or None for a fresh start."""
        ck, directory = self.config.checkpoint, self.directory
        if directory is not None:
            check_writable(directory)
            remove_stale_temporaries(directory)
        if memory is not None:
            return self.restore_memory(memory)
        if self.config.server_rank > 0:
            return None  # a partition server loads what server 0 says (load_partition)
        if ck.resume is None:
            self._start_fresh()
            return None
        if ck.resume == "latest":
            assert directory is not None
            found = find_latest(directory)
            if found is None:
                left = len(list_checkpoints(directory))
                log.warning("--resume: no valid checkpoint in %s, starting a new run %s%s", directory, self.run_id,
                            f" (the {left} invalid file(s) there are left alone)" if left else "")
                return None
            header, state = found
        else:
            header, state = load_named(Path(ck.resume))
        self._restore(state, header.path)
        self._continue(header, int(state["global_step"]))
        return self.engine.global_step

    def restore_memory(self, memory: tuple[dict, Path]) -> int:
        """Continue from the state a dead process of this run left in memory; its global step."""
        state, where = memory
        self._restore(state, where, checkpoint=False)
        self.run_id = state["run"]
        if self.checkpointer is not None:
            self.checkpointer.run = self.run_id
        log.info("continuing run %s from its state in memory (%s)", self.run_id, where)
        return self.engine.global_step

    def _start_fresh(self) -> None:
        ck, directory = self.config.checkpoint, self.directory
        if directory is None:
            return
        present = list_checkpoints(directory)
        if present and not ck.new_run:
            raise CheckpointDirError(
                f"--checkpoint-dir {directory} holds checkpoints of another run ({len(present)} file(s), newest "
                f"{present[0].name}): --resume to continue it, or --new-run to start a new run beside it")
        log.info("checkpoints of run %s go to %s%s", self.run_id, directory,
                 f" (the {len(present)} file(s) of other runs there are left alone)" if present else "")

    def _continue(self, header: Header, step: int) -> None:
        """Take over the run of the checkpoint resumed from, unless that would let this server
        prune files it did not continue from."""
        directory = self.directory
        if header.run == LEGACY_RUN:
            why = "was written before checkpoints had run ids"
        elif directory is not None and (newer := self._newer_of_run(directory, header.run, step)):
            why = f"is older than {newer.name} of its run {header.run}"
        else:
            self.run_id = header.run
            if self.checkpointer is not None:
                self.checkpointer.run = header.run
            log.info("continuing run %s", self.run_id)
            return
        log.warning("%s %s: continuing as a new run %s, leaving that run's files alone", header.path, why,
                    self.run_id)

    @staticmethod
    def _newer_of_run(directory: Path, run: str, step: int) -> Path | None:
        """A valid checkpoint of ``run`` in ``directory`` past ``step`` (resuming from an older
        one of a run starts a branch). Only this user's own files count: one planted by another
        user that names this run must not turn the run into a new one."""
        for path in list_checkpoints(directory):
            if step_of(path) <= step:
                break
            if untrusted_file(path) is not None:
                continue
            try:
                if read_header(path).run == run:
                    verify(path)
                    return path
            except CheckpointError:
                continue
        return None

    def _restore(self, state: dict, path: Path, *, checkpoint: bool = True) -> None:
        cfg, engine = self.config, self.engine
        if checkpoint:
            check_state(state, path)
        self._restore_model(state, path)
        if len(state["shards"]) != len(engine.shards):
            raise CheckpointError(
                f"checkpoint {path} has {len(state['shards'])} stage(s), this server has {len(engine.shards)}: "
                "resume with the same number of --devices"
            )
        recorded = state.get("partition")
        expected = None if engine.plan is None else {"server_rank": cfg.server_rank, "num_servers": cfg.num_servers,
                                                     "plan": engine.plan.to_dict()}
        if recorded != expected:
            def held(p: dict | None) -> str:
                return "the whole model" if p is None else f"partition {p['server_rank']} of {p['num_servers']}"

            raise CheckpointError(f"checkpoint {path} holds {held(recorded)}; this server holds {held(expected)} "
                                  "(resume with the same --num-servers, each server its own --server-rank)")
        recorded_shapes = [list(map(tuple, x)) for x in state.get("param_shapes", [])]
        shapes = [list(x) for x in engine.param_shapes()]
        if state.get("layout") is not None:
            # The layout matched the model's (or is the model learnt from it): the names differ
            # between a model built by --model and one held from its layout (t0, t1, ...), and a
            # server may resume the other's checkpoint.
            recorded_shapes = [[shape for _, shape in stage] for stage in recorded_shapes]
            shapes = [[shape for _, shape in stage] for stage in shapes]
        if recorded_shapes != shapes:
            raise CheckpointError(f"checkpoint {path} has parameter shapes that do not match model "
                                  f"{cfg.model or engine.model_ref}")
        try:
            saved = OptimizerConfig(**state["optimizer_config"]) if state.get("optimizer_config") else None
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path}: its optimizer_config: {e}") from None
        optimizer = engine.optimizer_config
        if optimizer is None:
            optimizer = saved
        elif saved is not None and saved.name != optimizer.name:
            raise CheckpointError(f"checkpoint {path} was trained with {saved.name}, server asked for {optimizer.name}")
        try:
            engine.load_state(state["shards"], optimizer, int(state["global_step"]), int(state["samples_seen"]),
                              state.get("tables"), state.get("lr_schedule"), state.get("buffers"))
            if state.get("rng") is not None:
                torch.set_rng_state(state["rng"])
        except torch.OutOfMemoryError:
            raise  # the device's memory, not the file
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path}: {e}") from None
        except (KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:
            # What check_state does not look into (tensor shapes against the model's, tables' rows).
            log.debug("loading %s failed", path, exc_info=True)
            raise CheckpointError(f"checkpoint {path} does not load into this server: {load_error(e)}") from None
        self._steps_at_checkpoint = engine.global_step
        if self.checkpointer is not None and checkpoint:
            self.checkpointer.last = CheckpointInfo(str(path), engine.global_step, state.get("time", 0.0))
        log.info("resumed from %s: global step %d, %d samples seen", path, engine.global_step, engine.samples_seen)



def partition_directory(config: ServerConfig) -> Path | None:
    """``--checkpoint-dir``, or ``<it>/server-<rank>`` when several server processes each write
    their partition (they may share one directory, or each have its own on its host)."""
    directory = config.checkpoint.directory
    if directory is None or config.num_servers == 1:
        return directory
    return Path(directory) / f"server-{config.server_rank}"
