"""Memory policies of long-running processes: the host allocator and Python's collector; and
how much memory this process may still take.

Allocator: keep freed memory for the next step.

Why: glibc serves each step's large, short-lived activation and gradient buffers with
``mmap`` or trims them off the heap, and gives them back to the kernel on ``free``; the next
step then page-faults and zero-fills them again. On the 2-core machine the server of
``mnist_cnn`` at batch 64 took ~50k minor faults/s that way, a quarter of its step time;
RPC and autograd threads also get arenas of their own that trim eagerly. One arena, a high
mmap threshold and a high trim threshold make every step reuse the pages of the last one,
which is what the CUDA caching allocator does for device memory. The cost is a resident set
that stays at its peak (bounded by ``trim_threshold`` of idle memory above it).

Collector: a server process holds ~330k long-lived Python objects (torch, the model, the RPC
layer) and every RPC allocates more, so CPython's full collections rescanned all of them:
~2 per 15 s of training, up to 120 ms each with the GIL held, stalling every trainer at once.
``freeze_long_lived`` moves what exists after start-up out of the collector's reach.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

# mallopt(3) parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

ALLOCATORS = ("cached", "system")


def configure_host_allocator(policy: str) -> bool:
    """Apply ``policy`` to this process; True if the cached policy is now in effect.

    ``system`` leaves the C library's defaults. ``cached`` needs glibc: elsewhere (musl,
    macOS) it logs and changes nothing. Call it before the RPC agent starts its threads,
    so they share the one arena.
    """
    if policy not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {policy!r}")
    if policy == "system":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018  (present in glibc only)
    except (OSError, AttributeError):
        log.info("host allocator: not glibc, keeping the C library's defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                (_M_TOP_PAD, TOP_PAD))
    failed = [param for param, value in settings if mallopt(param, value) != 1]
    if failed:
        log.warning("host allocator: mallopt refused parameters %s; freed memory may return to the kernel", failed)
        return False
    log.debug("host allocator: cached (one arena, mmap threshold %d MiB, trim above %d MiB)",
              MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return True


def freeze_long_lived() -> int:
    """Collect once, then exempt every surviving object from future collections.

    Call it when start-up is over (model built, RPC group joined): later cycles are still
    collected, and full collections only scan objects created since. Returns the number frozen.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d long-lived objects out of the cyclic collector", frozen)
    return frozen


CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_memory(cgroup_root: Path = CGROUP_ROOT, own_cgroups: Path = Path("/proc/self/cgroup")) -> int:
    """Bytes this process may still allocate: the host's available memory, capped by what its
    cgroup's limit leaves (v2 ``memory.max`` less ``memory.current``, v1 ``memory.limit_in_bytes``
    less ``memory.usage_in_bytes``: a container's ``--memory``, a pod's limit), where the host's
    figure would promise memory that the OOM killer then takes back."""
    available = int(psutil.virtual_memory().available)
    try:
        lines = own_cgroups.read_text().splitlines()
    except OSError:
        return available
    for line in lines:
        _, controllers, rel = line.split(":", 2) if line.count(":") >= 2 else ("", "-", "")
        if controllers == "":
            directory, files = cgroup_root / rel.lstrip("/"), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            directory, files = cgroup_root / "memory" / rel.lstrip("/"), ("memory.limit_in_bytes",
                                                                          "memory.usage_in_bytes")
        else:
            continue
        try:
            limit = (directory / files[0]).read_text().strip()
            if limit != "max":
                available = min(available, max(0, int(limit) - int((directory / files[1]).read_text().strip())))
        except (OSError, ValueError):
            continue  # no limit there, or none this process can read
    return available
