"""How many CPUs this process may use, and a trainer's share of them.

``os.cpu_count()`` is the host's; a process may be bound to fewer (affinity: ``taskset``,
Slurm's ``--cpus-per-task``, Kubernetes' static CPU manager) or throttled to fewer (a cgroup
quota: a container's ``--cpus``, a pod's CPU limit). A trainer computes on its share of what it
may use: those CPUs divided among the trainers the server knows on the same host.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on (affinity), capped by its cgroup's quota (v2 ``cpu.max``,
    or v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``), rounded up; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def cgroup_quota(cgroup_root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of this process's cgroup quota (None: no quota, or none can be read)."""
    for path in _own_cgroup_dirs(cgroup_root):
        v2 = path / "cpu.max"
        try:
            if v2.is_file():
                quota, _, period = v2.read_text().strip().partition(" ")
                if quota != "max" and float(period or 100000) > 0:
                    return float(quota) / float(period or 100000)
                continue
            v1_quota, v1_period = path / "cpu.cfs_quota_us", path / "cpu.cfs_period_us"
            if v1_quota.is_file() and v1_period.is_file():
                quota_us, period_us = int(v1_quota.read_text()), int(v1_period.read_text())
                if quota_us > 0 and period_us > 0:
                    return quota_us / period_us
        except (OSError, ValueError):
            log.debug("unreadable cgroup CPU quota under %s", path, exc_info=True)
    return None


def _own_cgroup_dirs(root: Path) -> list[Path]:
    """This process's cgroup directory (v2 unified, or v1's cpu controller), then the root."""
    dirs = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            if controllers == "":
                dirs.append(root / rel.lstrip("/"))
            elif "cpu" in controllers.split(","):
                dirs += [root / controllers / rel.lstrip("/"), root / "cpu,cpuacct" / rel.lstrip("/")]
    except (OSError, ValueError):
        pass
    return [*dirs, root]


def share(cpus: int, trainers_on_host: int) -> int:
    """A trainer's threads: its equal share of ``cpus`` (at least 1)."""
    return max(1, cpus // max(1, trainers_on_host))
