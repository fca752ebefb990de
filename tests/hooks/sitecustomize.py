"""Tests only: Python loads this module at start-up in every process whose ``PYTHONPATH``
holds this directory (``tests.procs.DIE_AFTER_UPDATE_ENV``).

With ``$PSSERVER_TEST_DIE_AFTER_UPDATE=N`` and ``$PSSERVER_TEST_DIE_ONCE=FILE``, a server
process SIGKILLs itself right after its N-th update is whole, before any reply to the trainers
whose gradients made it leaves: the moment at which a lost reply would have them send those
gradients again. Once only: FILE is written first, and a process that finds it does not die.

With ``$PSSERVER_TEST_SLOW_PROTOCOL_SETUP=S``, a trainer takes S seconds more to set up its
step protocol's half once the server has answered its join (as ``--step plain``'s
``DistributedOptimizer`` can on a loaded host).

With ``$PSSERVER_TEST_STEP_DELAY=S``, ``psserver train`` sleeps S seconds before each step: a
slow trainer (one caught mid-run, a straggler).

With ``$PSSERVER_TEST_DIE_AT_STEP=N`` (and ``$PSSERVER_TEST_DIE_ONCE=FILE``), ``psserver train``
SIGKILLs itself as its N-th step begins (the steps before it whole), once.

With ``$PSSERVER_TEST_CKPT_FAULT_AFTER=N``, a server dies (exit 17) once it has written N bytes
of a checkpoint's temporary file, as a crash in the middle of the write would.

With ``$PSSERVER_TEST_DIE_IN_JOIN=1``, a trainer dies (exit 9) inside ``init_rpc`` while it
holds its RPC group's membership token, as a crash there would.

With ``$PSSERVER_TEST_EOF_IN_JOIN=FILE``, a trainer's ``init_rpc`` fails with "EOF", as one
does while another member leaves the group, once (FILE is written first).
"""

from __future__ import annotations

import os

_AFTER = os.environ.get("PSSERVER_TEST_DIE_AFTER_UPDATE")
_ONCE = os.environ.get("PSSERVER_TEST_DIE_ONCE")


def _die_once_at(n: int, what: str):
    """A counter that SIGKILLs this process when it reaches ``n``, unless ``$PSSERVER_TEST_DIE_ONCE``
    names a file that exists (it is written first: once only)."""
    count = [0]

    def tick() -> None:
        count[0] += 1
        if count[0] == n and not os.path.exists(_ONCE):
            import signal

            with open(_ONCE, "w") as f:
                f.write(f"died {what} {n} of pid {os.getpid()}\n")
            print(f"dying {what} {n}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return tick


if _AFTER and _ONCE:
    from psserver.server.engine.journal import GradientSequences

    _commit = GradientSequences.commit
    _after_update = _die_once_at(int(_AFTER), "after update")

    def commit(self) -> None:
        _commit(self)
        _after_update()

    GradientSequences.commit = commit


_SLOW_SETUP = os.environ.get("PSSERVER_TEST_SLOW_PROTOCOL_SETUP")

if _SLOW_SETUP:
    import time

    from psserver.trainer import session as _session

    _trainer_half = _session.trainer_half

    def trainer_half(name):
        half = _trainer_half(name)

        def slow(channel):
            time.sleep(float(_SLOW_SETUP))
            return half(channel)

        return slow

    _session.trainer_half = trainer_half

if os.environ.get("PSSERVER_TEST_DIE_IN_JOIN"):
    from torch.distributed.rpc import backend_registry

    def die(agent) -> None:  # noqa: ARG001 - called where torch sets the joiner's devices, token held
        print("injected fault: dying inside init_rpc", flush=True)
        os._exit(9)

    backend_registry._set_devices_and_reverse_device_map = die

_EOF_ONCE = os.environ.get("PSSERVER_TEST_EOF_IN_JOIN")

if _EOF_ONCE:
    import torch.distributed.rpc as _rpc

    _init_rpc = _rpc.init_rpc

    def init_rpc(*args, **kwargs):
        if not os.path.exists(_EOF_ONCE):
            with open(_EOF_ONCE, "w") as f:
                f.write(f"EOF injected in the join of pid {os.getpid()}\n")
            raise RuntimeError("EOF: end of file (injected: another member left the group during this join)")
        return _init_rpc(*args, **kwargs)

    _rpc.init_rpc = init_rpc

_STEP_DELAY = os.environ.get("PSSERVER_TEST_STEP_DELAY")

if _STEP_DELAY:
    import time

    from psserver.trainer.model_steps import ModelSteps

    _train_step = ModelSteps.train_step

    def train_step(self, *args, **kwargs):
        time.sleep(float(_STEP_DELAY))
        return _train_step(self, *args, **kwargs)

    ModelSteps.train_step = train_step

_DIE_AT_STEP = os.environ.get("PSSERVER_TEST_DIE_AT_STEP")

if _DIE_AT_STEP and _ONCE:
    from psserver.trainer.model_steps import ModelSteps

    _step = ModelSteps.train_step
    _at_step = _die_once_at(int(_DIE_AT_STEP), "at step")

    def train_step_or_die(self, *args, **kwargs):
        _at_step()
        return _step(self, *args, **kwargs)

    ModelSteps.train_step = train_step_or_die

_CKPT_FAULT = os.environ.get("PSSERVER_TEST_CKPT_FAULT_AFTER")

if _CKPT_FAULT:
    import builtins

    import psserver.checkpoint as _checkpoint

    class _DyingFile:
        """A checkpoint's temporary file that takes N bytes, makes them durable, and ends the process."""

        def __init__(self, f) -> None:
            self._f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self._f.close()

        def write(self, data: bytes) -> int:
            self._f.write(data[:int(_CKPT_FAULT)])
            self._f.flush()
            os.fsync(self._f.fileno())
            print(f"injected fault: dying after {_CKPT_FAULT} bytes of {self._f.name}", flush=True)
            os._exit(17)

        def __getattr__(self, name):
            return getattr(self._f, name)

    def _open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return _DyingFile(f) if "w" in mode else f  # write_checkpoint's temporary (by its descriptor)

    _checkpoint.open = _open
