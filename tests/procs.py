"""Starting real psserver processes in tests, bounded in time and never left behind.

The one place the suite picks free ports and starts ``python -m psserver`` (or a launcher in
front of it: torchrun, a deploy script):

- ``free_port()``: a loopback port nobody listens on right now.
- ``env(**overrides)``: the environment of a child: this checkout on PYTHONPATH, unbuffered
  output, no launcher variables (torchrun, Slurm) and no control-plane token or address
  inherited from the shell; ``overrides`` last (a value of None removes the variable).
- ``run(args, timeout=...)``: a child to its end, output captured (``CompletedProcess``).
- ``cli(args)``: the same verb in this process (``psserver.cli.main``), for those that start no
  server or trainer (export, status, a usage error): no child that spends 3 s importing torch.
- ``Proc``: a child running in the background, its output in a log file (no pipe to fill up),
  in a session of its own so that ``kill()`` takes everything it started along.
- ``ProcessGroup``: the ``Proc`` objects of one test (fixture ``procs``), all killed after it.
- ``wait_until(predicate, timeout, what, procs)``: polls, failing early when one of ``procs`` exits.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from psserver.utils import ports
from tests import forked

ROOT = Path(__file__).resolve().parents[1]
MNIST_DIR = Path(os.environ.get("PSSERVER_TEST_MNIST", ROOT.parent / "shared" / "data" / "mnist"))
MNIST_ARGS = ["--dataset", "mnist", "--data-dir", str(MNIST_DIR), "--train-split", "8000"]

PSSERVER = (sys.executable, "-m", "psserver")
# Read by psserver as defaults (rank, world size, server address, launcher detection, token):
# a test that wants one sets it explicitly.
NOT_INHERITED = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "SLURM_PROCID",
    "SLURM_NTASKS", "PSSERVER_SERVER", "PSSERVER_AUTH_TOKEN", "PSSERVER_JOIN_TOKEN", "PSSERVER_CONTROL_ADDRESS",
)


def _worker_ports() -> range:
    """This xdist worker's share of the fixed ports: two workers never pick the same one."""
    span = ports.fixed_ports()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    share = len(span) // max(1, workers)
    return span[index * share:(index + 1) * share]


def free_port() -> int:
    """A loopback port nobody listens on, outside the kernel's ephemeral range (an outgoing
    connection took the ephemeral port a CI run's Slurm job had picked for its metrics), from
    this worker's share, never one this process handed out before."""
    return ports.free_port(ports=_worker_ports())


def env(**overrides: str | None) -> dict[str, str]:
    return _environment(overrides)


HOOKS = ROOT / "tests" / "hooks"


def die_after_update(n: int, once: Path) -> dict[str, str]:
    """Environment of a server process that SIGKILLs itself right after its ``n``-th update,
    before the replies (``tests/hooks/sitecustomize.py``), once (``once`` records it)."""
    return _hooked(PSSERVER_TEST_DIE_AFTER_UPDATE=str(n), PSSERVER_TEST_DIE_ONCE=str(once))


def die_at_step(n: int, once: Path) -> dict[str, str]:
    """Environment of a ``psserver train`` that SIGKILLs itself as its ``n``-th step begins, once
    (``once`` records it)."""
    return _hooked(PSSERVER_TEST_DIE_AT_STEP=str(n), PSSERVER_TEST_DIE_ONCE=str(once))


def slow_protocol_setup(seconds: float) -> dict[str, str]:
    """Environment of a trainer whose step protocol takes ``seconds`` more to set up after its
    join is answered (``tests/hooks/sitecustomize.py``)."""
    return _hooked(PSSERVER_TEST_SLOW_PROTOCOL_SETUP=str(seconds))


def slow_steps(seconds: float, pythonpath: str | None = None) -> dict[str, str]:
    """Environment of a ``psserver train`` that sleeps ``seconds`` before each step (a slow
    trainer), with ``pythonpath`` (a user's code) after the hooks."""
    env = _hooked(PSSERVER_TEST_STEP_DELAY=str(seconds))
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(HOOKS), pythonpath])
    return env


def die_mid_checkpoint(after_bytes: int) -> dict[str, str]:
    """Environment of a server that dies once it has written ``after_bytes`` of a checkpoint's
    temporary file."""
    return _hooked(PSSERVER_TEST_CKPT_FAULT_AFTER=str(after_bytes))


def die_in_join() -> dict[str, str]:
    """Environment of a trainer that dies inside ``init_rpc`` holding the membership token."""
    return _hooked(PSSERVER_TEST_DIE_IN_JOIN="1")


def eof_in_first_join(once: Path) -> dict[str, str]:
    """Environment of a trainer whose first ``init_rpc`` fails with "EOF", as one does while
    another member leaves the RPC group, once (``once`` records it)."""
    return _hooked(PSSERVER_TEST_EOF_IN_JOIN=str(once))


def _hooked(**variables: str) -> dict[str, str]:
    """``variables`` with ``tests/hooks`` first on ``PYTHONPATH``, where Python finds its sitecustomize."""
    return {"PYTHONPATH": os.pathsep.join([str(HOOKS), str(ROOT), os.environ.get("PYTHONPATH", "")]), **variables}


_RUNTIME_DIR: list[str] = []


def runtime_dir() -> str:
    """A private ``$XDG_RUNTIME_DIR`` for the children of a test process that has none (a
    server's local admin token goes there, not into the home of whoever runs the tests);
    removed at exit."""
    if not _RUNTIME_DIR:
        _RUNTIME_DIR.append(tempfile.mkdtemp(prefix="psserver-runtime-"))
        atexit.register(shutil.rmtree, _RUNTIME_DIR[0], True)
    return _RUNTIME_DIR[0]


def _environment(overrides: Mapping[str, str | None] | None) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["PYTHONUNBUFFERED"] = "1"
    # Two tests' servers and trainers share the CI machine's 2 cores: OpenMP threads that wait
    # sleep at once instead of spinning on a core another process needs (10 % less CPU measured
    # over tests/end_to_end/test_lifecycle.py and tests/control/test_e2e.py).
    e.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    e.setdefault("XDG_RUNTIME_DIR", runtime_dir())  # a test (tests/control) may give its own
    for name in NOT_INHERITED:
        e.pop(name, None)
    for name, value in (overrides or {}).items():
        if value is None:
            e.pop(name, None)
        else:
            e[name] = value
    return e


def _command(args: Sequence[str], prefix: Sequence[str] | None) -> list[str]:
    return [*(PSSERVER if prefix is None else prefix), *args]


def _kill_session(popen: subprocess.Popen) -> None:
    """SIGKILL the child's own session (started with start_new_session): it and whatever it started."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        popen.wait(10)
    except subprocess.TimeoutExpired:
        pass


def run(args: Sequence[str], *, timeout: float = 60, env: Mapping[str, str | None] | None = None,
        prefix: Sequence[str] | None = None) -> subprocess.CompletedProcess:
    """``python -m psserver ARGS`` (or ``prefix + ARGS``) to its end, stdout and stderr captured as text.

    Past ``timeout`` the child and everything it started are killed and the test fails with their output.
    """
    cmd, environment = _command(args, prefix), _environment(env)
    if forked.forkable(cmd, environment, _environment(None)):
        return _run_forked(cmd, environment, timeout)
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             text=True, env=environment, cwd=ROOT, start_new_session=True)
    try:
        out, err = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(popen)
        out, err = popen.communicate()
        raise AssertionError(f"{' '.join(cmd)} still running after {timeout}s:\nstdout:\n{out[-3000:]}\n"
                             f"stderr:\n{err[-6000:]}") from None
    finally:
        _kill_session(popen)  # anything it left behind in its session
    return subprocess.CompletedProcess(cmd, popen.returncode, out, err)


def _run_forked(cmd: list[str], environment: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """:func:`run` for a child of the fork server: its output goes through two files."""
    with tempfile.TemporaryDirectory(prefix="psserver-run-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        popen = forked.Forked(cmd, environment, ROOT, out_path, err_path)
        try:
            popen.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_session(popen)  # anything it left behind in its session
            popen.close()

        def read(path: str) -> str:
            try:
                with open(path, errors="replace") as f:
                    return f.read()
            except FileNotFoundError:
                return ""

        out, err = read(out_path), read(err_path)
    if timed_out:
        raise AssertionError(f"{' '.join(cmd)} still running after {timeout}s:\nstdout:\n{out[-3000:]}\n"
                             f"stderr:\n{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, popen.returncode, out, err)


def cli(args: Sequence[str]) -> subprocess.CompletedProcess:
    """``psserver ARGS`` run by ``psserver.cli.main`` in this process, its stdout and stderr
    captured as text (argparse's exit as its code), the launcher and token variables of
    ``NOT_INHERITED`` hidden as from a child, and the environment and torch's thread count
    (``--compute-threads``, set before a refusal) as they were afterwards. Only for verbs that
    return by themselves: nothing here bounds its time but the test's. A call that gets as far as
    ``init_rpc`` fails the test: RPC is initialised once per process, so a second such call in
    the same xdist worker would fail for a reason of its own (run those with :func:`run`)."""
    import torch

    from psserver.cli import main

    rpc_before = _rpc_initialised()
    out, err = io.StringIO(), io.StringIO()
    saved, threads = dict(os.environ), torch.get_num_threads()
    for k in NOT_INHERITED:
        os.environ.pop(k, None)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # --help, --version, argparse's own errors
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)
    if not rpc_before and _rpc_initialised():
        raise AssertionError(f"psserver {' '.join(args)} initialised RPC in the test process: run it with procs.run")
    return subprocess.CompletedProcess(["psserver", *args], code, out.getvalue(), err.getvalue())


def _rpc_initialised() -> bool:
    """Whether ``dist_autograd`` was initialised in this process (``init_rpc`` does it first)."""
    import torch.distributed.autograd as dist_autograd

    try:
        dist_autograd._get_debug_info()
    except RuntimeError:
        return False
    return True


class Proc:
    """One child in the background: ``python -m psserver ARGS``, or ``prefix + ARGS``.

    ``env``: overrides of ``env()``. ``log``: where its output goes (kept); by default a
    temporary file, removed by ``kill()``. ``cwd``: by default the checkout.
    """

    def __init__(self, args: Sequence[str], name: str, *, env: Mapping[str, str | None] | None = None,
                 log: Path | None = None, prefix: Sequence[str] | None = None, cwd: Path | None = None) -> None:
        self.args = list(args)
        self.name = name
        self._keep_log = log is not None
        if log is None:
            self._out = tempfile.NamedTemporaryFile("w", prefix=f"psserver-{name}-", suffix=".log", delete=False)
            self.log = Path(self._out.name)
        else:
            self.log = Path(log)
            self._out = open(self.log, "w")
        command, environment = _command(self.args, prefix), _environment(env)
        if forked.forkable(command, environment, _environment(None)):
            self.popen = forked.Forked(command, environment, cwd or ROOT, str(self.log), str(self.log))
        else:
            self.popen = subprocess.Popen(command, stdout=self._out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=environment, cwd=cwd or ROOT,
                                          start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 60.0, *, nth: int = 1) -> re.Match:
        """The ``nth`` match of ``pattern`` in the output (the first by default); fails if the
        process exits or time runs out first."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)

        def find() -> re.Match | None:
            found = list(rx.finditer(self.output()))
            return found[nth - 1] if len(found) >= nth else None

        while time.monotonic() < deadline:
            m = find()
            if m:
                return m
            if self.popen.poll() is not None:
                m = find()
                if m:
                    return m
                raise AssertionError(
                    f"{self.name} exited with {self.popen.returncode} before /{pattern}/:\n{self.tail()}")
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: no /{pattern}/ within {timeout}s:\n{self.tail()}")

    def wait(self, timeout: float) -> int:
        """The exit code; fails (with the output's tail) if it is still running after ``timeout``."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout}s:\n{self.tail()}") from None

    def signal(self, sig: int) -> None:
        """``sig`` to the process itself (not its session), if it still runs."""
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def signal_other_thread(self, sig: int) -> None:
        """``sig`` to one of its threads other than the main one (``tgkill``), as the kernel may
        deliver a signal sent to the process: the handler must still run."""
        import ctypes
        import platform

        import psutil

        def name(tid: int) -> str:
            return Path(f"/proc/{self.pid}/task/{tid}/comm").read_text().strip()

        # One of torch's own threads (TensorPipe's loops, its thread pool) where it has some.
        tids = sorted((name(t.id) == "python", t.id) for t in psutil.Process(self.pid).threads() if t.id != self.pid)
        assert tids, f"{self.name} has no thread besides its main one"
        tid = tids[0][1]
        number = {"x86_64": 234, "aarch64": 131}[platform.machine()]  # tgkill
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(number, self.pid, tid, sig) != 0:
            raise OSError(ctypes.get_errno(), f"tgkill {self.pid}/{tid}")

    def running(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-n:])

    def kill(self) -> None:
        """SIGKILL its whole session, close the log (and remove it unless it was given)."""
        _kill_session(self.popen)
        if isinstance(self.popen, forked.Forked):
            self.popen.close()
        self._out.close()
        if not self._keep_log:
            try:
                os.unlink(self.log)
            except OSError:
                pass


class ProcessGroup:
    """The processes of one test (fixture ``procs``); ``kill_all()`` ends them all.

    ``start``, ``server`` and ``trainer`` take ``Proc``'s keyword options (env, log, prefix, cwd).
    """

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def start(self, args: Sequence[str], name: str, **options) -> Proc:
        p = Proc(args, name, **options)
        self.procs.append(p)
        return p

    def server(self, port: int, *extra: str, control_port: int | None = None, wait: bool = True, **options) -> Proc:
        """``psserver serve`` on ``port`` (``--no-control`` unless ``control_port``); waits until it serves."""
        ctl = ["--control-port", str(control_port)] if control_port is not None else ["--no-control"]
        p = self.start(["serve", "--port", str(port), *ctl, *extra], f"server-{port}", **options)
        if wait:
            p.wait_for(r"serving \S+ on", timeout=90)
        return p

    def trainer(self, port: int, rank: int, *extra: str, **options) -> Proc:
        return self.start(
            ["train", "--server", f"127.0.0.1:{port}", "--rank", str(rank), "--no-progress", *extra],
            f"trainer-{rank}", **options,
        )

    def stop(self, proc: Proc, timeout: float = 30.0) -> int:
        """SIGTERM, then its exit code (fails if it is still running after ``timeout``)."""
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


def start_servers(procs: ProcessGroup, port: int, n: int, *extra: str, ckpt: Path | None = None,
                  control: bool = False, per_server: dict[int, list[str]] | None = None) -> list[Proc]:
    """Server 0 on ``port`` and servers 1..n-1 pointed at it; returns once all serve."""
    ck = ["--checkpoint-dir", str(ckpt)] if ckpt is not None else []
    s0 = procs.server(port, "--num-servers", str(n), "--server-rank", "0", *ck, *extra, *(per_server or {}).get(0, []),
                      control_port=0 if control else None, wait=False)
    servers = [s0]
    for i in range(1, n):
        servers.append(procs.start(["serve", "--num-servers", str(n), "--server-rank", str(i), "--coordinator",
                                    f"127.0.0.1:{port}", "--port", str(free_port()), *ck, *extra,
                                    *(per_server or {}).get(i, [])], f"server{i}-{port}"))
    s0.wait_for(r"all \d+ server processes are serving", timeout=90)
    return servers


def metric(proc: Proc, name: str) -> float:
    """The held-out metric a trainer printed at its end (``rank N <name> 0.xxxx``)."""
    m = re.search(rf"rank \d+ {name} ([0-9.]+)", proc.output())
    assert m, f"{proc.name} printed no {name}:\n{proc.tail()}"
    return float(m.group(1))


def accuracy(proc: Proc) -> float:
    m = re.search(r"rank \d+ accuracy ([0-9.]+)", proc.output())
    assert m, f"{proc.name} printed no accuracy:\n{proc.tail()}"
    return float(m.group(1))


def wait_until(predicate, timeout: float, what: str, procs: Sequence[Proc] = (), every: float = 0.25):
    """The first truthy result of ``predicate`` within ``timeout`` s; fails early when one of
    ``procs`` exits, and with the last error when time runs out."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        for p in procs:
            assert p.running(), f"{p.name} exited with {p.popen.returncode} while waiting for {what}:\n{p.tail()}"
        try:
            result = predicate()
            if result:
                return result
        except (OSError, ValueError, KeyError, AssertionError) as e:
            last = e
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last})")
