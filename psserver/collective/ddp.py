"""DDP: the model replicated on every rank, gradients all-reduced in buckets during backward."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

from psserver.collective.base import Strategy
from psserver.collective.hooks import averages_now, register_comm_hook

log = logging.getLogger(__name__)


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.averager: PeriodicModelAverager | None = None

    def setup(self, model: nn.Module) -> nn.Module:
        opts = self.config.ddp
        device = self.env.device
        model = model.to(device)
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            output_device=device.index if device.type == "cuda" else None,
            bucket_cap_mb=opts.bucket_cap_mb,
            find_unused_parameters=opts.find_unused_parameters,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            static_graph=opts.static_graph,
        )
        self.averager = register_comm_hook(ddp, opts, self.config.local_world_size)
        self.module = ddp
        log.info("DDP: %d ranks, bucket %g MiB%s%s%s, hook %s", self.env.world_size, opts.bucket_cap_mb,
                 ", static graph" if opts.static_graph else "",
                 ", gradients as bucket views" if opts.gradient_as_bucket_view else "",
                 ", finds unused parameters" if opts.find_unused_parameters else "", opts.comm_hook)
        return ddp

    @property
    def unwrapped(self) -> nn.Module:
        assert isinstance(self.module, DistributedDataParallel)
        return self.module.module

    @property
    def eval_module(self) -> nn.Module:
        # The bare module: no buffer broadcast or reducer state touched by evaluation.
        return self.unwrapped

    def after_optimizer_step(self, step: int) -> None:
        if self.averager is not None:
            if averages_now(self.averager):
                self.averaged_steps.append(step)
            self.averager.average_parameters(self.unwrapped.parameters())

    def describe(self) -> str:
        return f"ddp(hook={self.config.ddp.comm_hook})"
