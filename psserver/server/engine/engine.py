"""The server's tensor work, with no RPC in it: the model's stages on their devices, the
shared optimizer's updates, the steps in flight, and the one compute thread.

Step protocols' server halves drive it (``psserver.server.steps``); unit tests drive it
directly. A step is *open* from the forward that starts it until its gradient is submitted
or the step is dropped: that is what a draining server waits for, and where the samples a
step trained on are counted, whatever the protocol.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from psserver.common.partition import PartitionModule, PartitionPlan, make_plan, plan_for_model
from psserver.common.tensors import persistent_buffers
from psserver.common.versions import Packed, packed_views
from psserver.config import OptimizerConfig, ServerConfig
from psserver.errors import NoVersion
from psserver.models import ModelSpec, build_model, get_model_spec, split_stages
from psserver.models.layout import ModelLayout
from psserver.server.engine.buffers import ServerBuffers
from psserver.server.engine.compute import ComputeThread
from psserver.server.engine.guard import GradientGuard
from psserver.server.engine.held_model import HeldModel
from psserver.server.engine.journal import GradientSequences
from psserver.server.engine.lr_schedule import LRSchedule
from psserver.server.engine.shard import Shard
from psserver.server.engine.step_copies import StepCopies
from psserver.server.engine.sync_updates import FollowerSyncUpdater, SyncUpdater
from psserver.server.engine.updates import AsyncUpdater, Grads, OnStep, SSPUpdater, TrainerProgress, Updater
from psserver.server.sparse.table import RowChanges
from psserver.server.sparse.tables import SparseTables

log = logging.getLogger(__name__)

StepListener = Callable[[int, int], None]


class ShuttingDown(RuntimeError):
    """A new step was refused because the server is draining."""


MAX_SAMPLES = 2**40
"""The most samples one step may say it trained (a trainer's count; counters stay exact ints)."""


def check_samples(value: object, what: str = "a step's samples") -> int:
    """``value``, or ``ValueError`` unless it is an int in [0, ``MAX_SAMPLES``]: the counts go into
    the shared-memory journal and the checkpoints, which a float, NaN or 2**63 would break."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SAMPLES:
        raise ValueError(f"{what} must be an int in [0, 2**40], got {value!r}"[:200])
    return value


def model_keys(model: nn.Module, part: nn.Module) -> dict[str, str]:
    """``part``'s state_dict keys -> ``model``'s, for a part (a stage) that shares its tensors."""
    by_tensor: dict[int, str] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(t), key)
    return {key: by_tensor[id(t)] for key, t in part.state_dict(keep_vars=True).items() if id(t) in by_tensor}


def make_updater(mode: str, shards: list[Shard], on_step: OnStep, sync_trainers: int,
                 staleness: int = 0, *, follower: bool = False) -> Updater:
    """The updater of ``--update mode`` (``sync_trainers``: K of sync; ``staleness``: S of ssp;
    ``follower``: a server process of rank > 0, whose sync rounds server 0 decides)."""
    if mode == "sync":
        return FollowerSyncUpdater(shards, on_step) if follower else SyncUpdater(shards, on_step, sync_trainers)
    if mode == "ssp":
        return SSPUpdater(shards, on_step, staleness)
    if mode == "async":
        return AsyncUpdater(shards, on_step)
    raise ValueError(f"unknown update mode {mode!r}")



class EngineState(NamedTuple):
    """The engine's state at one step, as checkpoints and the state in memory take it."""

    shards: list[dict]
    """Each shard's parameters and optimizer state (``Shard.state_dict`` or ``live_state``)."""
    global_step: int
    samples: int
    """Samples seen, across trainers."""
    tables: dict | None
    """The embedding tables' rows (None: no tables)."""
    lr_schedule: dict | None
    """The learning-rate schedule's state (None: no schedule)."""
    buffers: list[torch.Tensor] | None
    """The buffers held outside the shards (server 0 of several; else None)."""

class StepEngine:
    """The model in stages, one shared optimizer per stage, and the update mode."""

    def __init__(self, config: ServerConfig, devices: list[torch.device]) -> None:
        self.config = config
        self.spec: ModelSpec | None = (get_model_spec(config.model, config.model_args)
                                       if config.model is not None else None)
        """The model's spec when the server was given ``--model``; None: it holds a model it
        learnt from the first trainer (or a checkpoint) and runs none of its code."""
        self.layout: ModelLayout | None = None
        """The model's layout (None: no trainer has brought the model yet)."""
        self.model_ref: str | None = config.model
        """The model's reference: ``--model``, else the first trainer's (plain text)."""
        self.model_args: dict = dict(config.model_args)
        self.devices = devices
        self.optimizer_config: OptimizerConfig | None = config.optimizer
        self.optimizer_defaulted = False
        """Whether the optimizer is the default, no flag or trainer having named one."""
        self.samples_seen = 0
        self.listeners: list[StepListener] = []
        """Called after every optimizer step with (global step, samples), no lock held."""
        self._cond = threading.Condition()
        self._live: set[str] = set()
        self._open: dict[str, int] = {}  # trainer -> samples of its step in flight
        self._told_buffers: set[str] = set()  # trainers whose non-finite buffers were logged
        self._draining = False
        self.guard = GradientGuard(config.max_grad_norm, config.max_nonfinite_steps)
        self.lr_schedule: LRSchedule | None = None
        """The learning-rate schedule (``--lr-schedule``, ``--warmup-steps``), once the optimizer is known."""
        self.sequences = GradientSequences()
        """Each trainer's gradients by number: one sent again after a restart is applied once."""
        # Every tensor op on one thread (psserver.server.engine.compute), the model's construction
        # included: an OpenMP team made here would throttle that thread's.
        self.compute = ComputeThread(inline=all(d.type == "cuda" for d in devices))
        try:
            self.compute.run(self._build)
        except BaseException:
            self.compute.close()
            raise
        try:
            # A bad schedule fails here, at start; one that needs the optimizer a trainer chooses
            # is tried on the default one now, and built when that trainer joins.
            schedule = self._make_schedule(self.optimizer_config or OptimizerConfig())
        except BaseException:
            self.compute.close()
            raise
        if self.optimizer_config is not None:  # the shards' optimizers exist (_hold made them)
            self._attach_schedule(schedule)

    def _build(self) -> None:
        cfg = self.config
        self.tables: SparseTables | None = None
        """The embedding tables' rows this server process holds (a model with tables)."""
        self.plan: PartitionPlan | None = None
        self.buffers: ServerBuffers | None = None
        """The model's buffers (server 0 only; None: the model has none)."""
        self.state_keys: list[dict[str, str]] | None = None
        """Per shard, its modules' state_dict keys -> the model's own (None: the same keys: one
        stage, or a held model); checkpoints record it for ``psserver export``."""
        self.shards: list[Shard] = []
        self.params: list[nn.Parameter] = []
        self.trainable: list[nn.Parameter] = []
        self.updater = make_updater(cfg.updater_mode, [], self._on_step, cfg.sync_trainers, cfg.staleness,
                                    follower=cfg.server_rank > 0)
        if cfg.update == "diloco" and isinstance(self.updater, SyncUpdater):
            self.updater.mean_per_parameter = True  # a round of streaming DiLoCo may mix fragments
        self.updater.journal = self.sequences
        self.step_copies = StepCopies(self)
        """This process's part copied at an exact step (a version of a model over several processes)."""
        self.updater.applied_hook = self.step_copies.applied
        if self.spec is None:
            return
        model = build_model(self.spec, seed=cfg.seed, embedding_dim=cfg.embedding.dim)
        if self.spec.sparse:
            self.tables = SparseTables(self.spec.tables, cfg.embedding, self.spec.embedding_dim, seed=cfg.seed,
                                       server_rank=cfg.server_rank, num_servers=cfg.num_servers)
            if cfg.embedding.prefill_rows:
                self.tables.prefill(cfg.embedding.prefill_rows)
            self.updater.tables = self.tables
        self._hold(model, ModelLayout.of(model), split=True)

    def _hold(self, model: nn.Module, layout: ModelLayout, *, split: bool) -> None:
        """Place ``model`` (of ``layout``): a partition of its parameters (several server
        processes), else the model in stages over the devices (``split``; else one stage on
        the first)."""
        cfg = self.config
        self.layout = layout
        if cfg.num_servers > 1:
            # One partition of the parameters (psserver.common.partition), on this server's first device.
            self.plan = plan_for_model(model, cfg.num_servers)
            self.devices = self.devices[:1]
            shards = [Shard(0, PartitionModule(model, self.plan, cfg.server_rank), self.devices[0])]
        elif split:
            stages = split_stages(model, len(self.devices))
            if len(stages) > 1:  # before Shard moves them (a GPU copy is another tensor)
                self.state_keys = [model_keys(model, stage) for stage in stages]
            shards = [Shard(i, m, d) for i, (m, d) in enumerate(zip(stages, self.devices, strict=True))]
        else:
            self.devices = self.devices[:1]
            shards = [Shard(0, model, self.devices[0])]
        if self.optimizer_config is not None:
            for shard in shards:
                shard.init_optimizer(self.optimizer_config)
        # The buffers: those the shards' modules hold (checkpointed with them, and what a
        # server-compute forward updates), or with a partition of the parameters a copy of the
        # model's, on server 0.
        held = [b for s in shards for b in persistent_buffers(s.module)] if self.plan is None else \
            [b.detach().clone() for b in persistent_buffers(model)]
        if held and cfg.server_rank == 0:
            devices = {b.device for b in held}
            owner = next((sh for sh in shards if len(devices) == 1 and sh.device in devices), None)
            self.buffers = self.updater.buffers = ServerBuffers(held, cfg.buffers,
                                                                owner.run if owner is not None else None)
        self.shards = shards
        self.params = [p for s in shards for p in s.params]
        self.trainable = [p for p in self.params if p.requires_grad]
        self.updater.set_shards(shards)

    @property
    def has_model(self) -> bool:
        """Whether the server holds a model (False: it waits for the first trainer's)."""
        return self.layout is not None

    def adopt(self, layout: ModelLayout, values: list[torch.Tensor] | None, reference: str | None,
              args: dict) -> None:
        """Hold the model of ``layout`` with ``values`` (None: zeros, a checkpoint's state is
        loaded next), learnt from a trainer (or a checkpoint) by a server started without
        ``--model``. ``ValueError`` for values that do not fit the layout."""
        with self.updater.lock:
            if self.layout is not None:
                raise RuntimeError("the server holds a model already")
            self.compute.run(lambda: self._hold(HeldModel(layout, values), layout, split=False))
            self.model_ref, self.model_args = reference, dict(args)
        log.info("model %s (%d parameters, %d buffer(s); fingerprint %s) learnt from %s", reference,
                 self.model_params, len(layout.buffers), layout.fingerprint()[:12],
                 "a checkpoint" if values is None else "the first trainer")

    def adopt_partition(self, layout: ModelLayout, flat: torch.Tensor, reference: str | None, args: dict) -> None:
        """Hold this server's partition of the model of ``layout`` (several server processes, no
        ``--model``): its pieces as one flat buffer, from server 0, which took the model from the
        first trainer (``ValueError``: pieces that do not fit the plan)."""
        cfg = self.config
        plan = make_plan([e.numel for e in layout.parameters], cfg.num_servers)

        def hold() -> None:
            module = PartitionModule.from_flat(plan, cfg.server_rank, flat.to(torch.float32))
            self.plan = plan
            self.devices = self.devices[:1]
            shard = Shard(0, module, self.devices[0])
            if self.optimizer_config is not None:
                shard.init_optimizer(self.optimizer_config)
            self.shards = [shard]
            self.params = list(shard.params)
            self.trainable = [p for p in self.params if p.requires_grad]
            self.updater.set_shards(self.shards)
            self.layout = layout

        with self.updater.lock:
            if self.layout is not None:
                if self.layout.fingerprint() == layout.fingerprint():
                    return  # told twice (server 0 retried): nothing to change
                raise RuntimeError("this server holds another model already")
            self.compute.run(hold)
            self.model_ref, self.model_args = reference, dict(args)
        log.info("partition of model %s learnt from server 0: %d of its %d parameters", reference, self.num_params,
                 self.model_params)

    def check_layout(self, layout: ModelLayout, who: str) -> None:
        """``ValueError`` naming the first keys that differ unless ``layout`` is the model's."""
        assert self.layout is not None
        if layout.fingerprint() != self.layout.fingerprint():
            raise ValueError(f"{who} differs from the server's ({self.model_ref}): "
                             f"{self.layout.difference(layout)}")

    # ---- the model ------------------------------------------------------------------------

    @property
    def num_params(self) -> int:
        return sum(s.num_params for s in self.shards)

    @property
    def model_params(self) -> int:
        """Parameters of the whole model (of which a partition server holds ``num_params``)."""
        return sum(self.plan.sizes) if self.plan is not None else self.num_params

    @property
    def global_step(self) -> int:
        return self.updater.global_step

    @property
    def learning_rate(self) -> float | None:
        """The learning rate of the next update: the schedule's, else the shards' optimizer's
        (as a checkpoint left it), else ``--lr``; None while the optimizer is not known."""
        if self.lr_schedule is not None:
            return self.lr_schedule.lr
        for s in self.shards:
            if s.optimizer is not None:
                return float(s.optimizer.param_groups[0]["lr"])
        return self.optimizer_config.lr if self.optimizer_config is not None else None

    def param_shapes(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        return [[(n, tuple(p.shape)) for n, p in zip(s.names, s.params, strict=True)] for s in self.shards]

    def forward(self, x: torch.Tensor, *, clone: bool, train: bool = True) -> torch.Tensor:
        """The model's forward, each stage on its device, on the caller's thread."""
        for shard in self.shards:
            x = shard.forward(x, clone=clone, train=train)
        return x

    def parameters(self, *, clone: bool, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """The parameters for a reply, as the results of autograd nodes (RPC ties a reply's
        tensors to the sender's graph only then, not for leaves) on the CPU: views, or copies
        taken at one step when another trainer's update could land while the reply is being
        sent, when they live on a GPU or go in another ``dtype`` (their backward returns the
        gradient to the parameter's device and dtype)."""
        params = self.params
        if not clone and all(p.device.type == "cpu" and dtype in (None, p.dtype) for p in params):
            return [p.view_as(p) for p in params]
        with self.updater.lock:
            for s in self.shards:
                s.after_updates()
            return [p.clone() if p.device.type == "cpu" and dtype in (None, p.dtype) else p.to("cpu", dtype or p.dtype)
                    for p in params]

    def flat_buffers(self) -> torch.Tensor:
        """The model's buffers as one float64 CPU tensor (``psserver.common.tensors``), at one step."""
        assert self.buffers is not None
        with self.updater.lock:
            return self.buffers.flat()

    def flat_parameters(self, dtype: torch.dtype | None = None, *, on_device: bool = False) -> list[torch.Tensor]:
        """Every shard's parameters as one flat buffer each (in ``dtype``), copied at one step: on
        the CPU, or on the shard's device (``on_device``: a trainer whose device map takes it).
        Each is a buffer of its own (replies to several trainers are in flight at once), cast on
        the shard's device before it leaves it: a narrow wire crosses to the host narrow."""
        with self.updater.lock:
            flats = [s.flat(dtype) for s in self.shards]
        return flats if on_device else [flat.to("cpu") for flat in flats]

    def parameters_of(self, indices: list[int], dtype: torch.dtype | None = None, *,
                      on_device: bool = False) -> torch.Tensor:
        """The parameters at ``indices`` (in the model's order) as one flat buffer of its own,
        copied at one step (a fragment of streaming DiLoCo: ``psserver.common.fragments``)."""
        chosen = {id(self.params[i]) for i in indices}
        with self.updater.lock:
            flats = [s.flat(dtype, [p for p in s.params if id(p) in chosen]) for s in self.shards]
        flats = [f for f in flats if f.numel()]
        if not on_device:
            flats = [f.to("cpu") for f in flats]
        return flats[0] if len(flats) == 1 else torch.cat([f.to(flats[0].device) for f in flats])

    def grads_from_flat(self, flats: list[torch.Tensor]) -> Grads:
        """The gradient of every parameter from one flat buffer per shard (``ValueError`` when
        the buffers do not fit the shards)."""
        if len(flats) != len(self.shards):
            raise ValueError(f"{len(flats)} gradient buffers for {len(self.shards)} shards")
        grads: Grads = {}
        for shard, flat in zip(self.shards, flats, strict=True):
            if flat.numel() != shard.num_params:
                raise ValueError(f"gradient buffer of {flat.numel()} values for shard {shard.index} of "
                                 f"{shard.num_params} parameters")
            if not flat.is_floating_point():
                raise ValueError(f"gradient buffer of dtype {flat.dtype} for shard {shard.index}")
            if not shard.params:
                continue
            flat = flat.to(shard.device, shard.params[0].dtype, non_blocking=True)
            offset = 0
            for p in shard.params:
                grads[p] = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        return grads

    def absent_parameters(self, absent: object) -> list[nn.Parameter]:
        """The parameters a trainer's step has no gradient for, from their indices in the
        model's order (None: none; ``ValueError`` for indices that name no parameter)."""
        if absent is None:
            return []
        params = [p for shard in self.shards for p in shard.params]
        if not isinstance(absent, list) or not all(type(i) is int and 0 <= i < len(params) for i in absent):
            raise ValueError(f"parameters without a gradient come as a list of indices below {len(params)}")
        return [params[i] for i in sorted(set(absent))]

    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """Eval-mode outputs on the CPU (on the compute thread)."""
        return self.compute.run(lambda: self.forward(x, clone=False, train=False).to("cpu"))

    def agree_optimizer(self, requested: OptimizerConfig | None, who: str, *,
                        replaces_default: bool = False) -> OptimizerConfig:
        """The shared optimizer: the first trainer's choice fixes it; another is refused.
        ``replaces_default``: ``requested``, named after its trainer joined (a user's own
        ``DistributedOptimizer``), replaces the default that trainers which named none left,
        while no update has been applied."""
        with self.updater.lock:
            replace = replaces_default and requested is not None and self.optimizer_defaulted \
                and self.updater.global_step == 0
            if self.optimizer_config is None or replace:
                chosen = requested or OptimizerConfig()
                schedule = self._make_schedule(chosen)  # UserCodeError: the join is refused, nothing is set
                self.optimizer_defaulted = requested is None
                self.optimizer_config = chosen
                for s in self.shards:
                    if replace:  # made anew: no update has used it
                        with s.lock:
                            s.optimizer = None
                    s.init_optimizer(self.optimizer_config)
                self._attach_schedule(schedule)
                log.info("optimizer %s (set by %s)", self.optimizer_config.describe(), who)
            else:
                refusal = self.optimizer_refusal(requested)
                if refusal is not None:
                    raise ValueError(refusal)
            return self.optimizer_config

    def optimizer_refusal(self, requested: OptimizerConfig | None) -> str | None:
        """Why a trainer asking for ``requested`` is refused, the server's optimizer being set
        (its ``--optimizer``, or the first trainer's), else None; nothing changes."""
        if requested is None or self.optimizer_config is None or requested == self.optimizer_config:
            return None
        return (f"this server trains with {self.optimizer_config.describe()}; trainer asked for "
                f"{requested.describe()} (omit the optimizer flags to use the server's)")

    def _make_schedule(self, optimizer: OptimizerConfig) -> LRSchedule | None:
        """The schedule of ``--lr-schedule`` on ``optimizer`` (None: none); ``UserCodeError``."""
        return LRSchedule(self.config.lr_schedule, optimizer) if self.config.lr_schedule.enabled else None

    def _attach_schedule(self, schedule: LRSchedule | None) -> None:
        """From now on every update takes its learning rate from ``schedule``, at the current step."""
        if schedule is None:
            return
        schedule.fast_forward(self.updater.global_step)
        self.lr_schedule = self.updater.lr_schedule = schedule
        log.info("learning-rate schedule %s, from lr %g at global step %d", schedule.describe(), schedule.lr,
                 schedule.steps)

    # ---- trainers and their steps ---------------------------------------------------------

    def trainer_joined(self, trainer: str) -> None:
        with self._cond:
            self._live.add(trainer)
        self.updater.trainer_joined(trainer)

    def trainer_gone(self, trainer: str) -> None:
        """Forget ``trainer``: its open step contributes nothing; a sync round it held up may apply."""
        with self._cond:
            self._live.discard(trainer)
            self._open.pop(trainer, None)
            self._cond.notify_all()
        self.guard.forget(trainer)
        self.sequences.gone(trainer)
        if self.tables is not None:
            self.tables.forget(trainer)
        if self.buffers is not None:
            self.buffers.forget(trainer)
        self.compute.run(self.updater.trainer_gone, trainer)

    def needs_clone(self) -> bool:
        """Whether another trainer's step can land between a forward and its backward.

        Async and ssp: whenever more than one trainer is live (ssp applies every gradient as it
        arrives too). Sync: only when live trainers outnumber K, since a round needs every live
        trainer's gradient before the weights change.
        """
        with self._cond:
            live = len(self._live)
        if self.config.rounds:
            return live > self.config.sync_trainers
        return live > 1

    def wait_turn(self, trainer: str) -> None:
        """Block until ``trainer`` may start its next step, on the caller's (RPC) thread, never
        the compute thread: sync until its last gradient's round is applied, ssp until it is
        within ``--staleness`` of the slowest live trainer; ``TimeoutError`` after
        ``--rpc-timeout``. Async returns at once."""
        self.updater.wait_turn(trainer, timeout=self.config.rpc_timeout)

    def try_start(self, trainer: str) -> bool:
        """``wait_turn`` if it needs no wait, whatever ``trainer``'s open step's update does (then
        ending that step and starting the next need no wait in between); False: wait_turn later."""
        return self.updater.try_start(trainer)

    def wait_applied(self, trainer: str) -> None:
        """Block until ``trainer``'s last update is in the weights (sync: its round), before it
        reads them outside a step (evaluation); on the caller's thread."""
        self.updater.wait_applied(trainer, timeout=self.config.rpc_timeout)

    def trainer_progress(self, trainer: str) -> TrainerProgress | None:
        """``trainer``'s clock and the staleness of its updates (live, or as it left; None when
        unknown), for status and metrics."""
        return self.updater.progress(trainer)

    def trainers_progress(self, trainers: list[str]) -> dict[str, TrainerProgress]:
        """``trainer_progress`` of several trainers, read at one instant."""
        return self.updater.progress_of(trainers)

    def open_step(self, trainer: str, samples: int, read: bool = True) -> None:
        """A step of ``samples`` starts (on the current weights: its clock ticks, the global
        step it reads is recorded unless ``read`` is False: a gradient that arrives with no step
        open here was computed elsewhere); ``ShuttingDown`` while the server drains."""
        check_samples(samples)
        with self._cond:
            if self._draining:
                raise ShuttingDown("psserver is shutting down")
            self._open[trainer] = samples
        self.updater.step_opened(trainer, read)

    def take_gradient(self, trainer: str, number: int, samples: int) -> bool:
        """``trainer``'s gradient of its step ``number`` arrives (on the RPC thread, before the
        update is handed to the compute thread). False: that gradient was applied before (sent
        again after the server process restarted), so its open step, if any, just closes. True:
        apply it; a trainer that rejoined a restarted server has no open step here, so the step
        its gradient ends (of ``samples``) is opened for it."""
        if self.sequences.applied_before(trainer, number):
            with self._cond:
                was_open = trainer in self._open
            if was_open:
                self.drop_step(trainer)
            log.info("%s sent the gradient of its step %d again: applied before this server process started, not "
                     "again", trainer, number)
            return False
        with self._cond:
            opened = trainer in self._open
        if not opened:
            self.open_step(trainer, samples, read=False)
        return True

    def set_samples(self, trainer: str, samples: int) -> None:
        """The samples of ``trainer``'s open step, known only once it ran (a library trainer
        opens its next step before its user's loop has read the next batch)."""
        with self._cond:
            if trainer in self._open:
                self._open[trainer] = samples

    def submit(self, trainer: str, grads: Grads, norm: float | None = None,
               buffers: torch.Tensor | None = None) -> None:
        """The whole gradient of ``trainer``'s open step: one update (async, ssp) or a share of
        one (sync); its staleness is recorded (``trainer_progress``). The guard drops a
        non-finite gradient (a sync round counts the trainer as arrived) and clips to
        ``--max-grad-norm`` (``psserver.server.engine.guard``); ``norm``: that of the whole step's gradient
        when ``grads`` is one partition of it."""
        with self._cond:
            samples = self._open.get(trainer)
        if samples is None:
            raise RuntimeError(f"{trainer} sent a gradient but has no step in flight on this server")
        try:
            checked = self.guard.check(trainer, grads, norm)
            if checked is None:
                log.warning("dropped a step of %s: its gradient is not finite", trainer)
            elif buffers is not None and self.buffers is not None and not self.buffers.receive(trainer, buffers):
                self._refused_buffers(trainer)
            self.updater.submit(trainer, checked, samples)
        finally:  # closed once applied (a drain waits for the update, not just its arrival)
            self.drop_step(trainer)

    def _refused_buffers(self, trainer: str) -> None:
        """One WARNING per trainer (its steps are kept; its statistics wait until they are finite again)."""
        with self._cond:
            told = trainer in self._told_buffers
            self._told_buffers.add(trainer)
        if not told:
            log.warning("kept the steps of %s but not its buffers: NaN or inf where the server's are finite (said "
                        "once per trainer)", trainer)

    def drop_step(self, trainer: str) -> None:
        """``trainer``'s open step ends: given up (nothing is applied), or after its update."""
        if self.tables is not None:
            self.tables.forget(trainer)
        with self._cond:
            self._open.pop(trainer, None)
            self._cond.notify_all()
        self.updater.step_closed(trainer)

    def _on_step(self, step: int, samples: int) -> None:
        with self._cond:
            self.samples_seen += samples
        for listener in self.listeners:
            listener(step, samples)

    # ---- drain, state ----------------------------------------------------------------------

    def drain(self) -> None:
        """Refuse new steps and release every waiter; open steps may still complete."""
        with self._cond:
            self._draining = True
        self.updater.close()

    def wait_idle(self, timeout: float) -> list[str]:
        """Wait until no step is open (at most ``timeout`` s); the trainers still open."""
        with self._cond:
            self._cond.wait_for(lambda: not self._open, timeout)
            return sorted(self._open)

    def copy_state(self) -> EngineState:
        """CPU copies of every shard, the global step, samples seen, the tables' rows (None: no
        tables), the learning-rate schedule's state (None: none) and the buffers held outside the
        shards (server 0 of several; else None), all at one step."""

        def copy() -> EngineState:
            with self.updater.lock:
                tables = self.tables.state_dict() if self.tables is not None else None
                schedule = self.lr_schedule.state_dict() if self.lr_schedule is not None else None
                buffers = self.buffers.state() if self.buffers is not None and self.plan is not None else None
                return EngineState([s.state_dict() for s in self.shards], self.updater.global_step,
                                   self.samples_seen, tables, schedule, buffers)

        return self.compute.run(copy)

    def model_version(self) -> tuple[int, dict[str, torch.Tensor], Packed | None]:
        """The global step and the model's ``state_dict`` (its own keys, parameters and buffers)
        copied to the CPU at that step: what a reader of the weights gets (``versions``).
        ``NoVersion`` without a model, or for one spread over several server processes."""
        if self.layout is None:
            raise NoVersion("the server holds no model yet (the first trainer brings it)", later=True)
        if self.plan is not None:  # server 0's group puts one together from every process's part
            raise NoVersion("the model is spread over several server processes: server 0 reads their parts")

        def copy() -> tuple[int, dict[str, torch.Tensor], Packed | None]:
            # Copied once, into one buffer allocated before the lock: the bytes a reader is sent
            # as held need no copy of their own (a model with aliases is sent its aliases' bytes
            # too: those encode).
            entries = self.layout.entries
            state, packed = packed_views([(e.key, getattr(torch, e.dtype), tuple(e.shape)) for e in entries])
            with self.updater.lock:
                for shard, keys in zip(self.shards, self.state_keys or [{}] * len(self.shards), strict=True):
                    with shard.lock:
                        shard.after_updates()
                        for key, value in shard.module.state_dict().items():
                            target = state.get(keys.get(key, key))
                            if target is not None:
                                target.copy_(value.detach())
                step = self.updater.global_step
            whole = self.layout.state_dict([state[e.key] for e in entries])
            return step, whole, packed if len(whole) == len(state) else None

        # One intra-op thread: a team's threads spin after each of the model's copies, on the
        # cores the trainers need (a resnet18 version cost the server twice the CPU with two).
        return self.compute.run_with(1, copy)

    def table_rows(self, table: str, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The global step and the rows of ``ids`` in ``table`` as held now, for a reader that
        serves lookups: nothing created or counted as a touch (``ValueError`` for bad ids;
        ``NoVersion`` without tables on this one server process)."""
        if self.tables is None:
            raise NoVersion("the model has no embedding tables")
        if self.tables.num_servers > 1:
            raise NoVersion("the rows are spread over several server processes, whose rows cannot be read yet")
        step = self.updater.global_step
        return step, self.tables.lookup({table: ids})[table]

    def table_changes(self, table: str, since: int) -> RowChanges:
        """A reader's delta of ``table``: the rows written and the ids dropped after the table's
        clock ``since`` (``psserver.server.sparse.table.EmbeddingTable.changes_since``)."""
        if self.tables is None:
            raise NoVersion("the model has no embedding tables")
        if self.tables.num_servers > 1:
            raise NoVersion("the rows are spread over several server processes, whose rows cannot be read yet")
        return self.tables.changes_since(table, since)

    def live_state(self) -> EngineState:
        """(updater's lock held, and the tables' lock) What ``copy_state`` gives, with the
        engine's own tensors instead of copies: the tensors every update writes to (the tables'
        in ``SparseTables.live_state``'s form)."""
        tables = self.tables.live_state() if self.tables is not None else None
        schedule = self.lr_schedule.state_dict() if self.lr_schedule is not None else None
        buffers = list(self.buffers.tensors) if self.buffers is not None and self.plan is not None else None
        return EngineState([s.live_state() for s in self.shards], self.updater.global_step, self.samples_seen, tables,
                           schedule, buffers)

    def state_signature(self) -> tuple:
        """(updater's lock held) Changes when the set of tensors ``live_state`` holds changes
        (a model learnt, an optimizer made, its state made by its first step, a table grown)."""
        tables = self.tables.signature() if self.tables is not None else ()
        return (self.layout is not None, *(-1 if s.optimizer is None else len(s.optimizer.state) for s in self.shards),
                *tables)

    def load_state(self, shards: list[dict], optimizer: OptimizerConfig | None, global_step: int,
                   samples_seen: int, tables: dict | None = None, lr_schedule: dict | None = None,
                   buffers: list[torch.Tensor] | None = None) -> None:
        """A checkpoint's state; ``lr_schedule``: its schedule's (``LRSchedule.restore`` says what
        a different one does); ``buffers``: those held outside the shards."""
        if (tables is None) != (self.tables is None):
            raise ValueError("the checkpoint has embedding tables and this model has none" if tables is not None
                             else f"model {self.config.model} has embedding tables and the checkpoint holds none")

        def load() -> None:
            for shard, state in zip(self.shards, shards, strict=True):
                shard.load_state_dict(state, optimizer)
            if self.tables is not None:
                self.tables.load_state_dict(tables)
            if buffers is not None and self.buffers is not None and self.plan is not None:
                self.buffers.load(buffers)

        schedule = self._make_schedule(optimizer) if optimizer is not None else None
        self.optimizer_config = optimizer
        self.optimizer_defaulted = False
        self.compute.run(load)
        self.updater.global_step = global_step
        self.samples_seen = samples_seen
        if schedule is not None:
            schedule.restore(lr_schedule, global_step)
        elif lr_schedule is not None and optimizer is not None:
            # The lr the checkpoint's optimizers hold is its schedule's last one: back to --lr.
            log.warning("the checkpoint's learning-rate schedule was %s; this server has none: the learning rate is "
                        "%g from global step %d", lr_schedule.get("describe"), optimizer.lr, global_step)
            for s in self.shards:
                for group in s.optimizer.param_groups if s.optimizer is not None else []:
                    group["lr"] = optimizer.lr
        self.lr_schedule = self.updater.lr_schedule = None
        self._attach_schedule(schedule)

    def close(self) -> None:
        self.updater.close()
        self.compute.close()
