"""The optimizer: any of ``torch.optim``'s by name, with its own keyword arguments.

The parameter server holds one optimizer per shard, shared by every trainer (and each rank of
``--mode ddp|fsdp`` holds its own, the same choice). A user who tuned Adam's ``betas`` or SGD's
``nesterov`` names them in ``--optimizer-args``; the flags ``--lr``, ``--momentum`` and
``--weight-decay`` keep their own fields, since the learning-rate schedule, the status and the
wrapper's ``param_groups`` read them.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from psserver.config.options import option
from psserver.optim import OWN_OPTIMIZERS

OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "rmsprop")
"""The short list the help shows; every other optimizer of ``torch.optim`` is taken too (:func:`optimizer_class`)."""
REFUSED: dict[str, str] = {
    "lbfgs": "it re-evaluates the loss in its step (a closure), which the server cannot run",
    "sparseadam": "it takes sparse gradients only; the server's are dense (embedding tables have "
                  "--embedding-optimizer)",
    "muon": "it takes 2-D parameters only, and the server's optimizer holds the whole model",
}
FIXED_ARGS = ("params", "lr", "momentum", "weight_decay", "fused", "foreach", "capturable", "differentiable")
"""Arguments ``--optimizer-args`` may not set: the flags' own, and how the server runs the step."""
FUSED = ("adam", "adamw", "sgd")
"""Optimizers the server builds with ``fused=True``: one kernel per step instead of several passes
over every tensor. Measured on the 2-core VM, one thread, mnist_cnn's 1.2 M parameters: Adam 5.2 ms
per step by default, 1.4 ms with ``foreach``, 0.46 ms fused. With trainer compute the update is
most of the server's CPU per trainer step: ``python -m benchmarks.server_half --optimizer sgd
--momentum 0.9 --unfused-rounds 5`` times a whole exchange (gradient in, step, parameters out)
at 0.80 (median of 5 alternating rounds, 0.70-0.89) of the default SGD's; Adam's at 0.43."""


def _classes() -> dict[str, type[torch.optim.Optimizer]]:
    """torch's optimizers by lower-case class name, and psserver's own (``psserver.optim``)."""
    return {**{name.lower(): cls for name, cls in vars(torch.optim).items()
               if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer},
            **OWN_OPTIMIZERS}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class named ``name`` (any case: ``nadam``, ``NAdam``), or psserver's
    own (``delayed_nesterov``, ``psserver.optim``); ``ValueError`` naming the known ones, or why
    one is refused."""
    key = str(name).lower()
    if key in REFUSED:
        raise ValueError(f"--optimizer {name} is not supported: {REFUSED[key]}")
    classes = _classes()
    if key not in classes:
        known = sorted(n for n in classes if n not in REFUSED)
        raise ValueError(f"unknown optimizer {str(name)[:40]!r}; known: {', '.join(known)}")
    return classes[key]


def _accepts(cls: type, arg: str) -> bool:
    return arg in inspect.signature(cls.__init__).parameters


@dataclass
class OptimizerConfig:
    """The server-side optimizer, one instance per shard, shared by every trainer."""

    name: str = option("adam", flag="--optimizer", metavar="NAME",
                       help=f"server-side optimizer, one per shard, shared by all trainers: {', '.join(OPTIMIZERS)} "
                            "or any other of torch.optim by name (nadam, radam, adamax, adadelta, ...), or "
                            "delayed_nesterov (--update diloco --outer async) (default {default})")
    """A ``torch.optim`` optimizer, by its class name in lower case (sgd, adam, adamw, adagrad,
    rmsprop, nadam, radam, adamax, adadelta, asgd, rprop, adafactor)."""
    lr: float = option(1e-3, help="learning rate (default {default})")
    """Learning rate."""
    momentum: float = option(0.0, help="momentum (sgd, rmsprop; default {default})")
    """Momentum (the optimizers that take one: sgd, rmsprop)."""
    weight_decay: float = option(0.0, help="L2 penalty (default {default})")
    """L2 penalty (decoupled for adamw)."""
    args: dict[str, Any] = option(
        factory=dict, flag="--optimizer-args", metavar="JSON",
        help='the optimizer\'s other keyword arguments, a JSON object ({"betas": [0.9, 0.95], "eps": 1e-6}, '
             '{"nesterov": true}; default {default})', show=lambda value: "none")
    """The optimizer's other keyword arguments (``betas``, ``eps``, ``nesterov``, ``amsgrad``,
    ...), as JSON gives them (``--optimizer-args``)."""

    def __post_init__(self) -> None:
        cls = optimizer_class(self.name)
        self.name = str(self.name).lower()
        for value, what in ((self.lr, "learning rate"), (self.momentum, "momentum"),
                            (self.weight_decay, "weight decay")):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{what} must be a finite number, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"learning rate must be positive, got {self.lr}")
        if self.momentum < 0 or self.weight_decay < 0:
            raise ValueError("momentum and weight decay must be >= 0")
        if self.momentum and not _accepts(cls, "momentum"):
            raise ValueError(f"--momentum: {self.name} takes none (its own arguments go in --optimizer-args)")
        if self.weight_decay and not _accepts(cls, "weight_decay"):
            raise ValueError(f"--weight-decay: {self.name} takes none")
        if not isinstance(self.args, dict):
            raise ValueError(f"--optimizer-args must be a JSON object, got {type(self.args).__name__}")
        for key in self.args:
            if key in FIXED_ARGS:
                raise ValueError(f"--optimizer-args may not set {key!r}"
                                 + (f": use --{key.replace('_', '-')}" if key in ("lr", "momentum", "weight_decay")
                                    else ": the server decides it"))
            if not _accepts(cls, key):
                takes = [a for a in inspect.signature(cls.__init__).parameters if a not in (*FIXED_ARGS, "self")]
                raise ValueError(f"--optimizer-args: {self.name} takes no argument {str(key)[:40]!r}; "
                                 f"it takes {', '.join(takes)}")
        if not self.args:
            return
        _check_kinds(cls, self.name, self.args)
        # The optimizer's own checks of its arguments (betas in [0, 1), eps >= 0, ...), and one step
        # as the server takes it (fused where it can: the fused kernel is what refuses a string
        # ``amsgrad``), before any trainer trains. Only then: building one imports torch's compiler
        # the first time (1-2 s).
        param = torch.zeros(1, requires_grad=True)
        param.grad = torch.ones(1)
        try:
            make_optimizer([param], self, fused=True).step()
        except Exception as e:  # noqa: BLE001 - whatever the class raises is a refusal of its arguments
            raise ValueError(f"--optimizer-args {self.args}: {self.name} refuses them: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer) -> OptimizerConfig:
        """The configuration that builds ``optimizer`` again on the server: its class and the
        hyperparameters of its one parameter group (those that differ from the class's
        defaults go in :attr:`args`). ``ValueError`` for several groups, which the server's one
        optimizer over the whole model cannot keep apart, or a class not of ``torch.optim``."""
        kind = type(optimizer)
        if getattr(torch.optim, kind.__name__, None) is not kind:
            raise ValueError(f"the server builds optimizers of torch.optim only, not {kind.__module__}."
                             f"{kind.__qualname__}")
        if len(optimizer.param_groups) != 1:
            raise ValueError(f"the optimizer has {len(optimizer.param_groups)} parameter groups; the server's "
                             "optimizer is one over the whole model: pass one made of model.parameters()")
        group = optimizer.param_groups[0]
        defaults = {name: p.default for name, p in inspect.signature(kind.__init__).parameters.items()}
        args = {}
        for key, value in group.items():
            if key in FIXED_ARGS or key not in defaults:
                continue
            value = _plain(value)
            if value != _plain(defaults[key]):
                args[key] = value
        return cls(name=kind.__name__.lower(), lr=float(group["lr"]), momentum=float(group.get("momentum", 0.0)),
                   weight_decay=float(group.get("weight_decay", 0.0)), args=args)

    def describe(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.args.items())
        return f"{self.name}(lr={self.lr:g}, momentum={self.momentum:g}, weight_decay={self.weight_decay:g}{extra})"


def _check_kinds(cls: type, name: str, args: dict[str, Any]) -> None:
    """Each argument of the kind of its default: a flag (``amsgrad``) a JSON true or false, a
    number a number, a pair (``betas``) a list of as many. A string ``"yes"`` is truthy to the
    plain step and a TypeError to the fused one, and ``"no"`` would be taken as yes."""
    defaults = {key: p.default for key, p in inspect.signature(cls.__init__).parameters.items()}
    for key, value in args.items():
        default = defaults.get(key)
        if isinstance(default, bool):
            ok, kind = isinstance(value, bool), "true or false"
        elif isinstance(default, int | float):
            ok, kind = isinstance(value, int | float) and not isinstance(value, bool), "a number"
        elif isinstance(default, tuple):
            ok, kind = isinstance(value, list | tuple) and len(value) == len(default), f"a list of {len(default)}"
        else:
            continue
        if not ok:
            raise ValueError(f"--optimizer-args: {name}'s {key} is {kind}, got {str(value)[:40]!r}")


def make_optimizer(params: list, config: OptimizerConfig, *, fused: bool = False) -> torch.optim.Optimizer:
    """``config``'s optimizer over ``params`` (``fused``: its fused implementation, where it has one)."""
    cls = optimizer_class(config.name)
    kw: dict[str, Any] = {"lr": config.lr, **config.args}
    if _accepts(cls, "weight_decay"):
        kw["weight_decay"] = config.weight_decay
    if config.momentum:
        kw["momentum"] = config.momentum
    if fused and config.name in FUSED:
        kw["fused"] = True
    return cls(params, **kw)


def _plain(value: Any) -> Any:
    """A hyperparameter as JSON carries it: a tuple as a list, a one-value tensor as a number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value
