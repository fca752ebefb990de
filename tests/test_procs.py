"""The suite's own helpers for real processes (``tests.procs``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import procs


def test_free_ports_are_free_and_never_handed_out_twice(monkeypatch):
    # the kernel picking the same port for two binds in a row, as it did in a CI run
    picks = iter([41000, 41000, 41001])
    real_socket = socket.socket

    class Repeating(real_socket):
        def getsockname(self):
            return ("127.0.0.1", next(picks))

    monkeypatch.setattr(procs, "_HANDED_OUT", set())
    monkeypatch.setattr(procs.socket, "socket", Repeating)
    assert (procs.free_port(), procs.free_port()) == (41000, 41001)
    monkeypatch.undo()
    port = procs.free_port()
    with real_socket() as s:
        s.bind(("127.0.0.1", port))  # free indeed


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_run_ended_by_sigterm_still_stops_the_processes_its_tests_started(tmp_path):
    # a CI timeout's SIGTERM: the children live in sessions of their own, so only the fixtures'
    # teardown, which the interrupt lets pytest run, stops them
    pid_file = tmp_path / "child.pid"
    (tmp_path / "test_child.py").write_text(textwrap.dedent(f"""
        import time
        from pathlib import Path

        def test_child(procs):
            child = procs.start(["300"], "sleeper", prefix=["sleep"])
            Path({str(pid_file)!r}).write_text(str(child.pid))
            time.sleep(300)
    """))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                            "--rootdir", str(tmp_path), str(tmp_path / "test_child.py")],
                           cwd=procs.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_file.exists(), run.communicate(timeout=30)[0] if run.poll() is not None else "no child in 60 s"
        child = int(pid_file.read_text())
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    outlived = _running(child)
    if outlived:
        os.kill(child, signal.SIGKILL)  # started by this test's run, by its PID
    assert not outlived, f"the test's child {child} outlived the run:\n{out}"
    assert run.returncode != 0 and "SIGTERM received" in out, out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
