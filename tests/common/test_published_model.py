"""What a server publishes for joining trainers (``rendezvous.model_info``): whoever may write
the store can put anything under its key; a value no server writes is one line for the
trainer, never an internal error while it builds its model."""

from __future__ import annotations

import datetime
import json

import pytest
import torch.distributed as dist

from psserver.common import rendezvous
from psserver.errors import UsageError
from tests.procs import free_port

SERVED = {"model": "mlp", "model_args": {}, "pinned": True, "seed": 0, "embedding_dim": 16, "fingerprint": None,
          "devices": ["cpu"], "num_servers": 1, "host_id": "h"}


@pytest.fixture(scope="module")
def store():
    return dist.TCPStore("127.0.0.1", free_port(), None, True, datetime.timedelta(seconds=5))


def published(store, **changes) -> dict:
    store.set(rendezvous.KEY_MODEL, json.dumps({**SERVED, **changes}))
    return rendezvous.model_info(store)


def test_what_a_server_publishes_is_read_back(store):
    assert published(store) == SERVED


@pytest.mark.parametrize(("key", "value"), [
    ("seed", "abc"), ("seed", 1e29), ("seed", [1]), ("seed", -1), ("seed", 2**63), ("seed", True),
    ("embedding_dim", 0), ("embedding_dim", "16"), ("model", 5), ("model", ""), ("model_args", [1]),
    ("pinned", "yes"), ("devices", [1]), ("num_servers", 0),
])
def test_a_forged_field_is_one_line_naming_it(store, key, value):
    """A forged seed made psserver train exit 1 with 'internal error: ValueError' (and a
    traceback file) before any check."""
    with pytest.raises(UsageError, match=rf"the server's published model has a malformed '{key}'"):
        published(store, **{key: value})


def test_a_value_nested_past_the_parser_or_too_large_is_one_line(store):
    """A forged value of 100,000 nested brackets made psserver train exit 1 (RecursionError)."""
    store.set(rendezvous.KEY_MODEL, '{"model": "mlp", "model_args": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(UsageError, match="not readable JSON"):
        rendezvous.model_info(store)
    with pytest.raises(UsageError, match="model_args that is nested more than 16 deep"):
        nested: list = [1]
        for _ in range(20):
            nested = [nested]
        published(store, model_args={"a": nested})
    store.set(rendezvous.KEY_MODEL, json.dumps({**SERVED, "host_id": "x" * (2 << 20)}))
    with pytest.raises(UsageError, match="over 1048576 bytes"):
        rendezvous.model_info(store)
