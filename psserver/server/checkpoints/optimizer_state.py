"""A checkpoint's optimizer state, checked against the parameters it will update before it is loaded.

torch's ``Optimizer.load_state_dict`` takes a state tensor of any shape (it only casts dtypes):
an Adam ``exp_avg`` of shape [1] for a [256, 784] weight loaded, and the fused step then wrote
past its end (SIGSEGV); a negative ``exp_avg_sq`` made every step's square root nan. What each
optimizer keeps is not listed here: a throwaway optimizer of the same class, with the
checkpoint's own hyperparameters, takes one step on a small stand-in of each rank of parameter,
and what it then holds is what the saved state must look like: the same keys, a tensor shaped
like the parameter where the stand-in's is shaped like the stand-in (a reduced dimension where
it has one, Adafactor's row and column variances), a scalar where it holds a scalar (``step``).
It runs once per load, never per step.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import torch

from psserver.config import OptimizerConfig
from psserver.config.optimizer import FUSED, optimizer_class
from psserver.errors import first_line

MAX_STEPS = 1 << 53
"""Steps and sample counts a checkpoint may hold: every one is exact in a float64, and a run
that resumes at it still counts on for ever within int64 (2**63 - 1 made the next step fail)."""
NON_NEGATIVE = frozenset({
    "step", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "sum", "square_avg", "acc_delta", "step_size", "variance",
    "row_var", "col_var", "eta", "mu", "mu_product",
})
"""State that torch's optimizers keep >= 0 (second moments, their maxima and sums, step sizes,
counts): a negative one becomes a nan under a square root, or a step the wrong way."""
_STAND_IN_DIMS = 12
"""Dimensions of a stand-in that are 2 (a stand-in of more dimensions is 1 in its first ones)."""


def check_optimizer_state(saved: Any, shapes: list[tuple[str, tuple[int, ...]]], config: OptimizerConfig,
                          where: str) -> None:
    """``ValueError`` naming the first field of ``saved`` (one shard's ``optimizer.state_dict()``,
    at ``where`` in the checkpoint) that the optimizer of ``config`` over parameters of ``shapes``
    (name, shape) would not have made."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        raise ValueError(f"its {where} is not an optimizer's state (state and param_groups)")
    groups = saved["param_groups"]
    if len(groups) != 1 or not isinstance(groups[0], dict):
        raise ValueError(f"its {where}.param_groups are not one group (the server's optimizer has one)")
    group = groups[0]
    ids = group.get("params")
    if not (isinstance(ids, list) and all(_is_int(i) for i in ids) and len(set(ids)) == len(ids)
            and len(ids) == len(shapes)):
        raise ValueError(f"its {where}.param_groups.0.params are not {len(shapes)} distinct parameter ids")
    expected = _stand_in_state(group, {len(shape) for _, shape in shapes}, config, where)
    position = {i: n for n, i in enumerate(ids)}
    for pid, state in saved["state"].items():
        if pid not in position:
            raise ValueError(f"its {where}.state holds {_short(pid)}, which is none of its parameters' ids")
        name, shape = shapes[position[pid]]
        field = f"{where}.state.{pid}"
        if not isinstance(state, dict):
            raise ValueError(f"its {field} is {_short(state)}, not the state of parameter {name}")
        if state:
            _check_parameter_state(state, expected[len(shape)], shape, name, field, config.name)


def _check_parameter_state(state: dict, expected: dict[str, Any], shape: tuple[int, ...], name: str, field: str,
                           optimizer: str) -> None:
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    if missing or extra:
        what = f"has no {missing[0]}" if missing else f"has {_short(extra[0])}"
        raise ValueError(f"its {field} (parameter {name}) {what}: {optimizer} keeps {', '.join(expected) or 'none'}")
    for key, like in expected.items():
        value, at = state[key], f"{field}.{key}"
        if isinstance(like, torch.Tensor):
            want = _expected_shape(tuple(like.shape), len(shape), shape)
            if _is_number(value) and want == ():  # a step of an older torch: a number
                _check_number(value, key, at)
                continue
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"its {at} is {_short(value)}, not a tensor")
            if value.dtype == torch.bool or value.is_complex() or (
                    like.is_floating_point() and want != () and not value.is_floating_point()):
                raise ValueError(f"its {at} is {_dtype(value)}, {optimizer} keeps it {_dtype(like)}")
            if tuple(value.shape) != want:
                raise ValueError(f"its {at} has shape {list(value.shape)}, {optimizer} keeps it {list(want)} for "
                                 f"parameter {name} of shape {list(shape)}")
            _check_values(value, key, at)
        elif like is None:
            if value is not None:
                raise ValueError(f"its {at} is {_short(value)}, {optimizer} keeps None")
        elif type(value) is not type(like) or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"its {at} is {_short(value)}, {optimizer} keeps a {type(like).__name__}")


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite: its minimum and maximum are (a nan is either),
    two reductions that allocate nothing (``isfinite(t).all()`` makes a tensor of bools first,
    and took 10 times longer)."""
    if not tensor.is_floating_point() or not tensor.numel():
        return True
    return math.isfinite(float(tensor.amin())) and math.isfinite(float(tensor.amax()))


def _check_values(value: torch.Tensor, key: str, at: str) -> None:
    """Finite, >= 0 where the optimizer keeps it so, a step count within ``MAX_STEPS``."""
    if not is_finite(value):
        raise ValueError(f"its {at} holds values that are not finite (nan or inf)")
    if not value.numel():
        return
    if key in NON_NEGATIVE and float(value.amin()) < 0:
        raise ValueError(f"its {at} holds negative values, which {key} never has")
    if key == "step" and float(value.amax()) > MAX_STEPS:
        raise ValueError(f"its {at} is past {MAX_STEPS} steps")


def _check_number(value: float, key: str, at: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"its {at} is {value}, not a finite number")
    if key in NON_NEGATIVE and value < 0:
        raise ValueError(f"its {at} is {value}, which {key} never is")
    if key == "step" and value > MAX_STEPS:
        raise ValueError(f"its {at} is past {MAX_STEPS} steps")


def _stand_in(ndim: int) -> tuple[int, ...]:
    """A small shape of ``ndim`` dimensions whose size 2 tells a kept dimension from a reduced one."""
    ones = max(0, ndim - _STAND_IN_DIMS)
    return (1,) * ones + (2,) * (ndim - ones)


def _expected_shape(kept: tuple[int, ...], ndim: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a state tensor of the stand-in's shape ``kept`` has for a parameter of ``shape``:
    the stand-in's dimensions of 2 (and 1 where it is 1) are the parameter's, a 1 where the
    stand-in has 2 stays 1; a tensor of another rank (a scalar) keeps its own shape."""
    if len(kept) != ndim:
        return kept
    stand_in = _stand_in(ndim)
    return tuple(1 if n == 1 and s == 2 else real for n, s, real in zip(kept, stand_in, shape, strict=True))


def _stand_in_state(group: dict, ranks: set[int], config: OptimizerConfig, where: str) -> dict[int, dict[str, Any]]:
    """What an optimizer of ``config``'s class with ``group``'s hyperparameters holds for a
    parameter of each rank in ``ranks`` after one step (by rank)."""
    cls = optimizer_class(config.name)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    for key, value in group.items():
        if key != "params" and not _is_plain(value):
            raise ValueError(f"its {where}.param_groups.0.{_short(key)} is {_short(value)}, not a hyperparameter")
    hyper = {k: v for k, v in group.items() if k in accepted}
    if config.name in FUSED:
        hyper["fused"] = True  # what the server sets after loading (CheckpointPolicy's shard)
    params = {ndim: torch.zeros(_stand_in(ndim), requires_grad=True) for ndim in sorted(ranks)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = cls(list(params.values()), **hyper)  # the class's checks of its hyperparameters
            # Then the group as the server loads it: torch takes the saved group whole (a key
            # it lacks, say lr, failed every step), and the server sets fused after it.
            optimizer.load_state_dict({"state": {}, "param_groups": [{**group, "params": list(range(len(params)))}]})
            for g in optimizer.param_groups:
                g["fused"] = True if config.name in FUSED else g.get("fused")
            for p in params.values():
                p.grad = torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape)
            optimizer.step()
    except KeyError as e:
        raise ValueError(f"its {where}.param_groups.0 has no {_short(e.args[0] if e.args else e)}, which a step "
                         f"of {config.name} needs") from None
    except Exception as e:  # noqa: BLE001 - whatever the class refuses, the checkpoint's hyperparameters did
        raise ValueError(f"its {where}.param_groups.0 are hyperparameters {config.name} refuses: "
                         f"{first_line(e)[:160]}") from None
    return {ndim: dict(optimizer.state[p]) for ndim, p in params.items()}


def _is_plain(value: Any, depth: int = 0) -> bool:
    """A hyperparameter as torch keeps one: a finite number, a bool, None, a string, or a short
    tuple of those (betas, eps pairs)."""
    if value is None or isinstance(value, bool | str):
        return True
    if isinstance(value, int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple) and depth == 0 and len(value) <= 8:
        return all(_is_plain(v, 1) for v in value)
    return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, torch.Tensor) else f"a {_dtype(value)} tensor"
    return text if len(text) <= 40 else text[:37] + "..."
