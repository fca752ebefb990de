"""``psserver serve --supervise``: bytes that crash TensorPipe cost at most the steps since the
last checkpoint (the crash is inside libtorch's C++, where psserver cannot catch it)."""

from __future__ import annotations

import signal
import socket
import time

import psutil
import pytest

from psserver.ps.server.supervisor import describe, resume_argv, server_argv
from tests.procs import accuracy

JOINED = r"joined psserver \S+ as (trainer_\d+_\d+)"


def test_a_restart_resumes_the_run_and_never_starts_a_new_one():
    first = server_argv(["--log-level", "INFO", "serve", "--supervise", "--new-run", "--checkpoint-dir", "d"])
    assert first[1:3] == ["-m", "psserver"] and "--supervise" not in first
    again = resume_argv(first)
    assert again[3:] == ["--log-level", "INFO", "serve", "--checkpoint-dir", "d", "--resume"]
    assert resume_argv(again) == again
    assert resume_argv([*first[:3], "serve", "--resume=/ckpt/x.pt"]) == [*first[:3], "serve", "--resume=/ckpt/x.pt"]
    assert describe(-signal.SIGSEGV) == "SIGSEGV" and describe(3) == "exit code 3"


def test_supervise_needs_a_checkpoint_dir(procs, port):
    from psserver.cli import main

    assert main(["serve", "--port", str(port), "--supervise", "--no-control"]) == 2


def listening_ports(proc: psutil.Process) -> list[int]:
    return sorted({c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN})


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_server_killed_by_bytes_on_its_tensorpipe_port_comes_back(procs, port, tmp_path):
    sup = procs.server(port, "--model", "mlp", "--supervise", "--checkpoint-dir", str(tmp_path),
                       "--checkpoint-every", "10", "--trainer-timeout", "2")
    t = procs.trainer(port, 0, "--dataset", "synthetic", "--max-steps", "300", "--reconnect", "--rpc-timeout", "10",
                      env={"PSSERVER_TEST_STEP_DELAY": "0.02"})
    t.wait_for(JOINED, timeout=60)
    sup.wait_for(r"checkpoint step [1-9]\d* written", timeout=60)
    (child,) = psutil.Process(sup.pid).children()
    for p in (p for p in listening_ports(child) if p != port):  # TensorPipe's listeners
        with socket.create_connection(("127.0.0.1", p), timeout=5) as s:
            s.sendall(b"\0" * 16)
        deadline = time.monotonic() + 2
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        if not child.is_running() or child.status() == psutil.STATUS_ZOMBIE:
            break
    else:
        pytest.fail("sixteen zero bytes on every TensorPipe port left the server alive: is the crash fixed upstream?")
    sup.wait_for(r"the server died of SIG\w+: restarting it from its last checkpoint", timeout=20)
    sup.wait_for(r"resumed at step [1-9]\d*", timeout=90)
    t.wait_for(r"reconnected as trainer_0_\d+ at global step [1-9]\d*", timeout=90)
    assert t.wait(120) == 0, t.tail()
    assert accuracy(t) > 0.5
    assert procs.stop(sup) == 0, sup.tail()
    assert "Traceback" not in t.output()
