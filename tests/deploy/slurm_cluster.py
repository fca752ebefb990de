"""A real Slurm cluster on this machine for the deploy tests: ``munged``, ``slurmctld`` and one
``slurmd`` per node, all under one temporary directory.

Debian's Slurm is built with multiple-slurmd: every node is a ``slurmd -N NAME`` on this host
with its own ``Port`` and its own loopback ``NodeAddr`` (127.0.0.2, .3, ...), so that two
processes of one job on different nodes can bind the same port, as on a real cluster. The
node names (``n0``...) resolve nowhere: the scripts find each node's address with
``scontrol show node``. No cgroups, no systemd: ``proctrack/linuxproc``, ``task/none``.

It never touches ``/etc/slurm`` or a running ``munged``: its own key and socket
(``AuthInfo=socket=``), its own ports, and clients find it through ``SLURM_CONF``. ``stop()``
cancels every job and stops every daemon it started, by PID.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.procs import free_port

SUBREAPER = Path(__file__).with_name("subreaper.py")
MUNGE_ROUTINE = re.compile(r"Unauthorized credential for client|Replayed credential from")
"""What munged logs when a second daemon of this one host decodes a credential (every job here
does it, and runs): noise in a failed test's report."""
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "squeue", "scontrol", "scancel")


def missing() -> str | None:
    """Why no cluster can start here (None: it can)."""
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if absent:
        return f"Slurm is not installed (no {', '.join(absent)}; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a Slurm cluster on one machine needs root (slurmd runs the jobs' steps as their users)"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """``nodes`` single-slurmd nodes ``n0``..; ``cpus`` each (claimed, not checked: the scripts'
    ``--cpus-per-task`` fits as it is)."""

    def __init__(self, root: Path, nodes: int = 4, cpus: int = 32) -> None:
        self.root = Path(root)
        self.names = [f"n{i}" for i in range(nodes)]
        self.addrs = {name: f"127.0.0.{i + 2}" for i, name in enumerate(self.names)}
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.logs = self.root / "log"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # -- starting -----------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> None:
        for d in ("log", "state", "munge", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        self._start_munged()
        self._write_conf()
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for name in self.names:
            (self.root / "spool" / name).mkdir(parents=True, exist_ok=True)
            self._spawn(f"slurmd-{name}", [_binary("slurmd"), "-D", "-N", name, "-f", str(self.conf)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            if len(states) == len(self.names) and all(s.startswith("idle") for s in states.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm nodes are not idle after {timeout}s:\n{self.daemon_logs()}")

    def _start_munged(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._spawn("munged", [
            _binary("munged"), "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.root / 'munge' / 'munged.pid'}", f"--seed-file={self.root / 'munge' / 'seed'}",
            f"--log-file={self.logs / 'munged.log'}",
        ])
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged made no socket:\n{self.daemon_logs()}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        host = socket.gethostname()
        r = self.root
        lines = [
            "ClusterName=pstest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
            f"SlurmdLogFile={self.logs / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "KillWait=30",
            "MinJobAge=300",
            "InactiveLimit=0",
            "Waittime=0",
        ]
        for name in self.names:
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr={self.addrs[name]} Port={free_port()} "
                         f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.logs / f"{name}.stdout", "w")
        self.procs[name] = subprocess.Popen([sys.executable, str(SUBREAPER), *cmd], stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                            cwd=self.root, start_new_session=True)
        out.close()

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.daemon_logs()}")

    # -- using it -----------------------------------------------------------------------------

    def run(self, cmd: list[str], *, check: bool = True, env: dict[str, str] | None = None,
            cwd: Path | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, squeue, scontrol...) against this cluster."""
        r = subprocess.run(cmd, env={**self.env, **(env or {}), "SLURM_CONF": str(self.conf)}, cwd=cwd,
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited with {r.returncode}:\n"
                                 f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
        return r

    def sbatch(self, script: Path, *options: str, env: dict[str, str], cwd: Path) -> int:
        """Submits ``script`` with ``env`` as the job's environment (``--export=ALL``); its job id."""
        r = self.run(["sbatch", "--parsable", *options, str(script)], env=env, cwd=cwd)
        return int(r.stdout.strip().split(";")[0])

    def state(self, job: int) -> tuple[str, str]:
        """(JobState, ExitCode) as ``scontrol show job`` says."""
        out = self.run(["scontrol", "-o", "show", "job", str(job)]).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "?"), fields.get("ExitCode", "?")

    def wait(self, job: int, timeout: float, states: tuple[str, ...] = ()) -> tuple[str, str]:
        """Waits until the job has ended (or reached one of ``states``); fails after ``timeout``."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                 "BOOT_FAIL", "DEADLINE")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            st = self.state(job)
            if st[0] in ended or st[0] in states:
                return st
            time.sleep(0.5)
        self.run(["scancel", str(job)], check=False)
        raise AssertionError(f"job {job} still {self.state(job)[0]} after {timeout}s")

    def daemon_logs(self, n: int = 1500) -> str:
        parts = []
        for log in sorted(self.logs.glob("*")):
            if log.suffix == ".stdout" and log.with_suffix(".log").exists():
                continue  # the same lines
            text = "\n".join(line for line in log.read_text(errors="replace").splitlines()
                              if not MUNGE_ROUTINE.search(line))
            if text.strip():
                parts.append(f"--- {log.name} (tail) ---\n{text[-n:]}")
        return "\n".join(parts)

    # -- stopping -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancels every job (waits up to 20 s for them to end), then SIGTERM to each daemon it
        started: its subreaper ends whatever slurmstepd or task is left under it (SIGTERM, SIGKILL
        after 10 s); SIGKILL to each daemon's session after 20 s more."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:
                self.run(["scancel", "--user=root"], check=False, timeout=10)  # missing(): root
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    r = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
                    if r.returncode != 0 or not r.stdout.strip():
                        break
                    time.sleep(0.5)
            except subprocess.TimeoutExpired:
                pass
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is None:
                continue
            self._signal_session(p, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                pass
            self._signal_session(p, signal.SIGKILL)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    @staticmethod
    def _signal_session(p: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
