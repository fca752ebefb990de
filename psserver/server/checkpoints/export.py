"""``psserver export``: a checkpoint as the trained model's plain ``state_dict``.

The tensors go under the model's own keys (parameters and buffers, tied weights under each of
their keys), gathered from every server process's partition, so the file loads with
``model.load_state_dict(torch.load(f, weights_only=True), strict=True)`` (or
``safetensors.torch.load_file``) into the user's own class, without psserver. Beside it, a
small JSON says what it is: the model's reference and arguments, the layout's fingerprint, the
step and the run. Embedding tables, which no ``state_dict`` of the model holds, go to a file of
their own: ``<table>.ids`` (int64 ``[n]``, sorted) and ``<table>.rows`` (float32 ``[n, width]``)
for every row any server process holds.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from psserver import __version__
from psserver.checkpoint import CheckpointError, Header, checkpoint_path, find_latest, load_checkpoint
from psserver.common.partition import PartitionPlan
from psserver.errors import UsageError
from psserver.models.layout import ModelLayout
from psserver.server.checkpoints.content import check_state, load_error
from psserver.utils.state_files import FORMATS, out_format, write_atomic, write_state

log = logging.getLogger(__name__)

@dataclass
class Exported:
    """What was written (``psserver export`` reports it)."""

    model: Path
    metadata: Path
    tables: Path | None
    step: int
    tensors: int


def model_note(reference: object) -> str | None:
    """What a reader of the export's JSON should know of a model reference nothing imports by
    its name: a class of a script run by its path is ``__main__:Net``."""
    if isinstance(reference, str) and reference.startswith("__main__:"):
        return (f"{reference.partition(':')[2]} was defined in the script that trained it (its __main__), which "
                "nothing imports by that name: load the state_dict into that class where the script defines it")
    return None


def export(source: Path, out: Path) -> Exported:
    """Write the model of checkpoint ``source`` (a file, or a ``--checkpoint-dir``: its newest
    complete checkpoint) to ``out`` (``.safetensors`` or ``.pt``). ``UsageError`` of one line
    for anything that is not an exportable checkpoint or a writable ``out``."""
    fmt = out_format(out)
    header, state = _load(source)
    if state.get("layout") is None:
        raise UsageError(f"{header.path} records no model layout (written by an older psserver): resume it with this "
                         "version and let it write a checkpoint, then export that one")
    # Past check_state, what does not fit is inside the fields (a tensor of another shape than
    # the layout says, a plan other than its partition's): still the file's fault, in one line.
    try:
        layout = ModelLayout.from_dict(state["layout"])
        tensors = _tensors(header.path, state, layout)
        model_state = layout.state_dict(tensors)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
        raise UsageError(f"{header.path}: cannot export it: {load_error(e)}") from None
    try:
        tables = _tables(header.path, state)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
        raise UsageError(f"{header.path}: cannot export its embedding tables: {load_error(e)}") from None
    tables_path = out.with_name(out.stem + ".tables" + out.suffix) if tables else None
    meta = out.with_suffix(".json")
    try:
        write_state(out, fmt, model_state)
        if tables_path is not None:
            write_state(tables_path, fmt, tables)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write it ({e.strerror or e})") from None
    info: dict[str, Any] = {
        "model": state.get("model"),
        "model_args": (state.get("model_config") or {}).get("model_args") or {},
        "fingerprint": layout.fingerprint(),
        "step": int(state["global_step"]),
        "samples_seen": int(state.get("samples_seen", 0)),
        "run": header.run,
        "checkpoint": str(header.path),
        "format": fmt,
        "keys": len(model_state),
        "tables": None if tables_path is None else tables_path.name,
        "psserver": __version__,
    }
    note = model_note(state.get("model"))
    if note:
        info["model_note"] = note
    try:
        write_atomic(meta, lambda f: f.write(json.dumps(info, indent=2).encode() + b"\n"))
    except OSError as e:
        raise UsageError(f"{meta}: cannot write it ({e.strerror or e})") from None
    log.info("exported %s (step %d, %d tensors) to %s", state.get("model"), info["step"], len(model_state), out)
    return Exported(out, meta, tables_path, info["step"], len(model_state))


def _load(source: Path) -> tuple[Header, dict]:
    """Server 0's checkpoint: ``source`` itself, or the newest valid one in a directory (a
    directory of several server processes: in its ``server-0``)."""
    if not source.exists():
        if source.is_symlink():
            raise UsageError(f"{source} is a symlink that cannot be resolved ({_unresolved(source)})")
        raise UsageError(f"{source} does not exist")
    try:
        if source.is_dir():
            directory = source / "server-0" if (source / "server-0").is_dir() else source
            found = find_latest(directory)
            if found is None:
                raise UsageError(f"{source} holds no valid checkpoint")
        else:
            found = load_checkpoint(source)
        check_state(found[1], found[0].path)
        return found
    except CheckpointError as e:
        raise UsageError(str(e)) from None


def _unresolved(link: Path) -> str:
    """Why ``link`` leads nowhere: a loop, or a target that does not exist."""
    try:
        os.stat(link)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        return f"{e.strerror or e}: {os.readlink(link)}" if e.errno == errno.ENOENT else (e.strerror or str(e))
    return "it resolves now"


def _load_partition(path: Path) -> dict:
    """Another server process's file of the same checkpoint, checked as server 0's."""
    _, state = load_checkpoint(path)
    check_state(state, path)
    return state


def _tensors(path: Path, state: dict, layout: ModelLayout) -> list[torch.Tensor]:
    """One tensor per layout entry, from one server's shards, or every server's partition."""
    partition = state.get("partition")
    if partition is None:
        keys = state.get("state_keys") or [{}] * len(state["shards"])
        merged: dict[str, torch.Tensor] = {}
        for shard, names in zip(state["shards"], keys, strict=True):
            for key, value in shard["module"].items():
                merged[names.get(key, key)] = value
        missing = [e.key for e in layout.entries if e.key not in merged]
        if missing:
            raise ValueError(f"the checkpoint has no {', '.join(missing[:3])}")
        return [merged[e.key] for e in layout.entries]
    step = int(state["global_step"])
    flats = [_flat(state)]
    for server in range(1, int(partition["num_servers"])):
        other = checkpoint_path(path.parent.parent / f"server-{server}", step)
        if not other.is_file():
            raise ValueError(f"server {server}'s partition of step {step} is missing ({other})")
        part = _load_partition(other)
        if int(part["global_step"]) != step or (part.get("partition") or {}).get("server_rank") != server:
            raise ValueError(f"{other} is not server {server}'s partition of step {step}")
        flats.append(_flat(part))
    params = layout.parameters
    # The layout is the file's word: nothing of its size is made before the partitions, which
    # the files hold, add up to it.
    held, declared = sum(f.numel() for f in flats), sum(e.numel for e in params)
    if held != declared:
        raise ValueError(f"its partitions hold {held} parameter elements, its layout {declared}")
    plan = PartitionPlan.from_dict(partition["plan"])
    like = [torch.empty(e.shape, device="meta") for e in params]
    gathered = plan.gather(flats, like)
    buffers = state.get("buffers") or []
    if len(buffers) != len(layout.buffers):
        raise ValueError(f"the checkpoint holds {len(buffers)} buffers, the model {len(layout.buffers)}")
    return [t.to(e.torch_dtype) for t, e in zip(gathered, params, strict=True)] + list(buffers)


def _flat(state: dict) -> torch.Tensor:
    """A partition's pieces as one flat buffer, in the plan's order."""
    module = state["shards"][0]["module"]
    pieces = [module[k] for k in sorted(module, key=lambda k: int(k.rsplit(".", 1)[1]))]
    return torch.cat([p.reshape(-1) for p in pieces]) if pieces else torch.zeros(0)


def _tables(path: Path, state: dict) -> dict[str, torch.Tensor]:
    """Every table's rows, from every server process, sorted by id."""
    if state.get("tables") is None:
        return {}
    states = [state]
    partition = state.get("partition")
    if partition is not None:
        step = int(state["global_step"])
        for server in range(1, int(partition["num_servers"])):
            states.append(_load_partition(checkpoint_path(path.parent.parent / f"server-{server}", step)))
    out: dict[str, torch.Tensor] = {}
    for name in state["tables"]["tables"]:
        ids = torch.cat([s["tables"]["tables"][name]["ids"] for s in states])
        rows = torch.cat([s["tables"]["tables"][name]["weights"] for s in states])
        order = torch.argsort(ids)
        out[f"{name}.ids"], out[f"{name}.rows"] = ids[order], rows[order]
    return out


__all__ = ["FORMATS", "Exported", "export"]
