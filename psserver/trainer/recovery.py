"""What a trainer does when a call fails or it joins again, shared by ``psserver train``'s loop
(``psserver.trainer.loop``) and the library (``psserver.trainer.connection``).

A failed call is diagnosed by asking the server: evicted, lost, or a failure of the call
itself. Evicted or lost, the trainer ends (exit 3 / ``Evicted`` / ``ServerLost``), or with
``reconnect`` it continues in a fresh process image that rejoins (``psserver.trainer.rejoin``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import NoReturn

import torch
import torch.distributed.rpc as rpc

from psserver.common import calls, rendezvous
from psserver.common.messages import Report
from psserver.config import TrainerConfig
from psserver.errors import AdmissionUnanswered, DeviceMapFailed, Evicted, ServerLost, StepFailed, UsageError
from psserver.trainer.rejoin import Position, reexec
from psserver.trainer.session import (
    PROBE_TIMEOUT_S,
    JoinDeferred,
    JoinLost,
    PartitionCallError,
    Session,
    remote_message,
)
from psserver.trainer.stop_signals import StopSignals

log = logging.getLogger(__name__)

EVICTED, LOST, FAILED = "evicted", "lost", "failed"
"""Why a call failed (:func:`diagnose`)."""
DEFERRED_WAIT_S = 2.0
"""The pause before rejoining a server that refused a join for now (``JoinDeferred``)."""
PROBE_TRIES, PROBE_RETRY_S = 2, 0.5
"""Asking the server after a failed call: once more after a pause when the first question
fails, since a server that evicted this trainer may just have closed its pipe (the next call
opens a new one)."""
FIRST_JOIN_TRIES = 3
"""Processes a first join may take when its ``init_rpc`` fails while the server still listens
(see :func:`join`)."""
LISTEN_CHECK_S = 2.0


def listening(host: str, port: int) -> bool:
    """Whether the server's rendezvous port still accepts a connection: a failed join is then
    a change of the RPC group under it, not a lost server."""
    try:
        with socket.create_connection((host, port), timeout=LISTEN_CHECK_S):
            return True
    except OSError:
        return False

def shard_count(config: TrainerConfig, info: dict) -> int:
    if config.num_trainers is not None:
        return config.num_trainers
    if info["update"] == "sync" or (info["update"] == "diloco" and info.get("outer") == "sync"):  # rounds of K
        n = int(info["sync_trainers"])
        if config.rank < n:
            return n
    if config.rank == 0:
        return 1
    raise UsageError(f"rank {config.rank}: pass --num-trainers (or set WORLD_SIZE) so the data can be sharded")


def join(config: TrainerConfig, position: Position | None, stop: StopSignals, model: torch.nn.Module | None = None,
         argv: Sequence[str] | None = None, build: bool = True, retry_first_join: bool = False) -> Session:
    """:func:`_join`; a join whose device map broke the pipe to the server (``DeviceMapFailed``)
    is made again in a fresh process image that goes ``staged`` (one line where there is no
    command line to re-execute, as inside a test runner)."""
    try:
        return _join(config, position, stop, model, argv, build, retry_first_join)
    except DeviceMapFailed as e:
        if argv is None:
            raise UsageError(f"{e}: start this trainer with --transport staged") from None
        log.warning("%s: joining again in a fresh process, through pinned host memory", e)
        pos = position if position is not None else Position()
        pos.fell_back = e.reason
        reexec(pos, stop, argv)


def _join(config: TrainerConfig, position: Position | None, stop: StopSignals, model: torch.nn.Module | None,
          argv: Sequence[str] | None, build: bool, retry_first_join: bool) -> Session:
    """The first join; or, in a trainer re-executed to rejoin, the rejoin, tried until the
    server takes it (each try waits up to ``--connect-timeout`` for a server that is starting).

    ``retry_first_join``: without ``--reconnect`` too, a first join whose ``init_rpc`` failed
    while its server still listens is tried again in a fresh process (``argv``: none when the
    command line is not known, as inside a test runner), at most ``FIRST_JOIN_TRIES`` times:
    torch's dynamic RPC group calls every member during a join, and one joining or leaving
    meanwhile fails it with "EOF" before anything trained."""
    fell_back = position.fell_back if position is not None else None
    if position is None or position.first_join_tries:
        tries = position.first_join_tries if position is not None else 0
        if tries:
            log.info("joining again in a fresh process (try %d of %d)", tries + 1, FIRST_JOIN_TRIES)
        if not config.reconnect:
            try:
                return Session(config, stop, model, build=build, fell_back=fell_back)
            except JoinLost as e:
                if (not retry_first_join or argv is None or isinstance(e, JoinDeferred) or tries + 1 >= FIRST_JOIN_TRIES
                        or not listening(config.server_host, config.server_port)):
                    raise
                log.warning("joining failed (%s) while the server still listens: trying again in a fresh process",
                            e)
                reexec(Position(first_join_tries=tries + 1), stop, argv)
        try:
            return Session(config, stop, model, build=build, fell_back=fell_back)
        except (JoinLost, AdmissionUnanswered) as e:  # --reconnect: a server lost during the first join too
            log.warning("joining failed (%s): rejoining in a fresh process", e)
            reexec(Position(), stop, argv)  # RPC is never initialised twice in one process (psserver.common.torch_rpc)
    where = f"{config.server_host}:{config.server_port}"
    delay = 0.5
    attempt = 0
    while True:
        attempt += 1
        log.info("rejoining psserver %s (attempt %d)", where, attempt)
        try:
            session = Session(config, stop, model, position.steps, build=build, fell_back=fell_back)
        except JoinLost as e:  # init_rpc failed half-way: RPC cannot be initialised again in this process
            log.warning("rejoin attempt %d failed (%s): rejoining in a fresh process", attempt, e)
            if isinstance(e, JoinDeferred):  # the server is there, not ready: no new process every 3 s
                with stop.interruptible():
                    time.sleep(DEFERRED_WAIT_S)
            reexec(position, stop, argv)
        except (UsageError, RuntimeError) as e:
            log.warning("rejoin attempt %d failed (%s): retrying in %.1fs", attempt, remote_message(e), delay)
            with stop.interruptible():
                time.sleep(delay)
            delay = min(delay * 2, 10.0)
            continue
        if position.report is not None:
            session.report = Report(**position.report)
        log.info("reconnected as %s at global step %d (attempt %d)", session.name, session.info["global_step"],
                 attempt)
        return session


def diagnose(session: Session, error: BaseException | None = None) -> str:
    """Why a call failed: ``EVICTED`` (the server says this trainer is no member), ``LOST`` (no
    answer, or a server that is stopping), ``FAILED`` (the call itself, for a member of a serving
    server). The server is asked, whatever ``error`` says: a remote exception arrives as a bare
    ``RuntimeError``, and a step of ``--step plain`` or ``pull`` fails inside torch's
    ``dist_autograd`` ("Could not find autograd context") before any call of ours can say why.
    A call that failed on another server process (several) is ``LOST`` when that one does not
    answer a ping: server 0 may not have noticed yet.

    The questions go from a thread of their own: when the server released this trainer's
    autograd context (an eviction does), the ``with dist_autograd.context()`` of the failed step
    could not release it, and torch leaves the stale id current on the failed thread, where
    every RPC then fails ("Couldn't find autograd context data")."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="psserver-probe") as pool:
        return pool.submit(_ask_server, session, error).result()


def _ask_server(session: Session, error: BaseException | None) -> str:
    if isinstance(error, PartitionCallError) and error.server > 0:
        try:
            rpc.rpc_sync(error.server_name, rendezvous.ping, timeout=PROBE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - no answer: that server process is gone
            return LOST
    state = None
    for attempt in range(PROBE_TRIES):
        try:
            state = session.probe()
            break
        except Exception as e:  # noqa: BLE001 - no answer: the server is gone, or the pipe it just closed is
            log.debug("asking the server after a failed call (attempt %d): %s", attempt + 1, e)
            if attempt + 1 == PROBE_TRIES:
                return LOST
            time.sleep(PROBE_RETRY_S)
    if state == calls.NOT_A_MEMBER:
        return EVICTED
    return FAILED if state == "SERVING" else LOST


def recover(session: Session, config: TrainerConfig, error: BaseException, pos: Position,
            stop: StopSignals, before_exec: Callable[[], None] | None = None,
            argv: Sequence[str] | None = None) -> NoReturn:
    """After a failed call: a step the live server could not complete ends the trainer
    (``StepFailed``, the server's reason, exit 3); an eviction or a lost server ends it (exit 3),
    or with ``--reconnect`` it rejoins under a fresh name and continues with the same batch (the
    failed step's update was not applied)."""
    what = diagnose(session, error)
    reason = remote_message(error)
    where = f"{config.server_host}:{config.server_port}"
    if what == FAILED:
        session.leave()
        raise StepFailed(f"the server at {where} could not complete this trainer's step: {reason}")
    name = session.name
    session.abandon()
    stop.check("after its eviction" if what == EVICTED else "after losing its server")
    if not config.reconnect:
        if what == EVICTED:
            why = session.evicted or ("no sign of life within its --trainer-timeout, or a gradient it would not "
                                      "keep")
            raise Evicted(f"{name} was evicted by the psserver at {where} ({why}); use --reconnect to rejoin")
        raise ServerLost(f"lost the server at {where} ({reason}); use --reconnect to wait for it")
    if what == EVICTED:
        log.warning("%s was evicted by the psserver at %s: rejoining under a fresh name", name, where)
    else:
        log.warning("server at %s lost (%s): reconnecting", where, reason)
    pos.reconnects += 1
    pos.report = asdict(session.report) if session.report is not None else None
    if before_exec is not None:
        before_exec()  # a DataLoader's worker processes would outlive this process image
    reexec(pos, stop, argv)
