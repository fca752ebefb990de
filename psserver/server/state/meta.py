"""What a segment's small files say, as plain data checked field by field.

``meta.json`` describes the tensors file of one generation: where each tensor is, which were
finite when written, and the checkpoint structure around them. It is JSON, never a pickle: a
reader runs no code and builds no object it did not ask for. Containers are tagged
(``{"l": [...]}`` a list, ``{"t": [...]}`` a tuple, ``{"d": [[key, value], ...]}`` a dict whose
keys may be ints, ``{"x": i}`` the i-th tensor, ``{"b": hex}`` bytes), nesting is bounded, and
a digest of the whole document is kept in it and in the tensors file's header: a file read with
another generation's metadata, or metadata changed after it was written, is refused.

``owner.json`` names the processes that own a segment; a field of the wrong type or out of
range makes the segment's owner unknown (the segment is reported as stale), never an error.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from psserver.server.state.arena import MAX_COUNT, Slot, slot_problem

FORMAT = 2
MAX_META_BYTES = 64 * 2**20
"""The largest ``meta.json`` read (its structure grows with the number of tensors, a few hundred
bytes each)."""
MAX_OWNER_BYTES = 64 * 2**10
MAX_DEPTH = 64
"""How deep the checkpoint structure may nest (a few levels in practice)."""
TENSOR = "__psserver_tensor__"
"""The reference to a tensor in the structure (``memory_state.state_layout``)."""


class MetaError(ValueError):
    """A metadata file that is not what this code writes."""


def dump_meta(generation: int, file: str, key: str, slots: list[Slot], finite: list[bool],
              structure: Any) -> tuple[bytes, bytes]:
    """``meta.json``'s bytes, and the digest its tensors file's header keeps."""
    body = {"format": FORMAT, "generation": generation, "file": file, "key": key,
            "slots": [[s.offset, s.dtype, list(s.shape)] for s in slots], "finite": finite,
            "state": _encode(structure)}
    digest = _digest(body)
    return json.dumps({**body, "digest": digest.hex()}, separators=(",", ":")).encode(), digest


def parse_meta(data: bytes) -> tuple[dict, bytes]:
    """The checked fields of ``meta.json`` (the state decoded, its tensors as references), and
    its digest; ``MetaError`` naming the first thing wrong."""
    try:
        doc = json.loads(data)
    except RecursionError:
        raise MetaError("nested too deep") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise MetaError(f"not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise MetaError(f"a {type(doc).__name__}, not an object")
    if doc.get("format") != FORMAT:
        raise MetaError(f"format {doc.get('format')!r}, this psserver reads {FORMAT}")
    digest = doc.pop("digest", None)
    if not isinstance(digest, str) or _digest(doc).hex() != digest:
        raise MetaError("its digest does not match its contents")
    generation, file, key = doc.get("generation"), doc.get("file"), doc.get("key")
    if type(generation) is not int or not 1 <= generation <= MAX_COUNT:
        raise MetaError(f"generation {generation!r}")
    if file != f"tensors-{generation}.bin":
        raise MetaError(f"file {file!r}")
    if not isinstance(key, str):
        raise MetaError(f"key {key!r}")
    raw, finite = doc.get("slots"), doc.get("finite")
    if not isinstance(raw, list) or not isinstance(finite, list) or len(finite) != len(raw):
        raise MetaError("slots and finite flags are not two lists of one length")
    slots = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[2], list)):
            raise MetaError(f"slot {item!r}")
        slot = Slot(item[0], item[1], tuple(item[2]))
        if (why := slot_problem(slot)) is not None:
            raise MetaError(f"a slot's {why}")
        slots.append(slot)
    if any(type(f) is not bool for f in finite):
        raise MetaError("a finite flag that is not true or false")
    state = _decode(doc.get("state"), len(slots), 0)
    if not isinstance(state, dict):
        raise MetaError("a state that is not a dict")
    return {"generation": generation, "file": file, "key": key, "slots": slots, "finite": finite,
            "state": state}, bytes.fromhex(digest)


def parse_owner(data: bytes | None) -> dict | None:
    """``owner.json``'s fields when each has its type and range, else None (owner unknown)."""
    try:
        owner = json.loads(data) if data is not None else None
    except (RecursionError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(owner, dict):
        return None
    pids = ("pid", "supervisor")
    counts = ("pid_start", "supervisor_start")
    texts = ("boot_id", "host", "key", "run")
    for name in pids:
        v = owner.get(name)
        if not (v is None or (type(v) is int and 0 < v < 2**31)):
            return None
    for name in counts:
        v = owner.get(name)
        if not (v is None or (type(v) is int and 0 <= v < 2**63)):
            return None
    for name in texts:
        v = owner.get(name)
        if not (v is None or (isinstance(v, str) and len(v) <= 256)):
            return None
    started = owner.get("started")
    if type(started) not in (int, float) or not (math.isfinite(started) and 0 <= started < 2**34):
        return None
    return owner


def _digest(body: dict) -> bytes:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).digest()


def _encode(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == TENSOR:
        return {"x": obj[1]}
    if isinstance(obj, dict):
        return {"d": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"l": [_encode(v) for v in obj]}
    if isinstance(obj, tuple):
        return {"t": [_encode(v) for v in obj]}
    if isinstance(obj, bytes):
        return {"b": obj.hex()}
    raise TypeError(f"a {type(obj).__name__} in the state cannot be kept in shared memory")


def _decode(obj: Any, tensors: int, depth: int) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if depth >= MAX_DEPTH:
        raise MetaError(f"the state nests deeper than {MAX_DEPTH}")
    if not (isinstance(obj, dict) and len(obj) == 1):
        raise MetaError(f"a {type(obj).__name__} where a tagged value belongs")
    (tag, value), = obj.items()
    if tag == "x":
        if type(value) is not int or not 0 <= value < tensors:
            raise MetaError(f"a reference to tensor {value!r} of {tensors}")
        return (TENSOR, value)
    if tag == "b" and isinstance(value, str):
        try:
            return bytes.fromhex(value)
        except ValueError:
            raise MetaError("bytes that are not hex") from None
    if not isinstance(value, list):
        raise MetaError(f"a {tag!r} that holds no list")
    if tag == "l":
        return [_decode(v, tensors, depth + 1) for v in value]
    if tag == "t":
        return tuple(_decode(v, tensors, depth + 1) for v in value)
    if tag == "d":
        out = {}
        for item in value:
            if not (isinstance(item, list) and len(item) == 2):
                raise MetaError("a dict's item that is not a pair")
            k = _decode(item[0], tensors, depth + 1)
            try:
                out[k] = _decode(item[1], tensors, depth + 1)
            except TypeError:  # an unhashable key
                raise MetaError(f"a dict key {type(k).__name__}") from None
        return out
    raise MetaError(f"tag {tag!r}")
