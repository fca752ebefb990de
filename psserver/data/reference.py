"""``--dataset MODULE:ATTR`` with ``--dataset-args JSON``: a user's data.

``ATTR`` is a callable (a ``Dataset`` class, or a function) called with ``--dataset-args`` as
keywords, returning a ``Dataset`` (all of it trains; nothing is held out) or a ``(train,
held_out)`` pair (``held_out`` may be None); or a ``Dataset`` object itself (no arguments).
Checked in two steps: when the configuration is made (the import, the kind of object, the
arguments it accepts: a bad reference is one line before anything starts) and when a trainer
calls it (what it returns, its first sample).
"""

from __future__ import annotations

import logging
from typing import Any

from torch.utils.data import Dataset

from psserver.data.loader import check_samples
from psserver.errors import UserCodeError
from psserver.utils.references import call_user, check_arguments, load_reference

log = logging.getLogger(__name__)


def check_dataset_reference(reference: str, args: dict[str, Any]) -> None:
    """``ValueError`` of one line when ``reference`` cannot give a dataset with ``args``
    (it does not import, it is not a callable or a ``Dataset``, it does not take ``args``)."""
    _target(reference, args)


def load_user_dataset(reference: str, args: dict[str, Any]) -> tuple[Dataset, Dataset | None]:
    """The ``(train, held_out)`` of ``reference`` called with ``args`` (``held_out``: None when
    it gives one dataset); ``ValueError`` of one line for anything else, an empty dataset or
    samples that are not ``(input, target)``."""
    target = _target(reference, args)
    what = f"--dataset {reference}"
    got = target if isinstance(target, Dataset) else call_user(target, (), args, what)
    if isinstance(got, Dataset):
        train, held_out = got, None
    elif isinstance(got, tuple | list) and len(got) == 2 and isinstance(got[0], Dataset) and (
            got[1] is None or isinstance(got[1], Dataset)):
        train, held_out = got
    else:
        raise UserCodeError(f"{what} returned {_describe(got)}, not a Dataset or a (train, held_out) pair of them")
    check_samples(train, reference)
    if held_out is not None:
        check_samples(held_out, f"{reference} (held out)")
    return train, held_out


def _target(reference: str, args: dict[str, Any]) -> Any:
    what = f"--dataset {reference}"
    target = load_reference(reference, "--dataset")
    if isinstance(target, Dataset):
        if args:
            raise UserCodeError(f"{what} is a Dataset object: it takes no --dataset-args (name a class or function)")
        return target
    if not callable(target):
        raise UserCodeError(f"{what} is a {type(target).__name__}, not a Dataset, a Dataset class or a function "
                            "returning one")
    check_arguments(target, (), args, what)
    return target


def _describe(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value[:3])})"
    return f"a {type(value).__name__}"


__all__ = ["check_dataset_reference", "load_user_dataset"]
