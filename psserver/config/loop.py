"""The options of a training loop that a parameter-server trainer (``TrainerConfig``) and a
collective run (``CollectiveConfig``) share: each is declared once here and is a field of both,
so ``psserver train`` has one flag for it whatever the ``--mode``, with one default."""

from __future__ import annotations

from typing import Any

from psserver.config.options import option

MODEL_HELP = ("a model name (mnist_cnn, mlp, mlp_wide, resnet18, resnet50, mf, dlrm_tiny, llama_tiny, or one a package "
              "registers in the entry-point group psserver.models) or MODULE:ATTR, an nn.Module class or a "
              "function returning one")
COLLECTIVE_MODEL = "mnist_cnn"
"""``CollectiveConfig.model``'s default (a ``--mode ps`` trainer's is its server's model)."""
TRAIN_MODEL_HELP = MODEL_HELP + (" (ps mode: default the server's model, else mnist_cnn; ddp/fsdp: default "
                                 f"{COLLECTIVE_MODEL})")
MODEL_ARGS_HELP = 'keyword arguments of the model\'s class or function, a JSON object ({"width": 64})'


def epochs() -> Any:
    return option(1, common=True, help="epochs over this trainer's shard (default {default})")


def batch_size() -> Any:
    return option(64, common=True, help="samples per step (default {default})")


def eval_batch_size() -> Any:
    return option(1000, common=True, help="samples per batch of the final evaluation (default {default})")


def max_steps() -> Any:
    return option(0, common=True, help="stop after N steps (default {default}: all epochs)")


def compute_threads() -> Any:
    return option(0, common=True,
                  help="torch threads of this trainer or worker (default {default}: its share of this host's cores "
                       "among the trainers or workers on it)")


def progress() -> Any:
    return option(None, flag="--no-progress", negate=True, common=True, help="log lines instead of a progress bar")


def bucket_cap_mb() -> Any:
    return option(25.0, common=True,
                  help="gradient bucket size in MiB (default {default}): with --mode ps, those a --step pushpull "
                       "trainer fills during backward; with --mode ddp, DDP's all-reduce buckets")


def check_loop(config: Any) -> None:
    """The checks of the shared fields, for either configuration (``ValueError`` naming the flag)."""
    for name in ("epochs", "batch_size", "eval_batch_size"):
        if getattr(config, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
    if config.max_steps < 0:
        raise ValueError("--max-steps must be >= 0")

