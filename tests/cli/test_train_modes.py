"""``psserver train`` takes every mode's flags in one parser; a flag of the other family of modes
(a parameter server's in ``--mode ddp|fsdp``, a collective one in ``--mode ps``) is refused in
one line naming its mode, before any connection or process. It used to be ignored."""

from __future__ import annotations

import pytest

from psserver.cli import main


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PSSERVER_SERVER",
                "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("argv,says", [
    (["--seed", "3"], "--seed is a flag of --mode ddp|fsdp, not --mode ps (a --mode ps trainer's initial "
                      "parameters are its server's: psserver serve --seed)"),
    (["--static-graph"], "--static-graph is a flag of --mode ddp, not --mode ps"),
    (["--no-reshard-after-forward"], "--no-reshard-after-forward is a flag of --mode fsdp, not --mode ps"),
    (["--tp-size", "2"], "--tp-size is a flag of --mode fsdp, not --mode ps"),
    (["--nproc-per-node", "2"], "--nproc-per-node is a flag of --mode ddp|fsdp, not --mode ps"),
    (["--control-port", "0"], "--control-port is a flag of --mode ddp|fsdp, not --mode ps"),
    (["--no-control"], "--no-control is a flag of --mode ddp|fsdp, not --mode ps"),
    (["--checkpoint-dir", "ckpt"], "--checkpoint-dir is a flag of --mode ddp|fsdp, not --mode ps"),
    (["--mode", "ddp", "--no-control", "--transport", "cpu"], "--transport is a flag of --mode ps, not --mode ddp"),
    (["--mode", "ddp", "--no-control", "--server", "127.0.0.1:1"], "--server is a flag of --mode ps, not --mode ddp"),
    (["--mode", "fsdp", "--no-control", "--step", "pull"], "--step is a flag of --mode ps, not --mode fsdp"),
    (["--mode", "fsdp", "--no-control", "--reconnect"], "--reconnect is a flag of --mode ps, not --mode fsdp"),
    (["--mode", "ddp", "--no-control", "--connect-timeout", "5"],
     "--connect-timeout is a flag of --mode ps, not --mode ddp"),
    # Kept: the configuration's own words between the two collective modes, and for --loss.
    (["--mode", "fsdp", "--no-control", "--bucket-cap-mb", "5"], "DDP flags (--comm-hook, --static-graph, "
                                                                  "--bucket-cap-mb, ...) need --mode ddp"),
    (["--mode", "ddp", "--no-control", "--loss", "mse"], "--loss and --metric apply to --mode ps"),
])
def test_a_flag_of_the_other_mode_is_one_line_exit_2(capsys, argv, says):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("argv", [
    ["--bucket-cap-mb", "5"], ["--rank", "0", "--num-trainers", "1"], ["--seed", "0"],  # --seed 0: its default
])
def test_a_ps_trainer_takes_its_own_and_the_shared_flags(argv):
    from psserver.cli import build_parser
    from psserver.cli.train import trainer_config_from_args

    parser, commands = build_parser()
    args = parser.parse_args(["train", *argv])
    commands["train"].mode_flags.refuse_other_mode(args)
    trainer_config_from_args(args)


def test_a_collective_run_takes_the_shared_flags():
    from psserver.cli import build_parser
    from psserver.cli.collective_args import collective_config_from_args

    parser, commands = build_parser()
    args = parser.parse_args(["train", "--mode", "ddp", "--bucket-cap-mb", "5", "--rank", "0", "--epochs", "2",
                              "--no-control"])
    commands["train"].mode_flags.refuse_other_mode(args)
    config = collective_config_from_args(args)
    assert (config.ddp.bucket_cap_mb, config.epochs) == (5, 2)
