"""A model's layout: the ordered names, shapes and dtypes of its ``state_dict``, as plain data.

What a server that runs none of the user's code knows of the model: the first trainer sends it
with the initial values (as Horovod's ``broadcast_parameters`` from rank 0), every later
trainer's layout is checked against its fingerprint, checkpoints record it, and ``psserver
export`` writes the trained tensors back under the model's own keys. Only strings, ints and
lists cross the wire for it (the RPC allow-list stays tight).

Order: parameters as ``named_parameters()`` gives them (the order every trainer computes its
gradients in), then the persistent buffers as ``named_buffers()`` gives them. A tensor that
several keys share (tied weights) is one entry; its other keys are ``aliases``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

LAYOUT_FORMAT = 1
PARAMETER, BUFFER = "parameter", "buffer"
MAX_DIMS = 64
"""More dimensions than any tensor of torch has (its kernels take at most 25)."""
MAX_BYTES = 1 << 50
"""1 PiB: a bound past every model, so that sizes stay within torch's int64 before a policy
(``--max-model-bytes``) is applied to them."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the model's ``state_dict``."""

    key: str
    """Its ``state_dict`` key (the first, when several keys share it)."""
    shape: tuple[int, ...]
    dtype: str
    """``torch.float32`` as ``"float32"``."""
    kind: str
    """``parameter`` or ``buffer``."""
    requires_grad: bool = True
    """False for a frozen parameter (and every buffer)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)

    def describe(self) -> str:
        return f"{self.key} {self.kind} {list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class ModelLayout:
    entries: tuple[Entry, ...]
    aliases: tuple[tuple[str, str], ...] = ()
    """(key, the entry's key it shares a tensor with), for tied weights."""

    @classmethod
    def of(cls, model: nn.Module) -> ModelLayout:
        """The layout of ``model``; ``ValueError`` for a state a server cannot hold (a
        parameter that is not floating point, a complex buffer)."""
        keys = model.state_dict(keep_vars=True)
        by_tensor: dict[int, str] = {}
        entries: list[Entry] = []
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                raise ValueError(f"parameter {name} is {p.dtype}: a parameter server holds floating-point parameters")
            entries.append(Entry(name, tuple(p.shape), _name(p.dtype), PARAMETER, p.requires_grad))
            by_tensor[id(p)] = name
        for name, b in model.named_buffers():
            if name not in keys or id(b) in by_tensor:
                continue  # a non-persistent buffer is not in the state_dict; a shared one is an alias
            if b.is_complex():  # buffers travel as one float64 tensor: the imaginary part would be lost
                raise ValueError(f"buffer {name} is {b.dtype}: a parameter server holds real-valued buffers")
            entries.append(Entry(name, tuple(b.shape), _name(b.dtype), BUFFER, False))
            by_tensor[id(b)] = name
        aliases = []
        for key, t in keys.items():
            first = by_tensor.get(id(t))
            if first is not None and first != key:
                aliases.append((key, first))
        extra = [k for k, t in keys.items() if id(t) not in by_tensor]
        if extra:
            raise ValueError(f"state_dict keys that are neither parameters nor buffers: {', '.join(extra[:5])}")
        layout = cls(tuple(entries), tuple(aliases))
        layout.check_one_dtype()
        return layout

    def check_one_dtype(self) -> None:
        """``ValueError`` unless the trained parameters share one dtype: the server keeps them,
        their gradients and the optimizer's state in flat buffers of one dtype (a float64 layer
        beside float32 ones failed at every step)."""
        trained = [e for e in self.parameters if e.requires_grad]
        kinds = dict.fromkeys(e.dtype for e in trained)
        if len(kinds) > 1:
            first = {dtype: next(e.key for e in trained if e.dtype == dtype) for dtype in kinds}
            named = ", ".join(f"{key} is {dtype}" for dtype, key in first.items())
            raise ValueError(f"its trained parameters are of {len(kinds)} dtypes ({named}): a parameter server holds "
                             "them in one dtype; convert the model with .to(dtype) first")

    @property
    def parameters(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == PARAMETER]

    @property
    def buffers(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == BUFFER]

    def fingerprint(self) -> str:
        """SHA-256 of the layout (names, shapes, dtypes, kinds, aliases), hex: equal
        fingerprints, equal layouts."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict:
        """Plain data (a checkpoint loads with ``weights_only=True``; an RPC message carries it)."""
        return {"format": LAYOUT_FORMAT,
                "entries": [[e.key, list(e.shape), e.dtype, e.kind, e.requires_grad] for e in self.entries],
                "aliases": [list(a) for a in self.aliases]}

    @classmethod
    def from_dict(cls, d: object) -> ModelLayout:
        """A layout sent or recorded as plain data, checked whole without allocating anything
        (``ValueError``: not a layout): strings for names, ints >= 0 for dimensions, known
        dtypes, a total of at most ``MAX_BYTES``."""
        try:
            if not isinstance(d, dict) or d.get("format") != LAYOUT_FORMAT:
                raise ValueError("unknown layout format")
            raw, raw_aliases = d["entries"], d.get("aliases", [])
            if not isinstance(raw, list | tuple) or not isinstance(raw_aliases, list | tuple):
                raise ValueError("its entries and aliases are not lists")
            entries = []
            for item in raw:
                if not isinstance(item, list | tuple) or len(item) != 5:
                    raise ValueError(f"an entry is {_short(item)}, not [key, shape, dtype, kind, requires_grad]")
                key, shape, dtype, kind, requires_grad = item
                if not isinstance(key, str) or kind not in (PARAMETER, BUFFER) or not isinstance(requires_grad, bool):
                    raise ValueError(f"bad entry {_short(key)}")
                if not isinstance(shape, list | tuple):
                    raise ValueError(f"bad shape of {key!r}")
                entry = Entry(key, tuple(shape), dtype, kind, requires_grad)
                _check_entry(entry)
                entries.append(entry)
            aliases = []
            for item in raw_aliases:
                if not (isinstance(item, list | tuple) and len(item) == 2 and all(isinstance(k, str) for k in item)):
                    raise ValueError(f"an alias is {_short(item)}, not [key, key]")
                aliases.append((item[0], item[1]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a model layout ({e})") from None
        keys = {e.key for e in entries}
        if len(keys) != len(entries):
            raise ValueError("not a model layout (a key is there twice)")
        for key, first in aliases:
            if first not in keys or key in keys:
                raise ValueError(f"not a model layout (alias {key!r} of {first!r} is not one of another entry)")
        layout = cls(tuple(entries), tuple(aliases))
        layout.check_one_dtype()
        if layout.nbytes() > MAX_BYTES:
            raise ValueError(f"not a model layout ({layout.nbytes()} bytes, more than the {MAX_BYTES} any model holds)")
        return layout

    def nbytes(self) -> int:
        """The bytes of every entry (numel times element size, in Python ints: nothing is
        allocated, nothing overflows); ``ValueError`` only for a malformed layout."""
        total = 0
        for e in self.entries:
            _check_entry(e)
            total += e.numel * e.torch_dtype.itemsize
        return total

    def difference(self, other: ModelLayout, limit: int = 3) -> str:
        """One line naming the first keys where ``other`` differs from this layout ("" when equal)."""
        mine = {e.key: e for e in self.entries}
        theirs = {e.key: e for e in other.entries}
        changed, missing = [], []
        for e in self.entries:
            o = theirs.get(e.key)
            if o is None:
                missing.append(f"{e.key} is missing")
            elif o != e:
                changed.append(f"{e.key} is {list(o.shape)} {o.dtype}, the server's {list(e.shape)} {e.dtype}"
                               if (o.shape, o.dtype) != (e.shape, e.dtype) else f"{e.key} differs ({o.kind})")
        extra = [f"{o.key} is not in the server's model" for o in other.entries if o.key not in mine]
        # Layers that changed first, then the first key each side lacks, then the rest.
        lines = changed + missing[:1] + extra[:1] + missing[1:] + extra[1:]
        if not lines and [e.key for e in self.entries] != [e.key for e in other.entries]:
            lines.append("the same keys in another order")
        if not lines and self.aliases != other.aliases:
            lines.append(f"tied weights differ ({list(other.aliases)} vs {list(self.aliases)})")
        more = f" (and {len(lines) - limit} more)" if len(lines) > limit else ""
        return "; ".join(lines[:limit]) + more

    def state_dict(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{key: tensor}`` under the model's own keys from one tensor per entry, aliases
        included (what ``model.load_state_dict(..., strict=True)`` takes)."""
        if len(tensors) != len(self.entries):
            raise ValueError(f"{len(tensors)} tensors for a layout of {len(self.entries)} entries")
        out = {}
        for e, t in zip(self.entries, tensors, strict=True):
            if tuple(t.shape) != e.shape:
                raise ValueError(f"{e.key}: a tensor of shape {tuple(t.shape)} for an entry of {e.shape}")
            out[e.key] = t
        for key, first in self.aliases:
            out[key] = out[first]
        return out


def values_of(model: nn.Module, layout: ModelLayout) -> list[torch.Tensor]:
    """The model's tensors in ``layout``'s order, detached, on the CPU."""
    state = model.state_dict()
    return [state[e.key].detach().to("cpu") for e in layout.entries]


def _check_entry(e: Entry) -> None:
    """``ValueError`` for an entry that no tensor can have: dimensions that are not ints >= 0
    (or too many of them), a name that is no dtype, a parameter that is not floating point."""
    if not isinstance(e.key, str) or not e.key.isprintable() or not 0 < len(e.key) <= 1024:
        raise ValueError(f"bad entry {_short(e.key)}: a key is one line of printable characters")
    if len(e.shape) > MAX_DIMS or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                          for n in e.shape):
        raise ValueError(f"bad shape of {e.key!r}: {_short(list(e.shape))}")
    if not isinstance(e.dtype, str):
        raise ValueError(f"bad dtype of {e.key!r}: {_short(e.dtype)}")
    dtype = dtype_of(e.dtype)
    if e.kind == PARAMETER and not dtype.is_floating_point:
        raise ValueError(f"parameter {e.key!r} is {e.dtype}: a parameter server holds floating-point parameters")
    if e.numel * dtype.itemsize > MAX_BYTES:
        raise ValueError(f"{e.key!r} of shape {_short(list(e.shape))} is larger than any model")


def _short(value: object) -> str:
    """A value in a message, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


__all__ = ["BUFFER", "PARAMETER", "Entry", "ModelLayout", "dtype_of", "values_of"]
