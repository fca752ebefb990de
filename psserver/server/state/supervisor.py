"""``psserver serve --supervise``: a server that dies by a signal comes back, from its state in
shared memory (``psserver.server.state.memory``: no applied update is lost), else from its
last checkpoint.

A few bytes sent to one of TensorPipe's listening ports (sixteen zero bytes; ``GET /
HTTP/1.0``) crash the server inside libtorch's C++ (a segfault, or an abort on
``std::bad_alloc``) while it parses a connection's first frame: no Python code runs there,
so psserver cannot catch it, and TensorPipe is in maintenance mode upstream. Keeping
strangers away from those ports is the first defence (``--host`` on a private interface, the
WireGuard mesh and NetworkPolicy in ``deploy/``); this is the second. The supervisor is a
parent process without RPC, tensors or listening ports of its own: it runs the server as its
child, forwards SIGTERM and SIGINT to it, and when the child dies by a signal it starts it
again. It gives every child one state key (``$PSSERVER_STATE_KEY``), so the restarted one maps
the memory its predecessor wrote; with checkpoints it adds ``--resume``, which a restart uses
when that memory is gone, or fails the checks a restart makes (it says so, in one WARNING
line). Trainers started with ``--reconnect`` rejoin.

A restart does not wait for Python to import torch: beside the server the supervisor keeps a
*standby*, the same command started ahead with everything imported, blocked on its stdin
(``standby_wait``). When the server dies the standby is told to go on and a new standby is
started; it costs the memory of one idle interpreter with torch loaded.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Sequence

from psserver.config import MemoryStateConfig

log = logging.getLogger(__name__)

RESTART_WINDOW_S = 600.0
"""Restarts are counted over this window: a server that keeps dying is given up."""
STOP_GRACE_S = 120.0
"""How long a stopping supervisor waits for its server (a final checkpoint) before killing it."""
KEY_ENV, STATE_DIR_ENV = "PSSERVER_STATE_KEY", "PSSERVER_STATE_DIR"
STANDBY_ENV = "PSSERVER_STANDBY"
"""Set for the standby: it imports what the server needs, then waits for the word to go on."""
GO = b"go\n"
STANDBY_DELAY_S = 15.0
"""The standby is started this long after the server (or its restart) started."""
SUPERVISOR_ENV = "PSSERVER_SUPERVISOR_PID"
"""Set for the child: the process that owns its state in memory across restarts."""
FALLBACK_ENV = "PSSERVER_STATE_FALLBACK"
"""Set for a restart that resumes from a checkpoint when its state in memory is gone: a state
that fails its check is discarded too (one WARNING line), rather than ending the job."""


def server_argv(argv: Sequence[str]) -> list[str]:
    """The child's command: ``psserver serve`` as given, without ``--supervise``."""
    return [sys.executable, "-m", "psserver", *(a for a in argv if a != "--supervise")]


def resume_argv(argv: list[str]) -> list[str]:
    """The command of a restart: from the newest checkpoint of the run, never a new run."""
    out = [a for a in argv if a != "--new-run"]
    if not any(a == "--resume" or a.startswith("--resume=") for a in out):
        out.append("--resume")
    return out


def describe(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def supervise(argv: Sequence[str], max_restarts: int, *, resume: bool = True,
              state: MemoryStateConfig | None = None, restart_codes: tuple[int, ...] = ()) -> int:
    """Run ``psserver serve argv`` until it stops on its own or is told to; its exit code
    (1 when it kept dying: ``max_restarts`` restarts within ``RESTART_WINDOW_S``). ``resume``:
    restarts add ``--resume`` (a checkpoint directory is set); ``state``: the memory state;
    ``restart_codes``: exit codes that restart it too, as a death by a signal does."""
    command = server_argv(argv)
    env = dict(os.environ, **{SUPERVISOR_ENV: str(os.getpid())})
    env.pop(FALLBACK_ENV, None)  # the first start never discards a state: only a restart of this supervisor's
    in_memory = state is not None and state.enabled
    if in_memory:
        from psserver.server.state.directory import open_root

        os.close(open_root(state.directory, create=True))  # this user's alone, or one line before anything runs
        env[STATE_DIR_ENV] = str(state.directory)  # the child runs without --supervise, which implies it
        env[KEY_ENV] = state.key or uuid.uuid4().hex[:16]
        log.info("supervised server's state in memory: %s/%s", state.directory, env[KEY_ENV])
    child: subprocess.Popen | None = None
    spare: subprocess.Popen | None = None
    stopping: list[int] = []
    restart_command = resume_argv(command) if resume else command
    restart_env = {**env, FALLBACK_ENV: "1"} if resume else env

    def forward(signum, frame):  # noqa: ARG001
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    def standby() -> subprocess.Popen:
        return subprocess.Popen(restart_command, env={**restart_env, STANDBY_ENV: "1"}, stdin=subprocess.PIPE)

    started = time.monotonic()

    def tick() -> None:
        nonlocal spare
        # Started once the server had time to start: never competing with its imports for the CPU.
        if spare is None and not stopping and time.monotonic() - started > STANDBY_DELAY_S:
            spare = standby()

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    restarts: deque[float] = deque()
    try:
        child = subprocess.Popen(command, env=env)
        log.info("supervising psserver serve (pid %d)", child.pid)
        while True:
            code = _wait(child, stopping, tick)
            if stopping or (code >= 0 and code not in restart_codes):
                return code if code >= 0 else 128 - code
            now = time.monotonic()
            while restarts and now - restarts[0] > RESTART_WINDOW_S:
                restarts.popleft()
            if len(restarts) >= max_restarts:
                log.error("the server died of %s again (%d deaths in %.0f min): giving up%s", describe(code),
                          len(restarts) + 1, RESTART_WINDOW_S / 60,
                          f"; its state stays in {state.directory}/{env[KEY_ENV]} (serve --state-key "
                          f"{env[KEY_ENV]} continues from it)" if in_memory else "")
                return 1
            restarts.append(now)
            source = "its state in memory" if in_memory else "its last checkpoint"
            log.error("the server died of %s: restarting it from %s (restart %d, at most %d in %.0f min)",
                      describe(code), source, len(restarts), max_restarts, RESTART_WINDOW_S / 60)
            time.sleep(0.5)  # let the kernel release its ports
            promoted = _promote(spare)
            child, spare = promoted or subprocess.Popen(restart_command, env=restart_env), None
            started = time.monotonic()
            log.info("supervising psserver serve (pid %d%s)", child.pid, ", the standby" if promoted else "")
    finally:
        if spare is not None:
            _retire(spare)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _promote(spare: subprocess.Popen | None) -> subprocess.Popen | None:
    """The standby, told to go on; None when it is gone (then a fresh process is started)."""
    if spare is None or spare.poll() is not None or spare.stdin is None:
        return None
    try:
        spare.stdin.write(GO)
        spare.stdin.close()
    except OSError:
        return None
    return spare


def _retire(spare: subprocess.Popen) -> None:
    """A standby that is not needed: its stdin closes, it exits."""
    try:
        if spare.stdin is not None:
            spare.stdin.close()
        spare.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        spare.kill()
        spare.wait()


def standby_wait() -> bool:
    """In a standby: wait for the supervisor's word (True: go on, as the server; False: the
    supervisor is done with it, or gone). What the restored state's optimizers import (torch's
    compiler, 1.3-1.9 s of CPU) is imported first, so the restart does not wait for it."""
    from psserver.server.engine.shard import warm_optimizers  # imports torch: the supervisor itself does not

    os.environ.pop(STANDBY_ENV, None)
    warm_optimizers().join()
    log.info("standby server ready (pid %d)", os.getpid())
    try:
        word = sys.stdin.buffer.readline()
    except (KeyboardInterrupt, OSError):  # Ctrl-C reaches the whole process group: the supervisor decides
        return False
    return word == GO


def _wait(child: subprocess.Popen, stopping: list[int], tick=lambda: None) -> int:
    """The child's exit code; once told to stop, kill it if it outlives ``STOP_GRACE_S``
    (``tick`` is called about once a second meanwhile)."""
    while True:
        try:
            return child.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        tick()
        if stopping:
            try:
                return child.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.error("the server did not stop within %.0fs: killing it", STOP_GRACE_S)
                child.kill()
                return child.wait()
