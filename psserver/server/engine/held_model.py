"""The model a server holds when it runs none of the user's code: tensors in a layout's order.

A server started without ``--model`` learns the model from the first trainer that joins (its
:class:`~psserver.models.layout.ModelLayout` and initial values) or from the checkpoint it
resumes; it needs the parameters for the optimizer and the buffers for the trainers, never a
forward. :class:`HeldModel` is that: an ``nn.Module`` whose parameters and buffers are the
layout's entries in its order (the order of ``parameters()`` on every trainer), and whose
``state_dict`` is the model's own, under its own keys: a checkpoint of a server without
``--model`` holds what one with it would, and ``psserver export`` writes it as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from psserver.models.layout import PARAMETER, ModelLayout


class HeldModel(nn.Module):
    def __init__(self, layout: ModelLayout, values: Sequence[torch.Tensor] | None = None) -> None:
        """``values``: one tensor per entry (checked: :func:`check_values`); None: zeros (a
        checkpoint's state is loaded next)."""
        super().__init__()
        self.layout = layout
        if values is not None:
            check_values(layout, values)
        self._slots: list[str] = []
        for i, e in enumerate(layout.entries):
            value = (values[i].detach().clone() if values is not None
                     else torch.zeros(e.shape, dtype=e.torch_dtype))
            slot = f"t{i}"  # attribute names cannot hold the model's dotted keys
            if e.kind == PARAMETER:
                self.register_parameter(slot, nn.Parameter(value, requires_grad=e.requires_grad))
            else:
                self.register_buffer(slot, value)
            self._slots.append(slot)

    def tensors(self) -> list[torch.Tensor]:
        """Parameters and buffers, in the layout's order."""
        return [getattr(self, slot) for slot in self._slots]

    def forward(self, *args, **kwargs):
        raise RuntimeError("this server holds the model's tensors, not its code: it was started without --model "
                           "(trainers compute: --compute trainer)")

    # The model's own keys in (and out of) the state_dict, aliases of tied weights included.
    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        tensors = self.tensors()
        state = self.layout.state_dict([t if keep_vars else t.detach() for t in tensors])
        for key, t in state.items():
            destination[prefix + key] = t

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        expected = {e.key: t for e, t in zip(self.layout.entries, self.tensors(), strict=True)}
        aliases = dict(self.layout.aliases)
        for key, t in expected.items():
            value = state_dict.get(prefix + key)
            if value is None:
                missing_keys.append(prefix + key)
            elif tuple(value.shape) != tuple(t.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                  f"the model's is {tuple(t.shape)}")
            else:
                with torch.no_grad():
                    t.copy_(value)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and
                                   k[len(prefix):] not in expected and k[len(prefix):] not in aliases)


def layout_bytes(layout: ModelLayout) -> int:
    """Bytes of the tensors ``layout`` declares, in Python integers: known before any is allocated."""
    return sum(max(e.numel, 0) * e.torch_dtype.itemsize for e in layout.entries)


def check_values(layout: ModelLayout, values: Sequence[torch.Tensor]) -> None:
    """``ValueError`` (one line) unless ``values`` are one tensor per entry of ``layout``, of its
    shape and dtype, finite for a parameter. A buffer may hold NaN or inf: a causal mask of
    ``-inf`` (``nn.Transformer.generate_square_subsequent_mask``) is a constant, and the server
    refuses what trainers send only where it was finite (``psserver.common.tensors``)."""
    if not isinstance(values, list | tuple) or len(values) != len(layout.entries):
        raise ValueError(f"{len(values) if isinstance(values, list | tuple) else type(values).__name__} initial "
                         f"values for a model of {len(layout.entries)} tensors")
    for e, v in zip(layout.entries, values, strict=True):
        if not isinstance(v, torch.Tensor) or v.layout != torch.strided or tuple(v.shape) != e.shape \
                or v.dtype != e.torch_dtype:
            got = (f"{list(v.shape)} {v.dtype}" + ("" if v.layout == torch.strided else f" {v.layout}")
                   if isinstance(v, torch.Tensor) else type(v).__name__)
            raise ValueError(f"initial value of {e.key} is {got}, its layout says {list(e.shape)} {e.dtype}")
        if v.is_complex():  # buffers travel as one float64 tensor: the imaginary part would be lost
            raise ValueError(f"initial value of {e.key} is complex, which the server does not hold")
        if e.kind == PARAMETER and v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise ValueError(f"initial value of {e.key} is not finite (NaN or inf)")
        if v.is_floating_point() and bool(torch.isnan(v).any()):  # a buffer's inf is a mask; NaN is no value
            raise ValueError(f"initial value of {e.key} holds NaN")
