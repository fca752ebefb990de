"""``psserver.v1.ControlService``: turns :class:`~psserver.telemetry.ControlTarget` calls into
gRPC responses and status codes.

Auth and call logging are interceptors (:mod:`psserver.control.auth`); this module only maps
target behaviour to the API: ``RuntimeError`` from ``checkpoint_now`` -> FAILED_PRECONDITION,
anything else unexpected -> INTERNAL (logged with its traceback, the message goes to the
client without it).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from psserver.control import convert
from psserver.control.v1 import control_pb2 as pb
from psserver.control.v1 import control_pb2_grpc as pb_grpc
from psserver.telemetry import ControlTarget

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_INTERVAL = 1.0
MIN_INTERVAL = 0.1
MAX_INTERVAL = 3600.0


class ControlService(pb_grpc.ControlServiceServicer):
    """The servicer; :meth:`close` ends every open ``WatchStatus`` stream."""

    def __init__(self, target: ControlTarget, *, max_watchers: int = 8) -> None:
        self._target = target
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._streams: set[threading.Event] = set()
        self._max_watchers = max_watchers

    # ---- helpers ------------------------------------------------------------------------

    def _call(self, context: grpc.ServicerContext, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every failure becomes a status, never a crash
            log.exception("control: %s failed", what)
            context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {type(e).__name__}: {e}")
            raise  # unreachable: abort raises

    def _status(self, context: grpc.ServicerContext) -> pb.ServerStatus:
        return convert.status_to_proto(self._call(context, "get_status", self._target.get_status))

    @property
    def watchers(self) -> int:
        with self._lock:
            return len(self._streams)

    def close(self) -> None:
        """Server is stopping: wake every WatchStatus stream so it ends with OK."""
        self._closing.set()
        with self._lock:
            for event in self._streams:
                event.set()

    # ---- RPCs ---------------------------------------------------------------------------

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.ServerStatus:
        return self._status(context)

    def ListTrainers(self, request: pb.ListTrainersRequest, context: grpc.ServicerContext) -> pb.ListTrainersResponse:
        trainers = self._call(context, "list_trainers", self._target.list_trainers)
        return convert.trainers_to_proto(trainers)

    def WatchStatus(self, request: pb.WatchStatusRequest, context: grpc.ServicerContext) -> Iterator[pb.ServerStatus]:
        interval = request.interval_seconds or DEFAULT_INTERVAL
        if not (math.isfinite(interval) and MIN_INTERVAL <= interval <= MAX_INTERVAL):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"interval_seconds must be between {MIN_INTERVAL} and {MAX_INTERVAL:g} (0 means {DEFAULT_INTERVAL}), "
                f"got {interval!r}",
            )
        wake = threading.Event()
        with self._lock:
            if len(self._streams) >= self._max_watchers:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many WatchStatus streams open ({self._max_watchers})"
                )
            self._streams.add(wake)
        # Called when the RPC ends for any reason (client gone, deadline): stop waiting at once.
        context.add_callback(wake.set)
        try:
            while not self._closing.is_set():
                status = self._status(context)
                yield status
                if status.state == pb.SERVER_STATE_STOPPED:
                    return
                wake.wait(interval)
                if not context.is_active():
                    return
        finally:
            with self._lock:
                self._streams.discard(wake)

    def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointResponse:
        try:
            info = self._target.checkpoint_now()
        except RuntimeError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot checkpoint: {e}")
        except OSError as e:  # a full or read-only disk: the operator's to fix, no traceback
            log.error("control: checkpoint failed: %s", e)
            context.abort(grpc.StatusCode.INTERNAL, f"checkpoint failed: {e}")
        except Exception as e:  # noqa: BLE001
            log.exception("control: checkpoint failed")
            context.abort(grpc.StatusCode.INTERNAL, f"checkpoint failed: {type(e).__name__}: {e}")
        log.info("control: checkpoint %s at step %d written on request from %s", info.path, info.step, context.peer())
        return pb.CheckpointResponse(checkpoint=convert.checkpoint_to_proto(info))

    def Shutdown(self, request: pb.ShutdownRequest, context: grpc.ServicerContext) -> pb.ShutdownResponse:
        reason = request.reason.strip()[:200] or "no reason given"
        log.warning("control: shutdown requested by %s (%s): draining", context.peer(), reason)
        self._call(context, "request_shutdown", self._target.request_shutdown)
        state = pb.SERVER_STATE_DRAINING
        try:
            current = convert.status_to_proto(self._target.get_status()).state
            if current in (pb.SERVER_STATE_DRAINING, pb.SERVER_STATE_STOPPED):
                state = current
        except Exception:  # noqa: BLE001 - the request was accepted; the state is a courtesy
            log.debug("control: status after shutdown request unavailable", exc_info=True)
        return pb.ShutdownResponse(state=state)


def add_to_server(service: ControlService, server: Any) -> None:
    pb_grpc.add_ControlServiceServicer_to_server(service, server)
