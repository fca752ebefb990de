"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded across ranks.

Each block of the ``nn.Sequential`` with parameters is its own FSDP unit (all-gathered just
before it runs, resharded after), then the root. With ``--tp-size T`` the ranks form a 2-D
mesh ``(dp = world / T, tp = T)``: tensor parallelism inside each tp group (Megatron-style
column/row sharding of the decoder's attention and MLP projections, the plan of the model's
``ModelSpec.tp_plan``), FSDP across the dp groups.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from psserver.collective.base import Strategy
from psserver.models import get_model_spec

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def apply_tensor_parallel(model: nn.Module, model_name: str, tp_mesh: DeviceMesh) -> int:
    """Shard the blocks of ``model`` over ``tp_mesh`` with the plan of its spec
    (``ModelSpec.tp_plan``); returns the number of blocks sharded."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = get_model_spec(model_name).tp_plan
    if plan is None:
        raise ValueError(f"model {model_name!r} has no tensor-parallel plan")
    block_cls, layout = plan
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    n = 0
    for block in model.modules():
        if type(block).__name__ == block_cls:
            parallelize_module(block, tp_mesh, {name: styles[kind]() for name, kind in layout.items()})
            n += 1
    return n


class FSDPStrategy(Strategy):
    name = "fsdp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mesh: DeviceMesh | None = None

    def setup(self, model: nn.Module) -> nn.Module:
        opts = self.config.fsdp
        device = self.env.device
        world, tp = self.env.world_size, opts.tp_size
        if world % tp:
            raise ValueError(f"world size {world} is not divisible by --tp-size {tp}")
        if tp > 1:
            self.mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
            dp_mesh = self.mesh["dp"]
        else:
            self.mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
            dp_mesh = self.mesh
        model = model.to(device)
        if tp > 1:
            n = apply_tensor_parallel(model, self.config.model, self.mesh["tp"])
            log.info("tensor parallel: %d blocks sharded over %d ranks", n, tp)
        mp_policy = MixedPrecisionPolicy()
        if opts.mixed_precision != "none":
            # Compute in half precision, keep fp32 master weights, reduce gradients in fp32.
            mp_policy = MixedPrecisionPolicy(param_dtype=_DTYPES[opts.mixed_precision], reduce_dtype=torch.float32)
        kwargs = {"mesh": dp_mesh, "reshard_after_forward": opts.reshard_after_forward, "mp_policy": mp_policy}
        units = 0
        children = list(model.children()) if isinstance(model, nn.Sequential) else []
        for block in children:
            if any(True for _ in block.parameters()):
                fully_shard(block, **kwargs)
                units += 1
        fully_shard(model, **kwargs)
        self.module = model
        log.info("FSDP2: %d units + root over %d data-parallel ranks%s, reshard_after_forward=%s, "
                 "mixed precision %s", units, dp_mesh.size(), f" x {tp} tensor-parallel" if tp > 1 else "",
                 opts.reshard_after_forward, opts.mixed_precision)
        return model

    @property
    def dp_rank(self) -> int:
        if self.mesh is not None and self.config.fsdp.tp_size > 1:
            return self.mesh["dp"].get_local_rank()
        return self.env.rank

    @property
    def dp_size(self) -> int:
        return self.env.world_size // self.config.fsdp.tp_size

    @property
    def counts_for_eval(self) -> bool:
        if self.mesh is not None and self.config.fsdp.tp_size > 1:
            return self.mesh["tp"].get_local_rank() == 0
        return True

    def describe(self) -> str:
        opts = self.config.fsdp
        return f"fsdp(tp={opts.tp_size}, mp={opts.mixed_precision}, reshard={opts.reshard_after_forward})"
