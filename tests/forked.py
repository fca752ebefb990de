"""The tests' Python children, forked from a process that has imported torch already.

Every ``python -m psserver ...`` a test starts would spend about 2 s of CPU importing torch
(measured: ``serve --help`` 2.0 s started plain, 0.14 s forked), and the suite starts hundreds on
a 2-core machine. Each test process (xdist worker) keeps one multiprocessing fork server that has
imported torch; a child forked from it gets what a fresh interpreter would have got: its own
session, environment, working directory, ``sys.argv`` and ``sys.orig_argv`` (psserver re-executes
itself from those), ``sys.path`` and the ``sitecustomize`` of its ``PYTHONPATH`` (the test hooks),
stdout and stderr, and its command line as ``ps`` shows it; at its end ``atexit`` runs as at a
normal exit.

What torch or the C runtime read once, when they are loaded, cannot be changed in a fork: a
child whose environment differs from the fork server's in such a variable (:data:`READ_AT_LOAD`)
is started the plain way instead (:func:`forkable`). ``OMP_NUM_THREADS`` is the exception: the
child sets torch's thread count from it, as loading would have.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import runpy
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import forkserver
from pathlib import Path

import setproctitle

PRELOAD = ["torch", "torch.distributed.rpc", "torch.distributed.autograd", "torch.optim", "numpy"]
READ_AT_LOAD = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH_", "PYTORCH_", "CUDA_", "LD_", "MALLOC_",
                "GLIBC_", "PYTHON")
"""Prefixes of variables read when torch, its libraries or the interpreter load."""
SET_IN_CHILD = frozenset({"OMP_NUM_THREADS", "PYTHONPATH"})
DISABLE_ENV = "PSSERVER_TESTS_NO_FORK"
"""Set (to anything): every child is started the plain way."""

_lock = threading.Lock()
_server_env: dict[str, str] | None = None


def _loaded(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_LOAD) and k not in SET_IN_CHILD}


def _script(command: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """``("module", NAME, ARGS)`` for ``python -m NAME ARGS``, ``("path", FILE, ARGS)`` for
    ``python FILE ARGS`` (no interpreter options), None for anything else."""
    if len(command) < 2 or command[0] != sys.executable:
        return None
    if command[1] == "-m" and len(command) > 2:
        return "module", command[2], list(command[3:])
    if not command[1].startswith("-"):
        return "path", command[1], list(command[2:])
    return None


def forkable(command: Sequence[str], env: Mapping[str, str], base: Mapping[str, str]) -> bool:
    """Whether ``command`` with ``env`` can be forked from the fork server rather than executed.
    The server starts, at the first such question, with ``base``: the environment of a child
    that sets nothing of its own (not the first child's, whose settings would then decide for
    every later one)."""
    if os.environ.get(DISABLE_ENV) or _script(command) is None or _main_is_a_script():
        return False
    with _lock:
        if _server_env is None:
            _start(base)
        return _loaded(env) == _loaded(_server_env)


def _main_is_a_script() -> bool:
    """A ``__main__`` run from a file (not pytest's): each fork would run it again first."""
    main = sys.modules.get("__main__")
    return getattr(main, "__spec__", None) is None and getattr(main, "__file__", None) is not None


def _start(env: Mapping[str, str]) -> None:
    global _server_env
    multiprocessing.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    os.environ.clear()
    # Without PYTHONPATH: a test's hooks there (a sitecustomize) would patch every later child.
    # The fork server gets this process's sys.path from multiprocessing instead.
    os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _server_env = dict(env)


def helper_pids() -> set[int]:
    """The fork server and multiprocessing's resource tracker that it starts: children of this
    process that are no test's."""
    from multiprocessing import resource_tracker

    pids = {getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None)}
    return {p for p in pids if p is not None}


class Forked:
    """What the tests use of ``subprocess.Popen``, for a child of the fork server."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: str, stderr: str) -> None:
        self.args = list(command)
        context = multiprocessing.get_context("forkserver")
        self._process = context.Process(target=_child, args=(self.args, dict(env), str(cwd), stdout, stderr),
                                        name=Path(self.args[2] if self.args[1] == "-m" else self.args[1]).name)
        self._process.start()
        self.pid: int = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self._process.join(timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def close(self) -> None:
        """Release the pipe to the fork server (once the child has ended)."""
        if self.poll() is not None:
            self._process.close()


def _child(command: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """In the fork: become ``command`` as a new interpreter would, run it, exit as it would."""
    os.setsid()
    # For ps and pgrep (.ci/run's check for leftovers); before the environment changes, which
    # moves the memory setproctitle writes to.
    setproctitle.setproctitle(" ".join(command))
    out = os.open(stdout, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    err = out if stderr == stdout else os.open(stderr, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    for fd in {null, out, err}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    kind, name, args = _script(command)  # type: ignore[misc]
    first = os.getcwd() if kind == "module" else os.path.dirname(os.path.abspath(name))
    entries = [first, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    sys.path[:] = list(dict.fromkeys([*entries, *(p for p in sys.path if p)]))
    if any(os.path.exists(os.path.join(p, "sitecustomize.py")) for p in entries):
        sys.modules.pop("sitecustomize", None)
        importlib.import_module("sitecustomize")
    sys.argv = [name, *args]
    sys.orig_argv = list(command)
    try:
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(name, run_name="__main__")
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's own exit: threads, then atexit
        atexit._run_exitfuncs()
