"""``psserver serve --supervise``: a server process that dies (SIGKILL; the bytes that crash
TensorPipe inside libtorch's C++, where psserver cannot catch it) comes back from its state in
memory with every update it had applied, and its trainers finish."""

from __future__ import annotations

import re
import signal
import socket
import sys
import time

import psutil
import pytest
import torch

from psserver.checkpoint import find_latest
from psserver.control.client import ControlClient
from psserver.server.state.supervisor import describe, resume_argv, server_argv
from tests.procs import MNIST_ARGS, Proc, accuracy, die_after_update, free_port, slow_steps

JOINED = r"joined psserver \S+ as (trainer_\d+_\d+)"
FOUND = r"found the state of run \S+ in memory: \S+, generation \d+, global step (\d+), (\d+) samples"


def frozen(trainers: list[Proc], ctl: int) -> tuple[int, int]:
    """Stop the trainers (SIGSTOP); the server's global step and samples once no update is in flight."""
    for t in trainers:
        t.signal(signal.SIGSTOP)
    last = None
    with ControlClient(f"127.0.0.1:{ctl}", timeout=5) as client:
        while True:
            status = client.get_status()
            now = (status.global_step, status.samples_seen)
            if now == last:
                return now
            last = now
            time.sleep(0.3)


def server_child(supervisor: Proc, port: int) -> psutil.Process:
    """The supervisor's server (not its standby): the child that listens on ``port``."""
    (child,) = [c for c in psutil.Process(supervisor.pid).children() if port in listening_ports(c)]
    return child


def dead(proc: psutil.Process, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_a_restart_resumes_the_run_and_never_starts_a_new_one():
    first = server_argv(["--log-level", "INFO", "serve", "--supervise", "--new-run", "--checkpoint-dir", "d"])
    assert first[1:3] == ["-m", "psserver"] and "--supervise" not in first
    again = resume_argv(first)
    assert again[3:] == ["--log-level", "INFO", "serve", "--checkpoint-dir", "d", "--resume"]
    assert resume_argv(again) == again
    assert resume_argv([*first[:3], "serve", "--resume=/ckpt/x.pt"]) == [*first[:3], "serve", "--resume=/ckpt/x.pt"]
    assert describe(-signal.SIGSEGV) == "SIGSEGV" and describe(3) == "exit code 3"


@pytest.mark.timeout(60)
def test_an_exit_code_it_is_told_of_restarts_the_server_as_a_signal_does(tmp_path, monkeypatch):
    """A partition server that lost server 0 exits 3: its supervisor starts it again (to wait for
    server 0 and continue from its state in memory); any other exit code ends the supervisor."""
    from psserver.server.state import supervisor

    runs = tmp_path / "runs"
    child = [sys.executable, "-c", f"import pathlib, sys; p = pathlib.Path({str(runs)!r}); "
             "n = len(p.read_text()) if p.exists() else 0; p.write_text('x' * (n + 1)); sys.exit(3 if n < 2 else 0)"]
    monkeypatch.setattr(supervisor, "server_argv", lambda argv: child)
    assert supervisor.supervise(["serve"], 5, resume=False, restart_codes=(3,)) == 0
    assert runs.read_text() == "xxx"  # exit 3, exit 3, exit 0
    runs.unlink()
    assert supervisor.supervise(["serve"], 5, resume=False) == 3  # not told: exit 3 is its answer
    assert runs.read_text() == "x"


def test_supervise_needs_somewhere_to_come_back_from(port):
    from psserver.cli import main

    assert main(["serve", "--port", str(port), "--supervise", "--state-dir", "off", "--no-control"]) == 2


def listening_ports(proc: psutil.Process) -> list[int]:
    return sorted({c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN})


def crash_by_bytes(child: psutil.Process, port: int) -> None:
    """Sixteen zero bytes to TensorPipe's listeners: the server dies inside libtorch's C++."""
    for p in (p for p in listening_ports(child) if p != port):  # TensorPipe's listeners
        with socket.create_connection(("127.0.0.1", p), timeout=5) as s:
            s.sendall(b"\0" * 16)
        if dead(child, timeout=2):
            return
    pytest.fail("sixteen zero bytes on every TensorPipe port left the server alive: is the crash fixed upstream?")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_server_killed_three_times_and_crashed_by_bytes_loses_no_update(procs, port, state_dir):
    """Two trainers on mnist_cnn; the server SIGKILLed three times mid-training and once crashed
    by the bytes that crash TensorPipe: each restart continues at the step and samples it had
    reached, every step lands once, the model still learns (a sanity bar: the bit-equal weights
    are the sync test's below), and no checkpoint directory is involved. The
    trainers overlap (``--overlap on``): a death can take a step in flight and one computed
    beside it, both made again, the one the dead process had applied not applied twice."""
    ctl = free_port()
    sup = procs.server(port, "--model", "mnist_cnn", "--supervise", "--state-dir", str(state_dir), control_port=ctl)
    # 150 ms a step more: each trainer's 126 steps (19 s at least) outlast the four deaths, 3 s of
    # training apart (in one CI run 252 steps at 40 ms ended before the fourth: the overlapped
    # trainers are fast, a restart's pause is not); sleeping, not computing, on a busy machine.
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--epochs", "2", "--reconnect", "--overlap", "on",
                              *MNIST_ARGS, env=slow_steps(0.15)) for r in (0, 1)]
    for t in trainers:
        t.wait_for(JOINED, timeout=90)
    standby = int(sup.wait_for(r"standby server ready \(pid (\d+)\)", timeout=60)[1])
    for death, how in enumerate(["SIGKILL", "SIGKILL", "bytes", "SIGKILL"], start=1):
        time.sleep(3)
        assert all(t.running() for t in trainers), (f"training ended before death {death}", [t.tail() for t in
                                                                                             trainers])
        before = frozen(trainers, ctl)
        child = server_child(sup, port)
        if how == "bytes":
            crash_by_bytes(child, port)
        else:
            child.kill()
            assert dead(child)
        for t in trainers:
            t.signal(signal.SIGCONT)
        found = sup.wait_for(FOUND, timeout=60, nth=death)
        assert (int(found[1]), int(found[2])) == before, f"restart {death} ({how}) lost updates"
        sup.wait_for(r"control plane health: SERVING", timeout=60, nth=death + 1)
    for t in trainers:
        assert t.wait(300) == 0, t.tail()
        assert accuracy(t) >= 0.9
        assert "reconnected as" in t.output() and "Traceback" not in t.output()
        assert "overlap on: async: each step computes on the reply before the last" in t.output()
    assert sup.output().count("the server died of SIGKILL: restarting it from its state in memory") == 3
    assert len(re.findall(r"the server died of SIG\w+: restarting it from its state in memory", sup.output())) == 4
    assert f"supervising psserver serve (pid {standby}, the standby)" in sup.output()  # no imports to wait for
    assert procs.stop(sup) == 0, sup.tail()
    # Every step of 2 trainers x 2 epochs x 63 batches applied once: none lost, none twice.
    assert "psserver stopped at global step 252" in sup.output(), sup.tail()
    assert not any(state_dir.rglob("*.bin")), "a clean stop releases the state"
    standbys = [int(m) for m in re.findall(r"standby server ready \(pid (\d+)\)", sup.output())]
    assert not [p for p in standbys if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


SYNC_STEPS = 60  # within one epoch of the 8000 samples split over 2 trainers (62 steps each)


def sync_run(procs, port: int, ckpt, *server_flags: str, server_env: dict | None = None,
             kill_mid_round_at: int | None = None) -> dict[str, torch.Tensor]:
    """2 trainers, sync K=2, mlp on MNIST, one torch thread each (so that two runs compute the
    same numbers): the weights the server's final checkpoint holds. ``kill_mid_round_at``: once
    the global step reaches it, trainer 1 is stopped until trainer 0's gradient waits in a round,
    and the server process is SIGKILLed."""
    ctl = free_port()
    sup = procs.server(port, "--model", "mlp", "--update", "sync", "--sync-trainers", "2", "--checkpoint-dir",
                       str(ckpt), *server_flags, control_port=ctl, env=server_env)
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--max-steps", str(SYNC_STEPS), "--compute-threads", "1",
                              "--reconnect", *MNIST_ARGS, env=slow_steps(0.05)) for r in (0, 1)]
    if kill_mid_round_at is not None:
        with ControlClient(f"127.0.0.1:{ctl}", timeout=5) as client:
            deadline = time.monotonic() + 120
            while client.get_status().global_step < kill_mid_round_at:
                assert time.monotonic() < deadline, sup.tail()
                time.sleep(0.05)
        trainers[1].signal(signal.SIGSTOP)
        time.sleep(1.0)  # trainer 0's next gradient is in the round, which waits for trainer 1's
        child = server_child(sup, port)
        child.kill()
        assert dead(child)
        trainers[1].signal(signal.SIGCONT)
    for t in trainers:
        assert t.wait(240) == 0, t.tail()
    assert procs.stop(sup) == 0, sup.tail()
    _, state = find_latest(ckpt)
    assert state["global_step"] == SYNC_STEPS, f"{sup.tail(60)}\n{trainers[0].tail(30)}\n{trainers[1].tail(30)}"
    return state["shards"][0]["module"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_sync_run_killed_twice_ends_with_the_weights_of_a_run_without_a_kill(procs, state_dir, tmp_path):
    """Killed once with a round half-gathered (its gradients sent again, applied once the round
    is whole again) and once right after an update was applied, before its replies (its
    gradients sent again and not applied twice): every update lands exactly once."""
    want = sync_run(procs, free_port(), tmp_path / "plain")
    got = sync_run(procs, free_port(), tmp_path / "killed", "--supervise", "--state-dir", str(state_dir),
                   server_env=die_after_update(30, tmp_path / "died"), kill_mid_round_at=15)
    assert (tmp_path / "died").exists()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.allclose(want[key], got[key], rtol=0, atol=1e-6), f"{key}: {(want[key] - got[key]).abs().max()}"
