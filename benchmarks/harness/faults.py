"""Faults injected into a benchmark's run from outside, as an operator or the machine would
cause them: a trainer SIGKILLed and started again by hand, the server process SIGKILLed under
its supervisor; and what the server says it applied through them (its status), with what the
logs say of the faults. The product reads nothing of this: the processes are killed by PID.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import measure, multihost

log = logging.getLogger(__name__)


def inject_faults(at: tuple[float, float], procs: list, children: measure.Children,
                  trainer_argv: Callable[[int, Path], list[str]], work: Path, start: float) -> dict:
    """At ``at`` seconds after ``start``: SIGKILL trainer 1 (mid-window: its steps since its last sync
    die with it) and start it again by hand, as an operator would; then SIGKILL the server
    process (not its supervisor, which starts it again from its state in memory; the trainers
    rejoin, ``--reconnect``). What was done, and when."""
    kill_trainer, kill_server = at
    done: dict = {}
    time.sleep(max(0.0, start + kill_trainer - time.time()))
    os.killpg(procs[1].pid, signal.SIGKILL)
    procs[1].wait(30)
    done["trainer_killed_s"] = time.time() - start
    procs[1] = children.start(trainer_argv(1, work / "trainer1-again.json"), "trainer1-again", {"OMP_NUM_THREADS": "1"})
    time.sleep(max(0.0, start + kill_server - time.time()))
    server = serving_child(children.items[0].pid)
    os.kill(server, signal.SIGKILL)
    done["server_killed_s"] = time.time() - start
    log.info("faults: trainer 1 SIGKILLed at %.0fs and started again; the server process %d SIGKILLed at %.0fs",
             done["trainer_killed_s"], server, done["server_killed_s"])
    return done


def serving_child(supervisor: int) -> int:
    """The server process under ``supervisor`` (not its standby spare)."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if not any(v.startswith(b"PSSERVER_STANDBY=") for v in environ):
            return int(pid)
    raise RuntimeError(f"no serving process under the supervisor {supervisor} (children {children})")


def fault_counts(topo: multihost.Topology, server: measure.Child, procs: list, control_port: int) -> dict:
    """What the server applied (its status: outer steps, samples, each trainer's windows) and
    what the logs say of the faults: the state the restarted process found, windows sent again
    and not applied again, trainers that rejoined."""
    done = subprocess.run(topo.wrap(0, measure.psserver_argv("--log-level", "ERROR", "status", "--address",
                                                            f"127.0.0.1:{control_port}", "--json")),
                          capture_output=True, text=True, timeout=60, env=measure.child_env())
    if done.returncode != 0:
        raise RuntimeError(f"psserver status: {done.stderr.strip()}")
    report = json.loads(done.stdout)
    text = server.output()
    found = re.search(r"found the state of run \S+ in memory: .*?global step (\d+)", text)
    return {"outer_steps": report["status"]["global_step"], "samples_seen": report["status"]["samples_seen"],
            "windows": {t["name"]: t["updates"] for t in report["trainers"]},
            "restarted_at_step": int(found.group(1)) if found else None,
            "sent_again_not_applied": len(re.findall(r"sent the gradient of its step \d+ again", text)),
            "sent_again": sum(p.output().count("diloco: sent again the window") for p in procs),
            "rejoined": sum(p.output().count("reconnected as") for p in procs)}
