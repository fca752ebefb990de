"""``psserver train --rank N``: join the server, train, evaluate, leave.

The :class:`Session` is one membership of the server's RPC group: the join, the heartbeat, the
leave, and the channel its step protocol's trainer half calls the server through
(``psserver.ps.protocols``). Progress and liveness ride on every call as a
:class:`~psserver.ps.messages.Report`; a low-rate heartbeat covers the time between steps.

How a trainer's run ends early:
- SIGTERM (Kubernetes, Slurm: preemption) or SIGINT: the step in flight finishes, what the
  trainer owes is handed in, it leaves, and exits 143 / 130 (:class:`StopSignals`).
- The server answers that it is no member (evicted: it was stopped or paused past the server's
  ``--trainer-timeout``, or evicted by the server's guard), or the server is gone: exit 3, or
  with ``--reconnect`` the trainer rejoins under a fresh name and continues where it was.

A rejoin runs in a fresh process image of the same command line (``psserver.ps.rejoin`` says
why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import resource
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict
from typing import NoReturn

import torch
import torch.distributed.rpc as rpc
from torch.utils.data import DistributedSampler

from psserver.config import TrainerConfig
from psserver.data import load_dataset
from psserver.errors import Evicted, ServerLost, ServerUnavailable, UsageError
from psserver.models import get_model_spec
from psserver.ps import endpoint, rendezvous, torch_rpc
from psserver.ps.engine import resolve_device
from psserver.ps.messages import JoinRequest, Report
from psserver.ps.protocols import TrainerHalf, get_protocol
from psserver.ps.protocols.trainer_compute import WIRE_DTYPES
from psserver.ps.rejoin import Position, reexec, take_position
from psserver.ps.stop_signals import Stopped, StopSignals
from psserver.utils.memory import freeze_long_lived
from psserver.utils.metrics import get_metric
from psserver.utils.progress import Progress

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0
"""How long a trainer whose call failed waits for the server to say whether it is a member."""
EVICTED, LOST, FAILED = "evicted", "lost", "failed"
"""Why a call failed (:func:`_diagnose`)."""


class JoinLost(ServerUnavailable):
    """``init_rpc`` failed: the server or a member went away while this trainer joined."""


class PartitionCallError(RuntimeError):
    """A call to one of several server processes failed (``Session.call_each``)."""

    def __init__(self, server: int, name: str, message: str) -> None:
        super().__init__(message)
        self.server = server
        self.server_name = name


class Session:
    """One membership of the RPC group, at most one per process (``--reconnect`` re-executes the
    trainer to rejoin: see the module's docstring)."""

    def __init__(self, config: TrainerConfig, stop: StopSignals | None = None) -> None:
        self.config = config
        self.closed = False
        self.device = trainer_device(config.device)
        self.wire_dtype = WIRE_DTYPES[config.wire_dtype]
        token = rendezvous.join_token(config)
        with stop.interruptible() if stop is not None else contextlib.nullcontext():
            self.store, self.url = rendezvous.connect_store(
                config.server_host, config.server_port, config.connect_timeout, config.rpc_timeout, token
            )
        # Before joining the RPC group, whose join calls every member: the server evicts the
        # dead ones (this rank's crashed holder, say) or refuses a rank whose holder is alive.
        rpc_id, incarnation = rendezvous.request_admission(self.store, config.rank,
                                                           f"{config.server_host}:{config.server_port}")
        self.name = rendezvous.trainer_name(config.rank, incarnation)
        rendezvous.set_transport_interface(config.server_host, local=False)
        torch_rpc.check_version()
        torch_rpc.restrict_unpickler()
        _maybe_inject_join_fault()
        try:
            rpc.init_rpc(
                self.name,
                rank=rpc_id,
                world_size=None,
                rpc_backend_options=rendezvous.backend_options(self.url, config.rpc_timeout, 4),
            )
        except RuntimeError as e:  # the group or the server went away while this trainer joined
            msg = str(e).splitlines()[0]
            raise JoinLost(f"cannot join the RPC group of {config.server_host}:{config.server_port}: {msg}") from None
        optimizer = asdict(config.optimizer) if config.optimizer else None
        request = JoinRequest(config.rank, self.name, socket.gethostname(), os.getpid(), config.step, optimizer,
                              config.compute, config.wire_dtype, config.device)
        try:
            self.info = rpc.rpc_sync(rendezvous.SERVER_NAME, endpoint.join, args=(request,))
        except Exception as e:  # noqa: BLE001 - the server's refusal is the user's answer
            self._shutdown(graceful=False)
            raise UsageError(f"server refused the join: {_remote_message(e)}") from None
        if "error" in self.info:
            refusal = self.info["error"]
            self._shutdown(graceful=True)
            raise UsageError(refusal)
        self.report: Report | None = None
        self.servers: list[str] = list(self.info.get("servers", [rendezvous.SERVER_NAME]))
        """RPC names of the server processes, server 0 first (several: ``--num-servers``)."""
        self.step_protocol: str = self.info["step"]
        self.protocol: TrainerHalf = get_protocol(self.step_protocol).trainer(self)
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat, name="psserver-heartbeat", daemon=True)
        self._hb.start()
        log.info("joined psserver %s:%d as %s (model %s, update %s, optimizer %s, --compute %s --step %s%s)",
                 config.server_host, config.server_port, self.name, self.info["model"], self.info["update"],
                 self.info["optimizer"]["name"], self.info["compute"], self.step_protocol,
                 f" on {self.device}" if self.info["compute"] == "trainer" else "")

    def call(self, op: str, *args):
        """``op`` of the server half of this session's step protocol (the trainer half's channel);
        what the server tells along (a step it dropped) is logged."""
        result, notices = rpc.rpc_sync(rendezvous.SERVER_NAME, endpoint.call, args=(self.name, op, args, self.report))
        for notice in notices:
            log.warning("%s", notice)
        return result

    def call_each(self, op: str, args: list[tuple]) -> list:
        """``op`` on every server process at once, ``args[i]`` for server i; their results in
        order. When any failed (after all have answered), ``PartitionCallError`` naming it."""
        futures = [rpc.rpc_async(name, endpoint.call, args=(self.name, op, a, self.report if i == 0 else None))
                   for i, (name, a) in enumerate(zip(self.servers, args, strict=True))]
        results, failed = [], None
        for i, fut in enumerate(futures):
            try:
                result, notices = fut.wait()
            except RuntimeError as e:
                failed = failed or (i, e)
                continue
            if i == 0:
                for notice in notices:
                    log.warning("%s", notice)
            results.append(result)
        if failed is not None:
            i, e = failed
            raise PartitionCallError(i, self.servers[i], f"server {i} ({self.servers[i]}): {_remote_message(e)}")
        return results

    def _heartbeat(self) -> None:
        interval = float(self.info["heartbeat_interval"])
        while not self._stop.wait(interval):
            try:
                rpc.rpc_async(rendezvous.SERVER_NAME, endpoint.heartbeat, args=(self.name, self.report),
                              timeout=max(1.0, interval * 4))
            except RuntimeError:  # the training loop reports a lost server
                pass

    def evaluate(self, dataset, batch_size: int, metric: str = "accuracy") -> float:
        """The model's ``metric`` on ``dataset`` (its tensors: the inputs, then the targets)."""
        self.protocol.flush()
        *xs, y = dataset.tensors
        outputs = [self.protocol.evaluate(_rows(xs, slice(i, i + batch_size))) for i in range(0, len(y), batch_size)]
        if not outputs:
            return float("nan")
        return get_metric(metric)(torch.cat(outputs), y)

    def probe(self) -> str:
        """The server's state, asked as a heartbeat (``endpoint.NOT_A_MEMBER`` once this trainer
        was evicted); an RPC error when the server is gone."""
        return rpc.rpc_sync(rendezvous.SERVER_NAME, endpoint.heartbeat, args=(self.name, self.report),
                            timeout=min(self.config.rpc_timeout, PROBE_TIMEOUT_S))

    def leave(self) -> None:
        """Hand in what the protocol owes, leave the server and the RPC group (once)."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        try:
            self.protocol.flush()
            rpc.rpc_sync(rendezvous.SERVER_NAME, endpoint.leave, args=(self.name, self.report), timeout=10)
            self._shutdown(graceful=True)
        except Exception:  # noqa: BLE001 - server already gone: leave locally
            self._shutdown(graceful=False)
        rendezvous.forget_store(self.url)

    def abandon(self) -> None:
        """Drop a session whose server is gone (or evicted it), without talking to it."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._shutdown(graceful=False)
        rendezvous.forget_store(self.url)

    def _shutdown(self, graceful: bool) -> None:
        protocol = getattr(self, "protocol", None)
        if protocol is not None:
            protocol.close()
        self.info = {}
        if not torch_rpc.agent_is_set():
            return
        if graceful:
            done = threading.Event()

            def graceful_leave() -> None:
                try:
                    rpc.shutdown(graceful=True, timeout=10)
                except Exception:  # noqa: BLE001
                    log.debug("graceful RPC shutdown failed", exc_info=True)
                finally:
                    done.set()

            threading.Thread(target=graceful_leave, daemon=True).start()
            if done.wait(20):
                return
            log.warning("leaving the RPC group timed out; shutting down locally")
        try:
            rpc.shutdown(graceful=False)
        except Exception:  # noqa: BLE001
            log.debug("local RPC shutdown failed", exc_info=True)


def _rows(tensors: list[torch.Tensor], idx):
    """A batch of the inputs: one tensor, or a tuple (a model with tables: ids and dense features)."""
    return tensors[0][idx] if len(tensors) == 1 else tuple(t[idx] for t in tensors)


def trainer_device(name: str) -> torch.device:
    """The device of ``--device``, made current for CUDA (``UsageError`` when this host does not have it)."""
    dev = resolve_device(name, "--device")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def _test_step_delay() -> float:
    """Tests only: ``PSSERVER_TEST_STEP_DELAY`` seconds of sleep per step, a slow trainer."""
    try:
        return max(0.0, float(os.environ.get("PSSERVER_TEST_STEP_DELAY", "0")))
    except ValueError:
        return 0.0


def _maybe_inject_join_fault() -> None:
    """Tests only: ``PSSERVER_FAULT_INJECT=die-in-join`` kills this process inside
    ``init_rpc`` while it holds the group's membership token, as a crash there would."""
    if os.environ.get("PSSERVER_FAULT_INJECT") != "die-in-join":
        return

    def die(agent) -> None:  # noqa: ARG001
        log.error("injected fault: dying inside init_rpc")
        os._exit(9)

    torch_rpc.die_inside_init_rpc(die)


def _remote_message(e: BaseException) -> str:
    """The useful line of an RPC error: the remote exception's message, not its traceback.

    Remote exceptions arrive as ``On WorkerInfo(...):\nValueError('...')\nTraceback ...``.
    """
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if lines and re.match(r"^(\w+: )?On WorkerInfo", lines[0]) and len(lines) >= 2:
        m = re.match(r"^\w+\((['\"])(.*)\1\)$", lines[1])
        return m.group(2) if m else lines[1]
    return lines[0] if lines else type(e).__name__


def _shard_count(config: TrainerConfig, info: dict) -> int:
    if config.num_trainers is not None:
        return config.num_trainers
    if info["update"] == "sync":
        n = int(info["sync_trainers"])
        if config.rank < n:
            return n
    if config.rank == 0:
        return 1
    raise UsageError(f"rank {config.rank}: pass --num-trainers (or set WORLD_SIZE) so the data can be sharded")


def run_trainer(config: TrainerConfig) -> int:
    """Train, evaluate and leave (0); after SIGTERM or SIGINT, 128 + its number, having left."""
    torch.set_num_threads(config.compute_threads)
    position = take_position()
    with StopSignals() as stop:
        try:
            return _train(config, position, stop)
        except Stopped as s:
            log.warning("received %s %s: exiting (exit %d)", signal.Signals(s.signum).name, s.why, s.code)
            return s.code


def _train(config: TrainerConfig, position: Position | None, stop: StopSignals) -> int:
    session = _join(config, position, stop)
    try:
        spec = get_model_spec(session.info["model"])
        num_shards = _shard_count(config, session.info)
        if config.rank >= num_shards:
            raise UsageError(f"--rank {config.rank} must be < number of trainers {num_shards}")
        train_set, eval_set = load_dataset(config.data, spec.input_shape, spec.num_classes, spec.input_dtype)
    except BaseException:
        session.leave()
        raise
    freeze_long_lived()  # the data set and the RPC layer: no full collection rescans them mid-step
    sampler = DistributedSampler(train_set, num_replicas=num_shards, rank=config.rank, shuffle=True,
                                 seed=config.data.seed, drop_last=False)
    *x_all, y_all = train_set.tensors
    steps_per_epoch = (len(sampler) + config.batch_size - 1) // config.batch_size
    total = steps_per_epoch * config.epochs
    if config.max_steps:
        total = min(total, config.max_steps)
    if position is None:
        position = Position()
        log.info("rank %d/%d: %d training samples, %d steps", config.rank, num_shards, len(sampler), total)
    pos = position
    progress = Progress(total, desc=f"trainer {config.rank}", enabled=config.progress)
    if pos.steps:
        progress.update(pos.steps)
    delay = _test_step_delay()
    try:
        while pos.epoch < config.epochs and pos.steps < total:
            sampler.set_epoch(pos.epoch)
            indices = torch.tensor(list(iter(sampler)))
            while pos.batch_idx < steps_per_epoch and pos.steps < total:
                if stop.signum is not None:
                    return _leave_on_signal(session, stop.signum, pos, progress)
                idx = indices[pos.batch_idx * config.batch_size:(pos.batch_idx + 1) * config.batch_size]
                xb, yb = _rows(x_all, idx), y_all[idx]
                if delay:
                    time.sleep(delay)
                try:
                    pos.loss = session.protocol.step(xb, yb)
                except (RuntimeError, TimeoutError) as e:
                    _recover(session, config, e, pos, stop)  # rejoins in a new process image, or raises
                pos.steps += 1
                pos.samples += len(idx)
                if config.stats_out is not None:
                    pos.step_ends.append(time.monotonic())
                pos.batch_idx += 1
                rate = pos.samples / max(1e-6, time.monotonic() - pos.t_start)
                session.report = Report(pos.steps, pos.samples, pos.loss, rate)
                progress.update(loss=pos.loss, rate=rate)
            pos.epoch += 1
            pos.batch_idx = 0
        progress.close()
        if stop.signum is not None:
            return _leave_on_signal(session, stop.signum, pos, progress)
        try:
            score = session.evaluate(eval_set, config.eval_batch_size, spec.metric)
        except (RuntimeError, TimeoutError) as e:
            _recover(session, config, e, pos, stop)
    except BaseException:
        progress.close()
        session.leave()
        raise
    if session.report is not None and spec.metric == "accuracy":
        session.report = dataclasses.replace(session.report, accuracy=score)
    session.leave()
    elapsed = time.monotonic() - pos.t_start
    log.info("rank %d: %d steps, %d samples in %.1fs (%.1f samples/s), final loss %.4f, %s %.4f",
             config.rank, pos.steps, pos.samples, elapsed, pos.samples / max(elapsed, 1e-6), pos.loss, spec.metric,
             score)
    if config.stats_out is not None:
        config.stats_out.write_text(json.dumps(
            {"rank": config.rank, "batch_size": config.batch_size, "start": pos.t_start, "step_ends": pos.step_ends,
             "samples": pos.samples, "metric": spec.metric, spec.metric: score,
             "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             "row_payload_bytes": getattr(session.protocol, "row_payload", None)}))
    print(f"rank {config.rank} {spec.metric} {score:.4f}", flush=True)
    return 0


def _join(config: TrainerConfig, position: Position | None, stop: StopSignals) -> Session:
    """The first join; or, in a trainer re-executed to rejoin, the rejoin, tried until the
    server takes it (each try waits up to ``--connect-timeout`` for a server that is starting)."""
    if position is None:
        if not config.reconnect:
            return Session(config, stop)
        try:
            return Session(config, stop)
        except JoinLost as e:  # --reconnect: a server lost during the first join is waited for too
            log.warning("joining failed (%s): rejoining in a fresh process", e)
            reexec(Position(), stop)  # RPC is never initialised twice in one process (psserver.ps.torch_rpc)
    where = f"{config.server_host}:{config.server_port}"
    delay = 0.5
    attempt = 0
    while True:
        attempt += 1
        log.info("rejoining psserver %s (attempt %d)", where, attempt)
        try:
            session = Session(config, stop)
        except JoinLost as e:  # init_rpc failed half-way: RPC cannot be initialised again in this process
            log.warning("rejoin attempt %d failed (%s): rejoining in a fresh process", attempt, e)
            reexec(position, stop)
        except (UsageError, RuntimeError) as e:
            log.warning("rejoin attempt %d failed (%s): retrying in %.1fs", attempt, _remote_message(e), delay)
            with stop.interruptible():
                time.sleep(delay)
            delay = min(delay * 2, 10.0)
            continue
        if position.report is not None:
            session.report = Report(**position.report)
        log.info("reconnected as %s at global step %d (attempt %d)", session.name, session.info["global_step"],
                 attempt)
        return session


def _leave_on_signal(session: Session, signum: int, pos: Position, progress: Progress) -> int:
    progress.close()
    code = 128 + signum
    log.warning("received %s: handing in step %d and leaving psserver (exit %d)", signal.Signals(signum).name,
                pos.steps, code)
    session.leave()
    return code


def _diagnose(session: Session, error: BaseException | None = None) -> str:
    """Why a call failed: ``EVICTED`` (the server says this trainer is no member), ``LOST`` (no
    answer, or a server that is stopping), ``FAILED`` (the call itself, for a member of a serving
    server). The server is asked, whatever ``error`` says: a remote exception arrives as a bare
    ``RuntimeError``, and a step of ``--step plain`` or ``pull`` fails inside torch's
    ``dist_autograd`` ("Could not find autograd context") before any call of ours can say why.
    A call that failed on another server process (several) is ``LOST`` when that one does not
    answer a ping: server 0 may not have noticed yet."""
    if isinstance(error, PartitionCallError) and error.server > 0:
        try:
            rpc.rpc_sync(error.server_name, rendezvous.ping, timeout=PROBE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - no answer: that server process is gone
            return LOST
    try:
        state = session.probe()
    except Exception:  # noqa: BLE001 - no answer: the server is gone
        return LOST
    if state == endpoint.NOT_A_MEMBER:
        return EVICTED
    return FAILED if state == "SERVING" else LOST


def _recover(session: Session, config: TrainerConfig, error: BaseException, pos: Position,
             stop: StopSignals) -> NoReturn:
    """After a failed call: a failure of a live membership is a bug (raised); an eviction or a lost
    server ends the trainer (exit 3), or with ``--reconnect`` it rejoins under a fresh name and
    continues with the same batch (the failed step's update was not applied)."""
    what = _diagnose(session, error)
    reason = _remote_message(error)
    where = f"{config.server_host}:{config.server_port}"
    if what == FAILED:
        session.leave()
        raise RuntimeError(f"training step failed on the server: {reason}")
    name = session.name
    session.abandon()
    stop.check("after its eviction" if what == EVICTED else "after losing its server")
    if not config.reconnect:
        if what == EVICTED:
            raise Evicted(f"{name} was evicted by the psserver at {where} (no sign of life within its "
                          "--trainer-timeout, or a gradient it would not keep); use --reconnect to rejoin")
        raise ServerLost(f"lost the server at {where} ({reason}); use --reconnect to wait for it")
    if what == EVICTED:
        log.warning("%s was evicted by the psserver at %s: rejoining under a fresh name", name, where)
    else:
        log.warning("server at %s lost (%s): reconnecting", where, reason)
    pos.reconnects += 1
    pos.report = asdict(session.report) if session.report is not None else None
    reexec(pos, stop)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: psserver train")
