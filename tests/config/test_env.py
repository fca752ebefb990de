"""The server address a ``--mode ps`` trainer defaults to: $PSSERVER_SERVER, never torchrun's
own rendezvous (its MASTER_ADDR:MASTER_PORT), else a hand-set or Slurm MASTER_ADDR:MASTER_PORT."""

from __future__ import annotations

import re

import pytest

from psserver.config.common import parse_host_port
from psserver.config.env import SERVER_VAR, default_server_address, under_torchelastic
from psserver.errors import UsageError
from tests.procs import NOT_INHERITED, ROOT

# What torchrun's agent puts in a worker's environment (LocalElasticAgent._start_workers).
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for name in (*NOT_INHERITED, *TORCHRUN, SERVER_VAR):
        monkeypatch.delenv(name, raising=False)


def _set(monkeypatch, **variables: str) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_without_a_launcher_it_is_the_loopback_default():
    assert not under_torchelastic()
    assert default_server_address() == "127.0.0.1:29500"


def test_hand_set_or_slurm_master_addr_and_port_still_name_the_server(monkeypatch):
    _set(monkeypatch, SLURM_PROCID="1", SLURM_NTASKS="2", MASTER_ADDR="10.0.0.5", MASTER_PORT="29555")
    assert default_server_address() == "10.0.0.5:29555"
    monkeypatch.delenv("MASTER_PORT")
    assert default_server_address() == "10.0.0.5:29500"


@pytest.mark.parametrize(("value", "expected"), [
    ("10.0.0.7:29600", ("10.0.0.7", 29600)),
    ("ps-0.ps-rpc", ("ps-0.ps-rpc", 29500)),  # HOST alone: the default port
    ("[::1]:29601", ("::1", 29601)),
    ("[fe80::1]", ("fe80::1", 29500)),
    (" psserver:29602 ", ("psserver", 29602)),
])
def test_psserver_server_comes_first(monkeypatch, value, expected):
    _set(monkeypatch, MASTER_ADDR="10.0.0.5", MASTER_PORT="29555", **{SERVER_VAR: value})
    assert parse_host_port(default_server_address()) == expected


def test_psserver_server_names_the_server_under_torchrun(monkeypatch):
    _set(monkeypatch, **TORCHRUN, **{SERVER_VAR: "10.0.0.7:29600"})
    assert under_torchelastic()
    assert default_server_address() == "10.0.0.7:29600"


def test_an_empty_psserver_server_is_unset(monkeypatch):
    _set(monkeypatch, MASTER_ADDR="10.0.0.5", MASTER_PORT="29555", **{SERVER_VAR: ""})
    assert default_server_address() == "10.0.0.5:29555"


@pytest.mark.parametrize("variables", [
    TORCHRUN,
    {"TORCHELASTIC_RUN_ID": "job-7", "MASTER_ADDR": "node-0", "MASTER_PORT": "29500"},
    {"TORCHELASTIC_RUN_ID": "job-7", "MASTER_ADDR": "node-0"},  # MASTER_ADDR alone is no guess either
    {"TORCHELASTIC_RESTART_COUNT": "1"},
])
def test_under_torchrun_master_port_is_never_the_server(monkeypatch, variables):
    _set(monkeypatch, **variables)
    with pytest.raises(ValueError) as info:
        default_server_address()
    message = str(info.value)
    assert message == ("under torchrun, $MASTER_ADDR:$MASTER_PORT is torchrun's own rendezvous, not a psserver: "
                       "name the psserver with --server HOST:PORT or $PSSERVER_SERVER")


@pytest.mark.parametrize(("value", "says"), [
    ("10.0.0.7:http", "port 'http' is not a number"),
    ("::1", "an IPv6 address goes in brackets"),
    ("ps:70000", "out of range"),
    ("my host", "'my host' is not a host name or address"),
])
def test_a_malformed_psserver_server_is_one_line_naming_it(monkeypatch, value, says):
    _set(monkeypatch, **{SERVER_VAR: value})
    with pytest.raises(ValueError) as info:
        default_server_address()
    message = str(info.value)
    assert message.startswith(f"$PSSERVER_SERVER={value!r} is not the psserver's HOST:PORT")
    assert says in message and "\n" not in message and len(message) < 250


def test_connect_without_an_address_under_torchrun_is_a_usage_error(monkeypatch):
    """Before any process group, store or signal handler: at once, not after --connect-timeout."""
    import psserver

    _set(monkeypatch, **TORCHRUN)
    with pytest.raises(UsageError) as info:
        psserver.connect()
    assert str(info.value) == ("psserver.connect: under torchrun, $MASTER_ADDR:$MASTER_PORT is torchrun's own "
                               "rendezvous, not a psserver: name the psserver with psserver.connect('HOST:PORT') "
                               "or $PSSERVER_SERVER")
    _set(monkeypatch, **{SERVER_VAR: "bad:port"})
    with pytest.raises(UsageError, match=r"^psserver.connect: \$PSSERVER_SERVER='bad:port' is not"):
        psserver.connect()


def test_connect_takes_the_address_or_psserver_server_under_torchrun(monkeypatch):
    from psserver.trainer.library import _config

    _set(monkeypatch, **TORCHRUN)
    config = _config("10.0.0.9:29700", rank=None, num_trainers=None, token_file=None, step=None)
    assert (config.server_host, config.server_port, config.rank) == ("10.0.0.9", 29700, 0)
    _set(monkeypatch, **{SERVER_VAR: "ps-0"})
    config = _config(None, rank=None, num_trainers=None, token_file=None, step=None)
    assert (config.server_host, config.server_port) == ("ps-0", 29500)


OUT_OF_RANGE = [
    ({"SLURM_NTASKS": "-5"}, "$SLURM_NTASKS=-5 (the default number of trainers, --num-trainers) must be >= 1"),
    ({"WORLD_SIZE": "0"}, "$WORLD_SIZE=0 (the default number of trainers, --num-trainers) must be >= 1"),
    ({"WORLD_SIZE": "9" * 23}, "$WORLD_SIZE=99999999999999999999999 (the default number of trainers, "
                               "--num-trainers) must be <= 2147483647"),
    ({"WORLD_SIZE": "9" * 30}, "$WORLD_SIZE=999999999999999999999... (the default number of trainers, "
                               "--num-trainers) must be <= 2147483647"),
    ({"RANK": "-4"}, "$RANK=-4 (the default trainer rank, --rank) must be >= 0"),
    ({"SLURM_PROCID": "-1"}, "$SLURM_PROCID=-1 (the default trainer rank, --rank) must be >= 0"),
    ({"MASTER_PORT": "99999"}, "$MASTER_PORT=99999 (the default server port) must be <= 65535"),
]


@pytest.mark.parametrize("variables,message", OUT_OF_RANGE, ids=[next(iter(v)) + "=" + next(iter(v.values()))[:5]
                                                                  for v, _ in OUT_OF_RANGE])
def test_a_launchers_variable_out_of_range_is_named_not_its_flag(monkeypatch, capsys, variables, message):
    """They were reported as the flags they default ("--num-trainers must be >= 1, got -5"): by
    the CLI (one line, exit 2) and by psserver.connect (a UsageError)."""
    import psserver
    from psserver.cli import main

    _set(monkeypatch, **variables)
    try:
        code = main(["train", "--max-steps", "1"])
    except SystemExit as e:  # $RANK, $WORLD_SIZE: read while the parser is built, as the flags' defaults
        code = e.code
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"psserver train: error: {message}"]
    with pytest.raises(UsageError) as info:
        psserver.connect()
    assert str(info.value) == f"psserver.connect: {message}"


def test_a_launchers_variable_that_is_no_int_is_still_no_default(monkeypatch):
    from psserver.config.env import default_rank, default_world_size

    _set(monkeypatch, RANK="abc", SLURM_PROCID="3", WORLD_SIZE="1.5", MASTER_PORT="x")
    assert (default_rank(), default_world_size(), default_server_address()) == (3, None, "127.0.0.1:29500")


READ_BY_NAME = re.compile(
    r"""(?:environ(?:\.get)?[(\[]|getenv\(|env_int\(|_launcher_var\(|_(?:VAR|ENV) = )["']([A-Z][A-Z0-9_]+)["']""")
"""How psserver reads a variable by name: ``os.environ.get("X")``, ``os.environ["X"]``,
``os.getenv("X")``, ``env_int("X", ...)`` and the ``*_VAR`` / ``*_ENV`` constants it reads through."""


def test_every_environment_variable_read_by_name_is_documented():
    """Launchers' variables too (MASTER_PORT, SLURM_PROCID, HOSTNAME), not only PSSERVER_*: a
    default taken from the environment is one the user must be able to find."""
    source = "\n".join(p.read_text() for p in (ROOT / "psserver").rglob("*.py"))
    read = set(READ_BY_NAME.findall(source))
    assert {"MASTER_PORT", "SLURM_PROCID", "PSSERVER_DATA_DIR", "HOSTNAME"} <= read, "the pattern is stale"
    documented = (ROOT / "docs" / "configuration.md").read_text()
    missing = sorted(v for v in read if f"`{v}`" not in documented and f"`{v.split('_')[0]}_*`" not in documented)
    assert not missing, f"docs/configuration.md does not document {missing}"
