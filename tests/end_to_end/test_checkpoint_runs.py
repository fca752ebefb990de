"""Checkpoints belong to a run: real ``psserver serve`` processes sharing a directory with
other runs, with corrupt files, a read-only or full directory, a crafted file, and a killed
writer's temporary file.

The read-only and full directories are tmpfs mounts made by the test (root only; skipped
with the reason where mounting is not possible), always unmounted after it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from psserver.checkpoint import (
    checkpoint_path,
    list_checkpoints,
    read_checkpoint,
    read_header,
    write_checkpoint,
)
from psserver.cli import main
from psserver.config import OptimizerConfig, ServerConfig
from psserver.server.server import ParameterServer
from tests.procs import cli, die_mid_checkpoint, free_port

OLD_RUN = "0ld" + "0" * 29
SERVE = ["--model", "mlp", "--compute-threads", "1"]


class WritesAMarker:
    """A pickle payload that, loaded without ``weights_only``, runs code: it writes ``marker``."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def digest(paths) -> dict[str, str]:
    return {Path(p).name: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


def mlp_state(step: int) -> dict:
    """A real mlp checkpoint's state (what ``CheckpointPolicy.snapshot`` stores) at ``step``."""
    server = ParameterServer(ServerConfig(model="mlp", devices=["cpu"]))
    try:
        state = server.policy.snapshot()
    finally:
        server.engine.close()
    state["global_step"] = step
    return state


def write_old_run(directory: Path, steps) -> list[Path]:
    state = mlp_state(0)
    paths = []
    for step in steps:
        state["global_step"] = step
        paths.append(checkpoint_path(directory, step))
        write_checkpoint(paths[-1], state, run=OLD_RUN)
    return paths


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def serve_once(*args: str) -> subprocess.CompletedProcess:
    """``psserver serve`` expected to refuse at start (it never serves), in this process: a
    refusal needs no child that spends seconds importing torch."""
    return cli(["serve", "--port", str(free_port()), "--no-control", *SERVE, *args])


@pytest.fixture
def tmpfs(tmp_path, procs):
    """``mount(name, options)``: a tmpfs at ``tmp_path/name``; every process of the test is
    killed and every mount undone after the test."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        if shutil.which("mount") is None:
            pytest.skip("no mount command here: the test needs a tmpfs of its own")
        path = tmp_path / name
        path.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {r.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    procs.kill_all()  # nothing may keep a mount busy
    for path in mounted:
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


# ---- in-process: configuration and what a checkpoint holds ----------------------------------------


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--new-run", "--resume"], "--new-run starts a new run, --resume continues one"),
        (["--new-run"], "--new-run needs --checkpoint-dir"),
    ],
    ids=["with-resume", "without-dir"],
)
def test_new_run_flag_is_checked(tmp_path, capsys, argv, fragment):
    dirs = ["--checkpoint-dir", str(tmp_path)] if "--resume" in argv else []
    assert main(["serve", "--no-control", *SERVE, *dirs, *argv]) == 2
    assert fragment in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "adagrad", "rmsprop"])
def test_a_trained_servers_checkpoint_loads_with_weights_only(tmp_path, optimizer):
    """Everything ``snapshot()`` stores after an optimizer step (optimizer state included)
    loads with ``torch.load(weights_only=True)`` and restores the same parameters."""
    momentum = 0.5 if optimizer in ("sgd", "rmsprop") else 0.0  # the others take none
    config = ServerConfig(model="mlp", devices=["cpu"], optimizer=OptimizerConfig(name=optimizer, momentum=momentum))
    server = ParameterServer(config)
    try:
        engine, half = server.engine, server.halves["chained"]
        engine.trainer_joined("t")
        x, y = torch.randn(4, *engine.spec.input_shape), torch.randint(0, 10, (4,))
        out = half.step("t", None, x).requires_grad_(True)
        (grad,) = torch.autograd.grad(torch.nn.functional.cross_entropy(out, y), (out,))
        half.step("t", grad, x)
        assert engine.global_step == 1
        snap = server.policy.snapshot()
        path = checkpoint_path(tmp_path, 1)
        write_checkpoint(path, snap, run="r")
    finally:
        server.engine.close()
    loaded = read_checkpoint(path)
    assert loaded["global_step"] == 1 and loaded["shards"][0]["optimizer"]["state"]
    for a, b in zip(snap["shards"][0]["module"].values(), loaded["shards"][0]["module"].values(), strict=True):
        assert torch.equal(a, b)


# ---- real processes ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_another_runs_checkpoints_refuse_a_fresh_start_and_survive_a_new_run(procs, port, tmp_path):
    old = write_old_run(tmp_path, (500, 600))
    before = digest(old)
    # A fresh start beside them: refused, one line, nothing touched.
    r = serve_once("--checkpoint-dir", str(tmp_path))
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert "holds checkpoints of another run" in line and "--resume" in line and "--new-run" in line
    assert digest(list_checkpoints(tmp_path)) == before
    # --new-run: a run of its own beside them, pruned to its own newest 2.
    server = procs.server(port, *SERVE, "--checkpoint-dir", str(tmp_path), "--new-run", "--checkpoint-every", "5",
                          "--keep-checkpoints", "2")
    run_id = re.search(r"checkpoints of run ([0-9a-f]{32}) go to", server.output()).group(1)
    t = procs.trainer(port, 0, "--max-steps", "20")
    assert t.wait(120) == 0, t.tail()
    assert procs.stop(server) == 0, server.tail()
    assert "checkpoint step 20 written" in server.output()
    assert digest(old) == before  # the old run's files, untouched
    mine = [p for p in list_checkpoints(tmp_path) if p not in old]
    assert [p.name for p in mine] == ["ckpt-000000000020.pt", "ckpt-000000000015.pt"], server.tail()
    assert {read_header(p).run for p in mine} == {run_id} != {OLD_RUN}
    # A later --resume continues the run written last, not the one with the highest steps.
    again = procs.server(port, *SERVE, "--checkpoint-dir", str(tmp_path), "--resume")
    assert re.search(r"resumed from \S+ckpt-000000000020\.pt: global step 20", again.output()), again.tail()
    assert f"continuing run {run_id}" in again.output()
    assert procs.stop(again) == 0
    assert digest(old) == before


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_resume_with_only_corrupt_files_starts_a_new_run_that_keeps_its_checkpoint(procs, port, tmp_path):
    old = write_old_run(tmp_path, (500, 600, 700))
    data = bytearray(old[0].read_bytes())
    data[-100] ^= 0xFF
    old[0].write_bytes(bytes(data))  # payload corrupt, header intact
    old[1].write_bytes(old[1].read_bytes()[:5000])  # truncated
    old[2].write_bytes(b"garbage\n" + old[2].read_bytes()[:100])  # no header
    before = digest(old)
    server = procs.server(port, *SERVE, "--checkpoint-dir", str(tmp_path), "--resume", "--checkpoint-every", "5",
                          "--keep-checkpoints", "1")
    assert "--resume: no valid checkpoint" in server.output() and "starting a new run" in server.output()
    t = procs.trainer(port, 0, "--max-steps", "10")
    assert t.wait(120) == 0, t.tail()
    assert procs.stop(server) == 0, server.tail()
    assert digest(old) == before  # another run's invalid files are not this run's to delete
    new = checkpoint_path(tmp_path, 10)
    assert new.is_file(), server.tail()  # written, and not pruned for older runs' higher steps
    assert read_checkpoint(new)["global_step"] == 10
    assert [p.name for p in list_checkpoints(tmp_path) if p not in old] == [new.name]
    again = procs.server(port, *SERVE, "--checkpoint-dir", str(tmp_path), "--resume")
    assert re.search(r"resumed from \S+ckpt-000000000010\.pt: global step 10", again.output()), again.tail()
    assert procs.stop(again) == 0


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_read_only_checkpoint_dir_is_refused_at_start(tmpfs, tmp_path):
    ro = tmpfs("ro", "ro,size=1m")
    r = serve_once("--checkpoint-dir", str(ro))
    assert r.returncode == 2, r.stderr
    assert f"--checkpoint-dir {ro} is not writable: Read-only file system" in one_line(r.stderr)
    (tmp_path / "file").write_text("x")
    r = serve_once("--checkpoint-dir", str(tmp_path / "file" / "sub"))
    assert r.returncode == 2 and "cannot be created: Not a directory" in one_line(r.stderr)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_full_checkpoint_dir_fails_the_final_checkpoint_and_the_exit_code(procs, port, tmpfs):
    """The probe fits a 64 KiB tmpfs, a 2 MB mlp checkpoint does not: SIGTERM after 3 steps
    exits 1 with one clear ERROR line, and the partial file is gone."""
    full = tmpfs("full", "size=64k")
    server = procs.server(port, *SERVE, "--checkpoint-dir", str(full))
    t = procs.trainer(port, 0, "--max-steps", "3")
    assert t.wait(120) == 0, t.tail()
    assert procs.stop(server) == 1, server.tail()
    errors = [x for x in server.output().splitlines() if " ERROR " in x]
    assert len(errors) == 1, server.tail()
    assert re.search(r"final checkpoint failed: .*No space left on device — the last 3 step\(s\) are not saved "
                     r"\(this run has no checkpoint\)", errors[0]), errors
    assert "psserver stopped at global step 3" in server.output()  # the other shutdown steps ran
    assert "Traceback" not in server.output()
    assert list(full.iterdir()) == []  # no temporary file left behind


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["latest", "path"])
def test_crafted_checkpoint_is_refused_and_never_run(tmp_path, how):
    marker = tmp_path / "marker"
    ckdir = tmp_path / "ck"
    write_old_run(ckdir, (5,))
    crafted = checkpoint_path(ckdir, 9)
    write_checkpoint(crafted, {**mlp_state(9), "rng": WritesAMarker(marker)}, run=OLD_RUN)
    resume = ["--resume"] if how == "latest" else ["--resume", str(crafted)]
    r = serve_once("--checkpoint-dir", str(ckdir), *resume)
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert f"refusing {crafted}: its payload would load exec, which a psserver checkpoint never holds" in line
    assert not marker.exists()
    assert crafted.is_file()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_temporary_files_of_a_killed_writer_are_removed_at_start(procs, port, tmp_path):
    dying = procs.server(port, *SERVE, "--checkpoint-dir", str(tmp_path),
                         env=die_mid_checkpoint(4096))
    t = procs.trainer(port, 0, "--max-steps", "2")
    assert t.wait(120) == 0, t.tail()
    dying.signal(signal.SIGTERM)
    assert dying.wait(60) == 17, dying.tail()  # killed half-way through the final checkpoint
    left = [p.name for p in tmp_path.iterdir()]
    assert left == [f".ckpt-000000000002.pt.tmp-{dying.pid}"], left
    live = tmp_path / f".ckpt-000000000001.pt.tmp-{os.getpid()}"  # a writer that still runs: left alone
    live.write_bytes(b"partial")
    server = procs.server(port, *SERVE, "--checkpoint-dir", str(tmp_path))
    assert f"removed 1 temporary file(s) of interrupted checkpoint writes in {tmp_path}" in server.output()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]
    assert procs.stop(server) == 0
