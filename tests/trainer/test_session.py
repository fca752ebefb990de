"""Joining the server's RPC group: what torch raises becomes one line."""

from __future__ import annotations

import pytest
from torch.distributed import rpc

from psserver.errors import UsageError
from psserver.trainer.session import JoinLost, join_rpc_group


@pytest.mark.parametrize(("raised", "caught", "line"), [
    (ValueError("Node server has target devices with invalid indices in its device map for trainer_0_1\nmore"),
     UsageError, "the devices of its RPC agents do not fit this trainer's (Node server has target devices"),
    (RuntimeError("connection refused\nmore"), JoinLost, "cannot join the RPC group of 10.0.0.5:29500: connection"),
])
def test_a_join_torch_refuses_is_one_line(monkeypatch, raised, caught, line):
    def refuse(*args, **kwargs):
        raise raised

    monkeypatch.setattr(rpc, "init_rpc", refuse)
    with pytest.raises(caught) as e:
        join_rpc_group("trainer_0_1", 3, None, "10.0.0.5:29500")
    assert line in str(e.value) and "\n" not in str(e.value)


def test_a_join_call_without_an_answer_is_a_lost_join_and_a_refusal_is_one_line():
    """A server SIGKILLed during a trainer's join call (the soak test): the trainer under
    --reconnect exited 2 with "server refused the join: ECONNRESET" instead of waiting for it."""
    from psserver.trainer.session import JoinLost, join_failure

    lost = join_failure(RuntimeError("ECONNRESET: connection reset by peer (this error originated at x.cc:1)"),
                        "127.0.0.1:29500")
    assert isinstance(lost, JoinLost) and str(lost).startswith("the join call to 127.0.0.1:29500 failed: ECONNRESET")
    refused = join_failure(RuntimeError("On WorkerInfo(id=0, name=psserver):\nValueError('layout differs')\nTb"),
                           "127.0.0.1:29500")
    assert type(refused) is UsageError and str(refused) == "server refused the join: layout differs"
