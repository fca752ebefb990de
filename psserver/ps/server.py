"""The parameter server process: model stages, RPC endpoint, membership, checkpoints."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import asdict

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from psserver import __version__
from psserver.checkpoint import CheckpointError, Checkpointer, load_latest, read_checkpoint
from psserver.config import OptimizerConfig, ServerConfig
from psserver.errors import UsageError
from psserver.metrics import rpc_timed
from psserver.models import build_model, get_model_spec, split_stages
from psserver.ps import rendezvous
from psserver.ps.chain import Chains
from psserver.ps.compute import ComputeThread
from psserver.ps.fold import FoldedStep
from psserver.ps.membership import Membership
from psserver.ps.shard import Shard
from psserver.ps.updates import AsyncUpdater, SyncUpdater, Updater
from psserver.telemetry import CheckpointInfo, RateMeter, ServerStatus, ShardStatus, TrainerStatus
from psserver.utils.memory import configure_host_allocator, freeze_long_lived

log = logging.getLogger(__name__)

_SERVER: "ParameterServer | None" = None


def current_server() -> "ParameterServer":
    if _SERVER is None:
        raise RuntimeError("no parameter server is running in this process")
    return _SERVER


def resolve_devices(devices: list[str] | None) -> list[torch.device]:
    if devices is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")]
    out = []
    for d in devices:
        dev = torch.device(d)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise UsageError(f"device {d} requested but CUDA is not available on this host")
            index = dev.index if dev.index is not None else 0
            if index >= torch.cuda.device_count():
                raise UsageError(f"device {d} does not exist ({torch.cuda.device_count()} GPUs visible)")
            dev = torch.device("cuda", index)
        out.append(dev)
    return out


class ParameterServer:
    """Implements :class:`psserver.telemetry.ControlTarget` for the control plane."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.spec = get_model_spec(config.model)
        self.devices = resolve_devices(config.devices)
        self.ready = threading.Event()
        self.state = "STARTING"
        self.started_at = time.time()
        self.samples_seen = 0
        self.accuracy = float("nan")
        self.meter = RateMeter(window=10.0)
        self._shutdown = threading.Event()
        self._shutdown_reason = ""
        self._pending_samples: dict[str, int] = {}
        self._pending_loss: dict[str, float] = {}
        self._folds: dict[str, FoldedStep] = {}
        self._fold_partial_warned = False
        self._steps_at_checkpoint = 0
        self._last_ckpt_time = time.monotonic()
        self.checkpointer = (
            Checkpointer(config.checkpoint.directory, config.checkpoint.keep)
            if config.checkpoint.directory is not None
            else None
        )
        # Every tensor op of the server on one thread (psserver.ps.compute), the model's
        # construction and restore included: a team made here would throttle that thread's.
        self.compute = ComputeThread(inline=all(d.type == "cuda" for d in self.devices))
        try:
            resume_step = self.compute.run(self._build)
        except BaseException:
            self.compute.close()
            raise
        if self.optimizer_config is not None:
            for s in self.shards:
                s.init_optimizer(self.optimizer_config)
        self.param_rrefs: list[rpc.RRef] = []
        self.membership: Membership | None = None
        self.store = None
        log.info(
            "model %s (%d parameters) in %d stage(s) on %s%s",
            config.model,
            self.num_params,
            len(self.shards),
            ", ".join(str(d) for d in self.devices),
            f", resumed at step {resume_step}" if resume_step is not None else "",
        )

    # ---- set-up -------------------------------------------------------------------------

    def _build(self) -> int | None:
        """Model, stages, updater; the resumed step if a checkpoint was restored."""
        model = build_model(self.config.model, seed=self.config.seed)
        stages = split_stages(model, len(self.devices))
        self.shards = [Shard(i, m, d) for i, (m, d) in enumerate(zip(stages, self.devices))]
        self.params = [p for s in self.shards for p in s.params]
        self._trainable = sum(p.requires_grad for p in self.params)
        self.optimizer_config: OptimizerConfig | None = self.config.optimizer
        self.updater: Updater = self._make_updater()
        self.chains = Chains(self.params, self.updater.submit)
        return self._maybe_resume()

    def _make_updater(self) -> Updater:
        if self.config.update == "sync":
            return SyncUpdater(self.shards, self._on_step, self.config.sync_trainers)
        return AsyncUpdater(self.shards, self._on_step)

    @property
    def num_params(self) -> int:
        return sum(s.num_params for s in self.shards)

    def _param_shapes(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        return [[(n, tuple(p.shape)) for n, p in zip(s.names, s.params)] for s in self.shards]

    def _maybe_resume(self) -> int | None:
        ck = self.config.checkpoint
        if ck.resume is None:
            return None
        if ck.resume == "latest":
            found = load_latest(ck.directory)
            if found is None:
                log.warning("--resume: no valid checkpoint in %s, starting fresh", ck.directory)
                return None
            path, state = found
        else:
            path = ck.resume
            state = read_checkpoint(path)
        self._restore(state, path)
        return self.updater.global_step

    def _restore(self, state: dict, path) -> None:
        if state.get("model") != self.config.model:
            raise CheckpointError(
                f"checkpoint {path} is for model {state.get('model')!r}, this server runs {self.config.model!r}"
            )
        if len(state["shards"]) != len(self.shards):
            raise CheckpointError(
                f"checkpoint {path} has {len(state['shards'])} stage(s), this server has {len(self.shards)}: "
                "resume with the same number of --devices"
            )
        if [list(map(tuple, x)) for x in state.get("param_shapes", [])] != [
            list(x) for x in self._param_shapes()
        ]:
            raise CheckpointError(f"checkpoint {path} has parameter shapes that do not match model {self.config.model}")
        saved_opt = OptimizerConfig(**state["optimizer_config"]) if state.get("optimizer_config") else None
        if self.optimizer_config is None:
            self.optimizer_config = saved_opt
        elif saved_opt is not None and saved_opt.name != self.optimizer_config.name:
            raise CheckpointError(
                f"checkpoint {path} was trained with {saved_opt.name}, server asked for {self.optimizer_config.name}"
            )
        for shard, shard_state in zip(self.shards, state["shards"]):
            shard.load_state_dict(shard_state, self.optimizer_config)
        self.updater.global_step = int(state["global_step"])
        self.samples_seen = int(state["samples_seen"])
        self._steps_at_checkpoint = self.updater.global_step
        if state.get("rng") is not None:
            torch.set_rng_state(state["rng"])
        if self.checkpointer is not None:
            self.checkpointer.last = CheckpointInfo(str(path), self.updater.global_step, state.get("time", 0.0))
        log.info("resumed from %s: global step %d, %d samples seen", path, self.updater.global_step, self.samples_seen)

    def start(self) -> None:
        """Open the RPC endpoint; trainers can join once this returns."""
        global _SERVER
        cfg = self.config
        self.store, url = rendezvous.create_server_store(cfg.host, cfg.port, cfg.rpc_timeout)
        self.store.set(rendezvous.KEY_SERVER_STATE, "STARTING")
        rendezvous.set_transport_interface(cfg.host, local=True)
        _SERVER = self
        rpc.init_rpc(
            rendezvous.SERVER_NAME,
            rank=0,
            world_size=None,
            rpc_backend_options=rendezvous.backend_options(url, cfg.rpc_timeout, cfg.rpc_threads),
        )
        self.param_rrefs = [rpc.RRef(p) for p in self.params]
        self.membership = Membership(self.store, cfg.trainer_timeout, self._trainer_gone)
        self.membership.start()
        self.state = "SERVING"
        self.store.set(rendezvous.KEY_SERVER_STATE, "SERVING")
        self.ready.set()
        log.info(
            "psserver %s serving %s on %s:%d (update=%s%s)",
            __version__,
            cfg.model,
            cfg.host,
            cfg.port,
            cfg.update,
            f", K={cfg.sync_trainers}" if cfg.update == "sync" else "",
        )

    # ---- RPC entry points (see psserver.ps.remote) -----------------------------------------

    def join(self, rank: int, name: str, host: str, pid: int, optimizer: dict | None) -> dict:
        """Admit a trainer; a refusal is returned as ``{"error": ...}`` (a user error, not a
        server fault, so no traceback in the server's log)."""
        try:
            return self._join(rank, name, host, optimizer)
        except (ValueError, RuntimeError) as e:
            log.warning("refused %s (rank %d from %s): %s", name, rank, host, e)
            return {"error": str(e)}

    def _join(self, rank: int, name: str, host: str, optimizer: dict | None) -> dict:
        if self.state != "SERVING":
            raise RuntimeError(f"psserver is {self.state.lower()}: not accepting trainers")
        assert self.membership is not None
        requested = OptimizerConfig(**optimizer) if optimizer else None
        with self.updater.lock:
            if self.optimizer_config is None:
                self.optimizer_config = requested or OptimizerConfig()
                for s in self.shards:
                    s.init_optimizer(self.optimizer_config)
                log.info("optimizer %s (set by %s)", self.optimizer_config.describe(), name)
            elif requested is not None and requested != self.optimizer_config:
                raise ValueError(
                    f"this server trains with {self.optimizer_config.describe()}; "
                    f"trainer asked for {requested.describe()} (omit the optimizer flags to use the server's)"
                )
        self.membership.join(rank, name, host)
        self.updater.trainer_joined(name)
        return {
            "model": self.config.model,
            "update": self.config.update,
            "sync_trainers": self.config.sync_trainers,
            "optimizer": asdict(self.optimizer_config),
            "global_step": self.updater.global_step,
            "heartbeat_interval": max(0.1, self.config.trainer_timeout / 5),
            "param_rrefs": self.param_rrefs,
            "version": __version__,
        }

    def _member(self, name: str, report: tuple | None):
        assert self.membership is not None
        try:
            member = self.membership.seen(name)
        except KeyError:
            raise RuntimeError(f"{name} is not a member of this psserver (evicted or never joined)") from None
        if report is not None:
            steps, samples, loss, rate, *rest = report
            st = member.status
            st.steps, st.samples, st.last_loss, st.samples_per_s = int(steps), int(samples), float(loss), float(rate)
            if rest:
                st.accuracy = self.accuracy = float(rest[0])
        return member

    @rpc_timed("forward")
    def forward(self, name: str, x: torch.Tensor, report: tuple | None, fold: bool = False) -> torch.Tensor:
        """``fold``: the update is applied when this step's backward ends (``--step fold``)."""
        if self.state == "DRAINING":
            raise RuntimeError("psserver is shutting down")
        member = self._member(name, report)
        self._flush_fold(name)
        self.updater.wait_turn(name, timeout=self.config.rpc_timeout)
        ctx = dist_autograd._current_context()._context_id()
        member.contexts.add(ctx)
        if len(member.contexts) > 4:
            member.contexts = set(sorted(member.contexts)[-4:])
        clone = self._needs_clone()
        step = None
        if fold:
            step = self._folds[name] = FoldedStep(
                self._trainable, int(x.shape[0]), lambda grads, n: self.updater.submit(name, grads, n))
        else:
            self._pending_samples[name] = int(x.shape[0])
        # On this RPC thread, not the compute thread: dist_autograd runs the backward on
        # threads of its own anyway (psserver.ps.compute), and a hand-off would only add latency.
        out = self._run_stages(x, clone=clone, fold=step, to_cpu=True)
        if report is not None:
            self._pending_loss[name] = float(report[2])
        return out

    @rpc_timed("train_step")
    def train_step(self, name: str, x: torch.Tensor, y: torch.Tensor, report: tuple | None) -> float:
        """``--step fused``: forward, loss, backward and update in one RPC.

        The same work as the dist_autograd path (same clones, same updater, same shared
        optimizer) without its extra round trips; the loss (cross-entropy) runs here.
        """
        if self.state == "DRAINING":
            raise RuntimeError("psserver is shutting down")
        self._member(name, report)
        self.updater.wait_turn(name, timeout=self.config.rpc_timeout)
        return self.compute.run(self._fused_step, name, x, y, self._needs_clone())

    def _fused_step(self, name: str, x: torch.Tensor, y: torch.Tensor, clone: bool) -> float:
        out = self._run_stages(x, clone=clone)
        loss = torch.nn.functional.cross_entropy(out, y.to(out.device))
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        value = float(loss.detach())
        self._pending_loss[name] = value
        self.updater.submit(name, {p: g for p, g in zip(self.params, grads) if g is not None}, int(x.shape[0]))
        return value

    @rpc_timed("chained_step")
    def chained_step(self, name: str, grad_out: torch.Tensor | None, x: torch.Tensor | None,
                     report: tuple | None) -> torch.Tensor | None:
        """``--step chained``: the backward and update of the trainer's last step, then the
        forward of its next batch ``x`` (None: only hand in the last gradient)."""
        if self.state == "DRAINING":
            raise RuntimeError("psserver is shutting down")
        self._member(name, report)
        if report is not None:
            self._pending_loss[name] = float(report[2])
        if x is not None and self.config.update == "async":  # nothing to wait for: one hand-off
            return self.compute.run(self._chained_forward, name, x, self._needs_clone(), grad_out)
        self.compute.run(self.chains.backward, name, grad_out)
        if x is None:
            return None
        self.updater.wait_turn(name, timeout=self.config.rpc_timeout)  # sync: on this RPC thread
        return self.compute.run(self._chained_forward, name, x, self._needs_clone())

    def _chained_forward(self, name: str, x: torch.Tensor, clone: bool,
                         grad_out: torch.Tensor | None = None) -> torch.Tensor:
        if grad_out is not None:
            self.chains.backward(name, grad_out)
        out = self._run_stages(x, clone=clone)
        self.chains.hold(name, out, int(x.shape[0]))
        return out.detach().to("cpu")

    def _run_stages(self, x: torch.Tensor, to_cpu: bool = False, **kw) -> torch.Tensor:
        """The model's forward: each stage on its device, in order (``Shard.forward`` options)."""
        for shard in self.shards:
            x = shard.forward(x, **kw)
        return x.to("cpu") if to_cpu else x

    def _needs_clone(self) -> bool:
        """Whether another trainer's step can land between this forward and its backward.

        Async: whenever more than one trainer is active. Sync: only when live trainers
        outnumber K, since a round needs every live trainer's gradient (each sent after its
        backward) before the weights change.
        """
        active = self.membership.active_count() if self.membership else 2
        if self.config.update == "sync":
            return active > self.config.sync_trainers
        return active > 1

    @rpc_timed("evaluate")
    def evaluate(self, name: str, x: torch.Tensor) -> torch.Tensor:
        self._member(name, None)
        self.updater.wait_turn(name, timeout=self.config.rpc_timeout)
        return self.compute.run(self._run_stages, x, clone=False, train=False, to_cpu=True)

    def heartbeat(self, name: str, report: tuple | None) -> str:
        self._member(name, report)
        return self.state

    def leave(self, name: str, report: tuple | None) -> None:
        try:
            self._member(name, report)
        except RuntimeError:
            return
        self._flush_fold(name)
        assert self.membership is not None
        self.membership.leave(name)

    @rpc_timed("step")
    def submit(self, name: str, grads: dict) -> None:
        """A trainer's whole gradient from ``SharedOptimizer.step``."""
        samples = self._pending_samples.pop(name, 0)
        self.updater.submit(name, grads, samples)  # the plain step: its RPC thread, as its forward

    def _flush_fold(self, name: str) -> None:
        """Submit a folded step that a parameter without a gradient left incomplete."""
        step = self._folds.pop(name, None)
        if step is not None and step.flush() and not self._fold_partial_warned:
            self._fold_partial_warned = True
            log.warning("--step fold: a step of %s left parameters without a gradient; its update is "
                        "applied at the trainer's next call, with those gradients as zero", name)

    def _trainer_gone(self, name: str, state: str) -> None:
        self._folds.pop(name, None)  # a lost trainer's unfinished step contributes nothing
        self.chains.drop(name)
        self._pending_samples.pop(name, None)
        self._pending_loss.pop(name, None)
        self.compute.run(self.updater.trainer_gone, name)  # may apply a sync round

    # ---- steps, checkpoints ------------------------------------------------------------

    def _on_step(self, step: int, samples: int) -> None:
        self.samples_seen += samples
        losses = list(self._pending_loss.values())
        self.meter.add(samples, sum(losses) / len(losses) if losses else None)
        ck = self.config.checkpoint
        if self.checkpointer is not None and ck.every_steps and step - self._steps_at_checkpoint >= ck.every_steps:
            self.checkpoint(wait=False)

    def snapshot_state(self) -> dict:
        """A consistent CPU copy of everything a resume needs (blocks updates only for the copy)."""
        shards, step, samples = self.compute.run(self._copy_shards)
        return {
            "model": self.config.model,
            "model_config": {"seed": self.config.seed, "stages": len(self.shards), "input_shape": self.spec.input_shape},
            "param_shapes": self._param_shapes(),
            "shards": shards,
            "optimizer_config": asdict(self.optimizer_config) if self.optimizer_config else None,
            "update": {"mode": self.config.update, "sync_trainers": self.config.sync_trainers},
            "global_step": step,
            "samples_seen": samples,
            "rng": torch.get_rng_state(),
            "cuda_rng": [torch.cuda.get_rng_state(d) for d in self.devices if d.type == "cuda"],
            "time": time.time(),
            "version": __version__,
        }

    def _copy_shards(self) -> tuple[list[dict], int, int]:
        with self.updater.lock:
            return [s.state_dict() for s in self.shards], self.updater.global_step, self.samples_seen

    def checkpoint(self, *, wait: bool) -> CheckpointInfo:
        if self.checkpointer is None:
            raise RuntimeError("checkpoints are not configured (start the server with --checkpoint-dir)")
        state = self.snapshot_state()
        self._steps_at_checkpoint = state["global_step"]
        self._last_ckpt_time = time.monotonic()
        return self.checkpointer.save(state["global_step"], state, wait=wait)

    def _periodic(self) -> None:
        interval = self.config.checkpoint.interval_s
        while not self._shutdown.wait(min(1.0, interval)):
            if time.monotonic() - self._last_ckpt_time >= interval and self.updater.global_step > self._steps_at_checkpoint:
                try:
                    self.checkpoint(wait=False)
                except Exception:  # noqa: BLE001
                    log.exception("periodic checkpoint failed")

    # ---- ControlTarget -----------------------------------------------------------------

    def get_status(self) -> ServerStatus:
        ups, sps, loss = self.meter.rates()
        return ServerStatus(
            version=__version__,
            state=self.state,
            mode="ps",
            started_at=self.started_at,
            model=self.config.model,
            num_params=self.num_params,
            update_mode=self.config.update,
            sync_trainers=self.config.sync_trainers if self.config.update == "sync" else 0,
            global_step=self.updater.global_step,
            samples_seen=self.samples_seen,
            updates_per_s=ups,
            samples_per_s=sps,
            mean_loss=loss,
            shards=[
                ShardStatus(s.index, str(s.device), s.num_params, s.num_bytes, s.device_memory() or _rss())
                for s in self.shards
            ],
            last_checkpoint=self.checkpointer.last if self.checkpointer else None,
            accuracy=self.accuracy,
        )

    def list_trainers(self) -> list[TrainerStatus]:
        return self.membership.snapshot() if self.membership else []

    def checkpoint_now(self) -> CheckpointInfo:
        return self.checkpoint(wait=True)

    def request_shutdown(self, reason: str = "shutdown requested") -> None:
        if not self._shutdown.is_set():
            self._shutdown_reason = reason
            self._shutdown.set()

    # ---- run, drain, stop --------------------------------------------------------------

    def serve_forever(self) -> None:
        if self.checkpointer is not None and self.config.checkpoint.interval_s > 0:
            threading.Thread(target=self._periodic, name="psserver-periodic-ckpt", daemon=True).start()
        self._shutdown.wait()

    def stop(self) -> None:
        """Drain: refuse joins and new steps, let in-flight ones finish, checkpoint, leave."""
        global _SERVER
        log.info("stopping: %s", self._shutdown_reason or "shutdown")
        self.state = "DRAINING"
        if self.store is not None:
            try:
                self.store.set(rendezvous.KEY_SERVER_STATE, "DRAINING")
            except Exception:  # noqa: BLE001
                pass
        self.ready.clear()
        time.sleep(0.2)  # in-flight forwards and steps finish; new ones are refused
        with self.updater.lock:
            pass
        if self.checkpointer is not None and self.updater.global_step > 0:
            try:
                self.checkpoint(wait=True)
            except Exception:  # noqa: BLE001
                log.exception("final checkpoint failed")
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self.updater.close()
        if self.membership is not None:
            self.membership.stop()
            for t in list(self.membership.members):
                self.membership._remove(t, "LEFT", evict=True)
        if rpc.api._is_current_rpc_agent_set():
            self.param_rrefs = []
            rpc.shutdown(graceful=False)
        self.compute.close()
        self.state = "STOPPED"
        _SERVER = None
        log.info("psserver stopped at global step %d", self.updater.global_step)


def _rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001
        return 0


def run_server(config: ServerConfig) -> int:
    """``psserver serve``: returns the exit code."""
    threads = config.compute_threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    configure_host_allocator(config.allocator)  # before the RPC agent's threads exist
    server = ParameterServer(config)
    control_cm = _control_plane(server, config)
    metrics = _metrics(server, config)
    previous = {}

    def on_signal(signum, frame):  # noqa: ARG001
        server.request_shutdown(f"received {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        with control_cm:
            server.start()
            freeze_long_lived()  # torch, the model, the RPC layer: out of every later full collection
            server.serve_forever()
            server.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if metrics is not None:
            metrics.close()
    return 0


def _control_plane(server: ParameterServer, config: ServerConfig):
    import contextlib

    if not config.control.enabled:
        return contextlib.nullcontext()
    try:
        from psserver.control.server import ControlServer
    except ImportError:
        log.warning("control plane unavailable in this build")
        return contextlib.nullcontext()
    return ControlServer(server, config.control)


def _metrics(server: ParameterServer, config: ServerConfig):
    obs = config.observability
    if obs.metrics_port is None and obs.tensorboard_dir is None:
        return None
    from psserver.metrics import start_exporters

    return start_exporters(server, obs)
