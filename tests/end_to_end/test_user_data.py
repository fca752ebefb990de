"""A user's data through the CLI: ``--dataset imagefolder`` without user code; loss and metric
by reference; a dataset that does not fit the model, in one line. (A user's Dataset of PNG files
in a package only the trainers can import, read by DataLoader workers, trains to the bar in
tests/end_to_end/test_user_project.py, with the user's model.)"""

from __future__ import annotations

import json
import sys

import pytest

from tests.procs import accuracy, cli, metric, slow_steps
from tests.userproject import PNG_DATASET, pythonpath, write_package

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

EXTRA = '''
    import torch
    from torch.utils.data import IterableDataset


    def top2(outputs, targets):
        return float((outputs.topk(2, dim=1).indices == targets[:, None]).any(1).double().mean())


    class ColourStream(IterableDataset):
        """Images of the wrong shape for mnist_cnn (3 x 32 x 32): found at the first step."""

        def __iter__(self):
            for i in range(256):
                yield torch.zeros(3, 32, 32), i % 10
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory, mnist_pngs):
    """The MNIST PNGs (``images``) and the package ``digits`` that reads them (``code``)."""
    root = tmp_path_factory.mktemp("project")
    (root / "images").symlink_to(mnist_pngs)
    write_package(root / "code", "digits", {"data": PNG_DATASET, "extra": EXTRA})
    return root


def user_data(project, *extra: str) -> list[str]:
    return ["--dataset", "digits.data:splits", "--dataset-args", json.dumps({"root": str(project / "images")}),
            *extra]


@pytest.mark.timeout(300)
def test_imagefolder_trains_without_user_code(procs, port, project):
    procs.server(port, "--model", "mnist_cnn")
    # 60 steps: the point is the folder read whole and learnt from, not a bar (a model fed
    # labels that do not match its images stays near 0.1).
    trainer = procs.trainer(port, 0, "--num-trainers", "1", "--max-steps", "60", "--dataset", "imagefolder",
                            "--data-dir", str(project / "images"))
    assert trainer.wait(240) == 0, trainer.tail()
    assert accuracy(trainer) >= 0.8, trainer.tail()
    assert "10 classes, 8000 training and 2000 held-out grayscale images" in trainer.output()


@pytest.mark.timeout(180)
def test_loss_and_metric_by_reference(procs, port, project):
    procs.server(port, "--model", "mnist_cnn")
    env = {"PYTHONPATH": pythonpath(project / "code")}
    trainer = procs.trainer(port, 0, "--num-trainers", "1", "--max-steps", "40", "--loss", "torch.nn:CrossEntropyLoss",
                            "--metric", "digits.extra:top2", *user_data(project), env=env)
    assert trainer.wait(150) == 0, trainer.tail()
    assert metric(trainer, "top2") > 0.8, trainer.tail()
    again = procs.trainer(port, 0, "--num-trainers", "1", "--max-steps", "5", "--metric", "loss", *user_data(project),
                          env=env)
    assert again.wait(150) == 0, again.tail()
    assert 0 < metric(again, "loss") < 2.3, again.tail()


@pytest.mark.timeout(180)
def test_a_dataset_of_the_wrong_shape_is_one_line_at_the_first_step(procs, port, project):
    server = procs.server(port, "--model", "mnist_cnn")
    trainer = procs.trainer(port, 0, "--num-trainers", "1", "--dataset", "digits.extra:ColourStream",
                            env={"PYTHONPATH": pythonpath(project / "code")})
    assert trainer.wait(120) == 2, trainer.tail()
    errors = [line for line in trainer.output().splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in trainer.output(), trainer.tail()
    assert ("dataset digits.extra:ColourStream gives inputs of shape (3, 32, 32) and targets of shape () that model "
            "mnist_cnn with loss cross_entropy cannot take: RuntimeError:") in errors[0], errors[0]
    assert server.running()
    # The server took the trainer's leave and serves the next one.
    ok = procs.trainer(port, 0, "--num-trainers", "1", "--max-steps", "3", *user_data(project),
                       env={"PYTHONPATH": pythonpath(project / "code")})
    assert ok.wait(120) == 0, ok.tail()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "fragment"), [
    (["--dataset", "digits.data:nothing"], "--dataset digits.data:nothing: 'digits.data' has no attribute 'nothing'"),
    (["--dataset", "nowhere.data:splits"], "--dataset nowhere.data:splits: module 'nowhere.data' is not importable"),
    (["--dataset", "digits.data:splits", "--dataset-args", '{"path": "x"}'],
     "--dataset digits.data:splits does not accept these arguments"),
    (["--dataset", "digits.data:splits", "--dataset-args", "{root: x}"], "--dataset-args is not JSON"),
    (["--loss", "digits.extra:nothing"], "--loss digits.extra:nothing: 'digits.extra' has no attribute 'nothing'"),
    (["--metric", "f1"], "unknown metric 'f1'"),
    (["--dataset", "imagefolder", "--data-dir", "/nonexistent"], "--data-dir /nonexistent does not exist"),
])
def test_bad_references_are_one_line_before_joining(port, project, args, fragment, monkeypatch):
    """No server is needed: the configuration refuses them (exit 2, one line), in this process
    with the user's code on its path as on a trainer's."""
    monkeypatch.syspath_prepend(str(project / "code"))
    try:
        r = cli(["train", "--server", f"127.0.0.1:{port}", "--rank", "0", "--no-progress", "--connect-timeout", "1",
                 *args])
    finally:
        for name in [m for m in sys.modules if m == "digits" or m.startswith("digits.")]:
            del sys.modules[name]  # another test's package of that name is not this one
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and fragment in errors[0], r.stderr


@pytest.mark.timeout(240)
def test_a_rejoin_with_workers_continues_its_epoch(procs, port, project):
    """Paused past the server's --trainer-timeout with two DataLoader workers: it rejoins in a
    fresh process image (its workers ended first) and finishes the planned steps, not more."""
    import re
    import signal
    import time

    server = procs.server(port, "--model", "mnist_cnn", "--trainer-timeout", "2")
    env = slow_steps(0.05, pythonpath(project / "code"))
    t = procs.trainer(port, 0, "--num-trainers", "4", "--data-workers", "2", "--reconnect", *user_data(project),
                      env=env)
    name = t.wait_for(r"joined psserver \S+ as (trainer_\d+_\d+)", timeout=60).group(1)
    t.wait_for(r"2000 training samples, 32 steps", timeout=60)
    time.sleep(1.0)
    t.signal(signal.SIGSTOP)
    server.wait_for(rf"trainer {name} missed heartbeats .* marking it LOST", timeout=20)
    t.signal(signal.SIGCONT)
    assert t.wait(150) == 0, t.tail()
    again = re.search(r"reconnected as (trainer_\d+_\d+)", t.output())
    assert again, t.tail()
    server.wait_for(rf"trainer {again.group(1)} \(rank 0\) left after 32 steps", timeout=20)
    assert "Traceback" not in t.output(), t.output()
