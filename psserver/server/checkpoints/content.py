"""What a checkpoint's payload must hold before a server resumes from it or ``psserver export``
reads it.

The checksum proves a file whole, not that psserver wrote it: a payload made by hand or by another
program (keys missing, other types) was a KeyError or TypeError half-way through a resume or an
export, an optimizer state of another shape a crash at the first step, an expanded tensor or a
forged layout gigabytes allocated. :func:`check_state` names the first field that is not what
``CheckpointPolicy._describe`` writes, before anything is built from it (the optimizer state:
``psserver.server.checkpoints.optimizer_state``); :func:`load_error` words what it does not look into
(a tensor of another shape than the model's, a table's rows) when loading fails. Both run when a
file is loaded, never per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

import torch

from psserver.checkpoint import CheckpointError
from psserver.config import OptimizerConfig
from psserver.errors import first_line
from psserver.models.layout import ModelLayout
from psserver.server.checkpoints.optimizer_state import MAX_STEPS, check_optimizer_state, is_finite

TABLE_NON_NEGATIVE = frozenset({"sum", "v", "t"})
"""An embedding table's optimizer state that is never negative: row-wise Adagrad's sums, lazy
Adam's second moments and step counts (``psserver.server.sparse.table``)."""
MAX_SERVERS = 64
"""Server processes a job may have (``--num-servers``' bound)."""
MAX_DEPTH = 32
"""How deep a payload may nest (a server's is at most 8 levels: shards, optimizer, state, ...)."""


def check_state(state: dict, path: Path) -> None:
    """``CheckpointError`` naming the first field of a loaded payload that is not what
    ``CheckpointPolicy._describe`` writes. The checksum proves a file whole, not that psserver
    wrote it: a payload made by hand or by another program (keys missing, other types) was a
    KeyError or TypeError half-way through a resume or an export. Refused like an unsafe
    payload, never skipped for an older checkpoint."""

    def bad(why: str) -> NoReturn:
        raise CheckpointError(f"{path} is not a psserver checkpoint: {why}")

    tensors = _walk(state, bad)  # first: the checks below would recurse into a payload nested too deep
    for key in ("global_step", "samples_seen"):
        if key not in state:
            bad(f"it has no {key}")
        if not _is_count(state[key]):
            bad(f"its {key} is {_kind(state[key])}, not a count")
        if state[key] > MAX_STEPS:
            bad(f"its {key} is {state[key]}, past the {MAX_STEPS} a run reaches")
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
        if "step" in table and (not _is_count(table["step"]) or table["step"] > MAX_STEPS):
            bad(f"its table {name!r} is at step {_kind(table['step'])}, not a count a run reaches")
        rows = table.get("state") or {}
        for key, value in rows.items() if isinstance(rows, dict) else ():
            if key in TABLE_NON_NEGATIVE and isinstance(value, torch.Tensor) and _is_dense(value) \
                    and not value.is_complex() and value.numel() and float(value.amin()) < 0:
                where = _path(("tables", "tables", name, "state", key))
                bad(f"its {where} holds negative values, which {key} never has")
    _check_tensors(tensors, bad, _buffer_paths(state))
    layout = state.get("layout")
    if layout is not None:
        try:
            layout = ModelLayout.from_dict(layout)
        except ValueError as e:
            bad(f"its layout is {e}")
        # A server adopts the layout before it loads the tensors: a layout the file does not
        # hold would be allocated first (a shape of 10^12: a torch allocation error). One
        # server's partition holds its share of the model, within 1/16 of the mean
        # (psserver.common.partition): the whole is at most twice the shares of all servers.
        held, declared = _elements_held(tensors), sum(e.numel for e in layout.entries)
        servers = 1 if state.get("partition") is None else state["partition"]["num_servers"]
        if servers > MAX_SERVERS:
            bad(f"its partition is one of {servers} servers, more than the {MAX_SERVERS} a job has")
        if declared > (held if servers == 1 else 2 * servers * held):
            bad(f"its layout has {declared} elements, more than the {held} its tensors hold"
                + (f" (as one of {servers} servers)" if servers > 1 else ""))
    _check_optimizers(state, bad)


def _walk(state: dict, bad: Callable[[str], NoReturn]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``state`` (dicts, lists, tuples) with the path of keys to it, walked
    without recursion; a payload nested deeper than ``MAX_DEPTH`` is refused (5,000 levels were
    a RecursionError, an internal error)."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()  # a pickle may share a container: each is walked once (a chain of shared
    stack: list[tuple[Any, tuple]] = [(state, ())]  # lists would be walked 2**depth times)
    while stack:
        value, where = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append((_path(where), value))  # every reference: each is copied where it is used
            continue
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list | tuple):
            items = enumerate(value)
        else:
            continue
        if len(where) >= MAX_DEPTH:
            bad(f"its {_path(where[:4])}... is nested more than {MAX_DEPTH} deep")
        if id(value) in seen:
            continue
        seen.add(id(value))
        stack.extend((v, (*where, k)) for k, v in items)
    found.reverse()
    return found


def _path(where: tuple) -> str:
    """Keys as a field's name in a message (each cut short)."""
    return ".".join(str(k) if len(str(k)) <= 40 else str(k)[:37] + "..." for k in where)


def _buffer_paths(state: dict) -> set[str]:
    """Where the payload holds the model's buffers (the layout's, under each shard's module, or
    a partitioned server's list): a buffer may hold inf (a causal mask's ``-inf``), never NaN."""
    paths = {_path(("buffers", i)) for i in range(len(state.get("buffers") or []))}
    try:
        buffers = {e.key for e in ModelLayout.from_dict(state["layout"]).buffers}
    except (KeyError, TypeError, ValueError):  # no layout (or a bad one, refused below): every tensor finite
        return paths
    keys = state.get("state_keys") or [{} for _ in state["shards"]]
    for i, shard in enumerate(state["shards"]):
        for key in shard["module"]:
            if keys[i].get(key, key) in buffers:
                paths.add(_path(("shards", i, "module", key)))
    return paths


def _check_tensors(tensors: list[tuple[str, torch.Tensor]], bad: Callable[[str], NoReturn],
                   buffers: set[str]) -> None:
    """Every tensor psserver writes is dense (strided), real, finite (a buffer: not NaN) and its
    own copy: a sparse, nested, quantized or complex one was an internal RuntimeError (or
    torch's warnings) in the restore or the export, and a view larger than its data
    (``torch.zeros(1).expand(n)``: a few bytes in the file) was materialised at its full size."""
    declared = 0
    for where, tensor in tensors:
        if not _is_dense(tensor) or tensor.is_complex():
            bad(f"its {where} is {_tensor_kind(tensor)}, not a dense real tensor")
        size = tensor.numel() * tensor.element_size()
        if size > tensor.untyped_storage().nbytes():
            bad(f"its {where} is a view of {size} bytes over {tensor.untyped_storage().nbytes()} bytes of data (an "
                "expanded tensor), which psserver never writes")
        declared += size
    if declared > sum(_storages(tensors).values()):
        bad(f"its tensors are views of {declared} bytes over {sum(_storages(tensors).values())} bytes of data, which "
            "psserver never writes")
    for where, tensor in tensors:
        if where in buffers:
            if tensor.is_floating_point() and tensor.numel() and (math.isnan(float(tensor.amin()))
                                                                  or math.isnan(float(tensor.amax()))):
                bad(f"its buffer {where} holds nan")
        elif not is_finite(tensor):
            bad(f"its {where} holds values that are not finite (nan or inf)")


def _storages(tensors: list[tuple[str, torch.Tensor]]) -> dict[int, int]:
    """The bytes of each distinct storage the tensors view, by address."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, t in tensors}


def _elements_held(tensors: list[tuple[str, torch.Tensor]]) -> int:
    """How many elements the file's data holds (each storage counted once, in its tensors' element size)."""
    sizes: dict[int, int] = {}
    for _, t in tensors:
        storage = t.untyped_storage()
        sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0), storage.nbytes() // t.element_size())
    return sum(sizes.values())


def _check_optimizers(state: dict, bad: Callable[[str], NoReturn]) -> None:
    """Each shard's optimizer state against its parameters (``psserver.server.checkpoints.optimizer_state``)."""
    saved = [(i, shard["optimizer"]) for i, shard in enumerate(state["shards"]) if shard.get("optimizer") is not None]
    if not saved:
        return
    if not state.get("optimizer_config"):
        bad("its shards hold optimizer state but it has no optimizer_config")
    try:
        config = OptimizerConfig(**state["optimizer_config"])
    except (ValueError, TypeError) as e:
        bad(f"its optimizer_config: {first_line(e)}")
    shapes = state.get("param_shapes") or []
    for i, optimizer in saved:
        if i >= len(shapes):
            bad(f"its param_shapes do not list shard {i}'s parameters, which its optimizer state is for")
        try:
            check_optimizer_state(optimizer, [(n, tuple(s)) for n, s in shapes[i]], config, f"shards.{i}.optimizer")
        except ValueError as e:
            bad(str(e))


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
