"""Sharded, resharding checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<dir>/step-00000120/`` holds DCP's files (each rank writes its own shards, plus
``.metadata``) and a ``COMPLETE`` marker. A save goes into ``step-N.tmp/``; after every rank
has written, rank 0 writes the marker last (fsynced) and renames the directory to
``step-N/``, so a crash mid-save never leaves something that looks like the latest
checkpoint (only ``step-N/`` directories holding the marker count). Loading goes
through ``get_state_dict``/``set_state_dict``, so a checkpoint saved by W ranks loads on any
other number of ranks (DCP reshards on load), and DDP and FSDP checkpoints hold the same
fully qualified names.

The directory must be visible to every rank (one host, or a shared file system).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from psserver.checkpoint import fsync_dir
from psserver.config.collective import CollectiveCheckpointConfig
from psserver.errors import UsageError
from psserver.telemetry import CheckpointInfo

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_NAME = re.compile(r"^step-(\d+)$")


class AppState:
    """Model and optimizer as one DCP ``Stateful`` (a protocol: DCP calls these on save and load).

    DCP is imported where a checkpoint is saved or loaded: its package imports FSDP, DTensor and
    sympy, 0.6 s of every rank's start that a run without checkpoints never uses."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint with its marker, oldest first."""
    found = []
    if directory.is_dir():
        for child in directory.iterdir():
            m = _NAME.match(child.name)
            if m and (child / MARKER).is_file():
                found.append((int(m.group(1)), child))
    return sorted(found)


class CheckpointManager:
    """Save and load the training state collectively; every rank calls every method."""

    def __init__(self, config: CollectiveCheckpointConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.last: CheckpointInfo | None = None

    @property
    def enabled(self) -> bool:
        return self.config.directory is not None

    def resume_path(self) -> Path | None:
        """The checkpoint ``--resume`` names (None when not resuming); ``UsageError`` if missing."""
        resume = self.config.resume
        if resume is None:
            return None
        if resume == "latest":
            assert self.config.directory is not None
            found = complete_checkpoints(self.config.directory)
            if not found:
                log.warning("--resume: no complete checkpoint in %s, starting from scratch", self.config.directory)
                return None
            return found[-1][1]
        path = Path(resume)
        if not (path / MARKER).is_file():
            raise UsageError(f"--resume {path}: not a complete checkpoint (no {MARKER} marker)")
        return path

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, progress: dict[str, int]) -> CheckpointInfo:
        """Write ``step-N/`` collectively; ``progress`` holds step, epoch, batch and world size."""
        assert self.config.directory is not None
        step = int(progress["step"])
        final = self.config.directory / f"step-{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        t0 = time.monotonic()
        if self.rank == 0:
            self.config.directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a save that died
                shutil.rmtree(tmp)
        dist.barrier()
        state = {"app": AppState(model, optimizer),
                 "progress": {k: torch.tensor(int(v)) for k, v in progress.items()}}
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(tmp))
        dist.barrier()  # every rank's shards are on disk
        if self.rank == 0:
            marker = tmp / MARKER  # written last, inside the temporary directory
            marker.write_text(json.dumps({**{k: int(v) for k, v in progress.items()}, "time": time.time()}) + "\n")
            with open(marker, "rb+") as f:
                os.fsync(f.fileno())
            fsync_dir(tmp)
            old = final.with_name(final.name + ".old")
            if final.exists():  # the same step saved again (a resumed run)
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)  # the commit: step-N/ appears complete or not at all
            fsync_dir(self.config.directory)
            shutil.rmtree(old, ignore_errors=True)
            self._prune()
        dist.barrier()
        self.last = CheckpointInfo(path=str(final), step=step, time=time.time(), duration_s=time.monotonic() - t0)
        log.info("checkpoint %s written in %.2fs", final, self.last.duration_s)
        return self.last

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Load ``path`` into ``model`` and ``optimizer`` (resharding as needed); returns the progress."""
        saved = json.loads((path / MARKER).read_text())
        progress = {k: torch.tensor(0) for k in saved if k != "time"}
        state = {"app": AppState(model, optimizer), "progress": progress}
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=str(path))
        out = {k: int(v) for k, v in progress.items()}
        log.info("resumed from %s (step %d, saved by %d ranks, now %d)", path, out.get("step", 0),
                 out.get("world_size", 0), self.world_size)
        self.last = CheckpointInfo(path=str(path), step=out.get("step", 0), time=float(saved.get("time", 0.0)))
        return out

    def _prune(self) -> None:
        assert self.config.directory is not None
        found = complete_checkpoints(self.config.directory)
        for _, old in found[:-self.config.keep]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("removed old checkpoint %s", old)
