"""A trainer's first join under ``--reconnect``: a server that goes away before it answers is
waited for (the join is tried again in a fresh process), not a one-line exit; a store slow to
answer once is tried again."""

from __future__ import annotations

import dataclasses
import datetime
import socket
import sys
import threading
import time

import pytest
import torch.distributed as dist

from psserver.common import rendezvous
from psserver.common.rendezvous import request_admission
from psserver.config import TrainerConfig
from psserver.errors import AdmissionUnanswered, DeviceMapFailed, UsageError
from psserver.trainer import recovery
from psserver.trainer.rejoin import Position
from psserver.trainer.session import JoinDeferred
from psserver.trainer.stop_signals import StopSignals
from tests.procs import eof_in_first_join, free_port


def test_an_admission_nobody_answers_is_its_own_error():
    store = dist.TCPStore("127.0.0.1", free_port(), None, True, datetime.timedelta(seconds=5))
    with pytest.raises(AdmissionUnanswered, match=r"did not answer the join of rank 3 within 0.3s"):
        request_admission(store, 3, "here:1", timeout=0.3)


class Reexec(Exception):
    """Where the trainer would re-execute itself: the end of the test's join."""


class FakeJoins:
    """``recovery``'s Session fails with ``error`` (changeable mid-test) and its re-execution
    raises ``Reexec``: each attempt's steps and each position handed over are recorded."""

    def __init__(self, monkeypatch, error: BaseException) -> None:
        self.error = error
        self.sessions: list[int] = []
        self.fell_back: list[str | None] = []  # what each Session was told of a failed device map
        self.positions: list[Position] = []
        monkeypatch.setattr(recovery, "Session", self._session)
        monkeypatch.setattr(recovery, "reexec", self._reexec)

    def _session(self, config, stop, model=None, steps=0, build=True, fell_back=None):  # noqa: ARG002
        self.sessions.append(steps)
        self.fell_back.append(fell_back)
        raise self.error

    def _reexec(self, position, stop, argv=None):  # noqa: ARG002
        self.positions.append(position)
        raise Reexec


@pytest.mark.parametrize("lost", [
    # seen in the soak test: the server SIGKILLed between a trainer's request for room and its answer
    AdmissionUnanswered("the psserver at here:1 went away while it admitted rank 1 (Connection reset)"),
    # several server processes: server 0 refuses joins while one of them is missing
    JoinDeferred("the psserver at here:1 refused the join for now (psserver is waiting: not accepting trainers)"),
], ids=["unanswered-admission", "refused-for-now"])
def test_a_first_join_whose_server_went_away_rejoins_under_reconnect(monkeypatch, lost):
    """The trainer exited 2 although it had ``--reconnect``."""
    joins = FakeJoins(monkeypatch, lost)
    config = TrainerConfig(rank=1, reconnect=True)
    with pytest.raises(Reexec):
        recovery.join(config, None, None)
    assert len(joins.positions) == 1 and joins.positions[0].steps == 0
    with pytest.raises(type(lost)):  # without --reconnect: its one line, as before
        recovery.join(dataclasses.replace(config, reconnect=False), None, None)


def test_a_step_the_live_server_could_not_complete_is_one_line_and_exit_3(monkeypatch, capsys):
    """A sync round that timed out on the server (a straggler past its --rpc-timeout) was an
    internal error of the trainer (exit 1, a traceback file); it is the server's reason now."""
    from psserver.cli import main
    from psserver.errors import ServerLost, StepFailed

    left = []

    class Member:
        name = "trainer_0_1"

        def leave(self):
            left.append(True)

    monkeypatch.setattr(recovery, "diagnose", lambda session, error: recovery.FAILED)
    error = RuntimeError("On WorkerInfo(id=0, name=psserver):\nTimeoutError('sync round 1 did not complete in "
                         "60s')\n")
    config = TrainerConfig(rank=0, server_host="10.0.0.5", server_port=29500)
    with pytest.raises(StepFailed, match=r"^the server at 10.0.0.5:29500 could not complete this trainer's step: "
                                         r"sync round 1 did not complete in 60s$") as failed:
        recovery.recover(Member(), config, error, Position(), StopSignals())
    assert left == [True] and isinstance(failed.value, ServerLost)

    def train(args):
        raise failed.value

    monkeypatch.setattr("psserver.cli.train.TrainCommand.run", lambda self, args: train(args))
    assert main(["train", "--rank", "0"]) == 3
    assert capsys.readouterr().err.strip().endswith("sync round 1 did not complete in 60s")


def test_a_first_join_the_rpc_group_changed_under_is_tried_again_a_bounded_number_of_times(monkeypatch):
    """A trainer whose ``init_rpc`` ran while a refused trainer left the group exited 2 with
    "EOF" (without ``--reconnect``). ``psserver train`` and a library script try again in a fresh
    process while the server listens, at most ``FIRST_JOIN_TRIES`` processes."""
    eof = recovery.JoinLost("cannot join the RPC group of 127.0.0.1:1: EOF: end of file")
    joins = FakeJoins(monkeypatch, eof)
    positions = joins.positions
    with socket.create_server(("127.0.0.1", 0)) as listener:
        config = TrainerConfig(rank=1, server_port=listener.getsockname()[1])
        argv = ["python", "-m", "psserver", "train"]
        with pytest.raises(Reexec):
            recovery.join(config, None, None, argv=argv, retry_first_join=True)
        assert [p.first_join_tries for p in positions] == [1] and positions[0].steps == 0
        with pytest.raises(Reexec):  # the fresh process: a first join again, not a rejoin
            recovery.join(config, positions[-1], None, argv=argv, retry_first_join=True)
        assert [p.first_join_tries for p in positions] == [1, 2] and joins.sessions == [0, 0]
        with pytest.raises(recovery.JoinLost):  # the last process: its one line
            recovery.join(config, positions[-1], None, argv=argv, retry_first_join=True)
        assert len(positions) == recovery.FIRST_JOIN_TRIES - 1
        with pytest.raises(recovery.JoinLost):  # asked not to: never re-executed
            recovery.join(config, None, None, argv=argv, retry_first_join=False)
        with pytest.raises(recovery.JoinLost):  # psserver train run in-process: nothing to re-execute
            recovery.join(config, None, None, argv=None, retry_first_join=True)
        joins.error = JoinDeferred("the psserver at here:1 refused the join for now")
        with pytest.raises(JoinDeferred):  # refused for now: waited for under --reconnect only
            recovery.join(config, None, None, argv=argv, retry_first_join=True)
    joins.error = eof
    with pytest.raises(recovery.JoinLost):  # the server went away: no new process
        recovery.join(config, None, None, argv=argv, retry_first_join=True)
    assert len(positions) == recovery.FIRST_JOIN_TRIES - 1


def test_a_device_map_that_broke_the_pipe_joins_again_staged_in_a_fresh_process(monkeypatch):
    """The pipe is spent for good (RPC cannot be set up twice in one process): the next process
    image is told why, and its Session goes staged; with no command line to re-execute, one line."""
    joins = FakeJoins(monkeypatch, DeviceMapFailed("cudaIpcOpenMemHandle failed"))
    argv = ["python", "-m", "psserver", "train"]
    with pytest.raises(Reexec):
        recovery.join(TrainerConfig(rank=1), None, StopSignals(), argv=argv)
    assert [p.fell_back for p in joins.positions] == ["cudaIpcOpenMemHandle failed"]
    assert joins.fell_back == [None]
    joins.error = recovery.JoinLost("cannot join the RPC group of here:1: EOF")
    with pytest.raises(Reexec):  # the fresh image (a rejoin under --reconnect) keeps what failed
        recovery.join(TrainerConfig(rank=1, reconnect=True), joins.positions[0], StopSignals(), argv=argv)
    assert joins.fell_back[-1] == "cudaIpcOpenMemHandle failed"
    assert joins.positions[-1].fell_back == "cudaIpcOpenMemHandle failed"
    joins.error = DeviceMapFailed("cudaIpcOpenMemHandle failed")
    with pytest.raises(UsageError, match=r"^the device map to the server failed \(cudaIpcOpenMemHandle failed\) "
                                         r"and took the connection with it: start this trainer with --transport "
                                         r"staged$"):
        recovery.join(TrainerConfig(rank=1), None, StopSignals(), argv=None)


def test_a_rejoin_refused_for_now_pauses_before_the_next_process(monkeypatch):
    FakeJoins(monkeypatch, JoinDeferred("the psserver at here:1 refused the join for now (psserver is draining: ...)"))
    monkeypatch.setattr(recovery, "DEFERRED_WAIT_S", 0.3)
    t0 = time.monotonic()
    with pytest.raises(Reexec):
        recovery.join(TrainerConfig(rank=1, reconnect=True), Position(steps=7), StopSignals())
    assert time.monotonic() - t0 >= 0.3


class _DeadStore:
    """A store whose server died after the connection: every call fails as torch's does."""

    def add(self, key, value):
        raise dist.DistNetworkError("Connection reset by peer")

    set = add


def test_a_server_that_dies_before_its_store_takes_the_request_is_an_unanswered_admission():
    """Seen in the soak test: the store's ``add`` reset mid-join became an internal error."""
    with pytest.raises(AdmissionUnanswered, match=r"went away before it admitted rank 3 \(Connection reset"):
        request_admission(_DeadStore(), 3, "here:1")


def test_a_store_that_answers_late_is_waited_for_a_silent_port_is_a_usage_error(monkeypatch):
    """The store of a server just restarted beside its trainers on two cores once left the
    handshake unanswered past ``_ANSWER_S`` (the soak test's trainer exited 2): it is given
    until ``_SILENT_S``, on the same connection; a port silent that long is not a psserver's."""
    monkeypatch.setattr(rendezvous, "_ANSWER_S", 0.2)
    monkeypatch.setattr(rendezvous, "_SILENT_S", 3.0)
    sock = socket.create_server(("127.0.0.1", 0), backlog=16)
    port = sock.getsockname()[1]
    stores: list = []
    # The client's connection waits in the backlog until the store starts on that socket.
    late = threading.Timer(0.8, lambda: stores.append(dist.TCPStore(
        "127.0.0.1", port, None, True, datetime.timedelta(seconds=10), wait_for_workers=False,
        master_listen_fd=sock.detach(), use_libuv=True)))
    late.start()
    try:
        t0 = time.monotonic()
        client = rendezvous._store_client("127.0.0.1", port, 10.0)
        late.join()
        assert isinstance(client, dist.TCPStore) and time.monotonic() - t0 >= 0.7
        client.set("k", "v")
        assert stores[0].get("k") == b"v"
    finally:
        late.cancel()
        late.join()
        stores.clear()
        sock.close()
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (the backlog), never answers
        where = silent.getsockname()[1]
        monkeypatch.setattr(rendezvous, "_SILENT_S", 0.6)
        with pytest.raises(UsageError, match=r"never answered the rendezvous handshake in 0.6s"):
            rendezvous._store_client("127.0.0.1", where, 10.0)
        with pytest.raises(TimeoutError):  # the caller's time ended first: not proof of silence
            rendezvous._store_client("127.0.0.1", where, 0.4)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_psserver_train_whose_first_join_fails_with_eof_joins_in_a_fresh_process(procs, port, tmp_path):
    """End to end, without --reconnect: the failed join's process re-executes, its admission
    (taken, never used) does not hold the rank, and the trainer runs to its end."""
    server = procs.server(port, "--model", "mlp")
    once = tmp_path / "once"
    t = procs.trainer(port, 0, "--max-steps", "5", "--dataset", "synthetic", env=eof_in_first_join(once))
    assert t.wait(120) == 0, t.tail()
    assert once.exists()
    out = t.output()
    assert "while the server still listens: trying again in a fresh process" in out, out
    assert "joining again in a fresh process (try 2 of 3)" in out and "Traceback" not in out, out
    server.wait_for(r"trainer trainer_0_\d+ \(rank 0\) left after 5 steps", timeout=20)
    assert procs.stop(server) == 0, server.tail()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_library_script_whose_first_join_fails_with_eof_runs_again_and_trains(procs, port, tmp_path):
    """Two library scripts started together: one failed its join with EOF, exit 1 (CI, once).
    The script runs again in a fresh process (same PID) and trains its epoch."""
    server = procs.server(port)
    once = tmp_path / "once"
    script = procs.start(["shard_epochs", str(port), f"out={tmp_path / 'seen.jsonl'}", "epochs=1", "delay=0"],
                         "script", prefix=[sys.executable, "-m", "tests.trainer.loops"],
                         env={**eof_in_first_join(once), "RANK": "0", "WORLD_SIZE": "1"})
    assert script.wait(120) == 0, script.tail()
    assert once.exists() and "trying again in a fresh process" in script.output(), script.tail()
    assert (tmp_path / "seen.jsonl").read_text().strip(), "the script trained nothing"
    assert procs.stop(server) == 0, server.tail()
