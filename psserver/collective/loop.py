"""The collective training loop: the same models, data and metrics as the parameter server.

Every rank runs :func:`train_worker`. Each reads its data-parallel shard through a DataLoader
with ``DistributedSampler`` semantics (``set_epoch`` each epoch; ``psserver.data.Batches``, as
a parameter-server trainer; a map-style dataset only: every rank must take the same number of
steps), steps its local optimizer on gradients the
strategy synchronises, and every ``SYNC_EVERY`` steps all ranks exchange one small row
(progress and rank 0's control requests) so a checkpoint or drain asked for over gRPC runs
on all ranks at the same step. At the end all ranks evaluate a shard of the held-out split
and rank 0 prints the model's metric (accuracy, or the held-out loss).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, TensorDataset

from psserver.collective.base import Strategy, create_strategy, local_tensor
from psserver.collective.checkpoint import CheckpointManager
from psserver.collective.launcher import DistEnv
from psserver.collective.status import ROW, SYNC_EVERY, CollectiveStatus, control_server, metrics_endpoint
from psserver.config.collective import CollectiveConfig
from psserver.config.optimizer import OptimizerConfig, make_optimizer
from psserver.data import Batches, check_batch, default_workers, load_dataset
from psserver.errors import DataError, UsageError
from psserver.models import build_model, get_model_spec
from psserver.models.calling import call_model, input_batch_size, move_input
from psserver.models.losses import get_loss
from psserver.utils.progress import Progress

log = logging.getLogger(__name__)

COLLECTIVE_METRICS = ("accuracy", "loss")
"""What ``--mode ddp|fsdp`` evaluates at the end: a model scored otherwise trains with ``--mode ps``."""

STRATEGY_MODULES = {"ddp": "psserver.collective.ddp", "fsdp": "psserver.collective.fsdp"}
"""Where the built-in strategies live. Each registers itself (by name) on import, and only the
one a run asks for is imported: FSDP's import pulls DTensor and sympy, 0.6 s of a DDP rank's
start. The base never imports them."""


def strategy_for(config: CollectiveConfig, env: DistEnv) -> Strategy:
    """The strategy of ``config.mode``, its module imported first if it is a built-in one."""
    module = STRATEGY_MODULES.get(config.mode)
    if module is not None:
        importlib.import_module(module)
    return create_strategy(config, env)


def build_optimizer(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The local optimizer of each rank (same choices as the parameter server's)."""
    return make_optimizer(params, cfg)


def parameter_hash(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter's full value, in name order (gathers DTensors: call on all ranks)."""
    h = hashlib.sha256()
    # Gathering a 2-D (dp, tp) DTensor warns about sequential all-gathers: expected here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(local_tensor(p.detach()).float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def parameter_digest(module: torch.nn.Module) -> list[list[float]]:
    """Per parameter, in name order: [sum, L2 norm] in float64 (gathers DTensors: call on all ranks).

    For comparing replicas with a tolerance where bit equality is not promised: PowerSGD
    recomputes each rank's gradient from all-reduced factors with local matmuls, and MKL's
    results can differ in the last bit with the operands' memory alignment.
    """
    out = []
    for _, p in sorted(module.named_parameters()):
        t = local_tensor(p.detach()).double().cpu()
        out.append([float(t.sum()), float(t.norm())])
    return out


def tensor_layouts(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """For each DTensor parameter: its mesh dimension names and placements."""
    out = {}
    for name, p in module.named_parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            out[name] = {"mesh": list(mesh.mesh_dim_names or ()), "placements": [str(x) for x in p.placements],
                         "local_shape": list(p.to_local().shape), "shape": list(p.shape)}
    return out


class CollectiveTrainer:
    """Model, optimizer, data and loop of one rank."""

    def __init__(self, config: CollectiveConfig, env: DistEnv, strategy: Strategy | None = None) -> None:
        self.config = config
        self.env = env
        self.spec = get_model_spec(config.model, config.model_args)
        if self.spec.metric not in COLLECTIVE_METRICS:
            raise UsageError(f"--mode {config.mode} reports {' or '.join(COLLECTIVE_METRICS)}; model "
                             f"{self.spec.name} is scored by {self.spec.metric}: train it with --mode ps")
        self.loss_fn = get_loss(self.spec.loss)
        model = build_model(self.spec, config.seed)
        self.num_params = sum(p.numel() for p in model.parameters())
        torch.manual_seed(config.seed + 1000 + env.rank)  # dropout differs by rank, the weights do not
        self.strategy = strategy or strategy_for(config, env)
        self.module = self.strategy.setup(model)
        self.optimizer = build_optimizer(self.module.parameters(), config.optimizer)
        self.global_step = 0

    # -- one step (also what benchmarks/collective_overhead.py times) -------------------------
    def train_step(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        """Forward, backward (gradients synchronised by the strategy), optimizer step."""
        device = self.env.device
        xb = move_input(xb, device, non_blocking=True)
        yb = yb.to(device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(call_model(self.module, xb).float(), yb)
        loss.backward()
        self.optimizer.step()
        self.global_step += 1
        self.strategy.after_optimizer_step(self.global_step)
        return loss.detach()

    def evaluate(self, eval_set) -> float:
        """The model's metric over the whole held-out split (accuracy, or the mean of the
        training loss); every rank evaluates a contiguous shard."""
        x, y = eval_set.tensors
        dp, rank = self.strategy.dp_size, self.strategy.dp_rank
        per_rank = -(-len(x) // dp)
        lo, hi = min(rank * per_rank, len(x)), min((rank + 1) * per_rank, len(x))
        bs = self.config.eval_batch_size
        module = self.strategy.eval_module
        module.eval()
        correct = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        with torch.no_grad():
            for start in range(0, per_rank, bs):  # same number of forwards on every rank (FSDP needs it)
                a, b = lo + start, min(lo + start + bs, hi)
                real = b > a
                xb = x[a:b] if real else x[:1]
                out = module(xb.to(self.env.device))
                if real and self.strategy.counts_for_eval:
                    if self.spec.metric == "loss":
                        correct[0] += float(self.loss_fn(out.float().cpu(), y[a:b])) * (b - a)
                    else:
                        correct[0] += (out.argmax(dim=1).cpu() == y[a:b]).sum().item()
                    correct[1] += b - a
        module.train()
        dist.all_reduce(correct)
        return float(correct[0] / correct[1]) if correct[1] > 0 else float("nan")


def _in_memory(dataset, name: str, batch_size: int) -> TensorDataset:
    """A held-out set as tensors (every rank evaluates a contiguous part of it: the same number
    of forwards on every rank, which FSDP needs): read whole through a DataLoader unless it is
    a ``TensorDataset`` of one input tensor already."""
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset
    xs, ys = [], []
    batches = Batches(dataset, name=f"{name} (held out)", batch_size=batch_size, shuffle=False)
    try:
        for x, y in batches.epoch(0):
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                raise DataError(f"dataset {name}: --mode ddp|fsdp evaluates held-out samples whose input and target "
                                "are tensors")
            xs.append(x)
            ys.append(y)
    finally:
        batches.close()
    return TensorDataset(torch.cat(xs), torch.cat(ys))


def train_worker(config: CollectiveConfig, env: DistEnv) -> int:
    """Body of every rank (see ``psserver.collective.launcher.launch``)."""
    trainer = CollectiveTrainer(config, env)
    return Fit(trainer).run()


class Fit:
    """The loop around :class:`CollectiveTrainer`: epochs, sync points, checkpoints, results."""

    def __init__(self, trainer: CollectiveTrainer) -> None:
        self.t = trainer
        config, env = trainer.config, trainer.env
        self.config, self.env, self.strategy = config, env, trainer.strategy
        self.train_set, self.eval_set = load_dataset(
            config.data, self.t.spec.input_shape, self.t.spec.num_classes, self.t.spec.input_dtype)
        if isinstance(self.train_set, IterableDataset):
            raise DataError(f"--mode {config.mode} needs a map-style dataset (every rank takes the same number of "
                            f"steps); {config.data.dataset} is an IterableDataset: train it with --mode ps")
        workers = config.data.workers if config.data.workers is not None else default_workers(config.data)
        self.data = Batches(self.train_set, name=config.data.dataset, batch_size=config.batch_size,
                            rank=self.strategy.dp_rank, num_replicas=self.strategy.dp_size, seed=config.data.seed,
                            workers=workers, pin_memory=env.device.type == "cuda")
        assert self.data.steps_per_epoch is not None
        self.steps_per_epoch = self.data.steps_per_epoch
        self.total = self.steps_per_epoch * config.epochs
        if config.max_steps:
            self.total = min(self.total, config.max_steps)
        self.ckpt = CheckpointManager(config.checkpoint, env.rank, env.world_size)
        self.status = CollectiveStatus(config.mode, config.model, trainer.num_params, env.world_size,
                                       self.strategy.devices(), self.ckpt.enabled, config.checkpoint.every_steps)
        self.losses: list[float] = []
        self.hash_history: list[str] = []
        self.samples = 0
        self.stop = False
        self._pending: list[torch.Tensor] = []

    def run(self) -> int:
        with ExitStack() as stack:
            if self.env.rank == 0:
                stack.enter_context(control_server(self.status, self.config.control))
                stack.enter_context(metrics_endpoint(self.status, self.config.observability))
            try:
                return self._run()
            finally:
                self.status.set_state("STOPPED")

    def _run(self) -> int:
        config, env = self.config, self.env
        epoch, batch = 0, 0
        path = self.ckpt.resume_path() if self.ckpt.enabled else None
        if path is not None:
            saved = self.ckpt.load(path, self.t.module, self.t.optimizer)
            self.t.global_step = saved["step"]
            epoch, batch = saved["epoch"], saved["batch"]
            if saved.get("world_size", env.world_size) != env.world_size:
                log.warning("checkpoint saved by %d ranks, resuming with %d: epoch %d restarts from its first batch",
                            saved["world_size"], env.world_size, epoch)
                batch = 0
        log.info("%s: %d ranks, %s (%d parameters), %d training samples per rank, %d steps per epoch, "
                 "%d steps to go", self.strategy.describe(), env.world_size, config.model, self.t.num_params,
                 self.data.samples_per_epoch, self.steps_per_epoch, max(0, self.total - self.t.global_step))
        self.status.global_step = self.t.global_step
        self.status.ready.set()
        self.status.set_state("SERVING")
        t0 = time.monotonic()
        progress = Progress(max(0, self.total - self.t.global_step), desc=f"{config.mode} rank 0",
                            enabled=config.progress if env.rank == 0 else False)
        try:
            self._epochs(epoch, batch, progress)
        finally:
            progress.close()
            self.data.close()
        elapsed = time.monotonic() - t0
        self.status.set_state("DRAINING")
        if self.ckpt.enabled and (self.ckpt.last is None or self.ckpt.last.step != self.t.global_step):
            self._save(self._position())
        if self.stop:
            log.warning("stopped on request at step %d", self.t.global_step)
            self._write_result(float("nan"), elapsed)
            return 0
        metric = self.t.spec.metric
        if self.eval_set is None:
            log.warning("dataset %s has no held-out set: evaluation skipped (%s nan)", config.data.dataset, metric)
            value = float("nan")
        else:
            value = self.t.evaluate(_in_memory(self.eval_set, config.data.dataset, config.eval_batch_size))
        self._write_result(value, elapsed)
        if env.rank == 0:
            rate = self.samples * self.strategy.dp_size / max(elapsed, 1e-6)
            final_loss = self.losses[-1] if self.losses else float("nan")
            log.info("%d steps in %.1fs (%.0f samples/s over %d ranks), final loss %.4f",
                     self.t.global_step, elapsed, rate, env.world_size, final_loss)
            log.info("%s: %.4f", metric, value)
            print(f"rank 0 {metric} {value:.4f}", flush=True)
        return 0

    def _epochs(self, epoch: int, batch: int, progress: Progress) -> None:
        config = self.config
        self._epoch = epoch
        first = True
        while epoch < config.epochs and self.t.global_step < self.total and not self.stop:
            for xb, yb in self.data.epoch(epoch, batch):  # a resumed epoch starts at its next batch
                if self.t.global_step >= self.total:
                    break
                if first:
                    check_batch(xb, yb, config.data.dataset)
                    first = False
                batch += 1
                self._epoch, self._batch = epoch, batch
                if self.step(xb, yb, progress, boundary=batch == self.steps_per_epoch):
                    break
            if self.stop or batch < self.steps_per_epoch:
                break  # stopped mid-epoch (request or --max-steps): the position stays in it
            epoch += 1
            batch = 0
            self._epoch, self._batch = epoch, 0

    def step(self, xb: torch.Tensor, yb: torch.Tensor, progress: Progress | None = None,
             boundary: bool = False) -> bool:
        """One training step with its bookkeeping (what the benchmark times); True: stop now."""
        self._pending.append(self.t.train_step(xb, yb))
        n = input_batch_size(xb)
        self.samples += n
        self.status.on_step(self.t.global_step, n * self.strategy.dp_size, None)
        if self.config.result_file and self.config.mode == "ddp":
            self.hash_history.append(parameter_hash(self.strategy.unwrapped))
        step = self.t.global_step
        if step % SYNC_EVERY == 0 or step == self.total or boundary:
            self._flush(self._pending, progress)
            self._pending = []
        if step % SYNC_EVERY == 0 and self._sync():
            return True
        every = self.config.checkpoint.every_steps
        if every and step % every == 0 and self.ckpt.enabled:
            self._save(self._position())
        return False

    def _flush(self, pending: list[torch.Tensor], progress: Progress | None) -> None:
        """Turn the step losses into floats (one device sync per ``SYNC_EVERY`` steps)."""
        if not pending:
            return
        values = torch.stack(pending).tolist()
        self.losses.extend(values)
        self.status.last_loss = values[-1]
        if progress is not None:
            progress.update(len(values), loss=values[-1])

    def _sync(self) -> bool:
        """Exchange progress rows; act on rank 0's control requests. True: stop now."""
        want_ckpt, want_stop = self.status.requests() if self.env.rank == 0 else (False, False)
        rate = self.samples / max(1e-6, time.monotonic() - self.status.started_at)
        row = torch.tensor([self.t.global_step, self.samples, self.losses[-1] if self.losses else float("nan"),
                            rate, float(want_ckpt), float(want_stop)], dtype=torch.float64, device=self.env.device)
        rows = [torch.empty_like(row) for _ in range(self.env.world_size)]
        dist.all_gather(rows, row)
        table = torch.stack(rows).cpu()
        assert table.shape[1] == len(ROW)
        if self.env.rank == 0:
            self.status.on_sync(table)
        if table[0, 4] > 0 and self.ckpt.enabled:
            self._save(self._position())
        if table[0, 5] > 0:
            self.stop = True
        return self.stop

    def _position(self) -> dict[str, int]:
        epoch, batch = getattr(self, "_epoch", 0), getattr(self, "_batch", 0)
        if batch >= self.steps_per_epoch:
            epoch, batch = epoch + 1, 0
        return {"step": self.t.global_step, "epoch": epoch, "batch": batch, "world_size": self.env.world_size}

    def _save(self, position: dict[str, int]) -> None:
        if self.ckpt.last is not None and self.ckpt.last.step == position["step"]:
            return  # already saved (or loaded) at this step
        info = self.ckpt.save(self.t.module, self.t.optimizer, position)
        if self.env.rank == 0:
            self.status.on_checkpoint(info)

    def _write_result(self, value: float, elapsed: float) -> None:
        if not self.config.result_file:
            return
        result = {
            "rank": self.env.rank,
            "world_size": self.env.world_size,
            "mode": self.config.mode,
            "backend": self.env.backend,
            "steps": self.t.global_step,
            "losses": self.losses,
            "metric": self.t.spec.metric,
            self.t.spec.metric: value,  # "accuracy", or "loss": the held-out mean
            "param_hash": parameter_hash(self.strategy.unwrapped),  # collective for DTensors
            "param_digest": parameter_digest(self.strategy.unwrapped),
            "hash_history": self.hash_history,
            "averaged_steps": self.strategy.averaged_steps,
            "layouts": tensor_layouts(self.strategy.unwrapped),
            "elapsed_s": elapsed,
            "samples": self.samples,
        }
        path = Path(self.config.result_file.format(rank=self.env.rank))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
