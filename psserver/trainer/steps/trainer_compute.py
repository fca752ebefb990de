"""What the trainer halves of ``pull`` and ``pushpull`` share: the replica on the trainer's
device, loaded from the server's flat parameters, its flat gradient in the wire dtype,
the transport, evaluation on the replica.

The protocol, its order of work and why: its server half, ``psserver.server.steps.trainer_compute``.
"""

from __future__ import annotations

import logging

import torch

from psserver.common.partition import PartitionPlan
from psserver.common.tensors import Part, flatten, persistent_buffers, total_norm, unflatten_into
from psserver.errors import DeviceMapFailed, first_line
from psserver.models.calling import call_model, move_input
from psserver.trainer.compute.buckets import GradBuckets, bucket_cap_bytes
from psserver.trainer.compute.flat import FlatBuffer, copy_flat_into
from psserver.trainer.compute.rows import RowBatch
from psserver.trainer.compute.staging import PinnedStaging
from psserver.trainer.steps.base import TrainerHalf

log = logging.getLogger(__name__)


PART_MIN_BYTES = 1 << 20

"""The smallest bucket a backward sends ahead of its step's call (``--step pushpull``): a call
costs each side its handling, worth it for a bucket whose bytes take a while to cross. The
bucket that fills last goes with the step's call whatever its size: nothing is left to overlap."""



class TrainerComputeHalf(TrainerHalf):
    """The trainer's replica: the model on ``channel.device``. On the wire its parameters go as
    one flat buffer per server shard, or, with several server processes, one flat buffer per
    server holding that server's pieces (``psserver.common.partition``). Replies and gradients are
    handled as one list of buffers per server process."""

    overlap = False
    """Whether a step computes while the call that hands in the step before is in flight
    (``--overlap``; ``--step pushpull`` only)."""

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
        """The replica's buffers, loaded from the server with its parameters (``psserver.common.tensors``)."""
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
        self.transport: str = (channel.info.get("transport") or {}).get("kind", "cpu")
        """The path the server agreed to (``psserver.common.transport``): ``device-map`` buffers
        stay on the device, ``staged`` ones go through :class:`PinnedStaging`."""
        self.fell_back: str | None = getattr(channel, "fell_back", None)
        """Why the device map the server agreed to failed its probe (here, or in this rank's
        last process image), this trainer going ``staged`` instead (None: it did not)."""
        self._staging: PinnedStaging | None = None
        self._packers: list[FlatBuffer] | None = None
        self._buckets: list[GradBuckets] | None = None
        self._ahead: list[set[int]] = []  # per shard, where the buckets sent ahead start
        self._part_number: int | None = None  # the step whose backward sends parts ahead
        self.absent: list[int] = []
        """The parameters (indices in the model's order) the last gradient made has no value
        for (unused by that step, or frozen): the server leaves them out of the update, as a
        torch optimizer skips a parameter whose ``.grad`` is None."""
        self._sent: list[object] = []  # the futures of that backward's parts (every bucket of _ahead's)
        if self.transport == "device-map":
            self._probe_device_map()

    def _probe_device_map(self) -> None:
        """Send one CUDA value to the server and back before the first step: a device map that
        cannot carry tensors (a torch or driver that refuses, a peer without the device) turns
        this trainer ``staged``, with a WARNING here and on the server, instead of failing its steps."""
        try:
            back = self.channel.call("probe", torch.ones(1, device=self.device))
            if not isinstance(back, torch.Tensor) or back.device != self.device or float(back) != 2.0:
                raise RuntimeError(f"the probe came back as {back!r}")
        except Exception as e:  # noqa: BLE001 - whatever failed, the staged path is the answer
            reason = first_line(e)
            try:
                self.channel.call("fall_back", reason)
            except Exception:  # noqa: BLE001 - the failure broke the pipe itself: only a new process can join
                raise DeviceMapFailed(reason) from None
            self.transport, self.fell_back = "staged", reason
            log.warning("the device map to the server failed (%s): this trainer sends through pinned host memory",
                        reason)

    def load(self, replies: list[list[torch.Tensor]], keep_buffers: bool = False) -> None:
        """Copy the parameters (any dtype, on the CPU or, device-map, on the replica's device)
        into the replica: one reply per server process, each its list of flat buffers; server
        0's ends with the model's buffers when it has any (``keep_buffers``: the replica keeps
        its own)."""
        if self.buffers:
            if not keep_buffers:
                unflatten_into(replies[0][-1], self.buffers)
            replies = [replies[0][:-1], *replies[1:]]
        with torch.no_grad():
            if self.plan is not None:
                flats = [reply[0].to(self.device, torch.float32, non_blocking=True) for reply in replies]
                for p, value in zip(self.params, self.plan.gather(flats, self.params), strict=True):
                    p.copy_(value)
                return
            for shard, flat in zip(self.shards, replies[0], strict=True):
                copy_flat_into(flat, shard)

    def flat_grads(self, grads: list[torch.Tensor | None]) -> list[list[torch.Tensor]]:
        """The gradient (one per parameter; None: unused, zero) as flat buffers in the wire dtype
        (cast where it was made: a GPU's copy to the host moves the narrow dtype), one list per
        server process, where the transport sends them from."""
        self.absent = [i for i, g in enumerate(grads) if g is None]
        full = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads, strict=True)]
        if self.plan is not None:
            flats = [[flat.to(self.wire_dtype)] for flat in self.plan.split(full)]
        else:
            if self._packers is None:  # one buffer per shard in the wire dtype, on the replica's device, reused
                self._packers = [FlatBuffer([p.numel() for p in shard], self.wire_dtype, self.device)
                                 for shard in self.shards]
            by_param = dict(zip(self.params, full, strict=True))
            flats = [[packer.pack([by_param[p] for p in shard])
                      for packer, shard in zip(self._packers, self.shards, strict=True)]]
        return self._for_transport(flats)

    def backward_flat(self, loss: torch.Tensor) -> list[list[torch.Tensor]]:
        """The gradient of ``loss`` as :meth:`flat_grads` gives it, each shard's buffer filled
        bucket by bucket from autograd hooks while backward runs (``psserver.trainer.compute.buckets``;
        staged: each bucket starts its copy to the host as it is filled). With several server
        processes it is packed after backward: their buffers are the partition's, not the shards'."""
        if self.plan is not None:
            return self.flat_grads(self.grads_of(loss))
        flats = self._fill_buckets(loss)
        if self.transport == "staged":
            return [self._staged().collect([(self._staging_key(j), flat) for j, flat in enumerate(flats)])]
        return self._for_transport([flats])

    def backward_parts(self, loss: torch.Tensor, number: int) -> tuple[list[list[torch.Tensor]] | None,
                                                                        list[Part] | None]:
        """:meth:`backward_flat`, each large bucket but the last sent ahead (``part``, as gradient
        step ``number``) as soon as backward has filled it. Returns ``(None, the parts left for
        the step's call)`` once all sent ahead have arrived (a failed one raises: the step is
        not made), or ``(backward_flat's buffers, None)`` for a model whose buckets are too small."""
        if self._make_buckets():
            ahead = sum(len(a) for a in self._ahead)
            log.info("gradient buckets: %d of %d go ahead of the step's call as backward fills them%s", ahead,
                     sum(len(b) for b in self._buckets),
                     "" if ahead else f" (none is {PART_MIN_BYTES >> 20} MiB but the last to fill)")
        if not any(self._ahead):
            return self.backward_flat(loss), None
        self._part_number, self._sent = number, []
        try:
            self._fill_buckets(loss)
        finally:
            self._part_number = None
            sent, self._sent = self._sent, []
        for future in sent:
            future.wait()
        rest = []
        for j, b in enumerate(self._buckets):
            for r in b.buckets:
                start, stop = b.offsets[r.start], b.offsets[r.stop]
                if start not in self._ahead[j] and stop > start:  # finish() hands on every bucket
                    rest.append((j, start, self._part_tensor(j, start, stop)))
        return None, rest

    def _make_buckets(self) -> bool:
        """The bucket buffers and hooks, made at the first backward (True: just made)."""
        if self._buckets is not None:
            return False
        cap = bucket_cap_bytes(self.channel.bucket_cap_mb)
        depth = 2 if self.overlap else 1  # overlap: one buffer in flight while the other fills
        self._buckets = [GradBuckets(shard, self.wire_dtype, self.device, cap, on_ready=self._bucket_ready(j),
                                     depth=depth) for j, shard in enumerate(self.shards)]
        itemsize = self.wire_dtype.itemsize
        self._ahead = [{b.offsets[r.start] for r in b.buckets[:-1]
                        if (b.offsets[r.stop] - b.offsets[r.start]) * itemsize >= PART_MIN_BYTES}
                       for b in self._buckets]
        return True

    def _fill_buckets(self, loss: torch.Tensor) -> list[torch.Tensor]:
        """Backward of ``loss``, its gradient left in the shards' bucket buffers (returned)."""
        self._make_buckets()
        for b in self._buckets:
            b.arm()
        try:
            self.grads_of(loss)  # the hooks keep what it makes
        finally:
            flats = [b.finish() for b in self._buckets]
        first = 0
        self.absent = []
        for b in self._buckets:
            self.absent += [first + i for i in b.missing]
            first += len(b.params)
        return flats

    def grads_of(self, loss: torch.Tensor, extra: tuple[torch.Tensor, ...] = ()) -> list[torch.Tensor | None]:
        """The gradient of ``loss`` for every parameter (None: unused, or frozen, which autograd
        cannot be asked about), then for ``extra``."""
        trainable = [p for p in self.params if p.requires_grad]
        got = iter(torch.autograd.grad(loss, trainable + list(extra), allow_unused=True))
        return [next(got) if p.requires_grad else None for p in self.params] + list(got)

    def _staging_key(self, shard: int) -> tuple[str, int, int]:
        """The pinned buffer of a shard's bucket buffer now filling (one per buffer of the turn)."""
        return ("bucket", shard, self._buckets[shard].index)

    def _bucket_ready(self, shard: int):
        def ready(start: int, stop: int) -> None:
            number = self._part_number
            if number is not None:  # parts: the large ones now, the rest with the step's call
                if start in self._ahead[shard]:
                    self._sent.append(self._send_part(number, shard, start, stop))
            elif self.transport == "staged":
                self._staged().copy_part(self._staging_key(shard), self._buckets[shard].flat, start, stop)
        return ready

    def _send_part(self, number: int, shard: int, start: int, stop: int) -> object:
        """A bucket, just filled during backward, sent ahead as a ``part``: a future. Staged, the
        hook only starts its copy to pinned memory; a thread of the staging sends it once landed
        (waiting in the hook would stall backward for every part)."""
        if self.transport != "staged":
            return self.channel.call_async("part", number, [(shard, start, self._part_tensor(shard, start, stop))])
        staging = self._staged()
        buf, landed = staging.start_part(("part", shard, start), self._buckets[shard].flat[start:stop])
        return staging.send_when_landed(landed, lambda: self.channel.call_async("part", number, [(shard, start, buf)]))

    def _part_tensor(self, shard: int, start: int, stop: int) -> torch.Tensor:
        """A bucket's slice of the gradient as a tensor of its own, where the transport sends it
        from (a view would take its whole buffer along over RPC)."""
        values = self._buckets[shard].flat[start:stop]
        if self.transport == "device-map":
            return values.clone()
        if self.transport == "staged":
            return self._staged().part(("part", shard, start), values)
        return values.to("cpu", copy=True)

    def _staged(self) -> PinnedStaging:
        if self._staging is None:
            self._staging = PinnedStaging(self.device)
        return self._staging

    def _for_transport(self, flats: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """``flats`` (on the replica's device) where the transport sends them from."""
        if self.transport == "device-map":
            return flats
        if self.transport == "staged":
            return self._staged().to_host(flats)
        return [[flat.to("cpu") for flat in server] for server in flats]

    def close(self) -> None:
        for b in self._buckets or ():
            b.remove()  # the replica outlives the session (a library user's model): no hooks, no buffers
        if self._staging is not None:
            self._staging.close()
        self._buckets = self._staging = None

    _sent_buffers: torch.Tensor | None = None
    """The buffers this trainer sent last: the server keeps them until others come."""

    def owed_buffers(self) -> torch.Tensor | None:
        """The replica's buffers after a step's forward, as they go up with its update (None:
        this trainer sends none, or they are what it sent last: a constant mask goes up once)."""
        if not self.send_buffers:
            return None
        flat = flatten(self.buffers)
        if self._sent_buffers is not None and torch.equal(flat, self._sent_buffers):
            return None
        self._sent_buffers = flat
        return flat

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
