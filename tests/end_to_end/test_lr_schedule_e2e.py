"""The learning-rate schedule on a real server: cosine after 50 warm-up steps, sync, one
trainer; the server is SIGKILLed mid-training and resumed. The learning rate it applied at
every step, before and after, is what ``torch.optim.lr_scheduler`` gives a local loop."""

from __future__ import annotations

import json
import re
import signal

import pytest
import torch
from torch.optim import lr_scheduler as L

from psserver.checkpoint import list_checkpoints, read_checkpoint
from tests.procs import cli, free_port, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

T_MAX, WARMUP, LR = 200, 50, 0.1
SERVE = ["--model", "mlp", "--compute-threads", "1", "--update", "sync", "--sync-trainers", "1", "--optimizer", "sgd",
         "--lr", str(LR),
         "--lr-schedule", "CosineAnnealingLR", "--lr-schedule-args", json.dumps({"T_max": T_MAX}),
         "--warmup-steps", str(WARMUP)]
APPLIED = re.compile(r"learning rate at step (\d+): (\S+)")


def torch_lrs(steps: int) -> list[float]:
    """The lr of each iteration of ``for t: opt.step(); sched.step()`` (the README's composition)."""
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=LR)
    warmup = L.LinearLR(opt, start_factor=1 / WARMUP, end_factor=1.0, total_iters=WARMUP - 1)
    sched = L.SequentialLR(opt, [warmup, L.CosineAnnealingLR(opt, T_max=T_MAX)], milestones=[WARMUP])
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def applied(log: str) -> dict[int, list[float]]:
    """Every lr the server logged as applied (DEBUG), by global step (a step lost with the killed
    server and made again after the resume appears twice)."""
    out: dict[int, list[float]] = {}
    for step, lr in APPLIED.findall(log):
        out.setdefault(int(step), []).append(float(lr))
    return out


@pytest.mark.timeout(400)
def test_cosine_with_warmup_is_torchs_at_every_step_across_a_kill_and_resume(procs, port, tmp_path):
    ckdir = tmp_path / "ck"
    control = free_port()
    debug = {"PSSERVER_LOG_LEVEL": "DEBUG"}
    ck = ["--checkpoint-dir", str(ckdir), "--checkpoint-every", "20", "--keep-checkpoints", "100"]
    first = procs.server(port, *SERVE, *ck, env=debug)
    trainer = procs.trainer(port, 0, "--max-steps", "300", "--epochs", "10", "--dataset", "synthetic", "--reconnect",
                            "--rpc-timeout", "10")
    first.wait_for(r"checkpoint step 40 written", timeout=120)
    first.signal(signal.SIGKILL)
    first.wait(10)
    before = applied(first.output())
    killed_at = max(before)
    trainer.wait_for("reconnecting", timeout=60)
    second = procs.server(port, *SERVE, *ck, "--resume", control_port=control, env=debug)
    resumed_at = int(second.wait_for(r"resumed from \S+ global step (\d+)", timeout=30).group(1))
    assert 40 <= resumed_at <= killed_at + 1 and resumed_at % 20 == 0
    assert trainer.wait(240) == 0, trainer.tail()
    assert re.search(rf"reconnected as trainer_0_\d+ at global step {resumed_at}\b", trainer.output()), trainer.tail()
    after = applied(second.output())
    final = max(after) + 1
    assert min(after) == resumed_at and sorted(after) == list(range(resumed_at, final))
    assert final >= 200, final

    # Every step 0 .. final-1, as applied by either server, is torch's; the steps the killed
    # server made past its last checkpoint, made again, took the same lr twice.
    want = torch_lrs(final + 1)
    assert sorted(set(before) | set(after)) == list(range(final))
    for step, lrs in sorted({**before, **{s: before.get(s, []) + v for s, v in after.items()}}.items()):
        assert all(abs(lr - want[step]) <= 1e-9 for lr in lrs), (step, lrs, want[step])
    assert [round(x, 12) for x in (want[0], want[49], want[50])] == [0.002, 0.1, 0.1]  # (t+1)/N, then cosine

    # The control plane shows the lr of the next step.
    st = json.loads(cli(["status", "--address", f"127.0.0.1:{control}", "--json"]).stdout)["status"]
    assert st["global_step"] == final and abs(st["learning_rate"] - want[final]) <= 1e-9
    assert st["lr_schedule"] == f"CosineAnnealingLR(T_max={T_MAX}) after a linear warm-up of {WARMUP} steps"
    assert procs.stop(second) == 0

    # What the checkpoints hold agrees: the optimizer's lr is its last step's, the schedule's
    # own state (no replay) stands at the checkpoint's step.
    saved = [read_checkpoint(p) for p in list_checkpoints(ckdir)]
    assert {s["global_step"] for s in saved} >= {20, 40, resumed_at + 20, final}
    for s in saved:
        step = s["global_step"]
        assert s["lr_schedule"]["steps"] == step and s["lr_schedule"]["scheduler"] is not None
        assert abs(s["shards"][0]["optimizer"]["param_groups"][0]["lr"] - want[step - 1]) <= 1e-9, step



@pytest.mark.timeout(300)
def test_two_server_processes_step_the_same_schedule(procs, port, monkeypatch):
    """Each server process applies the schedule to its partition at the same global steps (sync:
    server 0 decides the rounds, server 1 follows); a server with another schedule is refused in
    one line."""
    monkeypatch.setenv("PSSERVER_LOG_LEVEL", "DEBUG")
    group = ["--num-servers", "2"]
    s0 = procs.server(port, *SERVE, *group, "--server-rank", "0", wait=False)
    s0.wait_for(r"waiting for server process\(es\) 1 of 2", timeout=60)
    rank1 = [*group, "--server-rank", "1", "--coordinator", f"127.0.0.1:{port}"]
    other = [*SERVE[:-1], "10"]  # --warmup-steps 10
    r = run(["serve", *other, *rank1, "--port", str(free_port())], timeout=90)
    assert r.returncode == 2, r.stderr
    flags = f"--lr-schedule CosineAnnealingLR --lr-schedule-args '{{\"T_max\": {T_MAX}}}' --warmup-steps"
    assert r.stderr.strip().splitlines()[-1] == (
        f"psserver serve: error: server 0 refused this server: learning-rate schedule {flags} 10, server 0 steps "
        f"{flags} {WARMUP} (give every server the same flags)")
    assert "refused server 1" in s0.output()
    # Its name leaves the RPC group when server 0 evicts it; a server 1 that came sooner would be
    # refused as a second psserver_1.
    s0.wait_for(r"evicted psserver_1 from the RPC group", timeout=30)
    s1 = procs.start(["serve", *SERVE, *rank1, "--port", str(free_port())], "server1")
    s0.wait_for(r"all 2 server processes are serving", timeout=90)
    trainer = procs.trainer(port, 0, "--max-steps", "60", "--num-trainers", "1", "--dataset", "synthetic")
    assert trainer.wait(180) == 0, trainer.tail()
    want = torch_lrs(60)
    for server in (s0, s1):
        lrs = applied(server.output())
        assert sorted(lrs) == list(range(60)), server.tail()
        assert all(len(v) == 1 and abs(v[0] - want[step]) <= 1e-9 for step, v in lrs.items())
    assert procs.stop(s0) == 0
