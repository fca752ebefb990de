"""The control plane of a real ``psserver serve`` with a real trainer, through the real CLI."""

from __future__ import annotations

import re
import signal
import stat
import threading
import time
from pathlib import Path

import pytest

from psserver.checkpoint import list_checkpoints, read_checkpoint
from psserver.control.client import ControlClient, ControlError, ControlUnavailable
from psserver.control.local_token import runtime_dir
from psserver.control.v1 import control_pb2 as pb
from tests.procs import Proc, cli, run, slow_steps

from .fakes import TOKEN

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LISTENING = re.compile(r"control plane listening on (\S+):(\d+)")


def _wait_for(predicate, timeout: float, what: str, proc: Proc | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and not proc.running():
            pytest.fail(f"{what}: {proc.name} exited with {proc.popen.returncode}\n{proc.tail()}")
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}" + (f"\n{proc.tail()}" if proc else ""))


def _cli(*argv: str, timeout: float = 60):
    return run(["--log-level", "ERROR", *argv], timeout=timeout)


def _control_address(server: Proc) -> str:
    """HOST:PORT of the control plane (--control-port 0: the port it printed)."""
    return "{}:{}".format(*server.wait_for(LISTENING.pattern, timeout=30).groups())


@pytest.mark.timeout(300)
def test_status_during_training_then_stop_drains_and_checkpoints(procs, port, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    ckpt_dir = tmp_path / "ckpt"
    server = procs.server(port, "--model", "mlp", "--checkpoint-dir", str(ckpt_dir), "--auth-token-file",
                          str(token_file), control_port=0, log=tmp_path / "server.log")
    address = _control_address(server)
    client = ControlClient(address, token=TOKEN, timeout=10)
    try:
        _wait_for(lambda: client.health() == "SERVING", 60, "health SERVING", server)
        assert client.get_status().state == pb.SERVER_STATE_SERVING

        trainer = procs.trainer(port, 0, "--num-trainers", "1", "--epochs", "1000", "--max-steps", "100000",
                                log=tmp_path / "trainer.log", env=slow_steps(0.02))  # steps, not a busy core
        active = _wait_for(
            lambda: [t for t in client.list_trainers() if t.state == pb.TRAINER_STATE_ACTIVE and t.steps > 0],
            90, "an active trainer with steps", trainer,
        )
        assert active[0].rank == 0 and active[0].name.startswith("trainer_0_") and active[0].samples > 0
        assert "--compute trainer --step pushpull" in trainer.output()  # the default
        assert active[0].host and active[0].joined_at <= active[0].last_seen
        st = client.get_status()
        assert st.state == pb.SERVER_STATE_SERVING and st.mode == pb.MODE_PS and st.update_mode == pb.UPDATE_MODE_ASYNC
        assert st.model == "mlp" and st.num_params > 0 and st.global_step > 0 and st.samples_seen > 0
        assert [s.device for s in st.shards] == ["cpu"] and st.shards[0].num_params == st.num_params
        assert st.shards[0].bytes < st.shards[0].state_bytes < 1 << 26  # with its optimizer state, not the RSS
        _wait_for(lambda: client.get_status().samples_per_second > 0, 30, "a throughput", server)

        # The CLI, as an operator would run it.
        done = _cli("status", "--address", address, "--auth-token-file", str(token_file))
        assert done.returncode == 0, done.stderr
        assert "SERVING" in done.stdout and "trainer_0_" in done.stdout and "ACTIVE" in done.stdout
        assert _cli("status", "--address", address).returncode == 2  # no token

        info = client.checkpoint()
        assert Path(info.path).is_file() and info.step > 0
        assert client.get_status().last_checkpoint.path == info.path

        # Follow the server while it drains: the stream must end cleanly when it stops.
        watched: list[int] = []
        watch_error: list[BaseException] = []

        def follow() -> None:
            try:
                with ControlClient(address, token=TOKEN) as watcher:
                    for s in watcher.watch(interval=0.2):
                        watched.append(s.state)
            except ControlError as e:  # the process may go before the stream's last frame
                watch_error.append(e)

        follower = threading.Thread(target=follow)
        follower.start()
        _wait_for(lambda: watched, 30, "the first WatchStatus update", server)
        step_before_stop = client.get_status().global_step

        done = _cli("stop", "--address", address, "--auth-token-file", str(token_file), "--wait", "--reason", "e2e")
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == f"server at {address} has stopped"
        assert server.wait(60) == 0, server.tail()
        follower.join(30)
        assert not follower.is_alive()
        assert not watch_error or isinstance(watch_error[0], ControlUnavailable), watch_error
        assert watched[0] == pb.SERVER_STATE_SERVING

        out = server.output()
        assert "shutdown requested by" in out and "(e2e)" in out
        # The final checkpoint holds every step applied before the drain.
        final = read_checkpoint(list_checkpoints(ckpt_dir)[0])
        assert final["global_step"] >= max(step_before_stop, info.step)
        # A trainer whose server drains away stops (exit 3: server lost, unless --reconnect).
        assert trainer.wait(60) in (0, 3), trainer.tail()
    finally:
        client.close()


@pytest.mark.timeout(180)
def test_the_readme_commands_need_no_token_flag_and_another_user_is_refused(procs, port, tmp_path, monkeypatch):
    """``psserver serve`` without a token, then ``status``, ``checkpoint`` and ``stop`` as the
    README writes them: the server's local admin token (a 0600 file in a 0700 directory of this
    user) lets its own user in, and goes when the server stops; a user without it is refused."""
    server = procs.server(port, "--model", "mlp", "--checkpoint-dir", str(tmp_path / "ckpt"), control_port=0,
                          log=tmp_path / "server.log")
    address = _control_address(server)
    token_files = list(runtime_dir().glob("control-*.json"))
    assert len(token_files) == 1 and stat.S_IMODE(token_files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(runtime_dir().stat().st_mode) == 0o700
    _wait_for(lambda: cli(["status", "--address", address]).returncode == 0, 60, "status", server)
    with monkeypatch.context() as other_user:
        other_user.setenv("XDG_RUNTIME_DIR", str(tmp_path / "other-user"))
        done = cli(["stop", "--address", address])
    assert done.returncode == 2 and "PERMISSION_DENIED" in done.stderr and len(done.stderr.splitlines()) == 1
    done = cli(["checkpoint", "--address", address])
    assert done.returncode == 0 and done.stdout.startswith("checkpoint written: "), done.stderr
    done = cli(["stop", "--address", address])
    assert done.returncode == 0 and done.stdout.strip() == f"server at {address} is draining", done.stderr
    assert server.wait(60) == 0, server.tail()
    assert not token_files[0].exists()
    assert cli(["status", "--address", address, "--timeout", "3"]).returncode == 2  # gone: one line, exit 2


@pytest.mark.timeout(300)
def test_two_trainers_active_then_one_left_and_global_step_counts_updates(procs, port):
    """One trainer of each compute mode on one server: both are seen, and counted, alike."""
    server = procs.server(port, "--model", "mnist_cnn", control_port=0)
    with ControlClient(_control_address(server), timeout=10) as client:
        short = procs.trainer(port, 0, "--num-trainers", "2", "--epochs", "5", "--max-steps", "60",
                              "--compute", "server")
        long = procs.trainer(port, 1, "--num-trainers", "2", "--epochs", "1000", env=slow_steps(0.02))

        def active():
            return {t.rank: t for t in client.list_trainers() if t.state == pb.TRAINER_STATE_ACTIVE and t.steps > 0}

        first = _wait_for(lambda: len(active()) == 2 and active(), 120, "two active trainers")
        time.sleep(2)
        second = _wait_for(lambda: (a := active()) and len(a) == 2 and a, 30, "two active trainers again")
        assert all(second[r].steps > first[r].steps for r in (0, 1)), (first, second)
        assert short.wait(120) == 0, short.tail()
        assert "--compute server --step chained" in short.output()
        assert "--compute trainer --step pushpull" in long.output()
        trainers = {t.rank: t for t in client.list_trainers()}
        assert trainers[0].state == pb.TRAINER_STATE_LEFT and trainers[0].steps == 60
        assert trainers[1].state == pb.TRAINER_STATE_ACTIVE
        steps_after_leave = trainers[1].steps
        _wait_for(lambda: active().get(1) and active()[1].steps > steps_after_leave + 5, 60, "rank 1 going on")
        long.signal(signal.SIGINT)  # interrupted: it still leaves the group cleanly
        long.wait(60)
        _wait_for(lambda: all(t.state != pb.TRAINER_STATE_ACTIVE for t in client.list_trainers()), 30,
                  "no active trainer")
        # async: every trainer step is one optimizer step, so the global step is their sum.
        total = sum(t.steps for t in client.list_trainers())
        st = client.get_status()
        assert abs(st.global_step - total) <= 1, (st.global_step, total)  # the last report may trail a step
