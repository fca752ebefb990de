import argparse
import re

import pytest

from psserver.cli import build_parser, main
from tests.procs import free_port, run


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "serve" in capsys.readouterr().err


def test_every_verb_has_help(capsys):
    _, commands = build_parser()
    assert {"serve", "train", "status", "checkpoint", "stop", "demo"} <= set(commands)
    for name in commands:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == (2 if name == "bench" else 0), name  # bench only says where the benchmarks went
    assert "--sync-trainers" in capsys.readouterr().out


def test_bad_flag_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--update", "sometimes"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice" in err[0]


TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0"}
"""A torchrun worker's launcher variables (with MASTER_PORT, torchrun's rendezvous store's port)."""


def _server(monkeypatch, argv, **variables):
    from psserver.cli.train import trainer_config_from_args

    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "PSSERVER_SERVER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    parser, _ = build_parser()
    config = trainer_config_from_args(parser.parse_args(argv))
    return config.server_host, config.server_port


def test_rank_and_server_default_from_hand_set_master_env(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _server(monkeypatch, ["train"], MASTER_ADDR="10.1.2.3", MASTER_PORT="29999") == ("10.1.2.3", 29999)
    parser, _ = build_parser()
    args = parser.parse_args(["train"])
    assert (args.rank, args.num_trainers) == (3, 4)


def test_psserver_server_names_the_server_before_master_and_after_the_flag(monkeypatch):
    env = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29999", "PSSERVER_SERVER": "ps-0.rpc:29600"}
    assert _server(monkeypatch, ["train"], **env) == ("ps-0.rpc", 29600)
    assert _server(monkeypatch, ["train"], **TORCHRUN_ENV, MASTER_PORT="29400",
                   PSSERVER_SERVER="ps-0.rpc") == ("ps-0.rpc", 29500)
    assert _server(monkeypatch, ["train", "--server", "10.9.9.9:5"], **env) == ("10.9.9.9", 5)
    assert _server(monkeypatch, ["train", "--server", "10.9.9.9:5"], **TORCHRUN_ENV, MASTER_PORT="29400") == \
        ("10.9.9.9", 5)


def test_under_torchrun_the_collective_modes_and_serve_need_no_psserver_address(monkeypatch):
    """The server default is read when a ps-mode trainer is configured, not when the parser is built."""
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29400")
    monkeypatch.setenv("PSSERVER_SERVER", "not an address")
    parser, _ = build_parser()
    assert parser.parse_args(["train", "--mode", "ddp"]).server is None
    parser.parse_args(["serve"])


def test_a_trainer_under_torchrun_without_a_server_ends_at_once_exit_2(port):
    """Not connected to torchrun's store on MASTER_PORT (here: nobody) for --connect-timeout."""
    proc = run(["train", "--connect-timeout", "20"], env={**TORCHRUN_ENV, "MASTER_PORT": str(port)}, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "psserver train: error: under torchrun, $MASTER_ADDR:$MASTER_PORT is torchrun's own rendezvous, not a "
        "psserver: name the psserver with --server HOST:PORT or $PSSERVER_SERVER"]


def test_a_malformed_psserver_server_is_one_line_exit_2():
    proc = run(["train", "--connect-timeout", "20"], env={"PSSERVER_SERVER": "ps-0:http"}, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "psserver train: error: $PSSERVER_SERVER='ps-0:http' is not the psserver's HOST:PORT (or HOST): "
        "address 'ps-0:http': port 'http' is not a number"]


def test_slurm_env_is_a_fallback(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    parser, _ = build_parser()
    args = parser.parse_args(["train"])
    assert (args.rank, args.num_trainers) == (1, 2)


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["serve", "--sync-trainers", "0", "--no-control"], "--sync-trainers must be >= 1"),
        (["serve", "--devices", "tpu:0", "--no-control"], "unsupported device"),
        (["serve", "--port", "70000", "--no-control"], "out of range"),
        (["serve", "--lr", "-1", "--no-control"], "learning rate must be positive"),
        (["serve", "--resume", "--no-control"], "--resume without a path needs --checkpoint-dir"),
        (["train", "--rank", "2", "--num-trainers", "2"], "--rank 2 must be < --num-trainers 2"),
        (["train", "--epochs", "0"], "--epochs must be >= 1"),
        (["train", "--model", "nopkg:Net"], "module 'nopkg' is not importable"),
        (["train", "--model-args", '{"width": 3}'], "--model-args needs --model"),
        (["serve", "--model-args", '{"width": 3}', "--no-control"], "--model-args needs --model"),
        (["serve", "--model", "mlp", "--model-args", "{width: 3}", "--no-control"], "--model-args is not JSON"),
        (["serve", "--model", "mlp", "--model-args", '{"width": 3}', "--no-control"],
         "--model mlp does not accept these arguments: got an unexpected keyword argument 'width'"),
        (["train", "--model", "torch.nn:Module.nope"], "'torch.nn:Module' has no attribute 'nope'"),
        (["serve", "--compute", "server", "--no-control"], "--compute server runs the model on the server: it needs "
                                                          "--model"),
        (["serve", "--model", "mlp", "--devices", "cudaX", "--no-control"], "unsupported device 'cudaX'"),
        (["train", "--device", "cuda:abc"], "unsupported --device 'cuda:abc'"),
        (["serve", "--compute-threads", "100000", "--no-control"], "--compute-threads must be in 0..1024"),
        (["serve", "--rpc-threads", "100000000", "--no-control"], "--rpc-threads must be in 4..1024"),
        (["train", "--compute-threads", "-1"], "--compute-threads must be in 0..1024"),
        (["serve", "--seed", str(2**63), "--no-control"], "--seed must be in 0..2^63-1"),
        (["train", "--data-seed", "-1"], "--data-seed must be in 0..2^63-1"),
        (["train", "--mode", "ddp", "--seed", "-5", "--no-control"], "--seed must be in 0..2^63-1"),
        (["demo", "--model", "nosuch"], "unknown model 'nosuch'"),  # before it starts a server
        (["serve", "--model", "mf", "--embedding-max-rows", "100", "--embedding-prefill", "101", "--no-control"],
         "--embedding-prefill must be in 0..--embedding-max-rows (100), got 101"),  # not an endless prefill
        # Finite but too short to work: torch's C++ failed on them (1e-300 s is 0 ms).
        (["serve", "--rpc-timeout", "1e-300", "--no-control"],
         "--rpc-timeout is in seconds and must be between 1 and 604800, got 1e-300"),
        (["train", "--rpc-timeout", "0.001"],
         "--rpc-timeout is in seconds and must be between 1 and 604800, got 0.001"),
        (["serve", "--trainer-timeout", "1e-300", "--no-control"],
         "--trainer-timeout is in seconds and must be between 0.5 and 604800, got 1e-300"),
        (["train", "--connect-timeout", "0"],
         "--connect-timeout is in seconds and must be between 0.1 and 604800, got 0"),
        (["train", "--connect-timeout", "1e-300"],
         "--connect-timeout is in seconds and must be between 0.1 and 604800, got 1e-300"),
        # Finite but too long for torch: its RPC holds milliseconds in a C int (an OverflowError inside).
        (["serve", "--rpc-timeout", "1e308", "--no-control"],
         "--rpc-timeout is in seconds and must be between 1 and 604800, got 1e+308"),
        (["train", "--rpc-timeout", "1e308"], "--rpc-timeout is in seconds and must be between 1 and 604800"),
        (["train", "--num-trainers", "99999999999999999999"], "--num-trainers must be in 1..65536"),
        (["train", "--bucket-cap-mb", "1e308"], "--bucket-cap-mb must be a number in (0, 65536], got 1e+308"),
        (["train", "--stats-out", "/dev/zero"], "--stats-out /dev/zero is not a regular file"),
        (["stop", "--wait", "--wait-timeout", "-1"], "--wait-timeout must be >= 0, got -1"),
        # --mode ps took the flag and never passed it on: 0 was ignored there.
        (["train", "--eval-batch-size", "0"], "--eval-batch-size must be >= 1, got 0"),
        (["train", "--mode", "ddp", "--no-control", "--eval-batch-size", "0"], "--eval-batch-size must be >= 1, got 0"),
        (["train", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    ],
)
def test_config_validation_is_one_line_exit_2(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


@pytest.mark.parametrize("argv", [
    ["serve", "--rpc-timeout", "inf"], ["serve", "--lr", "nan"], ["serve", "--trainer-timeout", "1e309"],
    ["train", "--connect-timeout", "nan"], ["train", "--rpc-timeout", "inf"], ["status", "--timeout", "inf"],
    ["train", "--mode", "ddp", "--bucket-cap-mb", "nan"],
])
def test_a_number_flag_refuses_nan_and_infinities(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"argument {argv[-2]}: must be a finite number, got '{argv[-1]}'" in err[0], err


@pytest.mark.parametrize("argv", [
    ["serve", "--checkpoint-dir", ""], ["train", "--data-dir", " "], ["export", "ckpt", "--out", ""],
    ["status", "--auth-token-file", ""],
])
def test_an_empty_path_is_refused(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "an empty path names no file or directory" in err[0], err


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_path_the_system_refuses_is_one_line_exit_1(tmp_path):
    """An OSError about a path the user named (here a name longer than the 255 bytes a file
    system allows) is that path, cut short, and the system's words for it: not an internal error."""
    r = run(["serve", "--model", "mlp", "--no-control", "--port", str(free_port()), "--tensorboard-dir",
             str(tmp_path / ("t" * 300))], timeout=90)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"psserver serve: error: {str(tmp_path)[:40]}") and "..." in last, last
    assert last.endswith("ttt: File name too long"), last
    assert len(last) < 250 and "internal error" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv", [
    ["train", "--stats-out", "{tmp}"], ["train", "--stats-out", "{tmp}/no/s.json"],
    ["serve", "--no-control", "--tensorboard-dir", "{tmp}/file"], ["serve", "--no-control", "--checkpoint-dir",
                                                                    "{tmp}/file"],
    ["train", "--mode", "ddp", "--no-control", "--result-file", "{tmp}"],
    ["train", "--mode", "ddp", "--no-control", "--result-file", "{tmp}/{{x}}.json"],
])
def test_where_it_would_write_is_checked_at_start(capsys, tmp_path, argv):
    """A file where a directory belongs, a directory where a file does: refused before any work,
    not after training (--stats-out, --result-file were written at the end)."""
    (tmp_path / "file").write_text("")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and argv[-2] in err[0], err


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["serve", "--compute-t", "2"], "--compute-t"),  # not --compute-threads
        (["train", "--wire", "bf16"], "--wire"),  # not --wire-dtype
        (["train", "--nproc", "2"], "--nproc"),  # not --nproc-per-node
        (["train", "--mode", "ddp", "--static"], "--static"),  # not --static-graph
        (["--log=DEBUG", "status"], "--log=DEBUG"),  # not --log-level
    ],
)
def test_abbreviated_flags_are_refused(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unrecognized arguments" in err[0] and flag in err[0], err


def test_every_parser_refuses_abbreviations():
    parser, commands = build_parser()
    assert parser.allow_abbrev is False
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == set(commands)
    assert all(p.allow_abbrev is False for p in subparsers.choices.values())


def _help_sections(text: str) -> dict[str, str]:
    """Section title -> its text, from argparse's help (titles are unindented lines ending in ':')."""
    sections: dict[str, str] = {}
    title = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = ""
        elif title is not None:
            sections[title] += line + "\n"
    return sections


def test_eval_batch_size_reaches_a_ps_trainer():
    from psserver.cli.train import trainer_config_from_args

    parser, _ = build_parser()
    assert trainer_config_from_args(parser.parse_args(["train", "--eval-batch-size", "7"])).eval_batch_size == 7


def _train_help(capsys, *mode: str) -> dict[str, str]:
    with pytest.raises(SystemExit) as e:
        main(["train", *mode, "--help"])
    assert e.value.code == 0
    return _help_sections(capsys.readouterr().out)


def _flags(text: str) -> set[str]:
    return set(re.findall(r"^ +(--[\w-]+)", text, re.M))


COMMON = {
    "options": ["--mode", "--model", "--epochs", "--batch-size", "--max-steps", "--rank", "--num-trainers"],
    "data": ["--dataset", "--data-dir", "--train-split"],
    "optimizer": ["--optimizer", "--lr", "--momentum", "--weight-decay"],
}
BY_MODE = {
    "ps": {"parameter server (--mode ps)": ["--server", "--step", "--connect-timeout", "--reconnect",
                                            "--rpc-timeout", "--transport", "--loss", "--entry"],
           "options": ["--bucket-cap-mb"]},
    "ddp": {"DDP (--mode ddp)": ["--static-graph", "--comm-hook", "--powersgd-rank"],
            "options": ["--bucket-cap-mb"]},
    "fsdp": {"FSDP (--mode fsdp)": ["--reshard-after-forward", "--mixed-precision", "--tp-size"]},
}
COLLECTIVE = {
    "collective training (--mode ddp|fsdp)": ["--seed", "--result-file"],
    "collective launch (--mode ddp|fsdp)": ["--nproc-per-node", "--master-addr", "--master-port", "--backend"],
    "collective checkpoints (--mode ddp|fsdp)": ["--checkpoint-dir", "--resume"],
    "control plane": ["--control-port", "--no-control", "--auth-token-file"],
    "metrics": ["--metrics-port", "--tensorboard-dir"],
}


@pytest.mark.parametrize("mode", ["ps", "ddp", "fsdp"])
def test_train_help_shows_the_flags_of_its_mode(capsys, mode):
    """``train --help`` is a parameter-server trainer's; ``--mode ddp|fsdp --help`` the collective
    mode's own: each flag under its group, and no other mode's flag anywhere."""
    sections = _train_help(capsys, *([] if mode == "ps" else ["--mode", mode]))
    expected: dict[str, list[str]] = {title: list(flags) for title, flags in COMMON.items()}
    for title, flags in {**BY_MODE[mode], **(COLLECTIVE if mode != "ps" else {})}.items():
        expected.setdefault(title, []).extend(flags)
    for title, flags in expected.items():
        assert title in sections, (title, list(sections))
        assert set(flags) <= _flags(sections[title]), (title, set(flags) - _flags(sections[title]))
    assert set(sections) <= set(expected), set(sections) - set(expected)
    shown = set().union(*map(_flags, sections.values()))
    others = {flag for m, groups in BY_MODE.items() if m != mode for flags in groups.values() for flag in flags}
    if mode == "ps":
        others |= {flag for flags in COLLECTIVE.values() for flag in flags}
    assert not (shown & others - set(expected.get("options", []))), shown & others


def test_step_modes_come_from_the_config():
    from psserver.config import TrainerConfig
    from psserver.config.ps import STEP_MODES

    parser, _ = build_parser()
    args = parser.parse_args(["train"])
    assert args.step is None and args.compute is None and TrainerConfig().compute is None  # the join decides
    assert TrainerConfig(step="pull").compute == "trainer" and TrainerConfig(compute="server").step is None
    with pytest.raises(ValueError, match="--step chained is a protocol of --compute server"):
        TrainerConfig(compute="trainer", step="chained")
    with pytest.raises(ValueError, match="--wire-dtype applies to --compute trainer"):
        TrainerConfig(compute="server", wire_dtype="bf16")
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    step = next(a for a in subparsers.choices["train"]._actions if a.dest == "step")
    assert tuple(step.choices) == tuple(STEP_MODES)
    assert all(f"{mode} = [{m.compute}]" in step.help for mode, m in STEP_MODES.items())  # every mode explained
