"""The server's host allocator policy: freed buffers come back without page faults."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys
import textwrap
import weakref

import pytest

from psserver.config import ServerConfig
from psserver.utils.memory import available_memory, configure_host_allocator, freeze_long_lived


def _is_glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
        return True
    except AttributeError:
        return False


# A fresh process per policy (mallopt changes are process-wide): malloc, fill and free a
# 16 MiB buffer, then count the minor faults of doing it again.
_PROBE = textwrap.dedent("""
    import ctypes, resource, sys
    from psserver.utils.memory import configure_host_allocator
    applied = configure_host_allocator(sys.argv[1])
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    n = 16 << 20
    def cycle():
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        libc.free(p)
    cycle()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cycle()
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _probe(policy: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, policy], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not _is_glibc(), reason="the cached policy uses glibc's mallopt")
def test_cached_policy_reuses_freed_pages():
    applied, faults = _probe("cached")
    assert applied == "True"
    assert faults < 64, f"{faults} minor faults re-filling a freed 16 MiB buffer"
    applied, system_faults = _probe("system")
    assert applied == "False"
    # glibc's default hands the first large buffer back to the kernel: 4096 pages fault in again.
    assert system_faults > 1000


def test_system_policy_changes_nothing_and_bad_names_are_refused():
    assert configure_host_allocator("system") is False
    with pytest.raises(ValueError, match="allocator must be one of"):
        configure_host_allocator("jemalloc")
    with pytest.raises(ValueError, match="--allocator must be one of cached, system"):
        ServerConfig(allocator="tcmalloc")


def test_freeze_long_lived_exempts_existing_objects_and_still_collects_new_cycles():
    gc.unfreeze()
    try:
        marker = [object() for _ in range(10)]  # a tracked container, alive across the freeze
        assert any(o is marker for o in gc.get_objects())
        frozen = freeze_long_lived()
        # A frozen object that another thread frees meanwhile (xdist's, in a worker) leaves the count.
        assert 0 < gc.get_freeze_count() <= frozen
        assert not any(o is marker for o in gc.get_objects())  # no collection scans it any more

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle created after the freeze
        collected = []
        weakref.finalize(a, collected.append, "a")
        del a, b
        gc.collect()
        assert collected == ["a"]
    finally:
        gc.unfreeze()


def test_available_memory_is_capped_by_the_cgroup_limit(tmp_path):
    """A container's limit, not the host's free memory, is what the process may still take."""
    import psutil

    own = tmp_path / "cgroup"
    own.write_text("4:memory:/v1job\n0::/job\n")
    assert 0 < available_memory(tmp_path, own) <= psutil.virtual_memory().total  # no limit files: the host's
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "memory.max").write_text("max\n")
    (tmp_path / "job" / "memory.current").write_text("1000\n")
    assert available_memory(tmp_path, own) > 2**20  # v2 without a limit
    (tmp_path / "job" / "memory.max").write_text(f"{2**20 + 1000}\n")
    assert available_memory(tmp_path, own) == 2**20
    (tmp_path / "memory" / "v1job").mkdir(parents=True)
    (tmp_path / "memory" / "v1job" / "memory.limit_in_bytes").write_text(f"{2**19}\n")
    (tmp_path / "memory" / "v1job" / "memory.usage_in_bytes").write_text("0\n")
    assert available_memory(tmp_path, own) == 2**19  # the smaller of the two
