"""The suite's own helpers for real processes (``tests.procs``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import forked, procs


def test_each_worker_picks_ports_from_its_own_share(monkeypatch):
    shares = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        shares.append(procs._worker_ports())
    assert len(shares[0]) > 1000 and not set(shares[0]) & set(shares[1])
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    port = procs.free_port()
    assert port in shares[1]
    with socket.socket() as s:
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


PROBE = """
import builtins, json, os, sys
import torch
print(json.dumps({"argv": sys.argv, "orig_argv": sys.orig_argv, "cwd": os.getcwd(), "path0": sys.path[0],
                  "probe": os.environ.get("PROBE"), "threads": torch.get_num_threads(),
                  "hooked": getattr(builtins, "HOOKED", False), "session": os.getsid(0) == os.getpid(),
                  "title": open("/proc/self/cmdline").read().replace("\\0", " ").split()}))
print("to stderr", file=sys.stderr)
sys.exit(7)
"""


@pytest.mark.multiprocess
def test_a_forked_child_is_what_a_fresh_interpreter_would_be(tmp_path, monkeypatch):
    """``tests.forked``: the same script run plain and forked from the fork server sees the same
    argv, directory, path, environment, torch threads and hooks, and exits the same."""
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "sitecustomize.py").write_text("import builtins\nbuiltins.HOOKED = True\n")
    env = {"PYTHONPATH": f"{tmp_path / 'hooks'}{os.pathsep}{procs.ROOT}", "OMP_NUM_THREADS": "1", "PROBE": "x"}
    command = [sys.executable, str(tmp_path / "probe.py")]
    assert forked.forkable(command, procs.env(**env), procs.env())
    assert not forked.forkable(command, procs.env(**env, TORCH_CPP_LOG_LEVEL="INFO"), procs.env())  # read at load
    ran = {}
    for how in ("forked", "plain"):
        if how == "plain":
            monkeypatch.setenv(forked.DISABLE_ENV, "1")
        done = procs.run(["a", "--b"], prefix=command, env=env)
        assert (done.returncode, done.stderr) == (7, "to stderr\n"), done
        ran[how] = json.loads(done.stdout)
    assert ran["forked"] == ran["plain"]
    assert ran["plain"]["hooked"] and ran["plain"]["threads"] == 1 and ran["plain"]["session"]
    assert ran["plain"]["argv"][1:] == ["a", "--b"] and ran["plain"]["path0"] == str(tmp_path)


@pytest.mark.multiprocess
def test_a_forked_child_killed_reports_the_signal(tmp_path, procs):
    plain = procs.start(["-c", "print('up')"], "plain", prefix=[sys.executable])
    assert isinstance(plain.popen, subprocess.Popen)  # python -c: interpreter options, run plain
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    child = procs.start([], "sleeper", prefix=[sys.executable, str(sleeper)])
    assert isinstance(child.popen, forked.Forked)
    child.wait_for("up", timeout=30)
    child.signal(signal.SIGKILL)
    assert child.wait(10) == -signal.SIGKILL
    assert plain.wait(30) == 0
