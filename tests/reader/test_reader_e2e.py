"""A reader of a real ``psserver serve`` while a real trainer trains: whole versions of
increasing steps, loaded into the user's own model, listed in ``psserver status``, and
``psserver pull`` writing one to a file; the read token cannot stand in for the control token."""

from __future__ import annotations

import json
import re
import sys
import time

import pytest
import torch

from psserver.control.client import ControlClient
from psserver.models import build_model
from psserver.reader.reader import Reader
from tests.procs import run, slow_steps, start_servers, wait_until

pytestmark = [pytest.mark.multiprocess]

LISTENING = re.compile(r"control plane listening on (\S+):(\d+)")
READ_TOKEN, CONTROL_TOKEN = "reader-token-1", "control-token-1"


@pytest.mark.timeout(240)
def test_readers_follow_training_and_pull_writes_one_version(procs, port, tmp_path):
    read_file, control_file = tmp_path / "read.token", tmp_path / "control.token"
    read_file.write_text(READ_TOKEN)
    control_file.write_text(CONTROL_TOKEN)
    server = procs.server(port, "--model", "mlp", "--read-token-file", str(read_file), "--auth-token-file",
                          str(control_file), control_port=0, log=tmp_path / "server.log")
    address = "{}:{}".format(*server.wait_for(LISTENING.pattern, timeout=30).groups())
    procs.trainer(port, 0, "--num-trainers", "1", "--epochs", "1000", "--max-steps", "100000",
                  log=tmp_path / "trainer.log", env=slow_steps(0.02))
    model = build_model("mlp")
    with Reader(address, token_file=read_file, name="rollout-0", dtype="bfloat16") as reader:
        steps = []
        for version in reader.subscribe(timeout=60):
            reader.load_into(model, version)
            steps.append(version.step)
            if len(steps) == 5 and steps[-1] > 0:
                break
        assert steps == sorted(set(steps)) and len(steps) == 5  # each newer than the last
        assert set(version.state) == set(model.state_dict())
        assert torch.equal(model.state_dict()[next(iter(version.state))],
                           next(iter(version.state.values())).float())
    with ControlClient(address, token=CONTROL_TOKEN) as client:
        status = client.get_status()
        assert [r.name for r in status.readers] == ["rollout-0"] and status.readers[0].step == steps[-1]
        assert status.readers[0].reads >= 5 and status.readers[0].age_seconds >= 0
    out = tmp_path / "policy.safetensors"
    done = run(["--log-level", "ERROR", "pull", "--address", address, "--read-token-file", str(read_file),
                "--out", str(out), "--newer-than", str(steps[-1])], timeout=60)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    pulled, meta = load_file(out), json.loads(out.with_suffix(".json").read_text())
    assert meta["step"] > steps[-1] and meta["model"] == "mlp" and set(pulled) == set(model.state_dict())
    model.load_state_dict(pulled, strict=True)
    sharing = [Reader(address, token_file=read_file, name="host-copy", share=True) for _ in range(3)]
    try:
        firsts = [r.latest() for r in sharing]
        newer = [r.wait(max(v.step for v in firsts), timeout=30) for r in sharing]
        assert all(v is not None and v.step > max(f.step for f in firsts) for v in newer)
        with ControlClient(address, token=CONTROL_TOKEN) as client:
            def host():  # the fetcher tells the server at its next fetch how many it fetches for
                return [r for r in client.get_status().readers if r.name == "host-copy"]

            wait_until(lambda: [r.sharing for r in host()] == [3], 30, "one reader fetching for the three")
    finally:
        for r in sharing:
            r.close()
    # psserver relay: its readers get the server's versions through it (this one open to them).
    relay = procs.start(["relay", "--upstream", address, "--port", "0", "--upstream-token-file", str(read_file),
                         "--name", "relay-1"], "relay")
    relayed = "{}:{}".format(*relay.wait_for(r"relaying the weights of \S+ on (\S+):(\d+)", timeout=60).groups())
    with Reader(relayed, name="behind-relay") as reader:
        version = reader.wait(steps[-1], timeout=30)
        assert version is not None and version.step > steps[-1] and set(version.state) == set(model.state_dict())
    assert procs.stop(relay) == 0, relay.tail()
    refused = run(["--log-level", "ERROR", "status", "--address", address, "--auth-token-file", str(read_file)],
                  timeout=60)
    assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr
    wrong = run(["--log-level", "ERROR", "pull", "--address", address, "--out", str(tmp_path / "x.pt")], timeout=60)
    assert wrong.returncode == 2 and wrong.stderr.strip().count("\n") == 0
    assert "missing bearer token" in wrong.stderr


LR = 2.0 ** -6
"""Every update adds exactly LR to every parameter (a step's gradient is -1 everywhere, SGD),
so a version of step s holds s * LR in every element, exactly in fp32."""

STEADY_TRAINER = f"""
import sys
import torch
import psserver
from torch import nn

model = nn.Linear(64, 64)
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
with psserver.connect(sys.argv[1], rank=0, num_trainers=1) as ps:
    model = ps.replica(model, optimizer=torch.optim.SGD(model.parameters(), lr={LR!r}))
    for _ in range(int(sys.argv[2])):
        (-sum(p.sum() for p in model.parameters())).backward()
        ps.step(samples=1)
"""


@pytest.mark.timeout(240)
def test_a_reader_of_two_server_processes_never_holds_parts_of_two_steps(procs, port, tmp_path):
    """Two server processes, synchronous updates, a model cut across both (each holds pieces of
    the weight): a reader polling every 10 ms through 1,000 updates gets versions whose every
    element is its step's value, step * LR (a torn read would hold the other process's pieces
    one step apart), with the steps it reports never going back."""
    updates = 1000
    servers = start_servers(procs, port, 2, "--update", "sync", "--sync-trainers", "1", "--publish-interval", "0",
                            control=True)
    address = "{}:{}".format(*servers[0].wait_for(LISTENING.pattern, timeout=30).groups())
    script = tmp_path / "steady.py"
    script.write_text(STEADY_TRAINER)
    trainer = procs.start([str(script), f"127.0.0.1:{port}", str(updates)], "steady",
                          prefix=[sys.executable])
    reads, steps = 0, [-1]
    with Reader(address, name="checker") as reader:
        while steps[-1] < updates:
            version = reader.wait(steps[-1], timeout=60)  # the first waits for the trainer's model
            assert version is not None, trainer.tail()
            reads += 1
            for key, t in version.state.items():
                assert torch.equal(t, torch.full_like(t, version.step * LR)), \
                    f"{key} of step {version.step} holds values of another step: {t.unique()[:4].tolist()}"
            steps.append(version.step)
            time.sleep(0.01)
    assert trainer.wait(60) == 0, trainer.tail()
    assert steps == sorted(set(steps)) and reads > 50, steps
