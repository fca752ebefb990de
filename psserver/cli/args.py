"""Argument groups shared by several verbs, each derived from its configuration dataclass
(``psserver.cli.builder``), and the configuration pieces built back from them.

Each ``add_*_arguments`` adds one configuration's flags; the matching ``*_from_args`` builds that
configuration (validated in its ``__post_init__``: call it inside
:func:`psserver.cli.base.config_errors` so a bad value is a usage error).
"""

from __future__ import annotations

import argparse
import dataclasses

from psserver.cli.builder import add_options, argparse_type, build, given
from psserver.config.common import DataConfig
from psserver.config.control import ControlConfig, ObservabilityConfig
from psserver.config.optimizer import OptimizerConfig
from psserver.config.options import finite_float as _finite_float
from psserver.config.options import flag_of, path_value

finite_float = argparse_type(_finite_float, "finite_float")
"""argparse's ``type`` for a number flag of a verb without a configuration (``status --timeout``)."""
path_arg = argparse_type(path_value, "path")
"""argparse's ``type`` for a path flag of a verb without a configuration (``export --out``)."""


def add_optimizer_arguments(parser: argparse.ArgumentParser, *, defaults_from_server: bool) -> None:
    """``OptimizerConfig``'s flags. Left out, all of them, ``train`` takes the server's (``--mode
    ps``), else the field's (``--mode ddp|fsdp``); ``serve`` takes the first trainer's."""
    left_out = "the server's; ddp/fsdp: {default}" if defaults_from_server else "the first trainer's, else {default}"
    add_options(parser, OptimizerConfig, "optimizer", left_out=left_out)


def optimizer_from_args(args: argparse.Namespace) -> OptimizerConfig | None:
    """An OptimizerConfig when any optimizer flag was given, else None."""
    values = given(OptimizerConfig, args)
    return OptimizerConfig(**values) if values else None


SIZED_DATASETS = ("synthetic", "synthetic_clicks", "pysource")
DATASET_FLAGS = {"synthetic_train": SIZED_DATASETS, "synthetic_eval": SIZED_DATASETS,
                 "id_space": ("synthetic_clicks",), "click_vocab": ("synthetic_clicks",)}
"""Data fields that only some datasets read: given for another, they are refused, not ignored."""


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """``DataConfig``'s flags, shared by every training mode."""
    add_options(parser, DataConfig, "data")


def data_from_args(args: argparse.Namespace) -> DataConfig:
    """The DataConfig of the data flags; ``ValueError`` for a flag the dataset does not use."""
    from psserver.data import DATASETS, IMAGEFOLDER  # torch: not at parser build

    values = given(DataConfig, args)
    dataset = values.get("dataset", "").strip()
    if dataset == IMAGEFOLDER and "data_dir" not in values:
        raise ValueError("--dataset imagefolder needs --data-dir DIR (DIR/train/<class>/<image>, "
                         "DIR/val/<class>/<image>)")
    fields = {f.name: f for f in dataclasses.fields(DataConfig)}
    for name, datasets in DATASET_FLAGS.items():
        if name in values and dataset not in datasets and dataset in DATASETS:  # an unknown one: DataConfig says so
            raise ValueError(f"{flag_of(fields[name])} applies to --dataset {' or '.join(datasets)} only, "
                             f"not {dataset}")
    return DataConfig(**values)


CONTROL_GROUP = "control plane"
METRICS_GROUP = "metrics"


def add_control_arguments(parser: argparse.ArgumentParser, description: str | None = None) -> None:
    """Control-plane and metrics flags, shared by ``serve`` and collective ``train``
    (``description``: of both groups)."""
    add_options(parser, ControlConfig, CONTROL_GROUP, description)
    add_options(parser, ObservabilityConfig, METRICS_GROUP, description)


def control_from_args(args: argparse.Namespace) -> tuple[ControlConfig, ObservabilityConfig]:
    return build(ControlConfig, args), build(ObservabilityConfig, args)
