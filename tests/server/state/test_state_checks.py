"""The state in memory trusts nothing it did not write itself, in-process: a directory another
user could write, links planted beside its files, a stale segment that is a link, an owner file
or metadata of the wrong shape, a tensors file truncated or overwritten with NaN, counters at
the edge of 64 bits: each is one line (``MemoryStateError``) or a stale segment, never an
internal error, and nothing outside the state directory is written or deleted."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import stat
import struct
import sys

import pytest
import torch
from torch import nn

from psserver.checkpoint import CheckpointError
from psserver.config import CheckpointConfig, MemoryStateConfig
from psserver.server.server import ParameterServer
from psserver.server.state.memory import MemoryState, MemoryStateError, scan
from psserver.server.state.supervisor import FALLBACK_ENV
from tests.server.state.test_memory_state import assert_same, server_config, state_of, train

ODD = "tests.server.state.test_state_checks:OddBuffers"


class OddBuffers(nn.Module):
    """A model whose buffers are of dtypes beyond the usual floats and ints."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("counts", torch.tensor([0, 1, 2, 65535], dtype=torch.int32).to(torch.uint16))
        self.register_buffer("phase", torch.tensor([1.5, -2.25], dtype=torch.bfloat16))

    def forward(self, x):
        return self.fc(x)


class Float8Buffer(OddBuffers):
    """A buffer of a dtype the file does not hold (no finite check exists for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(3, dtype=torch.float8_e4m3fn))


def segment(state_dir, key="run-a"):
    return state_dir / key / "server-0"


def dead_server(config) -> ParameterServer:
    """A server that trained 3 steps and was abandoned as a SIGKILL leaves it."""
    server = ParameterServer(config)
    train(server, 3)
    server.engine.compute.close()
    return server


def tensors_file(seg):
    (path,) = seg.glob("tensors-*.bin")
    return path


# ---- the directory and its files ----------------------------------------------------------------

def test_a_directory_others_can_write_or_a_link_is_refused_in_one_line(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(MemoryStateError, match=r"writable by its group or others \(mode 777\)"):
        MemoryState(MemoryStateConfig(shared, "k"), 0).prepare()
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    (tmp_path / "mine").mkdir(mode=0o700)
    with pytest.raises(MemoryStateError, match="a symbolic link, not followed"):
        MemoryState(MemoryStateConfig(tmp_path / "link", "k"), 0).prepare()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
def test_a_directory_of_another_user_is_refused_in_one_line(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(MemoryStateError, match=r"is owned by uid 65534, not by this user \(uid 0\)"):
        MemoryState(MemoryStateConfig(theirs, "k"), 0).prepare()


def test_a_directory_under_one_another_user_can_write_is_refused_naming_it(tmp_path):
    """Whoever may rename the state directory away can put their own in its place: a parent
    writable by others without the sticky bit is refused, one with it (``/tmp``, ``/dev/shm``)
    is not."""
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    with pytest.raises(MemoryStateError, match=rf"{open_parent}, above it, is writable by its group or others without "
                                               r"the sticky bit \(mode 777\)"):
        MemoryState(MemoryStateConfig(open_parent / "state", "k"), 0).prepare()
    open_parent.chmod(0o1777)
    MemoryState(MemoryStateConfig(open_parent / "state", "k"), 0).prepare()
    assert (open_parent / "state").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a link to another uid")
def test_a_link_of_another_user_on_the_way_is_refused(tmp_path):
    """A link in a sticky directory that another user owns they can point anywhere: the state
    would be written where they choose."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (tmp_path / "target").mkdir(mode=0o700)
    link = sticky / "theirs"
    link.symlink_to(tmp_path / "target")
    os.lchown(link, 65534, 65534)
    with pytest.raises(MemoryStateError, match=rf"{link}, on the way to it, is a link of uid 65534"):
        MemoryState(MemoryStateConfig(link / "state", "k"), 0).prepare()
    assert list((tmp_path / "target").iterdir()) == []
    # Root's own link into a directory of theirs, then ".." out of the link's target: the kernel
    # follows the link first, so ".." lands in their directory (taken off the text, it did not).
    theirs = tmp_path / "theirs"
    (theirs / "e").mkdir(parents=True)
    os.chown(theirs, 65534, 65534)
    mine = sticky / "mine"
    mine.symlink_to(theirs / "e")
    with pytest.raises(MemoryStateError, match=rf"{theirs}, above it, is owned by uid 65534"):
        MemoryState(MemoryStateConfig(mine / ".." / "state", "k"), 0).prepare()
    assert sorted(p.name for p in theirs.iterdir()) == ["e"]


def test_the_state_is_made_private_and_a_planted_link_is_replaced_not_followed(state_dir, tmp_path):
    """Links named as the temporaries of ``meta`` and ``owner`` point at files outside: those
    files keep their bytes, the state's files are the server's own (0600, in 0700 directories)."""
    seg = segment(state_dir)
    seg.mkdir(parents=True, mode=0o700)
    state_dir.chmod(0o700)
    (state_dir / "run-a").chmod(0o700)
    outside = {}
    for name in ("owner.json.tmp", "meta.json.tmp", "meta.pkl.tmp", "tensors-1.bin"):
        victim = tmp_path / f"victim-{name}"
        victim.write_text("keep me")
        (seg / name).symlink_to(victim)
        outside[victim] = victim.read_text()
    server = dead_server(server_config(state_dir))
    for victim, text in outside.items():
        assert victim.read_text() == text and not victim.is_symlink()
    for path in (state_dir, state_dir / "run-a", seg):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    files = sorted(p.name for p in seg.iterdir() if not p.is_symlink())
    assert files == ["meta.json", "owner.json", "tensors-2.bin"]
    for name in files:
        assert stat.S_IMODE((seg / name).stat().st_mode) == 0o600
    server.engine.close()


def test_remove_stale_state_never_follows_a_link(state_dir, tmp_path):
    """``oldjob`` -> a tree with ``server-0/`` (a key), ``run-b/server-1`` -> another (a
    segment): --remove-stale-state removes neither tree, and a real stale segment still goes."""
    dead_server(server_config(state_dir, key="run-b"))
    owner = segment(state_dir, "run-b") / "owner.json"
    owner.write_text(json.dumps({**json.loads(owner.read_text()), "pid": 2**22 + 1, "supervisor": None}))
    trees = []
    for name in ("key-tree", "segment-tree"):
        tree = tmp_path / name
        (tree / "server-0").mkdir(parents=True)
        (tree / "server-0" / "owner.json").write_text("{}")
        (tree / "server-0" / "precious").write_text("keep me")
        trees.append(tree)
    (state_dir / "oldjob").symlink_to(trees[0])
    (state_dir / "run-b" / "server-1").symlink_to(trees[1] / "server-0")
    cleaner = MemoryState(MemoryStateConfig(state_dir, "run-c", remove_stale=True), 0)
    cleaner.prepare()
    for tree in trees:
        assert (tree / "server-0" / "precious").read_text() == "keep me"
    assert not segment(state_dir, "run-b").exists() and (state_dir / "oldjob").is_symlink()
    assert [s.key for s in scan(state_dir)] == []  # links are not segments


@pytest.mark.parametrize("started", ["x", 1e300, None, -1, True])
def test_an_owner_file_of_the_wrong_shape_is_a_stale_segment_not_a_crash(state_dir, caplog, started):
    dead_server(server_config(state_dir, key="old-run"))
    owner = segment(state_dir, "old-run") / "owner.json"
    dead = {**json.loads(owner.read_text()), "pid": 2**22 + 1, "supervisor": None}  # (beyond pid_max: gone)
    owner.write_text(json.dumps({**dead, "started": started}))
    with caplog.at_level(logging.WARNING):
        fresh = MemoryState(MemoryStateConfig(state_dir, "new-run"), 0)
        fresh.prepare()
    (stale,) = fresh.stale
    assert stale.owner is None and not stale.alive
    assert "owner.json missing or unreadable" in caplog.text


# ---- what a restart maps ----------------------------------------------------------------------

def test_a_state_overwritten_with_nan_is_refused(state_dir):
    config = server_config(state_dir)
    dead_server(config)
    path = tensors_file(segment(state_dir))
    data = bytearray(path.read_bytes())
    payload = (len(data) - 16384) // 4
    data[16384:16384 + 4 * payload] = struct.pack("<f", float("nan")) * payload
    path.write_bytes(bytes(data))
    with pytest.raises(MemoryStateError, match=r"hold NaN or infinite values that were finite when written"):
        ParameterServer(config)


def test_a_state_of_finite_values_no_optimizer_keeps_is_refused(state_dir):
    """-1 everywhere is finite, but no Adam keeps a negative second moment or step: the state
    gets a checkpoint's checks at restart (it was restored, then every step was NaN)."""
    config = server_config(state_dir)
    dead_server(config)
    path = tensors_file(segment(state_dir))
    data = bytearray(path.read_bytes())
    payload = (len(data) - 16384) // 4
    data[16384:16384 + 4 * payload] = struct.pack("<f", -1.0) * payload
    path.write_bytes(bytes(data))
    with pytest.raises(MemoryStateError, match=r"fails the checks of a checkpoint \(.*negative"):
        ParameterServer(config)


@pytest.mark.timeout(60)
def test_a_fifo_planted_for_the_metadata_is_refused_not_waited_on(state_dir):
    config = server_config(state_dir)
    dead_server(config)
    meta = segment(state_dir) / "meta.json"
    meta.unlink()
    os.mkfifo(meta, 0o600)
    with pytest.raises(MemoryStateError, match="is not a regular file"):
        ParameterServer(config)


def test_a_truncated_or_foreign_tensors_file_is_refused(state_dir):
    config = server_config(state_dir)
    dead_server(config)
    path = tensors_file(segment(state_dir))
    whole = path.read_bytes()
    path.write_bytes(whole[:-64])
    with pytest.raises(MemoryStateError, match=r"cannot be read \(tensors-2.bin is \d+ bytes, its tensors take \d+\)"):
        ParameterServer(config)
    path.write_bytes(whole[:-32] + b"\0" * 32)
    meta = segment(state_dir) / "meta.json"
    doc = json.loads(meta.read_text())
    doc["generation"] = 3
    meta.write_text(json.dumps(doc))
    with pytest.raises(MemoryStateError, match="its digest does not match its contents"):
        ParameterServer(config)


def test_a_global_step_at_the_edge_of_64_bits_is_refused_at_start(state_dir):
    """Every update packs the next step in 64 bits: a state or a checkpoint at 2^63-1 is one line
    at the start, not an error at every step."""
    config = server_config(state_dir)
    dead_server(config)
    path = tensors_file(segment(state_dir))
    with open(path, "r+b") as f:
        f.seek(32)
        f.write(struct.pack("<q", 2**63 - 1))
    with pytest.raises(MemoryStateError, match=r"global step 9223372036854775807"):
        ParameterServer(config)


def test_a_checkpoint_at_the_edge_of_64_bits_is_refused_with_a_state_dir(state_dir, tmp_path):
    ck = tmp_path / "ck"
    plain = server_config(state_dir, checkpoint=CheckpointConfig(directory=ck))
    plain = dataclasses.replace(plain, memory_state=MemoryStateConfig())
    writer = ParameterServer(plain)
    train(writer, 1)
    writer.engine.updater.global_step = 2**63 - 1
    saved = writer.policy.save(wait=True).path
    writer.engine.close()
    config = server_config(state_dir, key="run-b", checkpoint=CheckpointConfig(resume=saved))
    # The checkpoint's own check refuses it first (a step past 2^53 no run reaches).
    with pytest.raises(CheckpointError, match=r"its global_step is 9223372036854775807, past"):
        ParameterServer(config)


def _tensors_name(seg) -> tuple[str, int]:
    name = tensors_file(seg).name
    return name, int(name.removeprefix("tensors-").removesuffix(".bin"))


def _nested(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


def _pickled(case: str, seg) -> bytes:
    name, generation = _tensors_name(seg)
    meta = {"format": 1, "generation": generation, "file": name, "key": "run-a", "slots": [(16384, "float32", (2,))],
            "state": {}}
    if case == "binbytes8":
        return b"\x80\x05\x8e" + struct.pack("<Q", 2**40) + b"x" * 16
    if case == "shape":
        meta["slots"] = [(16384, "float32", (-5, 3))]
        meta["state"] = {"shards": [("__psserver_tensor__", 0)]}
    elif case == "nested":
        meta["state"] = {"x": _nested(3000)}
    elif case == "list":
        return pickle.dumps([meta])
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        return pickle.dumps(meta)
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize("case", ["binbytes8", "shape", "nested", "list"])
def test_a_pickled_metadata_file_is_never_unpickled(state_dir, case):
    config = server_config(state_dir)
    dead_server(config)
    seg = segment(state_dir)
    (seg / "meta.json").unlink(missing_ok=True)
    (seg / "meta.pkl").write_bytes(_pickled(case, seg))
    with pytest.raises(MemoryStateError, match=r"cannot be read .*move it away"):
        ParameterServer(config)


def _json_meta(seg) -> dict:
    return json.loads((seg / "meta.json").read_text())


@pytest.mark.parametrize("case", ["shape", "nested", "list", "too-big", "dtype", "reference"])
def test_metadata_of_the_wrong_shape_is_one_line(state_dir, case):
    from psserver.server.state.meta import _digest

    config = server_config(state_dir)
    dead_server(config)
    seg = segment(state_dir)
    doc = _json_meta(seg)
    doc.pop("digest")
    if case == "shape":
        doc["slots"][0][2] = [-5, 3]
    elif case == "dtype":
        doc["slots"][0][1] = "object"
    elif case == "reference":
        doc["state"] = {"x": 10**6}
    elif case == "nested":
        inner: dict = {"l": []}
        for _ in range(3000):
            inner = {"l": [inner]}
        doc["state"] = inner
    if case == "list":
        text = json.dumps([doc])
    elif case == "too-big":
        text = None
    else:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(20_000)
        try:
            text = json.dumps({**doc, "digest": _digest(doc).hex()})
        finally:
            sys.setrecursionlimit(limit)
    if text is None:
        with open(seg / "meta.json", "r+b") as f:
            f.truncate(2**40)  # sparse: nothing is allocated unless it is read
    else:
        (seg / "meta.json").write_text(text)
    with pytest.raises(MemoryStateError, match=r"cannot be read .*move it away"):
        ParameterServer(config)


# ---- what a supervised restart does with a state that fails ----------------------------------------

def test_a_supervised_restart_falls_back_to_the_newest_checkpoint_saying_so(state_dir, tmp_path, caplog, monkeypatch):
    """A restart the supervisor started (it resumes from checkpoints): a truncated tensors file
    is discarded with one WARNING line and the run continues from its newest checkpoint."""
    ck = tmp_path / "ck"
    config = server_config(state_dir, checkpoint=CheckpointConfig(directory=ck, resume="latest"))
    first = ParameterServer(config)
    train(first, 2)
    first.policy.save(wait=True)
    want = state_of(first)
    train(first, 2)
    first.engine.compute.close()
    path = tensors_file(segment(state_dir))
    path.write_bytes(path.read_bytes()[:-64])
    monkeypatch.setenv(FALLBACK_ENV, "1")
    with caplog.at_level(logging.WARNING):
        second = ParameterServer(config)
    try:
        assert_same(state_of(second), want)
        (line,) = [r for r in caplog.records if "discarded" in r.getMessage()]
        assert line.levelno == logging.WARNING and "resuming from the newest good checkpoint" in line.getMessage()
        assert "is 1" in line.getMessage() or "bytes" in line.getMessage()
        train(second, 1)  # and it keeps its state in memory again, from there
        assert second.memory.arena is not None and second.engine.global_step == 3
    finally:
        second.engine.close()


def test_the_supervisor_lets_only_restarts_with_checkpoints_fall_back(tmp_path, monkeypatch):
    from psserver.server.state import supervisor

    seen = tmp_path / "seen"
    child = [sys.executable, "-c", f"import os, pathlib, signal; p = pathlib.Path({str(seen)!r}); "
             "n = len(p.read_text().split()) if p.exists() else 0; "
             f"p.write_text((p.read_text() if p.exists() else '') + os.environ.get({FALLBACK_ENV!r}, '-') + ' '); "
             "os.kill(os.getpid(), signal.SIGKILL) if n == 0 else None"]
    monkeypatch.setattr(supervisor, "server_argv", lambda argv: child)
    monkeypatch.setattr(supervisor.time, "sleep", lambda s: None)
    assert supervisor.supervise(["serve"], 5, resume=True) == 0
    assert seen.read_text().split() == ["-", "1"]  # the first start does not; its restart does
    seen.unlink()
    assert supervisor.supervise(["serve"], 5, resume=False) == 0
    assert seen.read_text().split() == ["-", "-"]  # no checkpoint to go to: a failed state is one line, exit 2


def test_without_a_checkpoint_a_failed_state_is_one_line(state_dir):
    config = server_config(state_dir)
    dead_server(config)
    path = tensors_file(segment(state_dir))
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(MemoryStateError, match="move it away"):
        ParameterServer(config)


# ---- dtypes ---------------------------------------------------------------------------------------

def test_buffers_of_uint16_and_bfloat16_are_kept_and_come_back(state_dir):
    """(A complex buffer a first trainer brings is refused at the join: buffers travel as float64.)"""
    config = server_config(state_dir, model=ODD)
    first = ParameterServer(config)
    train(first, 2)
    want = state_of(first)
    first.engine.compute.close()
    second = ParameterServer(config)
    try:
        assert_same(state_of(second), want)
        train(second, 1)
        assert second.engine.global_step == 3
    finally:
        second.engine.close()


def test_a_tensor_the_file_cannot_hold_turns_the_state_off_in_one_line_not_every_step(state_dir, caplog):
    from psserver.server.state.layout import unplaceable

    assert unplaceable([torch.zeros(2), torch.zeros(2, dtype=torch.float8_e4m3fn)]).startswith("a torch.strided tensor")
    assert unplaceable([torch.zeros(2).to_sparse()]).startswith("a torch.sparse_coo tensor")
    assert unplaceable([torch.zeros(2, dtype=torch.uint16), torch.zeros(1, dtype=torch.complex64)]) is None
    with caplog.at_level(logging.ERROR):
        server = ParameterServer(server_config(state_dir, model="tests.server.state.test_state_checks:Float8Buffer"))
    try:
        train(server, 2)
        assert server.engine.global_step == 2 and server.memory.disabled.endswith("cannot be kept in shared memory")
        assert caplog.text.count("state in memory: off from now on") == 1
    finally:
        server.engine.close()


def test_a_file_where_a_parent_directory_should_be_is_one_line(tmp_path):
    """It was exit 1 with a bare 'File exists'."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(MemoryStateError, match=r"--state-dir \S+/afile/x: cannot make \S+/afile: it, or a directory "
                                               r"above it, is a file"):
        MemoryState(MemoryStateConfig(tmp_path / "afile" / "x", "k"), 0).prepare()
