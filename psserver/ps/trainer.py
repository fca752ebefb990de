"""``psserver train --rank N``: join the server, train, evaluate, leave.

The :class:`Session` is one membership of the server's RPC group: the join, the heartbeat, the
leave, and the channel its step protocol's trainer half calls the server through
(``psserver.ps.protocols``). Progress and liveness ride on every call as a
:class:`~psserver.ps.messages.Report`; a low-rate heartbeat covers the time between steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from dataclasses import asdict

import torch
import torch.distributed.rpc as rpc
from torch.utils.data import DistributedSampler

from psserver.config import TrainerConfig
from psserver.data import load_dataset
from psserver.errors import ServerLost, UsageError
from psserver.models import get_model_spec
from psserver.ps import endpoint, rendezvous, torch_rpc
from psserver.ps.engine import resolve_device
from psserver.ps.messages import JoinRequest, Report
from psserver.ps.protocols import TrainerHalf, get_protocol
from psserver.ps.protocols.trainer_compute import WIRE_DTYPES
from psserver.utils.memory import freeze_long_lived
from psserver.utils.progress import Progress

log = logging.getLogger(__name__)


class Session:
    """One membership of the RPC group (a trainer may hold several with ``--reconnect``)."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.device = trainer_device(config.device)
        self.wire_dtype = WIRE_DTYPES[config.wire_dtype]
        self.store, self.url = rendezvous.connect_store(
            config.server_host, config.server_port, config.connect_timeout, config.rpc_timeout
        )
        live_key = rendezvous.KEY_LIVE.format(rank=config.rank)
        if self.store.check([live_key]):
            holder = self.store.get(live_key).decode()
            raise UsageError(f"rank {config.rank} is already taken by live trainer {holder}")
        incarnation = self.store.add(rendezvous.KEY_INCARNATION.format(rank=config.rank), 1)
        self.name = rendezvous.trainer_name(config.rank, incarnation)
        rendezvous.set_transport_interface(config.server_host, local=False)
        torch_rpc.check_version()
        torch_rpc.reset_init_counter()  # a reconnecting trainer initialises RPC again
        _maybe_inject_join_fault()
        try:
            rpc.init_rpc(
                self.name,
                rank=rendezvous.next_rpc_id(self.store),
                world_size=None,
                rpc_backend_options=rendezvous.backend_options(self.url, config.rpc_timeout, 4),
            )
        except RuntimeError as e:
            msg = str(e).splitlines()[0]
            raise UsageError(f"cannot join the RPC group of {config.server_host}:{config.server_port}: {msg}") from None
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
        """``op`` of the server half of this session's step protocol (the trainer half's channel)."""
        return rpc.rpc_sync(rendezvous.SERVER_NAME, endpoint.call, args=(self.name, op, args, self.report))

    def _heartbeat(self) -> None:
        interval = float(self.info["heartbeat_interval"])
        while not self._stop.wait(interval):
            try:
                rpc.rpc_async(rendezvous.SERVER_NAME, endpoint.heartbeat, args=(self.name, self.report),
                              timeout=max(1.0, interval * 4))
            except RuntimeError:  # the training loop reports a lost server
                pass

    def evaluate(self, dataset, batch_size: int) -> float:
        self.protocol.flush()
        x, y = dataset.tensors
        correct = 0
        for i in range(0, len(x), batch_size):
            out = self.protocol.evaluate(x[i:i + batch_size])
            correct += int((out.argmax(1) == y[i:i + batch_size]).sum())
        return correct / max(1, len(x))

    def leave(self) -> None:
        self._stop.set()
        try:
            self.protocol.flush()
            rpc.rpc_sync(rendezvous.SERVER_NAME, endpoint.leave, args=(self.name, self.report), timeout=10)
            self._shutdown(graceful=True)
        except Exception:  # noqa: BLE001 - server already gone: leave locally
            self._shutdown(graceful=False)
        rendezvous.forget_store(self.url)

    def abandon(self) -> None:
        """Drop a session whose server is gone, without talking to it."""
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

    def server_alive(self) -> bool:
        try:
            return self.store.get(rendezvous.KEY_SERVER_STATE) == b"SERVING"
        except Exception:  # noqa: BLE001
            return False


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
    torch.set_num_threads(config.compute_threads)
    session = Session(config)
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
    x_all, y_all = train_set.tensors
    steps_per_epoch = (len(sampler) + config.batch_size - 1) // config.batch_size
    total = steps_per_epoch * config.epochs
    if config.max_steps:
        total = min(total, config.max_steps)
    log.info("rank %d/%d: %d training samples, %d steps", config.rank, num_shards, len(sampler), total)
    progress = Progress(total, desc=f"trainer {config.rank}", enabled=config.progress)
    delay = _test_step_delay()
    steps = samples = 0
    step_ends: list[float] = []
    loss = float("nan")
    t_start = time.monotonic()
    epoch, batch_idx = 0, 0
    try:
        while epoch < config.epochs and steps < total:
            sampler.set_epoch(epoch)
            indices = torch.tensor(list(iter(sampler)))
            while batch_idx < steps_per_epoch and steps < total:
                idx = indices[batch_idx * config.batch_size:(batch_idx + 1) * config.batch_size]
                xb, yb = x_all[idx], y_all[idx]
                if delay:
                    time.sleep(delay)
                try:
                    loss = session.protocol.step(xb, yb)
                except (RuntimeError, TimeoutError) as e:
                    session = _recover(session, config, e)
                    continue  # same batch again: its update was not applied
                steps += 1
                samples += len(idx)
                if config.stats_out is not None:
                    step_ends.append(time.monotonic())
                batch_idx += 1
                rate = samples / max(1e-6, time.monotonic() - t_start)
                session.report = Report(steps, samples, loss, rate)
                progress.update(loss=loss, rate=rate)
            epoch += 1
            batch_idx = 0
        progress.close()
        while True:
            try:
                accuracy = session.evaluate(eval_set, config.eval_batch_size)
                break
            except (RuntimeError, TimeoutError) as e:
                session = _recover(session, config, e)
    except BaseException:
        progress.close()
        session.leave()
        raise
    if session.report is not None:
        session.report = dataclasses.replace(session.report, accuracy=accuracy)
    session.leave()
    elapsed = time.monotonic() - t_start
    log.info("rank %d: %d steps, %d samples in %.1fs (%.1f samples/s), final loss %.4f, accuracy %.4f",
             config.rank, steps, samples, elapsed, samples / max(elapsed, 1e-6), loss, accuracy)
    if config.stats_out is not None:
        config.stats_out.write_text(json.dumps(
            {"rank": config.rank, "batch_size": config.batch_size, "start": t_start, "step_ends": step_ends,
             "samples": samples, "accuracy": accuracy}))
    print(f"rank {config.rank} accuracy {accuracy:.4f}", flush=True)
    return 0


def _recover(session: Session, config: TrainerConfig, error: BaseException) -> Session:
    """After a failed step: give up with a clear error, or rejoin with ``--reconnect``."""
    alive = session.server_alive()
    reason = _remote_message(error)
    if alive and "not a member" not in reason:
        session.leave()
        raise RuntimeError(f"training step failed on the server: {reason}")
    if not config.reconnect:
        session.abandon()
        raise ServerLost(
            f"lost the server at {config.server_host}:{config.server_port} ({reason}); "
            "use --reconnect to wait for it"
        )
    session.abandon()
    delay = 0.5
    while True:
        log.warning("server at %s:%d lost (%s): reconnecting in %.1fs", config.server_host, config.server_port,
                    reason, delay)
        time.sleep(delay)
        delay = min(delay * 2, 10.0)
        try:
            new = Session(config)
        except (UsageError, RuntimeError) as e:
            reason = str(e)
            continue
        new.report = session.report
        log.info("reconnected as %s at global step %d", new.name, new.info["global_step"])
        return new


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: psserver train")
