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
