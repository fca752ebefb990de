"""The threshold of torch's C++ log (c10's ``LOG(...)``), for a process that imported torch already.

TensorPipe logs a C++ WARNING for every peer that leaves (``encountered error when reading
incoming request from trainer_1_1: EOF``): routine for a parameter server whose trainers come
and go, noise at every clean exit. ``$TORCH_CPP_LOG_LEVEL`` is read once, when torch is
imported, which a user's script (and psserver's own CLI) has done before psserver can set it;
c10 exports the threshold itself, so it is raised there.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

log = logging.getLogger(__name__)

CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"
ERROR = 2
"""c10's severities: INFO 0, WARNING 1, ERROR 2, FATAL 3."""


def quiet_cpp_warnings() -> None:
    """C++ errors only, unless the user chose a level with ``$TORCH_CPP_LOG_LEVEL``; idempotent."""
    if os.environ.get(CPP_LOG_ENV, "").strip():
        return
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        level = ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError) as e:  # another build of torch: its warnings stay
        log.debug("cannot set the C++ log level (%s)", e)
        return
    level.value = max(level.value, ERROR)
