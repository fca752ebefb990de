"""Starting real psserver processes in tests, bounded in time and never left behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MNIST_DIR = Path(os.environ.get("PSSERVER_TEST_MNIST", ROOT.parent / "shared" / "data" / "mnist"))
MNIST_ARGS = ["--dataset", "mnist", "--data-dir", str(MNIST_DIR), "--train-split", "8000"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["PYTHONUNBUFFERED"] = "1"
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    e.pop("MASTER_ADDR", None)
    e.pop("MASTER_PORT", None)
    return e


class Proc:
    def __init__(self, args: list[str], name: str) -> None:
        self.args = args
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"psserver-{name}-", suffix=".log", delete=False)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "psserver", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env(),
            cwd=ROOT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            m = rx.search(self.output())
            if m:
                return m
            if self.popen.poll() is not None:
                m = rx.search(self.output())
                if m:
                    return m
                raise AssertionError(f"{self.name} exited with {self.popen.returncode} before /{pattern}/:\n{self.tail()}")
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: no /{pattern}/ within {timeout}s:\n{self.tail()}")

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout}s:\n{self.tail()}") from None

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def running(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-n:])

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


class ProcessGroup:
    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def start(self, args: list[str], name: str) -> Proc:
        p = Proc(args, name)
        self.procs.append(p)
        return p

    def server(self, port: int, *extra: str, control_port: int | None = None, wait: bool = True) -> Proc:
        ctl = ["--control-port", str(control_port)] if control_port is not None else ["--no-control"]
        p = self.start(["serve", "--port", str(port), *ctl, *extra], f"server-{port}")
        if wait:
            p.wait_for(r"serving \S+ on", timeout=90)
        return p

    def trainer(self, port: int, rank: int, *extra: str) -> Proc:
        return self.start(
            ["train", "--server", f"127.0.0.1:{port}", "--rank", str(rank), "--no-progress", *extra],
            f"trainer-{rank}",
        )

    def stop(self, proc: Proc, timeout: float = 30.0) -> int:
        proc.signal(signal.SIGTERM)
        return proc.wait(timeout)

    def kill_all(self) -> None:
        for p in reversed(self.procs):
            if p.running():
                p.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in reversed(self.procs):
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            p.kill()


def accuracy(proc: Proc) -> float:
    m = re.search(r"rank \d+ accuracy ([0-9.]+)", proc.output())
    assert m, f"{proc.name} printed no accuracy:\n{proc.tail()}"
    return float(m.group(1))
