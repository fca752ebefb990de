"""``psserver train --rank N``: join the server, train, evaluate, leave.

The loop is a client of the library (``psserver.trainer.connection``) like any other: a
``Connection`` keeps the membership (join, leave, signals, the position, a failed call
recovered) and the :class:`~psserver.trainer.model_steps.ModelSteps` that ``ps.join()``
returns steps the joined model a batch at a time; only their documented members are used here.

How a trainer's run ends early:
- SIGTERM (Kubernetes, Slurm: preemption) or SIGINT: the step in flight finishes, what the
  trainer owes is handed in, it leaves, and exits 143 / 130 (:class:`StopSignals`).
- The server answers that it is no member (evicted: it was stopped or paused past the server's
  ``--trainer-timeout``, or evicted by the server's guard), or the server is gone: exit 3, or
  with ``--reconnect`` the trainer rejoins under a fresh name and continues where it was.
  Evicted along with its last step (no later call fails on it): exit 3 all the same, with the
  server's reason, never a success.

A rejoin runs in a fresh process image of the same command line (``psserver.trainer.rejoin`` says
why).
"""

from __future__ import annotations

import json
import logging
import math
import resource
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
from torch.utils.data import IterableDataset, default_collate

from psserver.config import TrainerConfig
from psserver.data import Batches, check_batch, default_workers, load_dataset
from psserver.errors import DataError, UsageError
from psserver.models.calling import call_model, describe_input, input_batch_size, move_input
from psserver.models.losses import loss_name
from psserver.trainer.connection import Connection
from psserver.trainer.model_steps import ModelSteps
from psserver.trainer.rejoin import command_line
from psserver.trainer.session import remote_message
from psserver.trainer.stop_signals import Stopped
from psserver.utils.cpus import share, usable_cpus
from psserver.utils.eval_metrics import check_outputs, resolve_metric
from psserver.utils.memory import freeze_long_lived
from psserver.utils.progress import Progress
from psserver.utils.references import is_reference

log = logging.getLogger(__name__)

class ThreadShare:
    """The trainer's torch threads: ``--compute-threads``, or its share of the host's usable
    CPUs among the trainers there (``psserver.utils.cpus``), asked of the server at the start
    and again every ``INTERVAL_S`` while training (trainers come and go); set on the training
    thread, whose OpenMP team it sizes."""

    INTERVAL_S = 1.0
    """Often enough that a trainer alone on a host gives up its second thread within a second of
    another's join: until then three threads share two cores and OpenMP's barriers stall every
    step (seen: 400 ms steps instead of 80); one small call a second costs nothing."""

    def __init__(self, config: TrainerConfig) -> None:
        self.fixed = config.compute_threads or None
        self.cpus = usable_cpus()
        self._next = 0.0
        self.threads = self.fixed or 1
        torch.set_num_threads(self.threads)

    def update(self, joined: ModelSteps, *, force: bool = False) -> None:
        if self.fixed is not None or joined.compute != "trainer":
            return
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + self.INTERVAL_S
        try:
            threads = share(self.cpus, joined.host_trainers())
        except (RuntimeError, TimeoutError):  # the step's own call reports a lost server
            return
        if threads != self.threads:
            log.info("%d torch thread(s): a share of the %d CPUs this trainer may use", threads, self.cpus)
            self.threads = threads
            torch.set_num_threads(threads)


def run_trainer(config: TrainerConfig) -> int:
    """Train, evaluate and leave (0); after SIGTERM or SIGINT, 128 + its number, having left.
    The loop is a user of the library's :class:`~psserver.trainer.connection.Connection`, as
    any user's own loop is: one membership, one recovery, one way to leave."""
    try:
        with Connection(config, announce_errors=False, rejoin_command=command_line) as ps:
            return _train(ps)
    except Stopped as s:
        log.warning("received %s %s: exiting (exit %d)", signal.Signals(s.signum).name, s.why, s.code)
        return s.code
    except SystemExit as e:  # the connection left after a signal, at a step boundary
        return e.code if isinstance(e.code, int) else 1


def _train(ps: Connection) -> int:
    config = ps.config
    joined = ps.join()
    spec = joined.spec
    num_shards = ps.num_trainers
    if config.rank >= num_shards:
        raise UsageError(f"--rank {config.rank} must be < number of trainers {num_shards}")
    train_set, eval_set = load_dataset(config.data, spec.input_shape, spec.num_classes, spec.input_dtype)
    metric, metric_fn = resolve_metric(config.metric, spec.metric, joined.loss_fn)
    _check_metric(joined, eval_set, metric_fn)
    data = _batches(config, train_set, joined, rank=config.rank, num_replicas=num_shards)
    ps.before_rejoin(data.close)  # its worker processes would outlive this process image
    freeze_long_lived()  # the data set and the RPC layer: no full collection rescans them mid-step
    try:
        return _run(ps, joined, data, eval_set, metric, metric_fn)
    finally:
        data.close()


def _run(ps: Connection, joined: ModelSteps, data: Batches, eval_set, metric: str, metric_fn: Callable) -> int:
    """The training loop, evaluation and leave of :func:`_train`."""
    config = ps.config
    steps_per_epoch = data.steps_per_epoch  # None: an IterableDataset, whose epoch ends with its stream
    ps.steps_per_epoch = steps_per_epoch
    total: int | None = None if steps_per_epoch is None else steps_per_epoch * config.epochs
    if config.max_steps:
        total = config.max_steps if total is None else min(total, config.max_steps)
    if not ps.resumed:
        if data.samples_per_epoch is None:
            log.info("rank %d/%d: an IterableDataset (it shards itself), %s", config.rank, data.num_replicas,
                     "until its stream ends" if total is None else f"at most {total} steps")
        else:
            log.info("rank %d/%d: %d training samples, %d steps", config.rank, data.num_replicas,
                     data.samples_per_epoch, total)
    pos = ps.position
    threads = ThreadShare(config)
    threads.update(joined, force=True)
    progress = Progress(total, desc=f"trainer {config.rank}", enabled=config.progress)
    if pos.steps:
        progress.update(pos.steps)
    first = True  # this process's first step: a failure there is the data not fitting the model
    try:
        while pos.epoch < config.epochs and (total is None or pos.steps < total):
            read = 0
            for xb, yb in data.epoch(pos.epoch, pos.batch_idx):
                if ps.stop_signal is not None:
                    progress.close()
                    ps.leave_on_signal()
                if first:
                    check_batch(xb, yb, config.data.dataset)
                threads.update(joined)
                check = (lambda e, x=xb, y=yb: _first_step_failed(joined, config, e, x, y)) if first else None
                loss = joined.train_step(xb, yb, samples=_batch_len(xb, yb), on_failure=check)
                first = False
                read += 1
                if config.stats_out is not None:
                    pos.step_ends.append(time.monotonic())
                pos.batch_idx += 1
                progress.update(loss=loss, rate=(pos.samples - pos.samples_before) / max(1e-6, time.monotonic() -
                                                                                          pos.t_start))
                if total is not None and pos.steps >= total:
                    break
            if steps_per_epoch is None and read == 0 and pos.batch_idx == 0:
                raise DataError(f"dataset {config.data.dataset} gave rank {config.rank} no samples in epoch "
                                f"{pos.epoch} (an IterableDataset shards itself with psserver.data.shard_info())")
            pos.epoch += 1
            pos.batch_idx = 0
            pos.epoch_samples = 0
        progress.close()
        if ps.stop_signal is not None:
            ps.leave_on_signal()
        joined.check_not_evicted()
        score = _evaluate(ps, joined, eval_set, metric, metric_fn)
    finally:
        progress.close()
    if metric == "accuracy":
        joined.report_accuracy(score)
    ps.close()
    elapsed = time.monotonic() - pos.t_start
    mine = pos.samples - pos.samples_before  # a trainer started again by hand: what this process trained
    log.info("rank %d: %d steps, %d samples%s in %.1fs (%.1f samples/s), final loss %.4f, %s %.4f",
             config.rank, pos.steps, pos.samples, f" ({mine} by this process)" if pos.samples_before else "", elapsed,
             mine / max(elapsed, 1e-6), pos.loss, metric, score)
    if config.stats_out is not None:
        _write(config.stats_out, json.dumps(
            {"rank": config.rank, "batch_size": config.batch_size, "start": pos.t_start, "step_ends": pos.step_ends,
             "samples": pos.samples, "metric": metric, metric: score,
             "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             "rss_bytes": psutil.Process().memory_info().rss,
             "row_payload_bytes": joined.row_payload_bytes, "transport": joined.transport}))
    print(f"rank {config.rank} {metric} {score:.4f}", flush=True)
    return 0


def _batches(config: TrainerConfig, dataset, joined: ModelSteps, *, rank: int = 0, num_replicas: int = 1,
             evaluate: bool = False) -> Batches:
    """The DataLoader of a trainer's shard (or of the whole held-out set, in order)."""
    workers = config.data.workers if config.data.workers is not None else default_workers(config.data)
    return Batches(dataset, name=config.data.dataset, batch_size=config.eval_batch_size if evaluate else
                   config.batch_size, rank=rank, num_replicas=num_replicas, shuffle=not evaluate,
                   seed=config.data.seed, workers=workers, pin_memory=joined.device.type == "cuda")


def _evaluate(ps: Connection, joined: ModelSteps, eval_set, metric: str, metric_fn: Callable) -> float:
    """``metric`` over the whole held-out set (NaN, said in a log line, when there is none):
    the outputs of every batch concatenated, against the targets."""
    config = ps.config
    if eval_set is None:
        log.warning("dataset %s has no held-out set: evaluation skipped (%s nan)", config.data.dataset, metric)
        return math.nan
    batches = _batches(config, eval_set, joined, evaluate=True)
    try:
        return ps.evaluate(batches.epoch(0), metric=metric_fn)
    except DataError as e:
        raise DataError(f"dataset {config.data.dataset}: {e} ({metric})") from None
    finally:
        batches.close()


def _check_metric(joined: ModelSteps, eval_set, metric_fn: Callable) -> None:
    """A user's model (``MODULE:ATTR``) may return a tuple or dict, which a built-in metric cannot
    score: one held-out sample through it now says so before training, not after the last
    epoch. A sample that does not go through is left to the first step to diagnose."""
    model = joined.model
    if eval_set is None or model is None or joined.spec.sparse or not is_reference(joined.spec.name):
        return
    training = model.training
    try:
        sample = next(iter(eval_set)) if isinstance(eval_set, IterableDataset) else eval_set[0]
        x = default_collate([sample])[0]
        device = next(model.parameters()).device
        model.eval()
        with torch.no_grad():
            out = call_model(model, move_input(x, device))
    except Exception as e:  # noqa: BLE001 - the first step diagnoses data that does not fit the model
        log.debug("no held-out sample through the model before training: %s", e)
        return
    finally:
        model.train(training)
    check_outputs(metric_fn, out)


def _batch_len(x, y) -> int:
    return int(y.shape[0]) if isinstance(y, torch.Tensor) and y.dim() else input_batch_size(x)


def _first_step_failed(joined: ModelSteps, config: TrainerConfig, error: Exception, x, y) -> None:
    """The first step failed: raise one line when the batch does not fit the model (its
    forward, or the loss, failed: locally, or on a server that is serving this trainer);
    return when the server is the problem (lost, or evicted this trainer: recovered as any step)."""
    if isinstance(error, UsageError):
        raise error
    if isinstance(error, RuntimeError | TimeoutError) and joined.lost_or_evicted(error):
        return
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else ""
    line = remote_message(error)  # raised on the server: its message, without the RPC's wrapping
    if line == first_line or not text:  # raised here
        line = f"{type(error).__name__}: {first_line}"
    log.debug("the first step failed", exc_info=error)
    loss = loss_name(config.loss, joined.spec.loss)
    raise DataError(f"dataset {config.data.dataset} gives inputs of shape {describe_input(x)} and targets of shape "
                    f"{describe_input(y)} that model {joined.spec.name} with loss {loss} cannot "
                    f"take: {line}") from None


def _write(path: Path, text: str) -> None:
    """``text`` into ``path``; a failed write names the file (a full disk says no file name)."""
    try:
        path.write_text(text)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: psserver train")

