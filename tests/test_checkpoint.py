import errno
import hashlib
import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from psserver.checkpoint import (
    FORMAT,
    LEGACY_RUN,
    MAGIC,
    CheckpointDirError,
    Checkpointer,
    CheckpointError,
    UnsafeCheckpointError,
    check_writable,
    checkpoint_path,
    find_latest,
    list_checkpoints,
    load_latest,
    load_named,
    read_checkpoint,
    read_header,
    remove_stale_temporaries,
    verify,
    write_checkpoint,
)


def state(step):
    return {"global_step": step, "w": torch.full((100,), float(step))}


def test_round_trip_and_pruning(tmp_path):
    ck = Checkpointer(tmp_path, keep=2)
    for step in (10, 20, 30):
        ck.save(step, state(step), wait=False)
    ck.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000000030.pt", "ckpt-000000000020.pt"]
    assert ck.last.step == 30
    assert torch.equal(read_checkpoint(checkpoint_path(tmp_path, 30))["w"], torch.full((100,), 30.0))


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "header", "empty"])
def test_damaged_file_is_rejected_and_older_used(tmp_path, damage, caplog):
    write_checkpoint(checkpoint_path(tmp_path, 1), state(1))
    bad = checkpoint_path(tmp_path, 2)
    write_checkpoint(bad, state(2))
    data = bytearray(bad.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "bitflip":
        data[-10] ^= 0x01
    elif damage == "header":
        data[:5] = b"XXXXX"
    else:
        data = bytearray()
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        read_checkpoint(bad)
    path, loaded = load_latest(tmp_path)
    assert path == checkpoint_path(tmp_path, 1) and loaded["global_step"] == 1
    assert "skipping invalid checkpoint" in caplog.text


def test_temporary_files_are_never_taken(tmp_path):
    write_checkpoint(checkpoint_path(tmp_path, 5), state(5))
    (tmp_path / ".ckpt-000000000009.pt.tmp-123").write_bytes(b"partial")
    assert load_latest(tmp_path)[1]["global_step"] == 5
    assert load_latest(tmp_path / "missing") is None


# ---- runs, pruning, safe loads, the directory ---------------------------------------------------


class WritesAMarker:
    """A pickle payload that runs code when loaded without ``weights_only``: it writes ``marker``."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def corrupt(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))


def runs_of(directory) -> dict[str, str]:
    out = {}
    for p in list_checkpoints(directory):
        try:
            out[p.name] = read_header(p).run
        except CheckpointError:
            out[p.name] = "?"
    return out


def test_header_names_the_run_and_format_2(tmp_path):
    path = checkpoint_path(tmp_path, 3)
    write_checkpoint(path, state(3), run="r1")
    header = read_header(path)
    assert (header.format, header.run) == (FORMAT, "r1") == (2, "r1")
    assert header.time == pytest.approx(time.time(), abs=60)
    other = checkpoint_path(tmp_path, 4)
    write_checkpoint(other, state(4))  # no run given: a run of its own
    assert read_header(other).run not in ("r1", LEGACY_RUN)


def test_format_1_files_still_load_as_the_legacy_run(tmp_path):
    """Checkpoints written before run ids existed (format 1, no run in the header)."""
    buf = io.BytesIO()
    torch.save(state(7), buf)
    payload = buf.getvalue()
    header = {"magic": "PSSERVER-CKPT", "format": 1, "sha256": hashlib.sha256(payload).hexdigest(),
              "length": len(payload)}
    path = checkpoint_path(tmp_path, 7)
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)
    assert read_header(path).run == LEGACY_RUN
    assert read_checkpoint(path)["global_step"] == 7
    assert load_latest(tmp_path)[0] == path
    # A writer never prunes them, whatever the step numbers.
    ck = Checkpointer(tmp_path, keep=1, run="now")
    for step in (10, 20):
        ck.save(step, state(step), wait=True)
    assert runs_of(tmp_path) == {"ckpt-000000000020.pt": "now", "ckpt-000000000007.pt": LEGACY_RUN}


def test_pruning_keeps_the_newest_valid_checkpoints_of_its_own_run_only(tmp_path):
    for step in (100, 200):  # another run, with higher steps than this one will reach
        write_checkpoint(checkpoint_path(tmp_path, step), state(step), run="other")
    bad_header = checkpoint_path(tmp_path, 300)
    bad_header.write_bytes(b"not a checkpoint\n")  # whose it is cannot be told: never deleted
    write_checkpoint(checkpoint_path(tmp_path, 10), state(10), run="mine")
    write_checkpoint(checkpoint_path(tmp_path, 20), state(20), run="mine")
    corrupt(checkpoint_path(tmp_path, 20))  # this run's, invalid: never counted as a kept one
    ck = Checkpointer(tmp_path, keep=2, run="mine")
    ck.save(30, state(30), wait=True)
    # Kept: 30 (just written) and 10 (the newest valid one before it); 20 is not counted.
    assert sorted(runs_of(tmp_path)) == ["ckpt-000000000010.pt", "ckpt-000000000020.pt", "ckpt-000000000030.pt",
                                         "ckpt-000000000100.pt", "ckpt-000000000200.pt", "ckpt-000000000300.pt"]
    ck.save(40, state(40), wait=False)
    ck.wait()
    assert runs_of(tmp_path) == {
        "ckpt-000000000300.pt": "?", "ckpt-000000000200.pt": "other", "ckpt-000000000100.pt": "other",
        "ckpt-000000000040.pt": "mine", "ckpt-000000000030.pt": "mine",
    }
    assert read_checkpoint(checkpoint_path(tmp_path, 200))["global_step"] == 200


def test_keep_1_never_deletes_the_checkpoint_just_written(tmp_path):
    """Even when the run has a valid checkpoint of a higher step (resumed from an older one)."""
    write_checkpoint(checkpoint_path(tmp_path, 50), state(50), run="r")
    ck = Checkpointer(tmp_path, keep=1, run="r")
    ck.save(20, state(20), wait=True)
    assert checkpoint_path(tmp_path, 20).is_file()


def test_resume_picks_the_run_written_last(tmp_path, caplog):
    write_checkpoint(checkpoint_path(tmp_path, 500), state(500), run="old")
    time.sleep(0.01)
    write_checkpoint(checkpoint_path(tmp_path, 10), state(10), run="new")
    write_checkpoint(checkpoint_path(tmp_path, 20), state(20), run="new")
    corrupt(checkpoint_path(tmp_path, 20))
    header, loaded = find_latest(tmp_path)
    assert (header.run, loaded["global_step"]) == ("new", 10)
    assert "ckpt-000000000020.pt is corrupt" in caplog.text


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_checkpoint(checkpoint_path(tmp_path, 1), state(1), run="r")
    assert list(tmp_path.iterdir()) == []


def test_a_crafted_payload_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "marker"
    write_checkpoint(checkpoint_path(tmp_path, 1), state(1), run="r")
    crafted = checkpoint_path(tmp_path, 2)
    write_checkpoint(crafted, {"global_step": 2, "w": WritesAMarker(marker)}, run="r")
    verify(crafted)  # header and checksum are valid
    payload = crafted.read_bytes().split(b"\n", 1)[1]
    torch.load(io.BytesIO(payload), weights_only=False)  # the payload is live: loading it unsafely runs it
    assert marker.read_text() == "ran"
    marker.unlink()
    with pytest.raises(UnsafeCheckpointError, match=r"refusing \S+ckpt-000000000002.pt: its payload would load "
                                                    r"exec, which a psserver checkpoint never holds") as e:
        read_checkpoint(crafted)
    assert "\n" not in str(e.value)
    with pytest.raises(UnsafeCheckpointError):  # not skipped for the older one either
        load_latest(tmp_path)
    assert not marker.exists()


def test_temporary_files_of_dead_writers_are_removed_and_a_live_writers_left(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    dead, live = child.pid, os.getppid()
    names = [f".ckpt-000000000009.pt.tmp-{dead}", f".ckpt-000000000010.pt.tmp-{os.getpid()}",
             f".psserver-probe-{dead}", f".ckpt-000000000011.pt.tmp-{live}", "notes.txt"]
    for name in names:
        (tmp_path / name).write_bytes(b"partial")
    removed = remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == sorted(names[:3])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[3:])


def test_check_writable(tmp_path):
    check_writable(tmp_path / "a" / "b")  # created
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointDirError, match="file is not a directory"):
        check_writable(tmp_path / "file")
    with pytest.raises(CheckpointDirError, match="cannot be created: Not a directory"):
        check_writable(tmp_path / "file" / "sub")


def test_a_header_nested_too_deep_is_a_bad_header(tmp_path):
    """json.loads of 4000 '[' raised RecursionError: an internal error, not a refused file."""
    path = tmp_path / "h"
    path.write_bytes(b"[" * 4000 + b"\n")
    with pytest.raises(CheckpointError, match=r"is not a psserver checkpoint \(bad header\)"):
        read_header(path)
    with pytest.raises(CheckpointError, match=r"bad header"):
        verify(path)


class CallsOsSystem:
    """A payload that would run a shell command when loaded without ``weights_only``."""

    def __reduce__(self):
        return (os.system, ("true",))


def test_a_payload_calling_os_system_is_unsafe_and_stops_the_search(tmp_path):
    """torch 2.14 words this refusal ("unsupported GLOBAL posix.system whose module posix is
    blocked") unlike the ``exec`` one: it was a 'no loadable state', skipped for the older file."""
    write_checkpoint(checkpoint_path(tmp_path, 1), state(1), run="r")
    crafted = checkpoint_path(tmp_path, 2)
    write_checkpoint(crafted, {"global_step": 2, "w": CallsOsSystem()}, run="r")
    with pytest.raises(UnsafeCheckpointError, match=r"refusing \S+ckpt-000000000002.pt: its payload would load "
                                                    r"posix.system, which a psserver checkpoint never holds") as e:
        read_checkpoint(crafted)
    assert "\n" not in str(e.value)
    with pytest.raises(UnsafeCheckpointError, match=r"ckpt-000000000002\.pt"):
        find_latest(tmp_path)


def test_a_weights_only_refusal_of_any_wording_is_unsafe(tmp_path, monkeypatch):
    """The refusal is told by its type (``pickle.UnpicklingError``), not by torch's words."""
    import pickle

    def refuse(*args, **kwargs):
        raise pickle.UnpicklingError("the loader says no\nin words never seen before")

    write_checkpoint(checkpoint_path(tmp_path, 1), state(1), run="r")
    write_checkpoint(checkpoint_path(tmp_path, 2), state(2), run="r")
    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(UnsafeCheckpointError, match=r"its payload is refused by torch's weights-only loader "
                                                    r"\(the loader says no\) \(tampered with"):
        find_latest(tmp_path)


def test_a_forged_length_costs_no_memory_before_the_checksum_fails(tmp_path):
    """A sparse file of 64 MB whose header claims all of it: the checksum is computed as the
    file is read (it held the whole payload in memory, twice, before it failed)."""
    import tracemalloc

    path = checkpoint_path(tmp_path, 1)
    size = 64 << 20
    header = json.dumps({"magic": "PSSERVER-CKPT", "format": 2, "run": "r", "time": 1.0, "sha256": "0" * 64,
                         "length": size}).encode() + b"\n"
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + size)  # a hole: no disk, no memory
    tracemalloc.start()
    try:
        for read in (verify, read_checkpoint):
            with pytest.raises(CheckpointError, match="checksum mismatch"):
                read(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_a_length_other_than_the_files_is_refused_before_reading(tmp_path):
    path = checkpoint_path(tmp_path, 1)
    write_checkpoint(path, state(1))
    with open(path, "ab") as f:
        f.write(b"more")
    with pytest.raises(CheckpointError, match=r"is not a psserver checkpoint \(\d+ bytes where its header says"):
        verify(path)


def test_a_directory_every_user_can_write_is_refused_and_a_planted_link_is_never_followed(tmp_path):
    """Another user who can write the directory would plant links at the temporary names (root
    then overwrote the linked file) or checkpoints of their own."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(CheckpointDirError, match=r"writable by its group or others \(mode 777\)"):
        check_writable(shared)
    shared.chmod(0o770)
    with pytest.raises(CheckpointDirError, match=r"writable by its group or others \(mode 770\)"):
        check_writable(shared)
    mine = tmp_path / "mine"
    mine.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    path = checkpoint_path(mine, 5)
    (mine / f".{path.name}.tmp-{os.getpid()}").symlink_to(victim)
    (mine / f".psserver-probe-{os.getpid()}").symlink_to(victim)
    check_writable(mine)
    write_checkpoint(path, {"global_step": 5}, run="r")
    assert victim.read_text() == "root's file" and read_checkpoint(path)["global_step"] == 5


@pytest.mark.parametrize("payload", [b"s.", b"a.", b"\x80\x02t.", b"h\x05.", b"(\x88\x88u."])
def test_a_payload_of_malformed_opcodes_is_no_loadable_state(tmp_path, payload):
    """A valid checksum over a few bytes the weights-only unpickler chokes on (IndexError,
    KeyError): one line, not an internal error."""
    path = tmp_path / "ckpt-000000000001.pt"
    header = json.dumps({"magic": MAGIC, "format": FORMAT, "run": "r", "time": 0.0,
                         "sha256": hashlib.sha256(payload).hexdigest(), "length": len(payload)}).encode() + b"\n"
    path.write_bytes(header + payload)
    with pytest.raises(CheckpointError, match="holds no loadable state"):
        read_checkpoint(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_a_checkpoint_another_user_planted_or_can_change_is_never_resumed(tmp_path, caplog):
    """In a directory others may create files in (sticky, as /tmp), a newer checkpoint of
    another user's, or one its group can rewrite, is skipped in one line; this user's own is
    resumed."""
    tmp_path.chmod(0o1777)
    write_checkpoint(checkpoint_path(tmp_path, 10), state(10), run="mine")
    write_checkpoint(checkpoint_path(tmp_path, 30), state(30), run="mine")
    checkpoint_path(tmp_path, 30).chmod(0o664)
    write_checkpoint(checkpoint_path(tmp_path, 40), state(40), run="theirs")
    os.chown(checkpoint_path(tmp_path, 40), 65534, 65534)
    _, loaded = find_latest(tmp_path)
    assert loaded["global_step"] == 10
    assert "ckpt-000000000040.pt is owned by uid 65534" in caplog.text
    assert "ckpt-000000000030.pt is writable by its group or others (mode 664)" in caplog.text
    # Named by --resume (or a partition's step), the same files are refused in one line, not loaded.
    for step, says in ((40, "is owned by uid 65534"), (30, r"is writable by its group or others \(mode 664\)")):
        with pytest.raises(CheckpointError, match=rf"refusing to resume \S+ckpt-0+{step}.pt: \S+ {says}"):
            load_named(checkpoint_path(tmp_path, step))
    assert load_named(checkpoint_path(tmp_path, 10))[1]["global_step"] == 10
    link = tmp_path / "link.pt"
    link.symlink_to(checkpoint_path(tmp_path, 40))
    with pytest.raises(CheckpointError, match="is owned by uid 65534"):
        load_named(link)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_a_newer_checkpoint_another_user_planted_does_not_turn_a_resumed_run_into_a_new_one(tmp_path):
    """Resuming step 3 of run "mine" continues that run unless a newer checkpoint of it is there
    (a branch); one another user planted, claiming the run, is no such checkpoint."""
    from psserver.server.checkpoints.checkpointing import CheckpointPolicy

    tmp_path.chmod(0o1777)
    write_checkpoint(checkpoint_path(tmp_path, 3), state(3), run="mine")
    write_checkpoint(checkpoint_path(tmp_path, 50), state(50), run="mine")
    os.chown(checkpoint_path(tmp_path, 50), 65534, 65534)
    assert CheckpointPolicy._newer_of_run(tmp_path, "mine", 3) is None
    os.chown(checkpoint_path(tmp_path, 50), os.geteuid(), os.getegid())
    assert CheckpointPolicy._newer_of_run(tmp_path, "mine", 3) == checkpoint_path(tmp_path, 50)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
def test_a_directory_of_another_user_or_under_one_is_refused(tmp_path):
    """Its owner may swap the checkpoints in it between the check of a file and its load (a
    rename exchange), sticky bit or not; a directory under one of theirs they can replace."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(CheckpointDirError, match="is owned by uid 65534"):
        check_writable(theirs)
    theirs.chmod(0o1777)
    with pytest.raises(CheckpointDirError, match="is owned by uid 65534"):
        check_writable(theirs)
    with pytest.raises(CheckpointDirError, match=rf"{theirs}, above it, is owned by uid 65534"):
        check_writable(theirs / "mine")
    assert not (theirs / "mine").exists()  # refused before anything was made there
    # ".." after a link goes up from where the link points, as the kernel goes.
    (theirs / "e").mkdir()
    (tmp_path / "link").symlink_to(theirs / "e")
    with pytest.raises(CheckpointDirError, match=rf"{theirs}, above it, is owned by uid 65534"):
        check_writable(tmp_path / "link" / ".." / "ckd")
    assert not (theirs / "ckd").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a link and a directory to another uid")
def test_links_are_followed_one_at_a_time_the_last_component_too(tmp_path):
    """Root's link to another user's link: its owner pointed it at another job's directory
    mid-run and the checkpoints went there. Root's link as the checkpoint directory itself, into
    a directory of another user's: they swapped it for another job's and the resume loaded that
    job's checkpoint. Each link on the way is checked, and what is above each target."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    their_link = sticky / "theirs"
    their_link.symlink_to(elsewhere)
    os.lchown(their_link, 65534, 65534)
    mine = tmp_path / "mine"
    mine.symlink_to(their_link)
    for directory in (mine / "ck", mine):
        with pytest.raises(CheckpointDirError, match=rf"{their_link}, on the way to it, is a link of uid 65534"):
            check_writable(directory)
    assert list(elsewhere.iterdir()) == []
    home = tmp_path / "home"
    (home / "ck").mkdir(parents=True, mode=0o700)
    os.chown(home, 65534, 65534)
    (tmp_path / "cklink").symlink_to(home / "ck")
    with pytest.raises(CheckpointDirError, match=rf"{home}, above it, is owned by uid 65534"):
        check_writable(tmp_path / "cklink")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(CheckpointDirError, match="too many levels of symbolic links"):
        check_writable(loop / "ck")
    # A component not there yet, then '..': mkdir -p would make it and go on from there, into
    # their link; refused before anything is made.
    with pytest.raises(CheckpointDirError, match=rf"{their_link}, on the way to it, is a link of uid 65534"):
        check_writable(tmp_path / "n9" / ".." / "sticky" / "theirs" / "made")
    assert not (tmp_path / "n9").exists() and list(elsewhere.iterdir()) == []
    ok = tmp_path / "ok"
    ok.symlink_to(elsewhere)  # root's link to root's directory: taken
    check_writable(ok / "ck")
    assert (elsewhere / "ck").is_dir()
