"""``psserver demo``: a server and two trainers on generated data, in one command.

The processes are the real ones (``psserver serve`` and ``psserver train``), started as
children on a free loopback port, their logs interleaved with a prefix; the demo ends with
each trainer's accuracy and stops the server.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

from psserver.cli.base import SubCommand, config_errors
from psserver.cli.builder import add_options, build
from psserver.config.common import DataConfig
from psserver.config.protocols import COMPUTE_MODES
from psserver.config.server import ServerConfig
from psserver.errors import UsageError
from psserver.utils.ports import free_port

log = logging.getLogger(__name__)

MAX_TRAINERS = 16
"""The most trainers ``demo`` starts: each is a whole ``psserver train`` process on this host
(100000 were spawned); a larger job is ``serve`` and ``train`` run as such."""
DEMO_MODEL = "mnist_cnn"
DEMO_TRAINERS = 2
DEMO_EPOCHS = 2
"""The demo's own defaults: a small job that shows learning in a minute (not a trainer's)."""
DEMO_DATA = ("dataset", "data_dir", "train_split")
"""The data flags the demo takes, each ``DataConfig``'s (``psserver.cli.builder``)."""


def _pump(proc: subprocess.Popen, prefix: str, lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        sys.stderr.write(f"{prefix:>10} | {line}")


class DemoCommand(SubCommand):
    name = "demo"
    help = "run a server and two trainers on generated data (no download) and print their accuracy"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default=DEMO_MODEL, help=f"model (default {DEMO_MODEL})")
        parser.add_argument("--trainers", type=int, default=DEMO_TRAINERS,
                            help=f"number of trainers (default {DEMO_TRAINERS}, at most {MAX_TRAINERS})")
        parser.add_argument("--epochs", type=int, default=DEMO_EPOCHS,
                            help=f"epochs per trainer (default {DEMO_EPOCHS})")
        add_options(parser, ServerConfig, only=("update",))
        compute = next(iter(COMPUTE_MODES))
        parser.add_argument("--compute", choices=list(COMPUTE_MODES), default=compute,
                            help=f"where the trainers' steps run (default {compute}: each trainer runs the model)")
        add_options(parser, DataConfig, "data", "passed on to every trainer", only=DEMO_DATA)

    def run(self, args: argparse.Namespace) -> int:
        if not 1 <= args.trainers <= MAX_TRAINERS:
            raise UsageError(f"--trainers must be in 1..{MAX_TRAINERS} (each is a process on this host), "
                             f"got {args.trainers}")
        from psserver.config.trainer import TrainerConfig
        from psserver.models import check_model_name

        with config_errors():  # before any process starts: the trainers' flags as they will see them
            check_model_name(args.model)
            TrainerConfig(rank=0, num_trainers=args.trainers, epochs=args.epochs, compute=args.compute,
                          data=build(DataConfig, args), progress=False)
        port = free_port()
        exe = [sys.executable, "-m", "psserver"]
        # A join token of the demo's own, as a real job has one (psserver.common.rendezvous.namespace).
        env = dict(os.environ, PYTHONUNBUFFERED="1", PSSERVER_JOIN_TOKEN=secrets.token_hex(16))
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        serve = [*exe, "serve", "--port", str(port), "--model", args.model, "--no-control", "--update", args.update,
                 "--sync-trainers", str(args.trainers)]
        data = ["--dataset", args.dataset]
        if args.data_dir is not None:
            data += ["--data-dir", str(args.data_dir)]
        if args.train_split is not None:
            data += ["--train-split", str(args.train_split)]
        procs: list[subprocess.Popen] = []
        outputs: list[list[str]] = []
        pumps: list[threading.Thread] = []

        def start(cmd: list[str], prefix: str) -> subprocess.Popen:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                 stdin=subprocess.DEVNULL)
            lines: list[str] = []
            t = threading.Thread(target=_pump, args=(p, prefix, lines), daemon=True)
            t.start()
            procs.append(p)
            outputs.append(lines)
            pumps.append(t)
            return p

        log.info("demo: server on 127.0.0.1:%d, %d trainers (--compute %s), model %s, %s data", port, args.trainers,
                 args.compute, args.model, args.dataset)
        server = start(serve, "server")
        try:
            deadline = time.monotonic() + 120
            while not any("serving" in line for line in outputs[0]):
                if server.poll() is not None or time.monotonic() > deadline:
                    said = next((line for line in reversed(outputs[0]) if "error: " in line), None)
                    if server.returncode == 2 and said:  # the demo's flags it passed on: the server's words
                        raise UsageError(said.split("error: ", 1)[1])
                    log.error("demo: the server did not start (%s); see its log above",
                              "still starting after 120 s" if server.returncode is None
                              else f"exit code {server.returncode}")
                    return 1
                time.sleep(0.1)
            trainers = [
                start([*exe, "train", "--server", f"127.0.0.1:{port}", "--rank", str(r), "--num-trainers",
                       str(args.trainers), "--epochs", str(args.epochs), "--compute", args.compute, "--no-progress",
                       *data], f"trainer {r}")
                for r in range(args.trainers)
            ]
            codes = [t.wait() for t in trainers]
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for t in pumps:
                t.join(5)
        results = []
        for r, lines in enumerate(outputs[1:]):
            m = next((re.search(r"accuracy ([0-9.]+)", line) for line in lines
                      if line.startswith(f"rank {r} accuracy")), None)
            results.append(m.group(1) if m else "failed")
        print("demo finished: " + ", ".join(f"trainer {r} accuracy {a}" for r, a in enumerate(results)))
        return 0 if all(c == 0 for c in codes) else 1
