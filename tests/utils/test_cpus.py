"""A trainer's share of the CPUs it may use: affinity, cgroup quotas, trainers on the host."""

from __future__ import annotations

import os

import pytest

from psserver.utils import cpus


def fake_cgroup(tmp_path, monkeypatch, files: dict[str, str], proc_line: str = "0::/job") -> None:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    real = cpus.Path

    class FakePath(type(real())):  # /proc/self/cgroup of a process in cgroup /job
        def read_text(self, *a, **kw):
            if str(self) == "/proc/self/cgroup":
                return proc_line + "\n"
            return super().read_text(*a, **kw)

    monkeypatch.setattr(cpus, "Path", FakePath)


@pytest.mark.parametrize(("files", "proc_line", "quota"), [
    ({"job/cpu.max": "150000 100000\n"}, "0::/job", 1.5),
    ({"job/cpu.max": "max 100000\n"}, "0::/job", None),
    ({"cpu.max": "300000 100000\n"}, "0::/elsewhere", 3.0),
    ({"cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"},
     "4:cpu,cpuacct:/job", 0.5),
    ({"cpu,cpuacct/job/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"},
     "4:cpu,cpuacct:/job", None),
    ({"job/cpu.max": "garbage\n"}, "0::/job", None),
    ({}, "0::/job", None),
])
def test_quotas_of_cgroup_v1_and_v2(tmp_path, monkeypatch, files, proc_line, quota):
    fake_cgroup(tmp_path, monkeypatch, files, proc_line)
    assert cpus.cgroup_quota(tmp_path) == quota


def test_usable_cpus_is_the_smaller_of_affinity_and_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    fake_cgroup(tmp_path, monkeypatch, {"job/cpu.max": "150000 100000\n"})
    assert cpus.usable_cpus(tmp_path) == 2  # 1.5 CPUs of quota: two threads keep it busy
    fake_cgroup(tmp_path, monkeypatch, {"job/cpu.max": "max 100000\n"})
    assert cpus.usable_cpus(tmp_path) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert cpus.usable_cpus(tmp_path) == 1


@pytest.mark.parametrize(("n", "trainers", "want"), [(16, 1, 16), (16, 3, 5), (2, 2, 1), (2, 5, 1), (8, 0, 8)])
def test_share(n, trainers, want):
    assert cpus.share(n, trainers) == want
