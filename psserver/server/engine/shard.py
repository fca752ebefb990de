"""One model stage on one device, with the optimizer that every trainer shares.

Concurrency: a trainer's backward runs long after its forward, and meanwhile another
trainer's optimizer step updates the weights in place. Autograd would then refuse the first
backward ("modified by an inplace operation"), or, after a fused step (which does not bump the
parameters' version counter), silently return the gradient of weights that forward never saw.
When more than one trainer is active the
forward therefore runs on clones of the weights taken under the shard's lock; gradients still
reach the leaf parameters through the clone. With one trainer the steps are strictly
sequential and the clone is skipped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from torch.func import functional_call

from psserver.checkpoint import CheckpointError
from psserver.config import OptimizerConfig
from psserver.config.optimizer import FUSED, make_optimizer

log = logging.getLogger(__name__)

T = TypeVar("T")


def warm_optimizers() -> threading.Thread:
    """Build a throwaway optimizer in a background thread, so the first join does not wait for it.

    torch imports its compiler (``torch._dynamo``, 1.3-1.9 s of CPU on the 2-core VM) the first time
    any optimizer adds a parameter group. A server builds the shared optimizer when the first trainer
    joins, so that trainer would wait for the import; started when the server opens, it runs while
    the trainers are still importing torch themselves. A join that comes first waits on the import lock.
    """
    def build() -> None:
        try:
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        except Exception:  # noqa: BLE001 - a warm-up only: the real optimizer reports its own errors
            log.debug("optimizer warm-up failed", exc_info=True)

    thread = threading.Thread(target=build, name="psserver-optimizer-warm-up", daemon=True)
    thread.start()
    return thread


class Shard:
    """A consecutive slice of the model placed on ``device``."""

    def __init__(self, index: int, module: nn.Module, device: torch.device) -> None:
        self.index = index
        self.device = device
        self.module = module.to(device)
        self.lock = threading.RLock()
        self.params: list[nn.Parameter] = list(self.module.parameters())
        self.names: list[str] = [n for n, _ in self.module.named_parameters()]
        self.optimizer: torch.optim.Optimizer | None = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def device_memory(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return 0

    def init_optimizer(self, config: OptimizerConfig) -> None:
        with self.lock:
            if self.optimizer is None and self.params:
                self.optimizer = make_optimizer(self.params, config, fused=True)

    def forward(self, x: torch.Tensor, *, clone: bool, train: bool = True) -> torch.Tensor:
        """Run this stage; ``x`` may be on any device (autograd records the copy)."""
        return self._on_own_stream(lambda: self._forward(x, clone=clone, train=train))

    def run(self, work: Callable[[], T], *received: torch.Tensor) -> T:
        """``work()`` on this stage's stream (on the CPU: as it is), ordered after the caller's
        stream, where ``received`` tensors were made or arrived (TensorPipe hands each call's
        CUDA tensors over on a stream of its pool); they are recorded on this stream, so their
        memory is not reused before the work is done. The server's GPU work on a shard's tensors
        (a round's sums, the update, the copies it replies with) all runs on this one stream, so
        it is ordered whatever RPC thread, and stream, each call came in on."""
        if self._stream is None:
            return work()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            out = work()
        for t in received:
            if t.is_cuda:
                t.record_stream(self._stream)
        return out

    def _on_own_stream(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, on a GPU run on this stage's own stream (the default stream is shared with
        other threads; updates run on this one), ordered after the caller's stream's work and
        before its next; the tensor it makes is handed to the caller's stream."""
        if self._stream is None:
            return make()
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            out = make()
        current.wait_stream(self._stream)
        out.record_stream(current)
        return out

    def _forward(self, x: torch.Tensor, *, clone: bool, train: bool) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True)
        with self.lock:
            self.module.train(train)
            if not train:
                with torch.no_grad():
                    return self.module(x)
            if not clone:
                return self.module(x)
            weights = {name: p.clone() for name, p in zip(self.names, self.params, strict=True)}
            return functional_call(self.module, weights, (x,), strict=True)

    def apply(self, grads: dict[nn.Parameter, torch.Tensor], scale: float = 1.0) -> None:
        """One optimizer step with ``grads`` (missing ones count as zero, as in torch)."""
        if self.optimizer is None:
            return
        with self.lock:
            if self._stream is None:
                self._step(grads, scale)
                return
            # The gradients were made on this stage's stream (backward runs on the stream of
            # its forward); step there too, so the update is ordered after them and before
            # the next forward, whatever thread (RPC or backward) applies it.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._step(grads, scale)

    def after_updates(self) -> None:
        """On a GPU, order the caller's stream after the updates launched on this stage's stream
        (a copy of the parameters from another thread would read them half applied)."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def flat(self, dtype: torch.dtype | None = None, params: list[nn.Parameter] | None = None) -> torch.Tensor:
        """The parameters (``params``: those of them, in that order) as one flat buffer of its
        own (in ``dtype``): on a GPU read on this stage's stream, so after the updates launched
        before and before those launched after, whichever thread's stream the caller is on."""
        params = self.params if params is None else params
        with self.lock:
            if not params:  # a partition of no parameters
                return torch.zeros(0, dtype=dtype or torch.float32)
            wire = dtype or params[0].dtype
            return self._on_own_stream(lambda: torch.cat([p.detach().reshape(-1) for p in params]).to(wire))

    def _step(self, grads: dict[nn.Parameter, torch.Tensor], scale: float) -> None:
        assert self.optimizer is not None
        for p in self.params:
            g = grads.get(p)
            p.grad = None if g is None else (g if scale == 1.0 else g * scale)
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        """A CPU copy of the parameters, buffers and optimizer state (taken under the lock)."""
        with self.lock:
            self.after_updates()
            return {
                "module": {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()},
                "optimizer": _to_cpu(self.optimizer.state_dict()) if self.optimizer is not None else None,
            }

    def live_state(self) -> dict:
        """``state_dict``'s structure holding this shard's own tensors, not copies (the caller
        holds the lock that keeps updates out)."""
        return {"module": dict(self.module.state_dict(keep_vars=True)),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state: dict, optimizer_config: OptimizerConfig | None) -> None:
        """``ValueError`` for a tensor of another dtype than this shard's (torch would cast it:
        a float16 weight loaded into a float32 model, silently rounded)."""
        with self.lock:
            _check_dtypes(state, self.module.state_dict(), [p.dtype for p in self.params])
            self.module.load_state_dict(state["module"])
            if state.get("optimizer") is not None:
                if optimizer_config is None:
                    raise CheckpointError("checkpoint holds optimizer state but no optimizer config")
                self.init_optimizer(optimizer_config)
                assert self.optimizer is not None
                self.optimizer.load_state_dict(state["optimizer"])
                for group in self.optimizer.param_groups:  # a checkpoint's flag (an older one's None) is not ours
                    group["fused"] = True if optimizer_config.name in FUSED else group.get("fused")


def _check_dtypes(state: dict, own: dict[str, torch.Tensor], params: list[torch.dtype]) -> None:
    """The module's tensors and the optimizer's floating state (beside ``step``) in the dtype of
    the tensors they belong to (``params``: the optimizer's parameters' dtypes, in its order)."""
    module = state.get("module")
    for key, value in (module.items() if isinstance(module, dict) else ()):
        mine = own.get(key)
        if isinstance(value, torch.Tensor) and mine is not None and value.dtype != mine.dtype:
            raise ValueError(f"its {key} is {str(value.dtype).removeprefix('torch.')}, the model's is "
                             f"{str(mine.dtype).removeprefix('torch.')}")
    optimizer = state.get("optimizer")
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    ids = groups[0].get("params") if isinstance(groups, list) and groups and isinstance(groups[0], dict) else None
    if not isinstance(ids, list) or not isinstance(optimizer.get("state"), dict):
        return  # the optimizer's own checks (check_optimizer_state) name what is wrong
    dtypes = dict(zip(ids, params, strict=False))
    for pid, entry in optimizer["state"].items():
        for key, value in (entry.items() if isinstance(entry, dict) else ()):
            want = dtypes.get(pid)
            if (key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() and want is not None
                    and value.dim() and value.dtype != want):
                raise ValueError(f"its optimizer state {pid}.{key} is {str(value.dtype).removeprefix('torch.')}, "
                                 f"its parameter's is {str(want).removeprefix('torch.')}")


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
