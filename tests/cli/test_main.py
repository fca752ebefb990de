import pytest

from psserver.cli import build_parser, main


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "serve" in capsys.readouterr().err


def test_every_verb_has_help(capsys):
    _, commands = build_parser()
    assert {"serve", "train", "status", "checkpoint", "stop", "demo"} <= set(commands)
    for name in commands:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
    assert "--sync-trainers" in capsys.readouterr().out


def test_bad_flag_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--update", "sometimes"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice" in err[0]


def test_rank_and_server_default_from_torchrun_env(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29999")
    parser, _ = build_parser()
    args = parser.parse_args(["train"])
    assert (args.rank, args.num_trainers, args.server) == (3, 4, "10.1.2.3:29999")


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
        (["train", "--model", "mlp"], "chosen by the server"),
    ],
)
def test_config_validation_is_one_line_exit_2(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
