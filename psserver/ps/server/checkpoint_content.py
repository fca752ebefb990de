"""What a checkpoint's payload must hold before a server resumes from it or ``psserver export``
reads it.

The checksum proves a file whole, not that psserver wrote it: a payload made by hand or by another
program (keys missing, other types) was a KeyError or TypeError half-way through a resume or an
export. :func:`check_state` names the first field that is not what ``CheckpointPolicy._describe``
writes; :func:`load_error` words what it does not look into (optimizer state, tensor shapes) when
loading fails.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

import torch

from psserver.checkpoint import CheckpointError
from psserver.config import OptimizerConfig
from psserver.errors import first_line


def check_state(state: dict, path: Path) -> None:
    """``CheckpointError`` naming the first field of a loaded payload that is not what
    ``CheckpointPolicy._describe`` writes. The checksum proves a file whole, not that psserver
    wrote it: a payload made by hand or by another program (keys missing, other types) was a
    KeyError or TypeError half-way through a resume or an export. Refused like an unsafe
    payload, never skipped for an older checkpoint."""

    def bad(why: str) -> NoReturn:
        raise CheckpointError(f"{path} is not a psserver checkpoint: {why}")

    for key in ("global_step", "samples_seen"):
        if key not in state:
            bad(f"it has no {key}")
        if not _is_count(state[key]):
            bad(f"its {key} is {_kind(state[key])}, not a count")
    if "shards" not in state:
        bad("it has no shards")
    shards = state["shards"]
    if not isinstance(shards, list) or not shards:
        bad(f"its shards are {_kind(shards)}, not a list of the model's stages")
    for i, shard in enumerate(shards):
        module = shard.get("module") if isinstance(shard, dict) else None
        if not isinstance(module, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                   for k, v in module.items()):
            bad(f"shard {i} holds no module state (tensors by name)")
        if shard.get("optimizer") is not None and not isinstance(shard["optimizer"], dict):
            bad(f"shard {i}'s optimizer state is {_kind(shard['optimizer'])}")
    for key in ("model_config", "layout", "optimizer_config", "lr_schedule", "partition", "tables", "update"):
        if state.get(key) is not None and not isinstance(state[key], dict):
            bad(f"its {key} field is {_kind(state[key])}, not a dict")
    if state.get("model") is not None and not isinstance(state["model"], str):
        bad(f"its model is {_kind(state['model'])}, not a name")
    model_args = (state.get("model_config") or {}).get("model_args")
    if model_args is not None and not isinstance(model_args, dict):
        bad(f"its model arguments are {_kind(model_args)}, not a dict")
    keys = state.get("state_keys")
    if keys is not None and not (isinstance(keys, list) and len(keys) == len(shards)
                                 and all(isinstance(k, dict) for k in keys)):
        bad("its state_keys are not one dict of names per shard")
    shapes = state.get("param_shapes", [])
    if not isinstance(shapes, list) or not all(isinstance(stage, list) and all(_is_named_shape(x) for x in stage)
                                               for stage in shapes):
        bad("its param_shapes are not (name, shape) pairs per stage")
    buffers = state.get("buffers")
    if buffers is not None and not (isinstance(buffers, list) and all(isinstance(b, torch.Tensor) for b in buffers)):
        bad("its buffers are not a list of tensors")
    rng = state.get("rng")
    if rng is not None and not (isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8):
        bad("its rng is not a random generator's state (a uint8 tensor)")
    unknown = set(state.get("optimizer_config") or {}) - {f.name for f in fields(OptimizerConfig)}
    if unknown:
        bad(f"its optimizer_config has fields no optimizer has ({', '.join(sorted(map(str, unknown)))})")
    partition = state.get("partition")
    if partition is not None and not (_is_count(partition.get("server_rank"))
                                      and _is_count(partition.get("num_servers"))
                                      and isinstance(partition.get("plan"), dict)):
        bad("its partition is not a server rank, a number of servers and a plan")
    tables = (state.get("tables") or {"tables": {}}).get("tables")
    if not isinstance(tables, dict) or not all(
            isinstance(t, dict) and all(isinstance(t.get(k), torch.Tensor) for k in ("ids", "weights"))
            for t in tables.values()):
        bad("its tables are not ids and weights by table name")
    if "time" in state and not isinstance(state["time"], int | float):
        bad(f"its time is {_kind(state['time'])}, not a number")
    for name, table in tables.items():
        if not _is_dense(table["ids"]) or table["ids"].is_floating_point() or table["ids"].dtype == torch.bool:
            bad(f"its table {name!r} has ids that are {_tensor_kind(table['ids'])}, not dense integers")
        if not _is_dense(table["weights"]) or not table["weights"].is_floating_point():
            bad(f"its table {name!r} has weights that are {_tensor_kind(table['weights'])}, not dense floats")
    # Every tensor psserver writes is dense (strided) and real: a sparse, nested, quantized or
    # complex one was an internal RuntimeError (or torch's warnings) in the restore or the export.
    for where, tensor in _tensors(state, ()):
        if not _is_dense(tensor) or tensor.is_complex():
            bad(f"its {'.'.join(map(str, where))} is {_tensor_kind(tensor)}, not a dense real tensor")


def _tensors(value: Any, where: tuple) -> Any:
    """Every tensor in ``value`` (dicts, lists, tuples), with the path of keys to it."""
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, (*where, k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _tensors(v, (*where, i))


def _is_dense(tensor: torch.Tensor) -> bool:
    return tensor.layout == torch.strided and not tensor.is_nested and not tensor.is_quantized


def _tensor_kind(tensor: torch.Tensor) -> str:
    """A tensor in a message: its layout when not dense, else its dtype."""
    if tensor.is_nested:
        return "a nested tensor"
    if tensor.is_quantized:
        return "a quantized tensor"
    if tensor.layout != torch.strided:
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor"
    return f"a {str(tensor.dtype).removeprefix('torch.')} tensor"


def _is_count(value: Any) -> bool:
    """A non-negative int that fits torch's int64 (a step, a sample count, a rank)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _is_named_shape(value: Any) -> bool:
    return (isinstance(value, list | tuple) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], list | tuple) and all(_is_count(n) for n in value[1]))


def load_error(e: Exception) -> str:
    """``e`` in one line: a ValueError's own words, another type named (a bare KeyError is a key).
    Every line is kept (up to 240 characters): torch's load_state_dict says what is wrong below
    its first line."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or first_line(e)
    text = f"{text[:240]}{'...' if len(text) > 240 else ''}"
    return text if type(e) is ValueError else f"{type(e).__name__}: {text}"


def _kind(value: Any) -> str:
    """What a field holds, for a message: a short value, else its type."""
    text = repr(value)
    return text if len(text) <= 40 and not isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
