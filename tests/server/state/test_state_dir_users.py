"""Another local user cannot take over the state in memory, end to end: a real second user,
created and removed here, makes the state directory first and plants a state, links to files
outside and a link to a tree to be deleted; ``psserver serve --supervise`` (as root) refuses the
directory in one line, and no file outside it is written or deleted. A directory the server made
is closed to that user."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from psserver.config import MemoryStateConfig
from psserver.config.ps import DEFAULT_STATE_DIR
from psserver.server.state.memory import MemoryState
from tests.procs import run

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("userdel") is None,
                                reason="needs root and useradd/userdel to create a second local user")


@pytest.fixture
def stranger() -> Iterator[str]:
    """A local user of its own, removed after the test."""
    name = f"pst{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name], check=True,
                   capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


def as_user(user: str, script: str, *args: str) -> subprocess.CompletedProcess:
    """``sh -c script args`` run as ``user`` (the system's shell: root's Python may be out of its reach)."""
    return subprocess.run(["/bin/sh", "-c", script, "sh", *args], user=user, group=user, capture_output=True,
                          text=True, cwd="/", env={"PATH": "/usr/bin:/bin"}, timeout=60)


PLANT = """
set -e
root=$1; seg=$1/job/server-0
mkdir -m 755 "$root"
mkdir -p "$seg"
printf '{"format": 2}' > "$seg/meta.json"
printf 'PSSTATE3' > "$seg/tensors-1.bin"
head -c 20000 /dev/zero >> "$seg/tensors-1.bin"
ln -s "$2" "$seg/owner.json.tmp"
ln -s "$3" "$seg/meta.json.tmp"
ln -s "$4" "$seg/meta.pkl.tmp"
ln -s "$5" "$root/oldjob"
"""


def snapshot(paths: list[Path]) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths}


def serve(port: int, *extra: str) -> subprocess.CompletedProcess:
    return run(["serve", "--port", str(port), "--model", "mlp", "--supervise", "--no-control", *extra], timeout=120)


def test_a_directory_another_user_made_first_is_refused_and_nothing_outside_is_touched(stranger, tmp_path, port):
    root = Path("/dev/shm") / f"psserver-taken-{uuid.uuid4().hex[:8]}"
    victims = [tmp_path / f"victim-{i}" for i in range(3)]
    for v in victims:
        v.write_text("root's own file")
    tree = tmp_path / "tree"
    (tree / "server-0").mkdir(parents=True)
    (tree / "server-0" / "owner.json").write_text("{}")
    (tree / "server-0" / "precious").write_text("keep me")
    outside = [*victims, tree / "server-0" / "owner.json", tree / "server-0" / "precious"]
    before = snapshot(outside)
    try:
        planted = as_user(stranger, PLANT, str(root), *map(str, victims), str(tree))
        assert planted.returncode == 0, planted.stderr
        inside = sorted(str(p) for p in root.rglob("*"))
        got = serve(port, "--state-dir", str(root), "--state-key", "job", "--remove-stale-state")
        assert got.returncode == 2, got.stderr[-3000:]
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{root} is owned by uid" in lines[0], lines
        assert "not by this user (uid 0)" in lines[0]
        assert snapshot(outside) == before  # no link followed: not written, not deleted
        assert sorted(str(p) for p in root.rglob("*")) == inside  # nothing made or removed in their directory
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_default_directory_made_first_by_another_user_is_refused(stranger, port):
    """The default is per user (``/dev/shm/psserver-<uid>``): a stranger who makes root's first
    is refused in one line, never used."""
    default = Path(DEFAULT_STATE_DIR)
    assert default.name == f"psserver-{os.geteuid()}"
    if os.path.lexists(default):
        pytest.skip(f"{default} exists on this host (a server of root's uses it)")
    try:
        made = as_user(stranger, 'mkdir -m 755 "$1"', str(default))
        assert made.returncode == 0, made.stderr
        got = serve(port)
        assert got.returncode == 2 and len(got.stderr.strip().splitlines()) == 1, got.stderr[-3000:]
        assert f"{default} is owned by uid" in got.stderr
        assert os.listdir(default) == []
    finally:
        shutil.rmtree(default, ignore_errors=True)


def test_a_directory_the_server_made_is_closed_to_another_user(stranger, state_dir):
    state = MemoryState(MemoryStateConfig(state_dir, "job"), 0)
    state.prepare()
    state._make_dir()  # noqa: SLF001 - what attach does before the first update
    probe = as_user(stranger, 'ls "$1"', str(state_dir))
    assert probe.returncode != 0 and "Permission denied" in probe.stderr
    probe = as_user(stranger, 'mkdir "$1"', str(state_dir / "x"))
    assert probe.returncode != 0 and "Permission denied" in probe.stderr
    state.release()
