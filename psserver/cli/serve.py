"""``psserver serve``: the long-running parameter server."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from psserver.cli.args import (
    MODEL_HELP,
    add_control_arguments,
    add_model_args_argument,
    add_optimizer_arguments,
    byte_size,
    control_from_args,
    finite_float,
    model_args_from_args,
    optimizer_from_args,
    path_arg,
)
from psserver.cli.base import SubCommand, config_errors
from psserver.config import CheckpointConfig, EmbeddingConfig, LRScheduleConfig, MemoryStateConfig, ServerConfig
from psserver.config.common import MIN_RPC_TIMEOUT_S, MIN_TRAINER_TIMEOUT_S
from psserver.config.embedding import EVICTION_POLICIES, ROW_OPTIMIZERS
from psserver.config.env import (
    COORDINATOR_VAR,
    NUM_SERVERS_VAR,
    SERVER_RANK_VAR,
    STATE_DIR_VAR,
    STATE_KEY_VAR,
    default_coordinator,
    default_num_servers,
    default_serve_port,
    default_state_dir,
    default_state_key,
    server_rank_from_env,
)
from psserver.config.ps import BUFFER_POLICIES, COMPUTE_MODES, DEFAULT_STATE_DIR, UPDATE_MODES
from psserver.utils.memory import ALLOCATORS
from psserver.utils.references import parse_json_args


class ServeCommand(SubCommand):
    name = "serve"
    help = "run the parameter server (RPC rank 0) until SIGINT/SIGTERM"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default=ServerConfig.host, help=f"address to bind (default {ServerConfig.host})")
        parser.add_argument("--port", type=int, default=default_serve_port(ServerConfig.port),
                            help=f"rendezvous port trainers connect to (default $MASTER_PORT or {ServerConfig.port})")
        parser.add_argument("--model", default=None,
                            help=MODEL_HELP + " (default: none; the server learns the model from the first trainer "
                                 "that joins, its layout and initial values, and runs none of its code)")
        add_model_args_argument(parser)
        parser.add_argument("--devices", default=None,
                            help="comma-separated devices, one model stage each (default: all GPUs, else cpu)")
        parser.add_argument("--update", choices=UPDATE_MODES, default=ServerConfig.update,
                            help="async: apply updates as they arrive; sync: one step per K gradients, averaged; "
                                 "ssp: async, no trainer more than --staleness steps ahead of the slowest (default "
                                 f"{ServerConfig.update})")
        parser.add_argument("--sync-trainers", type=int, default=ServerConfig.sync_trainers,
                            help=f"K of --update sync (default {ServerConfig.sync_trainers})")
        parser.add_argument("--buffers", choices=BUFFER_POLICIES, default=ServerConfig.buffers,
                            help="the model's buffers (BatchNorm statistics) on the server: average of what the "
                                 "trainers send with their updates (sync: each round's mean), or rank0's, as "
                                 "DDP's broadcast_buffers; trainers load the server's every step (default "
                                 f"{ServerConfig.buffers})")
        parser.add_argument("--staleness", type=int, default=ServerConfig.staleness,
                            help=f"S of --update ssp (0: bulk-synchronous; default {ServerConfig.staleness})")
        parser.add_argument("--compute", choices=list(COMPUTE_MODES), default=None,
                            help="pin where every trainer's steps run, trainer or server (default: each "
                                 "trainer's choice, trainer unless it says otherwise)")
        add_optimizer_arguments(parser, defaults_from_server=False)
        add_schedule_arguments(parser)
        g = parser.add_argument_group("guarding the shared model")
        g.add_argument("--max-grad-norm", type=finite_float, default=None, metavar="NORM",
                       help="clip each trainer step's gradient to this L2 norm (default: no clipping; a gradient "
                            "with NaN or inf is always dropped)")
        g.add_argument("--max-nonfinite-steps", type=int, default=ServerConfig.max_nonfinite_steps, metavar="N",
                       help="evict a trainer after N non-finite gradients in a row "
                            f"(default {ServerConfig.max_nonfinite_steps})")
        parser.add_argument("--trainer-timeout", type=finite_float, default=ServerConfig.trainer_timeout,
                            help=f"seconds without heartbeat before a trainer is evicted (default "
                                 f"{ServerConfig.trainer_timeout:g}, at least {MIN_TRAINER_TIMEOUT_S:g})")
        parser.add_argument("--rpc-timeout", type=finite_float, default=ServerConfig.rpc_timeout,
                            help=f"RPC timeout in seconds (default {ServerConfig.rpc_timeout:g}, at least "
                                 f"{MIN_RPC_TIMEOUT_S:g})")
        parser.add_argument("--rpc-threads", type=int, default=ServerConfig.rpc_threads,
                            help=f"RPC worker threads (default {ServerConfig.rpc_threads})")
        parser.add_argument("--compute-threads", type=int, default=ServerConfig.compute_threads,
                            help=f"torch threads (default {ServerConfig.compute_threads}: all cores)")
        parser.add_argument("--allocator", choices=ALLOCATORS, default=ServerConfig.allocator,
                            help="host memory: cached keeps freed buffers for the next step; system returns them to "
                                 f"the kernel at once (default {ServerConfig.allocator})")
        parser.add_argument("--seed", type=int, default=ServerConfig.seed,
                            help=f"seed of the initial parameters (default {ServerConfig.seed})")
        parser.add_argument("--join-token-file", type=path_arg, default=None,
                            help="file holding the job's join token; only trainers that know it can join (else "
                                 "$PSSERVER_JOIN_TOKEN; neither: anyone who reaches --port can join). It may be the "
                                 "control plane's --auth-token-file")
        parser.add_argument("--no-join-token", action="store_true",
                            help="serve a --host beyond loopback without a join token: anyone who reaches --port can "
                                 "join, read the model and write it (without this, such a server needs a token)")
        parser.add_argument("--max-model-bytes", type=byte_size, default=ServerConfig.max_model_bytes, metavar="SIZE",
                            help="the largest model a server without --model takes from the first trainer, "
                                 "parameters and buffers (bytes, or with K/M/G/T; default "
                                 f"{ServerConfig.max_model_bytes >> 30}G)")
        parser.add_argument("--supervise", action="store_true",
                            help="run the server under a supervisor that restarts it if it dies by a signal (SIGKILL, "
                                 "the OOM killer, a crash inside TensorPipe): from its state in shared memory "
                                 f"(--state-dir, default {DEFAULT_STATE_DIR} here), else its last checkpoint")
        parser.add_argument("--max-restarts", type=int, default=ServerConfig.max_restarts, metavar="N",
                            help="supervised: give up after N restarts within ten minutes "
                                 f"(default {ServerConfig.max_restarts})")
        m = parser.add_argument_group("several server processes")
        m.add_argument("--num-servers", type=int, default=default_num_servers(ServerConfig.num_servers), metavar="S",
                       help="server processes that hold the parameters together, each a partition "
                            f"(default ${NUM_SERVERS_VAR} or {ServerConfig.num_servers})")
        m.add_argument("--server-rank", type=int, default=default_server_rank(), metavar="I",
                       help=f"this server's rank, 0 coordinates (default ${SERVER_RANK_VAR}, else $SLURM_PROCID, "
                            "else the ordinal of a StatefulSet pod's hostname NAME-I, else "
                            f"{ServerConfig.server_rank})")
        m.add_argument("--coordinator", default=default_coordinator(ServerConfig.coordinator), metavar="HOST:PORT",
                       help=f"server 0's --host:--port, for servers of rank > 0 (default ${COORDINATOR_VAR}, "
                            "else $MASTER_ADDR:$MASTER_PORT)")
        add_embedding_arguments(parser)
        c = parser.add_argument_group("checkpoints")
        c.add_argument("--checkpoint-dir", type=path_arg, default=None, help="directory of checkpoints")
        c.add_argument("--checkpoint-every", type=int, default=CheckpointConfig.every_steps,
                       help=f"checkpoint every N global steps (default {CheckpointConfig.every_steps}: not by steps)")
        c.add_argument("--checkpoint-interval", type=finite_float, default=CheckpointConfig.interval_s,
                       help=f"checkpoint every N seconds (default {CheckpointConfig.interval_s:g}: not by time)")
        c.add_argument("--keep-checkpoints", type=int, default=CheckpointConfig.keep,
                       help=f"keep this run's newest N valid checkpoints; other runs' files stay (default "
                            f"{CheckpointConfig.keep})")
        c.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                       help="continue the run of the newest valid checkpoint in --checkpoint-dir, or resume from PATH")
        c.add_argument("--new-run", action="store_true",
                       help="start a new run in a --checkpoint-dir that holds another run's checkpoints, leaving "
                            "their files alone (without it or --resume, such a start is refused)")
        s = parser.add_argument_group("state in shared memory")
        s.add_argument("--state-dir", default=default_state_dir(), metavar="DIR|off",
                       help="keep the model's live state (parameters, buffers, optimizer state, step) in files "
                            "under DIR, a memory filesystem, so a server process that dies comes back with every "
                            f"update it had applied (default ${STATE_DIR_VAR}, else "
                            f"{DEFAULT_STATE_DIR} with --supervise, else off)")
        s.add_argument("--state-key", default=default_state_key(MemoryStateConfig.key), metavar="KEY",
                       help="the run that state belongs to: a server maps only its own key's state (default "
                            f"${STATE_KEY_VAR}; none: a new run's key; --supervise keeps one across restarts)")
        s.add_argument("--remove-stale-state", action="store_true",
                       help="delete the state that jobs whose processes are gone left in --state-dir (it is "
                            "reported either way)")
        add_control_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        with config_errors():
            config = server_config_from_args(args)
        if config.supervise:
            from psserver.server.state.supervisor import supervise

            # A partition server that lost server 0 exits 3: restarted, it waits for server 0 to be
            # back and continues from its state in memory (kept by this process's key).
            return supervise(args.argv, config.max_restarts, resume=config.checkpoint.directory is not None,
                             state=config.memory_state, restart_codes=(3,) if config.server_rank > 0 else ())
        from psserver.server.server import run_server  # (imports torch: what a standby has done ahead)
        from psserver.server.state.supervisor import STANDBY_ENV, standby_wait

        if os.environ.get(STANDBY_ENV) and not standby_wait():
            return 0
        return run_server(config)


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's learning-rate schedule: the server owns the optimizer, so it owns the schedule."""
    g = parser.add_argument_group(
        "learning-rate schedule",
        "stepped once per optimizer update of the server (its global step; a sync round is one), in every "
        "--update mode, from --lr; checkpoints keep it and --resume continues it (another schedule given at "
        "--resume takes over at the resumed step, as if it had run from step 0). The embedding tables' rows keep "
        "--embedding-lr.")
    g.add_argument("--lr-schedule", default=None, metavar="NAME|MODULE:ATTR",
                   help="a torch.optim.lr_scheduler class by name (CosineAnnealingLR, StepLR, MultiStepLR, LinearLR, "
                        "ExponentialLR, PolynomialLR, OneCycleLR, CyclicLR, ...), or MODULE:ATTR: a scheduler class "
                        "or a function (optimizer, **args) -> scheduler (default: none, the lr stays --lr)")
    g.add_argument("--lr-schedule-args", default=None, metavar="JSON",
                   help='keyword arguments of the scheduler beside the optimizer, a JSON object ({"T_max": 1000})')
    g.add_argument("--warmup-steps", type=int, default=LRScheduleConfig.warmup_steps, metavar="N",
                   help="linear warm-up: the lr at step t < N is --lr * (t+1)/N, then the schedule from its own step "
                        "0, as SequentialLR(opt, [LinearLR(opt, start_factor=1/N, end_factor=1.0, total_iters=N-1), "
                        "schedule], milestones=[N]); without --lr-schedule the lr stays --lr after it (default "
                        f"{LRScheduleConfig.warmup_steps})")


def schedule_from_args(args: argparse.Namespace) -> LRScheduleConfig:
    return LRScheduleConfig(name=args.lr_schedule, args=parse_json_args(args.lr_schedule_args, "--lr-schedule-args"),
                            warmup_steps=args.warmup_steps)


def add_embedding_arguments(parser: argparse.ArgumentParser) -> None:
    """The tables of a recommendation model (``mf``, ``dlrm_tiny``), held only by the servers."""
    e = parser.add_argument_group("embedding tables (models with tables: mf, dlrm_tiny)")
    d = EmbeddingConfig  # the class: its fields' defaults
    e.add_argument("--embedding-dim", type=int, default=d.dim, metavar="D",
                   help="width of a row (default: the model's)")
    e.add_argument("--embedding-max-rows", type=int, default=d.max_rows, metavar="N",
                   help=f"rows per table per server process at most; past it rows are evicted (default {d.max_rows})")
    e.add_argument("--embedding-eviction", choices=EVICTION_POLICIES, default=d.eviction,
                   help="which rows go past the bound: least recently (lru) or least often (lfu) touched "
                        f"(default {d.eviction})")
    e.add_argument("--embedding-ttl", type=int, default=d.ttl_steps, metavar="STEPS",
                   help=f"evict rows untouched for this many steps (default {d.ttl_steps}: never)")
    e.add_argument("--embedding-admit-after", type=int, default=d.admit_after, metavar="N",
                   help="an id becomes a row once N training batches held it; before, it reads a shared default "
                        f"row (default {d.admit_after}: at once)")
    e.add_argument("--embedding-optimizer", choices=ROW_OPTIMIZERS, default=d.optimizer,
                   help=f"row-wise optimizer of the tables (default {d.optimizer}); the dense part uses --optimizer")
    e.add_argument("--embedding-lr", type=finite_float, default=d.lr, help=f"its learning rate (default {d.lr:g})")
    e.add_argument("--embedding-init-std", type=finite_float, default=d.init_std,
                   help=f"std of a new row's values (default {d.init_std:g})")
    e.add_argument("--embedding-prefill", type=int, default=d.prefill_rows, metavar="N",
                   help="create N rows per table at start, as if trainers had touched them (benchmarks; default "
                        f"{d.prefill_rows})")


def embedding_from_args(args: argparse.Namespace) -> EmbeddingConfig:
    return EmbeddingConfig(dim=args.embedding_dim, max_rows=args.embedding_max_rows, eviction=args.embedding_eviction,
                           ttl_steps=args.embedding_ttl, admit_after=args.embedding_admit_after,
                           optimizer=args.embedding_optimizer, lr=args.embedding_lr,
                           init_std=args.embedding_init_std, prefill_rows=args.embedding_prefill)


def default_server_rank() -> int:
    """``--server-rank``'s default: where launchers say it, else ``ServerConfig.server_rank``."""
    return server_rank_from_env(ServerConfig.server_rank)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    control, obs = control_from_args(args)
    return ServerConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        model_args=model_args_from_args(args),
        devices=[d.strip() for d in args.devices.split(",")] if args.devices else None,
        update=args.update,
        buffers=args.buffers,
        sync_trainers=args.sync_trainers,
        staleness=args.staleness,
        compute=args.compute,
        optimizer=optimizer_from_args(args),
        lr_schedule=schedule_from_args(args),
        max_grad_norm=args.max_grad_norm,
        max_nonfinite_steps=args.max_nonfinite_steps,
        trainer_timeout=args.trainer_timeout,
        rpc_timeout=args.rpc_timeout,
        rpc_threads=args.rpc_threads,
        compute_threads=args.compute_threads,
        allocator=args.allocator,
        seed=args.seed,
        join_token_file=args.join_token_file,
        no_join_token=args.no_join_token,
        max_model_bytes=args.max_model_bytes,
        supervise=args.supervise,
        max_restarts=args.max_restarts,
        num_servers=args.num_servers,
        server_rank=args.server_rank if args.num_servers > 1 else 0,
        coordinator=args.coordinator if args.num_servers > 1 and args.server_rank > 0 else None,
        checkpoint=CheckpointConfig(
            directory=args.checkpoint_dir,
            every_steps=args.checkpoint_every,
            interval_s=args.checkpoint_interval,
            keep=args.keep_checkpoints,
            resume=args.resume,
            new_run=args.new_run,
        ),
        memory_state=memory_state_from_args(args),
        embedding=embedding_from_args(args),
        control=control,
        observability=obs,
    )


def memory_state_from_args(args: argparse.Namespace) -> MemoryStateConfig:
    directory = args.state_dir
    if directory is None and args.supervise:
        directory = DEFAULT_STATE_DIR
    if directory is not None and directory.strip().lower() in ("off", "none", ""):
        directory = None
    return MemoryStateConfig(directory=Path(directory) if directory else None, key=args.state_key,
                             remove_stale=args.remove_stale_state)
