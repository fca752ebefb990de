"""What the trainer-compute protocols share (``pull``, ``pushpull``).

The trainer keeps a replica of the model on its own device; the server keeps the fp32 master
weights and the optimizer state, sends parameters and receives gradients in the trainer's
wire dtype (``--wire-dtype``), always on the CPU. The trainer evaluates on its replica, loaded
once from the server's current parameters.
"""

from __future__ import annotations

import threading

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from psserver.models.calling import call_model, move_input
from psserver.ps.engine.buffers import flatten, persistent_buffers, unflatten_into
from psserver.ps.engine.guard import total_norm
from psserver.ps.group.partition import PartitionPlan
from psserver.ps.protocols.base import ServerHalf, TrainerHalf
from psserver.ps.rpc.messages import JoinRequest
from psserver.ps.sparse.batch import RowBatch

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainerComputeServer(ServerHalf):
    """Remembers each trainer's wire dtype; serves the flat parameters for evaluation."""

    ops = ("parameters", "rows")
    compute_threads = 1  # an update and copies, on a host the trainers share (psserver.ps.engine.compute)

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._wire_lock = threading.Lock()
        self._wire: dict[str, torch.dtype] = {}

    def join_info(self, trainer: str, request: JoinRequest) -> dict:
        self.set_wire_dtype(trainer, request.wire_dtype)
        info = {**super().join_info(trainer, request), "shard_params": [len(s.params) for s in self.engine.shards]}
        if self.engine.tables is not None:
            info["tables"] = self.engine.tables.describe()
        buffers = self.engine.buffers
        if buffers is not None:
            # rank0: only trainer 0's statistics reach the server (DDP's broadcast_buffers).
            info["buffers"] = {"numel": buffers.numel, "send": buffers.policy == "average" or request.rank == 0}
        return info

    def with_buffers(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """A reply's parameters, and the model's buffers after them when this server holds any."""
        if self.engine.buffers is None:
            return params
        return [*params, self.engine.flat_buffers()]

    def check_buffers(self, buffers: object) -> torch.Tensor | None:
        """A trainer's buffers as sent (None: none sent); ``ValueError`` for ones that do not fit."""
        if buffers is None:
            return None
        if self.engine.buffers is None:
            raise ValueError("this server holds no buffers of the model, yet a trainer sent some")
        return self.engine.buffers.check(buffers)

    def set_wire_dtype(self, trainer: str, name: str) -> None:
        if name not in WIRE_DTYPES:
            raise ValueError(f"unknown wire dtype {name!r}; known: {', '.join(WIRE_DTYPES)}")
        with self._wire_lock:
            self._wire[trainer] = WIRE_DTYPES[name]

    def wire_dtype(self, trainer: str) -> torch.dtype:
        with self._wire_lock:
            return self._wire.get(trainer, torch.float32)

    def parameters(self, trainer: str) -> list[torch.Tensor]:
        """Every shard's parameters as one flat fp32 CPU buffer, copied at one step (no step
        opens: the trainer evaluates on them)."""
        self.engine.wait_applied(trainer)
        return self.with_buffers(self.engine.flat_parameters())

    def rows(self, trainer: str, ids: object) -> dict[str, torch.Tensor]:
        """Rows of an embedding table for evaluation (nothing is created), after ``trainer``'s
        last update landed."""
        tables = self.engine.tables
        if tables is None:
            raise ValueError(f"model {self.engine.config.model} has no embedding tables")
        self.engine.wait_applied(trainer)
        return tables.lookup(ids)

    def trainer_gone(self, trainer: str, evicted: bool) -> None:
        with self._wire_lock:
            self._wire.pop(trainer, None)
        super().trainer_gone(trainer, evicted)


class TrainerComputeHalf(TrainerHalf):
    """The trainer's replica: the model on ``channel.device``. On the wire its parameters go as
    one flat buffer per server shard, or, with several server processes, one flat buffer per
    server holding that server's pieces (``psserver.ps.group.partition``). Replies and gradients are
    handled as one list of buffers per server process."""

    def __init__(self, channel) -> None:
        super().__init__(channel)
        self.device: torch.device = channel.device
        self.wire_dtype: torch.dtype = channel.wire_dtype
        spec = channel.spec
        self.loss_fn = channel.loss_fn
        tables = channel.info.get("tables")
        self.model = channel.model.to(self.device)
        self.table_columns: list[tuple[str, int]] | None = None
        """(name, id column) of each embedding table, for a model with tables on the servers."""
        if spec.sparse:
            if not tables or {d.name: tables["dim"] + d.extra_dims for d in spec.tables} != tables["tables"]:
                raise RuntimeError(f"the server's embedding tables {tables} do not fit model {spec.name}")
            self.table_columns = [(d.name, d.column) for d in spec.tables]
        elif tables:  # the library's replica of the dense part: column t of a batch's ids is table t
            self.table_columns = [(name, t) for t, name in enumerate(tables["tables"])]
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params: list[torch.nn.Parameter] = list(self.model.parameters())
        buffers = channel.info.get("buffers")
        self.buffers: list[torch.Tensor] = persistent_buffers(self.model) if buffers else []
        """The replica's buffers, loaded from the server with its parameters (``psserver.ps.engine.buffers``)."""
        if buffers and sum(b.numel() for b in self.buffers) != buffers["numel"]:
            raise RuntimeError(f"the server holds {buffers['numel']} buffer values, this model "
                               f"{sum(b.numel() for b in self.buffers)}")
        self.send_buffers = bool(buffers and buffers["send"])
        """Whether this trainer's buffers go up with its updates (``--buffers rank0``: rank 0's only)."""
        plan = channel.info.get("plan")
        self.plan: PartitionPlan | None = PartitionPlan.from_dict(plan) if plan is not None else None
        if self.plan is not None:
            self.plan.check_model([p.numel() for p in self.params])
        params = self.params
        self.shards: list[list[torch.nn.Parameter]] = []
        for n in channel.info["shard_params"]:
            self.shards.append(params[:n])
            params = params[n:]
        self._loaded = False  # the replica holds the server's current parameters

    def load(self, replies: list[list[torch.Tensor]]) -> None:
        """Copy the parameters (any dtype, on the CPU) into the replica: one reply per server
        process, each its list of flat buffers; server 0's ends with the model's buffers when
        it has any."""
        if self.buffers:
            unflatten_into(replies[0][-1], self.buffers)
            replies = [replies[0][:-1], *replies[1:]]
        with torch.no_grad():
            if self.plan is not None:
                flats = [reply[0].to(self.device, torch.float32, non_blocking=True) for reply in replies]
                for p, value in zip(self.params, self.plan.gather(flats, self.params), strict=True):
                    p.copy_(value)
                return
            for shard, flat in zip(self.shards, replies[0], strict=True):
                vector_to_parameters(flat.to(self.device, torch.float32, non_blocking=True), shard)

    def flat_grads(self, grads: list[torch.Tensor | None]) -> list[list[torch.Tensor]]:
        """The gradient (one per parameter; None: unused, zero) as flat CPU buffers in the wire
        dtype, one list per server process."""
        full = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads, strict=True)]
        if self.plan is not None:
            return [[flat.to("cpu", self.wire_dtype)] for flat in self.plan.split(full)]
        by_param = dict(zip(self.params, full, strict=True))
        return [[parameters_to_vector([by_param[p] for p in shard]).to("cpu", self.wire_dtype)
                 for shard in self.shards]]

    def owed_buffers(self) -> torch.Tensor | None:
        """The replica's buffers after a step's forward, as they go up with its update (None:
        this trainer sends none)."""
        return flatten(self.buffers) if self.send_buffers else None

    @staticmethod
    def norm_of(grads: list[list[torch.Tensor]], rows: list[dict[str, torch.Tensor]] | None = None) -> float:
        """The L2 norm of a whole gradient spread over several servers' buffers (and row
        gradients): each server's guard decides on it, so all drop or clip a step alike."""
        return total_norm([g for server in grads for g in server] +
                          [g for server in rows or [] for g in server.values()])

    def batch(self, x, y: torch.Tensor):
        """The batch on the replica's device (a tensor, tuple or dict input: ``psserver.models.calling``);
        a model with tables takes ``(ids, dense)``, whose ids stay on the CPU (they go to the servers)."""
        if self.device.type == "cpu":
            return x, y
        y = move_input(y, self.device, non_blocking=True)
        if self.table_columns is not None:
            return (x[0], x[1].to(self.device, non_blocking=True)), y
        return move_input(x, self.device, non_blocking=True), y

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self._loaded = False
        return self.train_step(*self.batch(x, y))

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        raise NotImplementedError

    def fetch_parameters(self) -> list[list[torch.Tensor]]:
        """The current parameters from every server process (no step opens)."""
        if self.plan is None:
            return [self.channel.call("parameters")]
        return self.channel.call_each("parameters", [() for _ in self.channel.servers])

    def evaluate(self, x) -> torch.Tensor:
        """Eval-mode outputs of the replica, loaded once with the server's current parameters
        (a model with tables: ``x`` is ``(ids, dense)``, whose rows are looked up, not created)."""
        if not self._loaded:
            self.load(self.fetch_parameters())
            self._loaded = True
        self.model.eval()
        try:
            with torch.no_grad():
                if self.table_columns is None:
                    return _outputs_to_cpu(call_model(self.model, move_input(x, self.device)))
                ids, dense = x
                batch = RowBatch(ids, self.table_columns, len(self.channel.servers))
                if len(self.channel.servers) == 1:
                    replies = [self.channel.call("rows", batch.requests[0])]
                else:
                    replies = self.channel.call_each("rows", [(r,) for r in batch.requests])
                rows = batch.assemble(replies, self.device, requires_grad=False)
                return self.model(batch.per_sample(rows), dense.to(self.device)).float().to("cpu")
        finally:
            self.model.train()


def _outputs_to_cpu(out):
    """A model's outputs for the held-out metric: floating tensors as float32 on the CPU (a
    tuple or dict of them kept as it is)."""
    if isinstance(out, torch.Tensor):
        return out.detach().float().to("cpu") if out.is_floating_point() else out.detach().to("cpu")
    if isinstance(out, dict):
        return {k: _outputs_to_cpu(v) for k, v in out.items()}
    if isinstance(out, tuple | list):
        return type(out)(_outputs_to_cpu(v) for v in out)
    return out
