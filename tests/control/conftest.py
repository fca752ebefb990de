"""Fixtures of the control-plane tests: a fake target and servers on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from psserver.config.control import TOKEN_ENV
from psserver.control.server import ControlServer

from .fakes import TOKEN, FakeTarget, Trained, serve


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No token or address from the shell; servers' local admin tokens in a directory of the
    test's own (``$XDG_RUNTIME_DIR/psserver``), never the user's."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv("PSSERVER_CONTROL_ADDRESS", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path_factory.mktemp("run")))


@pytest.fixture
def target(tmp_path: Path) -> Iterator[FakeTarget]:
    t = FakeTarget(checkpoint_dir=tmp_path)
    yield t
    t.close()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    p = tmp_path / "token"
    p.write_text(TOKEN + "\n")
    return p


@pytest.fixture
def server(target: FakeTarget) -> Iterator[ControlServer]:
    s = serve(target)
    yield s
    s.stop()


@pytest.fixture
def auth_server(target: FakeTarget, token_file: Path) -> Iterator[ControlServer]:
    s = serve(target, auth_token_file=token_file)
    yield s
    s.stop()


@pytest.fixture
def trained() -> Iterator[Trained]:
    """A linear model stepped by a thread, with versions readers can read (``fakes.Trained``)."""
    t = Trained()
    yield t
    t.stop()
