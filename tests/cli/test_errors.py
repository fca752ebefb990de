"""Exit codes: usage errors are one line and 2; anything unexpected is an internal error (1),
its traceback in a log file named on the one stderr line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from psserver.checkpoint import CheckpointError
from psserver.cli import bench, main
from psserver.cli.control import StatusCommand
from psserver.errors import DataError, ServerLost, UsageError
from psserver.trainer.stop_signals import Stopped


def _raising(error: BaseException):
    def run(self, args):
        raise error

    return run


@pytest.fixture
def log_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PSSERVER_LOG_DIR", str(tmp_path))
    monkeypatch.delenv("PSSERVER_LOG_LEVEL", raising=False)
    return tmp_path


@pytest.mark.parametrize(
    "error,code",
    [
        (UsageError("no such thing"), 2),
        (CheckpointError("checkpoint x is for model 'mlp', this server runs 'mnist_cnn'"), 2),
        (DataError("no MNIST IDX files (*-idx3-ubyte[.gz]) in /nowhere"), 2),
        (ServerLost("lost the server at 127.0.0.1:29500"), 3),
    ],
)
def test_project_errors_are_one_line(monkeypatch, capsys, log_dir, error, code):
    monkeypatch.setattr(StatusCommand, "run", _raising(error))
    assert main(["status"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"psserver status: error: {error}"]
    assert not list(log_dir.iterdir())


def test_interrupt_is_130(monkeypatch, capsys, log_dir):
    monkeypatch.setattr(StatusCommand, "run", _raising(KeyboardInterrupt()))
    assert main(["status"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["psserver status: interrupted"]


def test_unexpected_value_error_is_an_internal_error(monkeypatch, capsys, log_dir):
    # A ValueError from deep inside (torch, say) is a bug, not bad input: exit 1, no usage line.
    def run(self, args):
        raise ValueError("Expected all tensors to be on the same device\nsecond line of torch's message")

    monkeypatch.setattr(StatusCommand, "run", run)
    assert main(["status", "--timeout", "3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    path = log_dir / f"psserver-status-{os.getpid()}.log"
    assert err == [f"psserver status: internal error: ValueError: Expected all tensors to be on the same device "
                   f"(traceback in {path})"]
    text = path.read_text()
    assert "Traceback (most recent call last)" in text and "in run" in text
    assert "second line of torch's message" in text
    assert "command: psserver status --timeout 3" in text


class UsersBaseException(BaseException):
    """What a user's code may raise where no narrower handler names it (its training step)."""


def test_a_base_exception_is_one_line_not_a_raw_traceback(monkeypatch, capsys, log_dir):
    monkeypatch.setattr(StatusCommand, "run", _raising(UsersBaseException("out of budget")))
    assert main(["status"]) == 1
    path = log_dir / f"psserver-status-{os.getpid()}.log"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"psserver status: internal error: UsersBaseException: out of budget (traceback in {path})"]
    assert "UsersBaseException: out of budget" in path.read_text()


def test_a_stop_a_loop_could_not_leave_on_is_its_signal_code(monkeypatch, capsys, log_dir):
    monkeypatch.setattr(StatusCommand, "run", _raising(Stopped(signal.SIGTERM, "while waiting for the server")))
    assert main(["status"]) == 143
    assert capsys.readouterr().err.strip().splitlines() == [
        "psserver status: received SIGTERM while waiting for the server: exiting"]


def test_internal_error_without_a_message(monkeypatch, capsys, log_dir):
    monkeypatch.setattr(StatusCommand, "run", _raising(RuntimeError()))
    assert main(["status"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"psserver status: internal error: RuntimeError \(traceback in .*psserver-status-\d+\.log\)",
                        line), line


def test_config_validation_errors_stay_usage_errors(capsys, log_dir):
    assert main(["train", "--mode", "ddp", "--comm-hook", "nope", "--no-control"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "psserver train: error: unknown --comm-hook 'nope'; known: none, fp16, bf16, powersgd, powersgd+fp16, "
        "post-localsgd"]
    assert main(["train", "--server", "127.0.0.1:notaport"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "psserver train: error: address '127.0.0.1:notaport': port 'notaport' is not a number"]
    assert not list(log_dir.iterdir())


@pytest.mark.parametrize(
    "argv,line",
    [
        (["--compute", "trainer", "--step", "chained"],
         "--step chained is a protocol of --compute server, not --compute trainer"),
        (["--compute", "server", "--wire-dtype", "bf16"],
         "--wire-dtype applies to --compute trainer (server compute sends batches)"),
        (["--step", "plain", "--device", "cuda:0"],
         "--device applies to --compute trainer (server compute runs on the server's devices)"),
        (["--device", "tpu:0"], "unsupported --device 'tpu:0': use cpu or cuda:N"),
    ],
    ids=["step-of-the-other-compute", "wire-dtype-of-server-compute", "device-of-server-compute", "unknown-device"],
)
def test_compute_flags_that_do_not_fit_are_one_line(capsys, log_dir, argv, line):
    """Where a step runs (--compute, --step, --wire-dtype, --device): refused before any server is reached."""
    assert main(["train", *argv, "--server", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"psserver train: error: {line}"]
    assert not list(log_dir.iterdir())


def test_bogus_log_level_env_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("PSSERVER_LOG_LEVEL", "bogus")
    assert main(["status"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "psserver status: error: $PSSERVER_LOG_LEVEL='bogus' is not a log level; use one of DEBUG, INFO, WARNING, "
        "ERROR"]


def test_log_level_env_any_case_and_flag_wins(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(StatusCommand, "run", lambda self, args: seen.append(args.log_level) or 0)
    monkeypatch.setenv("PSSERVER_LOG_LEVEL", "warning")
    assert main(["status"]) == 0
    assert main(["--log-level", "debug", "status"]) == 0
    assert seen == [None, "DEBUG"]


@pytest.mark.timeout(60)
def test_bogus_log_level_env_through_the_console_entry_point():
    env = dict(os.environ, PSSERVER_LOG_LEVEL="bogus")
    proc = subprocess.run([sys.executable, "-m", "psserver", "status"], capture_output=True, text=True, env=env,
                          timeout=50)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "psserver status: error: $PSSERVER_LOG_LEVEL='bogus' is not a log level; use one of DEBUG, INFO, WARNING, "
        "ERROR"]


def test_bench_says_where_the_benchmarks_went_and_imports_none_of_them():
    """``psserver bench`` of an installed package imported the checkout; now it is one line
    pointing at ``python -m benchmarks.run``, whatever flags follow, with ``benchmarks`` importable
    and never imported."""
    code = ("import sys\nfrom psserver.cli import main\ntry:\n    main(['bench', '--quick', '--rounds', '2'])\n"
            "except SystemExit as e:\n    print(e.code, 'benchmarks' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == f"psserver bench: error: {bench.MOVED}"
    assert "python -m benchmarks.run" in line


def test_an_unwritable_log_dir_falls_back_to_the_temporary_directory(monkeypatch, capsys, tmp_path):
    """The traceback went to stderr, in full, when $PSSERVER_LOG_DIR could not be written."""
    monkeypatch.setenv("PSSERVER_LOG_DIR", "/dev/null/x")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(StatusCommand, "run", _raising(RuntimeError("boom")))
    assert main(["status"]) == 1
    path = tmp_path / f"psserver-status-{os.getpid()}.log"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"psserver status: internal error: RuntimeError: boom (traceback in {path}; PSSERVER_LOG_DIR unusable: "
        f"/dev/null/x/psserver-status-{os.getpid()}.log: Not a directory)"]
    assert "Traceback (most recent call last)" in path.read_text()


def test_no_writable_log_dir_at_all_is_still_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PSSERVER_LOG_DIR", "/dev/null/x")
    monkeypatch.setattr("tempfile.tempdir", "/dev/null/y")
    monkeypatch.setattr(StatusCommand, "run", _raising(RuntimeError("boom")))
    assert main(["status"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("psserver status: internal error: RuntimeError: boom (traceback not saved: cannot write "
                           "/dev/null/x/psserver-status-"), line
    assert "/dev/null/y/psserver-status-" in line and "Not a directory" in line
