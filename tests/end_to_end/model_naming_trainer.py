"""Tests only: ``python -m tests.end_to_end.model_naming_trainer REFERENCE ARGS_JSON train ARGS`` is ``psserver
train ARGS`` whose join names the model ``REFERENCE`` with ``ARGS_JSON`` as its arguments, whatever it
built: a peer that wants the trainers after it to call ``REFERENCE(**ARGS)`` (``os:system`` and a
command, say). Its layout and values are those of the model it did build, so the server takes them."""

from __future__ import annotations

import dataclasses
import json
import os
import sys


def install(reference: str, args: dict) -> None:
    from psserver.trainer import session

    real = session.JoinRequest

    def forged(*a, **kw):
        return dataclasses.replace(real(*a, **kw), model=reference, model_args=args)

    session.JoinRequest = forged


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # as psserver.cli.main, before torch is imported
    install(sys.argv[1], json.loads(sys.argv[2]))
    from psserver.cli import main

    sys.exit(main(sys.argv[3:]))
