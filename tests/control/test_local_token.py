"""The local admin token: a server without a configured token writes a private file, and the
CLI of the same user on the same host checkpoints and stops it with no token flag."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import grpc
import pytest

from psserver.control.client import ControlClient, ControlError, read_token
from psserver.control.local_token import LocalToken, file_name, find_local_token, reaches_bound, runtime_dir
from psserver.errors import UsageError

from .fakes import TOKEN, serve
from .test_cli import _error_lines, run

pytestmark = pytest.mark.timeout(60)

NOBODY = 65534


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_checkpoint_and_stop_need_no_token_flag_and_the_file_goes_with_the_server(target, capsys):
    """The README's sequence against a server started without a token: status, checkpoint and
    stop as written; the token sits 0600 in a 0700 directory of this user while it serves."""
    control = serve(target)
    try:
        path = control.local_token.path
        assert path.parent == runtime_dir() and path.name == file_name(control.port)
        assert _mode(path.parent) == 0o700 and _mode(path) == 0o600
        assert os.stat(path).st_uid == os.geteuid() == os.stat(path.parent).st_uid
        assert json.loads(path.read_text())["port"] == control.port
        rc, out, err = run(capsys, "status", "--address", control.address)
        assert rc == 0 and "SERVING" in out, err
        rc, out, err = run(capsys, "checkpoint", "--address", control.address)
        assert rc == 0 and out.startswith(f"checkpoint written: {target.checkpoints[-1].path}"), err
        rc, out, err = run(capsys, "stop", "--address", control.address)
        assert rc == 0 and out.strip() == f"server at {control.address} is draining", err
        assert target.shutdown_requested.is_set()
    finally:
        control.stop()
    assert not path.exists()


def test_another_user_without_the_file_is_refused(server, target, capsys, monkeypatch, tmp_path):
    """What another user's CLI sees (its own runtime directory, no file for this server), and a
    client presenting another token: refused, nothing happens."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "other-user"))
    rc, _, err = run(capsys, "stop", "--address", server.address)
    assert rc == 2 and len(_error_lines(err)) == 1
    assert "PERMISSION_DENIED: Checkpoint and Shutdown need the server's local admin token" in err
    with ControlClient(server.address) as anonymous, ControlClient(server.address, token=TOKEN) as wrong:
        assert anonymous.get_status().model == "mlp"  # reads stay open
        for client, code in ((anonymous, grpc.StatusCode.PERMISSION_DENIED), (wrong, grpc.StatusCode.UNAUTHENTICATED)):
            for call in (client.checkpoint, client.shutdown):
                with pytest.raises(ControlError) as e:
                    call()
                assert e.value.code == code
    assert not target.shutdown_requested.is_set() and not target.checkpoints


def test_only_its_owner_can_read_the_file(tmp_path):
    """Mode bits keep group and others out; as root, a process of another uid indeed cannot read it."""
    local = LocalToken.write("127.0.0.1", 50051)
    try:
        assert _mode(local.path) & 0o077 == 0 and _mode(local.path.parent) & 0o077 == 0
        if os.geteuid() == 0:
            done = subprocess.run(["cat", str(local.path)], user=NOBODY, group=NOBODY, capture_output=True,
                                  text=True, timeout=30)
            assert done.returncode != 0 and "Permission denied" in done.stderr and local.token not in done.stdout
    finally:
        local.remove()
    assert not local.path.exists()


def _refused_by_server_and_client(target, caplog, why: str) -> None:
    """The server writes nothing there and says why in one line (it serves all the same, admin
    calls refused as without the token); the CLI's lookup is the same line, as an error."""
    with caplog.at_level("WARNING", logger="psserver.control.server"), serve(target) as control:
        assert control.local_token is None and list(runtime_dir().iterdir()) == []
        with ControlClient(control.address) as client, pytest.raises(ControlError) as e:
            client.shutdown()
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "--auth-token-file" in str(e.value)
        with pytest.raises(UsageError) as refused:
            find_local_token(control.address)
    assert str(refused.value) == (f"control token directory {runtime_dir()} {why}: psserver trusts only a private "
                                  "one of your own (chmod 700 it, or remove it)")
    warnings = [r.getMessage() for r in caplog.records if r.name == "psserver.control.server"]
    assert warnings == ["no local admin token, so checkpoint and stop over the control plane are refused: "
                        f"{refused.value}"]
    assert not target.shutdown_requested.is_set()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_directory_others_can_write_is_refused(target, caplog, mode):
    runtime_dir().mkdir(parents=True)
    runtime_dir().chmod(mode)
    _refused_by_server_and_client(target, caplog, f"is writable by its group or others (mode {mode:03o})")


def test_a_private_directory_under_one_others_can_write_is_refused(target, caplog):
    runtime_dir().mkdir(parents=True, mode=0o700)
    runtime_dir().parent.chmod(0o777)
    _refused_by_server_and_client(target, caplog, f"is not safe: {runtime_dir().parent}, above it, is writable by "
                                  "its group or others without the sticky bit (mode 777): another user can replace "
                                  "what is in it")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_directory_of_another_user_is_refused(target, caplog):
    runtime_dir().mkdir(parents=True, mode=0o700)
    os.chown(runtime_dir(), NOBODY, NOBODY)
    _refused_by_server_and_client(target, caplog, f"is owned by uid {NOBODY}, not by this user (uid {os.geteuid()})")


def test_symbolic_links_are_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    directory = runtime_dir()
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.symlink_to(elsewhere)
    with pytest.raises(UsageError, match="is a symbolic link or not a directory"):
        LocalToken.write("127.0.0.1", 50051)
    assert list(elsewhere.iterdir()) == []
    directory.unlink()
    directory.mkdir(mode=0o700)
    (elsewhere / "token.json").write_text(json.dumps({"host": "127.0.0.1", "port": 50051, "pid": os.getpid(),
                                                       "token": "planted"}))
    (directory / file_name(50051)).symlink_to(elsewhere / "token.json")
    with pytest.raises(UsageError, match="is a symbolic link"):
        find_local_token("127.0.0.1:50051")


def test_a_file_others_can_read_or_write_is_refused():
    local = LocalToken.write("127.0.0.1", 50051)
    for mode in (0o644, 0o660):
        local.path.chmod(mode)
        with pytest.raises(UsageError, match=r"is (readable|writable) by (its group or )?others"):
            find_local_token("127.0.0.1:50051")
    local.path.chmod(0o600)
    assert find_local_token("127.0.0.1:50051") == local.token
    local.remove()


def test_the_token_goes_only_to_the_server_that_wrote_it():
    """Another port, another host, or a server that is gone (killed: its file left behind)
    gets nothing; loopback names reach a loopback bind."""
    local = LocalToken.write("127.0.0.1", 50051)
    assert find_local_token("localhost:50051") == find_local_token("127.0.0.1:50051") == local.token
    assert find_local_token("127.0.0.1:50052") is None
    assert find_local_token("example.org:50051") is None and find_local_token("10.9.8.7:50051") is None
    dead = subprocess.Popen(["true"])
    dead.wait()
    record = json.loads(local.path.read_text())
    local.path.write_text(json.dumps({**record, "pid": dead.pid}))
    assert find_local_token("127.0.0.1:50051") is None
    local.remove()
    assert reaches_bound("127.0.0.1", "0.0.0.0") and reaches_bound("[::1]", "::")
    assert reaches_bound("10.0.0.5", "10.0.0.5") and not reaches_bound("127.0.0.1", "10.0.0.5")
    assert not reaches_bound("10.9.8.7", "0.0.0.0")  # not an address of this machine


def test_a_configured_token_wins(target, token_file, monkeypatch):
    """A server with a token of its own writes no file; a client's flag or variable wins over a file."""
    with serve(target, auth_token_file=token_file) as control:
        assert control.local_token is None and not any(runtime_dir().glob("control-*"))
    with serve(target) as control:
        assert read_token(None, control.address) == control.local_token.token
        assert read_token(token_file, control.address) == TOKEN
        monkeypatch.setenv("PSSERVER_AUTH_TOKEN", "env-token")
        assert read_token(None, control.address) == "env-token"
        assert read_token(None) == "env-token"
    with serve(target, allow_unauthenticated_admin=True) as control:
        assert control.local_token is None
    # ``with`` on a started server does not start a second one, whose file would stay behind.
    assert not any(runtime_dir().glob("control-*"))
