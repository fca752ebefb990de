"""A ``--mode ps`` trainer under a real torchrun, no psserver named: torchrun's MASTER_PORT is
its own rendezvous store, so the trainer ends at once saying so instead of connecting to that
store and waiting its whole connect timeout for a psserver that never registers there."""

from __future__ import annotations

import sys
import time

import pytest

from tests.procs import run

MESSAGE = ("under torchrun, $MASTER_ADDR:$MASTER_PORT is torchrun's own rendezvous, not a psserver: "
           "name the psserver with {option} or $PSSERVER_SERVER")
SCRIPT = "import psserver\n\nwith psserver.connect() as ps:\n    print('joined', ps)\n"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["cli", "library"])
def test_a_trainer_under_torchrun_without_a_server_ends_at_once(port, tmp_path, how):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--nnodes", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0"]
    if how == "cli":  # a connect timeout well past run()'s: waiting for torchrun's store fails the test
        argv, option = ["-m", "psserver", "train", "--no-progress", "--connect-timeout", "300"], "--server HOST:PORT"
    else:  # connect()'s default connect_timeout (60 s) is past run()'s too
        script = tmp_path / "train.py"
        script.write_text(SCRIPT)
        argv, option = [str(script)], "psserver.connect('HOST:PORT')"
    start = time.monotonic()
    proc = run(argv, prefix=torchrun, timeout=50, env={"TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout
    assert "joined" not in proc.stdout
    assert MESSAGE.format(option=option) in proc.stderr, proc.stderr[-3000:]
    if how == "cli":
        assert f"psserver train: error: {MESSAGE.format(option=option)}" in proc.stderr.splitlines()
    else:
        assert f"psserver.errors.UsageError: psserver.connect: {MESSAGE.format(option=option)}" in proc.stderr
    assert elapsed < 40, f"{elapsed:.1f}s"
