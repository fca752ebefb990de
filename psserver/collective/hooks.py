"""DDP communication hooks by name, and the model averager post-local-SGD needs.

- ``fp16`` / ``bf16``: all-reduce gradients in half precision (half the bytes), cast back;
- ``powersgd``: low-rank gradient compression (``--powersgd-rank``) with error feedback, plain
  all-reduce for the first ``--powersgd-start-iter`` steps;
- ``powersgd+fp16``: PowerSGD whose factors travel in fp16;
- ``post-localsgd``: global all-reduce for ``--localsgd-start-iter`` steps, then all-reduce
  inside subgroups only (``--localsgd-group-size``; default one group per node, 1: no
  gradient communication at all) while a ``PeriodicModelAverager`` averages the parameters
  of all ranks every ``--model-averaging-period`` steps after the optimizer step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

from psserver.config.collective import DDPOptions

log = logging.getLogger(__name__)


def register_comm_hook(ddp: DistributedDataParallel, options: DDPOptions, local_world_size: int
                       ) -> PeriodicModelAverager | None:
    """Register ``options.comm_hook`` on ``ddp``; returns the averager post-local-SGD needs."""
    hook = options.comm_hook
    if hook == "none":
        return None
    state: Any
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook in ("powersgd", "powersgd+fp16"):
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=options.powersgd_rank,
            start_powerSGD_iter=options.powersgd_start_iter,
        )
        fn = powerSGD_hook.powerSGD_hook
        if hook == "powersgd+fp16":
            fn = default_hooks.fp16_compress_wrapper(fn)
        ddp.register_comm_hook(state, fn)
    elif hook == "post-localsgd":
        return _register_post_local_sgd(ddp, options, local_world_size)
    else:  # validated by DDPOptions; kept for direct callers
        raise ValueError(f"unknown --comm-hook {hook!r}")
    log.info("DDP communication hook: %s", hook)
    return None


def _register_post_local_sgd(ddp: DistributedDataParallel, options: DDPOptions, local_world_size: int
                             ) -> PeriodicModelAverager:
    group_size = options.localsgd_group_size or local_world_size
    world = dist.get_world_size()
    subgroup = None
    if group_size > 1:
        if world % group_size:
            raise ValueError(f"world size {world} is not divisible by the local-SGD group size {group_size}")
        # Every rank creates every subgroup (a collective); each gets its own back.
        subgroup, _ = dist.new_subgroups(group_size=group_size)
    state = post_localSGD_hook.PostLocalSGDState(
        process_group=None,
        subgroup=subgroup,
        start_localSGD_iter=options.localsgd_start_iter,
        post_local_gradient_allreduce=group_size > 1,
    )
    ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
    log.info("DDP communication hook: post-local-SGD from step %d, subgroups of %d, averaging every %d steps",
             options.localsgd_start_iter, group_size, options.model_averaging_period)
    return PeriodicModelAverager(period=options.model_averaging_period, warmup_steps=options.localsgd_start_iter)


def averages_now(averager: PeriodicModelAverager) -> bool:
    """Whether the next ``average_parameters`` call averages (mirrors the averager's rule)."""
    step = averager.step
    return step >= averager.warmup_steps and (step - averager.warmup_steps) % averager.period == 0
