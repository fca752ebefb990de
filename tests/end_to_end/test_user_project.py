"""A user's project end to end: its own CNN with BatchNorm and its own Dataset of PNG files, in
a package only the trainers can import, trained by a server that runs none of its code, then
exported and evaluated where psserver is not installed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig

import pytest
import torch
from safetensors.torch import load_file

from psserver.checkpoint import list_checkpoints, read_checkpoint
from tests.procs import accuracy, cli, env
from tests.userproject import BN_CNN, PNG_DATASET, pythonpath, write_package

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

BAR = 0.97

EVALUATE = '''
import json, sys
import torch
from safetensors.torch import load_file
try:
    import psserver
    print(json.dumps({"error": "psserver is importable: " + psserver.__file__}))
    sys.exit(1)
except ImportError:
    pass
from digits.data import PngDigits
from digits.model import BNNet
model = BNNet()
model.load_state_dict(load_file(sys.argv[1]), strict=True)
model.eval()
val = PngDigits(sys.argv[2], "val")
loader = torch.utils.data.DataLoader(val, batch_size=500)
right = total = 0
with torch.no_grad():
    for x, y in loader:
        right += int((model(x).argmax(1) == y).sum())
        total += len(y)
print(json.dumps({"accuracy": right / total}))
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory, mnist_pngs):
    """The MNIST PNGs (``images``) and the package ``digits`` (``code``: its model and data)."""
    root = tmp_path_factory.mktemp("project")
    (root / "images").symlink_to(mnist_pngs)
    write_package(root / "code", "digits", {"data": PNG_DATASET, "model": BN_CNN})
    return root


def summary_logged_at(proc) -> str:
    """When the trainer logged its summary line (steps, samples, accuracy), as the log's asctime,
    which sorts as text: offsets in two different logs say nothing about which came first."""
    m = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*rank \d+: \d+ steps.*accuracy", proc.output(),
                  re.M)
    assert m, f"{proc.name} logged no summary line:\n{proc.tail()}"
    return m.group(1)


def evaluate_without_psserver(project, weights) -> float:
    """The exported model's held-out accuracy in a fresh interpreter that has torch, PIL and the
    user's package but not psserver (no site hooks: the editable install's path file is unread)."""
    site = sysconfig.get_paths()["purelib"]
    code = ("import sys; sys.path[:0] = [" + repr(str(project / "code")) + "]; sys.path.append(" + repr(site) + ")\n"
            + EVALUATE)
    out = subprocess.run([sys.executable, "-S", "-c", code, str(weights), str(project / "images")],
                         capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"}, cwd=project,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["accuracy"]


def cosine(epochs: int) -> list[str]:
    """The async run's lr, to zero over its updates (one per step of 2 trainers x 63 steps an
    epoch). At a constant lr, two trainers that evaluated the model a second apart scored 0.9715
    and 0.9835, and one run in seven fell under the bar (0.9695): the last updates at full lr move
    the model that much. With this schedule and three epochs, seven runs scored 0.9845-0.987, both
    trainers alike to 0.0005."""
    return ["--lr-schedule", "CosineAnnealingLR", "--lr-schedule-args", json.dumps({"T_max": 2 * 63 * epochs})]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("update", "epochs"), [("async", 3), ("sync", 2)])
def test_the_users_model_and_data_train_export_and_load_without_psserver(procs, port, tmp_path, project, update,
                                                                          epochs):
    """Two trainers read the PNG files through the user's Dataset with two DataLoader workers
    each, and train the user's model on a server that can import neither."""
    ckpt = tmp_path / "ckpt"
    server_env = env()
    assert str(project) not in server_env["PYTHONPATH"]
    r = subprocess.run([sys.executable, "-c", "import digits"], env=server_env, capture_output=True, timeout=60,
                       check=False)
    assert r.returncode != 0  # the server's environment cannot import the user's package
    server = procs.server(port, "--update", update, "--sync-trainers", "2", "--optimizer", "adam", "--lr", "0.002",
                          "--checkpoint-dir", str(ckpt), *(cosine(epochs) if update == "async" else []))
    user = {"PYTHONPATH": pythonpath(project / "code")}
    data = ["--dataset", "digits.data:splits", "--dataset-args", json.dumps({"root": str(project / "images")}),
            "--data-workers", "2"]
    trainers = [procs.trainer(port, rank, "--num-trainers", "2", "--epochs", str(epochs),
                              "--model", "digits.model:BNNet", *data, env=user) for rank in (0, 1)]
    for t in trainers:
        assert t.wait(420) == 0, t.tail()
    scores = [accuracy(t) for t in trainers]
    assert min(scores) >= BAR, [t.tail() for t in trainers]
    for t in trainers:
        assert f"4000 training samples, {63 * epochs} steps" in t.output(), t.tail()
    assert "learnt from the first trainer" in server.output()
    assert procs.stop(server) == 0, server.tail()

    out = tmp_path / "bnnet.safetensors"
    r = cli(["export", str(ckpt), "--out", str(out)])
    assert r.returncode == 0, r.stderr
    exported = load_file(out)
    held = read_checkpoint(list_checkpoints(ckpt)[0])["shards"][0]["module"]
    for key in ("bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked", "bn2.running_var"):
        assert torch.equal(exported[key], held[key]), key  # the server's statistics, as they are
    assert not torch.allclose(exported["bn2.running_var"], torch.ones(64))
    got = evaluate_without_psserver(project, out)
    # Both trainers evaluated the server's parameters and statistics at their end; the export
    # holds the final ones: within ten of the 2000 held-out images (0.005, plus float rounding) of
    # the trainer whose summary was logged last (sync: of both).
    last = max(range(2), key=lambda i: summary_logged_at(trainers[i]))
    ten_images = 0.005 + 1e-9
    assert abs(got - scores[last]) <= ten_images or (update == "sync" and all(abs(got - s) <= ten_images
                                                                          for s in scores)), (got, scores, last)
