"""How the state is laid out in its file, and what a restart checks before it maps it again.

The checks cost a pass over the tensors once per generation (a few times in a run: the finite
flags) and once at a restart; nothing per update. A checksum of the tensors would cost a pass
over the state per update, which the state in memory exists to avoid (``benchmarks.state_copy``):
instead the restart checks the size of everything against the slots, the metadata's digest
against the one in the tensors file, the journal's counters, and that every tensor that was
finite when its generation was written still is (a state overwritten with NaN, or garbage).
"""

from __future__ import annotations

from typing import Any

import torch

from psserver.server.state.arena import HEADER_BYTES, SUPPORTED, Arena, aligned
from psserver.server.state.meta import TENSOR

_FINITE_CHUNK = 1 << 22


def state_layout(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` (nested dicts, lists and tuples) with each tensor replaced by a reference, and
    its tensors in the order of the references, each tensor object once: how the state in memory
    lays out its file (``benchmarks.state_copy`` lays out its host copy so too)."""
    tensors: list[torch.Tensor] = []
    return _refs(state, tensors, {}), tensors


def _refs(obj: Any, tensors: list[torch.Tensor], seen: dict[int, int]) -> Any:
    """``obj`` with each tensor replaced by its index in ``tensors`` (one per tensor object)."""
    if isinstance(obj, torch.Tensor):
        index = seen.get(id(obj))
        if index is None:
            index = seen[id(obj)] = len(tensors)
            tensors.append(obj)
        return (TENSOR, index)
    if isinstance(obj, dict):
        return {k: _refs(v, tensors, seen) for k, v in obj.items()}
    if isinstance(obj, torch.Size):
        return tuple(obj)
    if isinstance(obj, (list, tuple)):
        out = [_refs(v, tensors, seen) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def fill(obj: Any, views: list[torch.Tensor]) -> Any:
    """``obj`` with each reference replaced by its tensor in ``views``."""
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == TENSOR:
        return views[obj[1]]
    if isinstance(obj, dict):
        return {k: fill(v, views) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fill(v, views) for v in obj]
    if isinstance(obj, tuple):
        return tuple(fill(v, views) for v in obj)
    return obj


def check(arena: Arena, meta: dict, digest: bytes) -> str | None:
    """What makes ``arena`` not the tensors ``meta`` describes (None: nothing): another
    generation's metadata, a size that is not the slots', impossible counters."""
    if arena.digest() != digest:
        return f"{arena.path.name} was not written with this metadata (their digests differ)"
    journal = arena.journal()
    if journal.generation != meta["generation"]:
        return f"{arena.path.name} is generation {journal.generation}, its metadata names {meta['generation']}"
    why = journal.problem()
    if why is not None:
        return f"its journal says {why}"
    end = HEADER_BYTES  # the header's end, then each slot's in turn
    for slot in meta["slots"]:
        if slot.offset != end:
            return f"a tensor at byte {slot.offset}, where the one before it ends at {end}"
        end += aligned(slot.nbytes)
    if end != arena.size:
        return f"{arena.path.name} is {arena.size} bytes, its tensors take {end}"
    return None


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite (in chunks: no copy of the whole tensor)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + _FINITE_CHUNK]).all()) for i in range(0, flat.numel(), _FINITE_CHUNK))


def unplaceable(tensors: list[torch.Tensor]) -> str | None:
    """Why some of ``tensors`` cannot be placed in the file (None: all can)."""
    for t in tensors:
        if t.device.type != "cpu":
            return f"a tensor on {t.device} cannot be kept in shared memory"
        if t.layout != torch.strided or t.dtype not in SUPPORTED:
            return f"a {t.layout} tensor of {t.dtype} cannot be kept in shared memory"
    return None
