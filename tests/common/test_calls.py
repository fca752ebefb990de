"""The server's RPC surface: what a peer's call raises goes back to it as torch's remote error,
logged here in one line, not as the traceback torch prints for each failed call."""

from __future__ import annotations

import logging
import typing

import pytest
from torch.distributed.rpc.internal import RemoteException, _handle_exception

from psserver.common import calls
from psserver.trainer.session import remote_message


class _Refusing:
    halves: typing.ClassVar[dict] = {}

    def call(self, trainer, op, args, report):
        raise ValueError(f"{trainer}'s gradient is float64, the server's parameters float32")


@pytest.fixture
def refusing():
    calls.install(_Refusing())
    yield
    calls.install(None)


def test_a_failed_call_is_the_remote_error_the_trainer_reads_and_one_line_here(refusing, caplog):
    with caplog.at_level(logging.DEBUG, logger="psserver.common.calls"):
        result = calls.call("trainer_0_1", "exchange", (), None)
    assert isinstance(result, RemoteException)
    with pytest.raises(ValueError) as raised:
        _handle_exception(result)  # what torch does with the reply on the trainer
    assert remote_message(raised.value) == "trainer_0_1's gradient is float64, the server's parameters float32"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "a call to call failed: ValueError: trainer_0_1's gradient is float64, the server's parameters float32"]
    assert warnings[0].exc_info is None
    assert [r.exc_info is not None for r in caplog.records if r.levelno == logging.DEBUG] == [True]


def test_a_call_with_no_server_installed_is_an_error_reply_too():
    calls.install(None)
    result = calls.heartbeat("trainer_0_1", None)
    assert isinstance(result, RemoteException) and "no parameter server is running" in result.msg


def test_a_routine_refusal_is_logged_at_its_own_level(caplog):
    """An evicted trainer's next call (``NotAMember``) is INFO, not a warning."""
    from psserver.server.endpoint import NotAMember

    class _Evicted(_Refusing):
        def call(self, trainer, op, args, report):
            raise NotAMember(f"{trainer} is not a member: evicted (3 non-finite gradients)")

    calls.install(_Evicted())
    try:
        with caplog.at_level(logging.INFO, logger="psserver.common.calls"):
            assert isinstance(calls.call("trainer_0_1", "exchange", (), None), RemoteException)
    finally:
        calls.install(None)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "a call to call failed: NotAMember: trainer_0_1 is not a member: evicted (3 non-finite "
                       "gradients)")]
