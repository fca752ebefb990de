"""Bad flags and combinations: one line on stderr, exit code 2, no traceback, no process group."""

from __future__ import annotations

import pytest
import torch

from psserver.cli import main
from psserver.errors import UsageError

from .helpers import run_cli, worker_env

CASES = [
    ("--mode fsdp --model llama_tiny --nproc-per-node 2 --tp-size 3", "not divisible by --tp-size 3"),
    ("--mode fsdp --model llama_tiny --nproc-per-node 16 --tp-size 16", "must divide the 8 attention heads"),
    ("--mode ddp --comm-hook nope", "unknown --comm-hook 'nope'"),
    ("--mode ddp --comm-hook powersgd --powersgd-rank 0", "--powersgd-rank must be >= 1"),
    ("--mode ddp --comm-hook powersgd --powersgd-start-iter 1", "--powersgd-start-iter must be >= 2"),
    ("--mode ddp --comm-hook post-localsgd --model-averaging-period 0", "--model-averaging-period must be >= 1"),
    ("--mode ddp --localsgd-group-size 1", "--localsgd-group-size needs --comm-hook post-localsgd"),
    ("--mode fsdp --nproc-per-node 2 --tp-size 2", "tensor-parallel plan"),
    ("--mode ddp --tp-size 2", "need --mode fsdp"),
    ("--mode fsdp --comm-hook fp16", "need --mode ddp"),
    ("--mode fsdp --mixed-precision fp8", "unknown --mixed-precision"),
    ("--mode ddp --backend mpi", "unknown --backend"),
    ("--mode ddp --bucket-cap-mb 0", "--bucket-cap-mb must be positive"),
    ("--mode ddp --nccl-min-nchannels 0", "NCCL_MIN_NCHANNELS"),
    # Accepted, and handed to NCCL as they were.
    ("--mode ddp --nccl-min-nchannels 100000000000000000000",
     "--nccl-min-nchannels (NCCL_MIN_NCHANNELS) must be in 1..64, got 100000000000000000000"),
    ("--mode ddp --nccl-socket-nthreads 17", "--nccl-socket-nthreads (NCCL_SOCKET_NTHREADS) must be in 1..16"),
    ("--mode ddp --nccl-nsocks-perthread 65", "--nccl-nsocks-perthread (NCCL_NSOCKS_PERTHREAD) must be in 1..64"),
    ("--mode ddp --nccl-nsocks-perthread 8 --nccl-socket-nthreads 16",
     "--nccl-nsocks-perthread x --nccl-socket-nthreads must be at most 64 (NCCL's limit), got 8 x 16"),
    # Spawned 100000 workers.
    ("--mode ddp --nproc-per-node 100000", "--nproc-per-node 100000 is more than this host can run: at most"),
    ("--mode ddp --rank 1", "--rank is set by the launcher"),
    ("--mode ddp --nproc-per-node 2 --num-trainers 3", "does not match the world size 2"),
    ("--mode ddp --model nosuchmodel", "unknown model"),
    ("--mode ddp --resume", "--resume without a path needs --checkpoint-dir"),
    ("--mode ddp --resume /nonexistent/step-1", "no such checkpoint directory"),
    ("--mode ddp --nproc-per-node 0", "--nproc-per-node must be >= 1"),
    # Not a host: the workers retried it for torch's whole rendezvous timeout (five minutes).
    ("--mode ddp --nproc-per-node 2 --master-addr 999.9.9.9",
     "--master-addr '999.9.9.9' is not an IPv4 address (four numbers 0 to 255"),
    ("--mode ddp --master-addr no/such", "--master-addr 'no/such' is not a host name or address"),
    ("--mode ddp --master-addr fe80::zz", "--master-addr 'fe80::zz' is not an IPv6 address"),
]


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags,message", CASES, ids=[c[0] for c in CASES])
def test_rejected_in_process(flags, message, capsys):
    assert main(["train", *flags.split(), "--no-control"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("psserver train: error: ") and message in err[0], err[0]


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when no GPU is present")
def test_nccl_without_gpu_in_process(capsys):
    assert main(["train", "--mode", "ddp", "--backend", "nccl", "--nproc-per-node", "2", "--no-control"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["psserver train: error: --backend nccl needs CUDA GPUs and none is available (use gloo on CPU)"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when no GPU is present")
def test_nccl_without_gpu_subprocess():
    proc = run_cli(["--mode", "ddp", "--backend", "nccl", "--nproc-per-node", "2", "--no-control"], timeout=100)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("needs CUDA GPUs and none is available (use gloo on CPU)")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_tp_size_against_torchrun_world_size():
    """Under a launcher, WORLD_SIZE decides: rejected in the worker before it joins any group."""
    env = worker_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_PORT="1")
    proc = run_cli(["--mode", "fsdp", "--model", "llama_tiny", "--tp-size", "4", "--no-control"], timeout=100, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "psserver train: error: world size 2 is not divisible by --tp-size 4")


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_unknown_hook_message_is_one_line_via_python_m():
    # The same through the console entry point (python -m psserver): exit code 2, one line.
    proc = run_cli(["--mode", "ddp", "--comm-hook", "bogus"], timeout=50)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "psserver train: error: unknown --comm-hook 'bogus'; known: none, fp16, bf16, powersgd, powersgd+fp16, "
        "post-localsgd"]


@pytest.mark.parametrize("value", ["1.5", "abc", "-1", ""])
def test_a_launchers_variable_that_is_no_rank_is_one_line(monkeypatch, value):
    from psserver.config.env import launcher_env

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", value)
    with pytest.raises(UsageError, match=r"\$LOCAL_RANK=.* is (not an int|out of range)") as info:
        launcher_env()
    assert "\n" not in str(info.value)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert launcher_env().local_rank == 3
    assert launcher_env().local_world_size == 1


@pytest.mark.timeout(60)
def test_a_rendezvous_that_never_answers_is_one_line(port):
    """A worker that cannot reach the store: one line naming where, at the end of the wait."""
    from datetime import timedelta

    from psserver.collective.launcher import join_store

    with pytest.raises(UsageError, match=rf"cannot reach the rendezvous at 127.0.0.1:{port} within 1s \(") as info:
        join_store("127.0.0.1", port, 2, timedelta(seconds=1))
    assert "\n" not in str(info.value)


TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
BAD_LAUNCHER_ENV = [
    ({"RANK": "5"}, "$RANK=5 must be below $WORLD_SIZE=2 (ranks are 0..1)"),
    ({"RANK": "-4"}, "$RANK=-4 (the default trainer rank, --rank) must be >= 0"),
    ({"WORLD_SIZE": "99999999999999999999999"}, "$WORLD_SIZE=99999999999999999999999 (the default number of "
                                                "trainers, --num-trainers) must be <= 2147483647"),
    ({"WORLD_SIZE": "abc"}, "$WORLD_SIZE='abc' is not an int (torchrun and Slurm set it to one in 1..2147483647)"),
    ({"WORLD_SIZE": "1.5"}, "$WORLD_SIZE='1.5' is not an int"),
    ({"WORLD_SIZE": "0"}, "$WORLD_SIZE=0 (the default number of trainers, --num-trainers) must be >= 1"),
    ({"LOCAL_RANK": "2"}, "$LOCAL_RANK=2 must be below $WORLD_SIZE=2"),
    ({"LOCAL_RANK": "-1"}, "$LOCAL_RANK='-1' is out of range 0..2147483646"),
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}, "$LOCAL_RANK=1 must be below $LOCAL_WORLD_SIZE=1"),
    ({"LOCAL_WORLD_SIZE": "3"}, "$LOCAL_WORLD_SIZE=3 is more than $WORLD_SIZE=2"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variables,message", BAD_LAUNCHER_ENV, ids=[str(v) for v, _ in BAD_LAUNCHER_ENV])
def test_a_launchers_bad_variables_are_refused_before_the_rendezvous(monkeypatch, capsys, variables, message):
    """RANK=5 WORLD_SIZE=2 sat five minutes in the TCPStore connect; WORLD_SIZE=1e23 was a
    TypeError inside it; WORLD_SIZE=abc an int() message naming no variable."""
    for name, value in {**TORCHRUN_ENV, **variables}.items():
        monkeypatch.setenv(name, value)
    try:
        code = main(["train", "--mode", "ddp", "--max-steps", "1", "--no-control"])
    except SystemExit as e:  # the flags' defaults ($RANK, $WORLD_SIZE) are read as the parser is built
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"psserver train: error: {message}"), err


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rank_past_the_world_size_is_refused_at_once():
    env = worker_env(RANK="5", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_PORT="1")
    proc = run_cli(["--mode", "ddp", "--max-steps", "1", "--no-control"], timeout=100, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["psserver train: error: $RANK=5 must be below $WORLD_SIZE=2 "
                                                "(ranks are 0..1)"]
