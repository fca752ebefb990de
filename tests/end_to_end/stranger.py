"""Tests only: ``python -m tests.end_to_end.stranger PORT PWNED``: a process that joins the RPC group of
the psserver on 127.0.0.1:PORT as a ten-line attacker script would (torch alone: the store's
address, a name and an RPC id of its own), then asks the server and every trainer to run what is
no part of psserver's RPC surface, each attempt meant to create the file PWNED or to answer
something. Prints one JSON line (``{"members": [...], "results": {worker: {attempt: {"ok":
bool, "value" | "error": str}}}}``), then leaves the group.

``ping`` (``psserver.common.rendezvous.ping``, which psserver does call on its workers) is the
control: it answers, so the stranger is in the group and the refusals are the allow-list's.
"""

from __future__ import annotations

import builtins
import functools
import json
import os
import pathlib
import sys

import torch.distributed.rpc as rpc

from psserver.common.rendezvous import ping


def attempts(pwned: str) -> dict[str, tuple]:
    """name -> (function, args) of each attempt."""
    return {
        "ping": (ping, ()),
        "getpid": (os.getpid, ()),
        "exec": (builtins.exec, (f"open({pwned!r}, 'w').write('x')",)),
        "system": (os.system, (f"touch {pwned}",)),
        "write_text": (pathlib.Path.write_text, (pathlib.Path(pwned), "x")),
        "partial_system": (functools.partial(os.system, f"touch {pwned}"), ()),
        "getattr": (builtins.getattr, ("x", "upper")),
    }


def main(port: int, pwned: str) -> None:
    rpc.init_rpc(f"stranger_{os.getpid()}", rank=30000 + os.getpid() % 2000, world_size=None,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=20, _transports=["uv"]))
    me = rpc.get_worker_info().name
    members = sorted(w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos())
    results: dict[str, dict] = {}
    for worker in (m for m in members if m != me):
        results[worker] = {}
        for name, (fn, args) in attempts(pwned).items():
            try:
                value = rpc.rpc_sync(worker, fn, args=args, timeout=20)
                results[worker][name] = {"ok": True, "value": repr(value)}
            except Exception as e:  # noqa: BLE001 - every failure is a result here
                results[worker][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    print(json.dumps({"members": members, "results": results}), flush=True)
    try:
        rpc.shutdown(graceful=True, timeout=20)
    except Exception:  # noqa: BLE001 - leave locally then
        rpc.shutdown(graceful=False)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
