"""psserver as a library: a user's own loop (``tests/trainer/loops.py``) against a real server.

The three ways a loop reaches the server (``ps.step()``, the Horovod-style wrapper, and the
RPC tutorial's RRefs with ``dist_autograd``) each give the parameters of a plain local loop;
membership holds as for ``psserver train`` (eviction, SIGTERM, an exception, a long
validation, a rejoin that continues the epoch).
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time

import pytest
import torch

from tests.procs import cli, free_port
from tests.trainer import loops

ENTRY = "tests.trainer.loops"
SCRIPT = [sys.executable, "-m", ENTRY]
SYNC_ADAM = ["--update", "sync", "--sync-trainers", "1", "--optimizer", "adam", "--lr", str(loops.LR)]


def entry(procs, port: int, name: str, *extra: str, args: dict | None = None, **options):
    """``psserver train --entry tests.trainer.loops:NAME`` as rank 0 of one shard."""
    more = ["--entry-args", json.dumps(args)] if args else []
    return procs.trainer(port, 0, "--num-trainers", "1", "--entry", f"{ENTRY}:{name}", *more, *extra, **options)


def same(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert state.keys() == reference.keys()
    return max(float((state[k] - reference[k]).abs().max()) for k in state)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("loop", ["through_step", "through_wrapper", "through_rrefs"])
def test_twenty_adam_steps_equal_a_local_loop(procs, port, tmp_path, loop):
    """One trainer, sync: 20 Adam steps through each path give the local loop's parameters
    to 1e-6 (the RRef path runs the model on the server: it holds the model's code)."""
    pinned = ["--model", f"{ENTRY}:tiny_net"] if loop == "through_rrefs" else []
    server = procs.server(port, *SYNC_ADAM, *pinned)
    out = tmp_path / "state.pt"
    t = entry(procs, port, loop, args={"out": str(out)})
    assert t.wait(120) == 0, t.tail()
    assert same(torch.load(out), loops.local_adam()) < 1e-6
    counters = json.loads(t.output().strip().splitlines()[-1])
    assert counters["steps"] == loops.STEPS, counters
    if loop == "through_step":
        assert counters == {"steps": 20, "global_step": 20, "lr": loops.LR, "staleness": 0}
    if loop == "through_wrapper":
        assert counters["lr"] == loops.LR and counters["samples"] == 20 * loops.BATCH
    server.wait_for(rf"left after {loops.STEPS} steps", timeout=10)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("explicit", "hooked"), [(False, True), (True, False), (True, True)],
                         ids=["local_sgd", "sync", "local_sgd-then-sync"])
def test_diloco_of_one_trainer_under_outer_sgd_lr1_equals_its_inner_loop(procs, port, tmp_path, explicit, hooked):
    """A server of --update diloco whose outer step is SGD at lr 1: the loop's own Adam, synced
    every 5 of its steps (ps.local_sgd, or the loop's own ps.sync()), ends where a plain local
    Adam loop does, to 1e-6; each window is one outer step. A ps.sync() right after local_sgd's
    own hands in nothing (no zero pseudo-gradient, no outer step of its own)."""
    procs.server(port, "--update", "diloco", "--sync-trainers", "1", "--optimizer", "sgd", "--lr", "1")
    out = tmp_path / "state.pt"
    t = entry(procs, port, "through_local_sgd",
              args={"out": str(out), "every": 5, "explicit": explicit, "hooked": hooked})
    assert t.wait(120) == 0, t.tail()
    assert same(torch.load(out), loops.local_adam()) < 1e-6
    counters = json.loads(t.output().strip().splitlines()[-1])
    assert counters["global_step"] == loops.STEPS // 5 and counters["samples"] == loops.STEPS * loops.BATCH
    assert counters["steps"] == (loops.STEPS if hooked else loops.STEPS // 5), counters
    assert counters["outer"] == ([1, 2, 3, 4] if explicit else []), counters


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("chosen_by", ["server", "trainer"])
def test_an_optimizer_of_any_torch_class_with_its_own_arguments_equals_a_local_one(procs, port, tmp_path, chosen_by):
    """NAdam with its own betas and eps: named by the server's flags, or handed to ``ps.replica``
    as the trainer's ``torch.optim.NAdam`` (the server started without ``--optimizer``)."""
    args = {"betas": [0.8, 0.9], "eps": 1e-6}
    flags = ["--optimizer", "NAdam", "--lr", str(loops.LR), "--optimizer-args", json.dumps(args)]
    procs.server(port, "--update", "sync", "--sync-trainers", "1", *(flags if chosen_by == "server" else []))
    out = tmp_path / "state.pt"
    optimizer = {"name": "NAdam", "args": args} if chosen_by == "trainer" else None
    t = entry(procs, port, "through_step", args={"out": str(out), "optimizer": optimizer})
    assert t.wait(120) == 0, t.tail()
    assert "optimizer nadam" in t.output()
    assert same(torch.load(out), loops.local_with("nadam", args)) < 1e-6


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_four_micro_batches_through_the_wrapper_are_one_batch_of_64(procs, port, tmp_path):
    procs.server(port, *SYNC_ADAM)
    out = tmp_path / "state.pt"
    t = entry(procs, port, "through_wrapper", args={"out": str(out), "accumulate": 4})
    assert t.wait(120) == 0, t.tail()
    assert same(torch.load(out), loops.local_adam(batch=4 * loops.BATCH)) < 1e-6
    counters = json.loads(t.output().strip().splitlines()[-1])
    assert counters["steps"] == loops.STEPS and counters["samples"] == 20 * 64, counters  # one update per 4 passes


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_compiled_replica_brings_the_plain_layout_and_an_uncompiled_trainer_follows(procs, port, tmp_path):
    """``torch.compile(model)`` (inductor, on the CPU) joins with the module it wraps: the server
    keeps its layout and class without ``_orig_mod.``, so a trainer that does not compile is
    taken, and the compiled module's state is the server's."""
    server = procs.server(port)
    first = entry(procs, port, "compiled_steps", args={"out": str(tmp_path / "compiled.pt")})
    assert first.wait(180) == 0, first.tail()
    assert json.loads(first.output().strip().splitlines()[-1]) == {"steps": 5, "samples": 5 * loops.BATCH}
    assert "model torch.nn.modules.container:Sequential" in first.output(), first.tail()
    plain = entry(procs, port, "through_step", args={"out": str(tmp_path / "plain.pt")})
    assert plain.wait(120) == 0, plain.tail()
    server.wait_for(r"left after 20 steps", timeout=10)
    for text in (server.output(), first.output(), plain.output()):
        assert "_orig_mod" not in text and "OptimizedModule" not in text, text


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_killed_library_trainer_is_evicted_and_its_rank_rejoins(procs, port):
    server = procs.server(port, "--trainer-timeout", "2")
    first = entry(procs, port, "slow_steps")
    first.wait_for(r"step 5 ", timeout=60)
    first.signal(signal.SIGKILL)
    server.wait_for(r"trainer trainer_0_1 missed heartbeats .* marking it LOST", timeout=30)
    again = entry(procs, port, "slow_steps", args={"steps": 5})
    assert again.wait(60) == 0, again.tail()
    # It continues where its rank stopped (the server kept the killed one's position): its steps count on.
    before = int(re.search(r"rank 0 continues where its last trainer stopped: .* step (\d+)", again.output()).group(1))
    server.wait_for(rf"trainer trainer_0_2 \(rank 0\) left after {before + 5} steps", timeout=10)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_sigterm_leaves_after_the_step_in_flight_and_status_says_left(procs, port):
    control = free_port()
    server = procs.server(port, control_port=control)
    t = entry(procs, port, "slow_steps")
    t.wait_for(r"step 3 ", timeout=60)
    t.signal(signal.SIGTERM)
    assert t.wait(30) == 143, t.tail()
    left = re.search(r"received SIGTERM: handing in step (\d+) and leaving psserver \(exit 143\)", t.output())
    steps = int(left.group(1))
    server.wait_for(rf"trainer_0_1 \(rank 0\) left after {steps} steps", timeout=10)
    done = cli(["--log-level", "ERROR", "status", "--address", f"127.0.0.1:{control}", "--json"])
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["trainers"]
    assert [(r["name"], r["state"], r["steps"]) for r in rows] == [("trainer_0_1", "LEFT", steps)], rows
    assert "Traceback" not in t.output()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_an_exception_in_the_users_loop_leaves_and_says_so(procs, port):
    server = procs.server(port)
    t = entry(procs, port, "slow_steps", args={"steps": 4, "validate_after": 2, "validate_s": "oops"})
    assert t.wait(60) == 2, t.tail()
    out = t.output()
    assert "leaving psserver: the training loop raised UserCodeError" in out, out
    lines = [line for line in out.splitlines() if line.startswith("psserver train: error:")]
    assert len(lines) == 1 and "TypeError" in lines[0] and "loops.py:" in lines[0], out
    assert "Traceback" not in out
    server.wait_for(r"trainer_0_1 \(rank 0\) left after 2 steps", timeout=10)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_validation_three_times_the_trainer_timeout_is_not_an_eviction(procs, port):
    server = procs.server(port, "--trainer-timeout", "2")
    t = entry(procs, port, "slow_steps", args={"steps": 6, "validate_s": 6.0, "delay": 0.0})
    assert t.wait(90) == 0, t.tail()
    assert "validated" in t.output()
    server.wait_for(r"trainer_0_1 \(rank 0\) left after 6 steps", timeout=10)
    assert "LOST" not in server.output() and "evict" not in server.output(), server.output()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_script_evicted_with_reconnect_rejoins_and_its_sampler_continues_the_epoch(procs, port, tmp_path):
    """SIGSTOP past the timeout: the script re-executes itself, connects again, and ``ps.epoch``
    with ``ps.sampler`` continue where it was: every sample of both epochs once."""
    server = procs.server(port, "--trainer-timeout", "2")
    seen = tmp_path / "seen.jsonl"
    t = procs.start(["shard_epochs", str(port), "reconnect", f"out={seen}", "delay=0.1"], "script", prefix=SCRIPT)
    t.wait_for(r"joined psserver", timeout=60)
    while not seen.exists() or len(seen.read_text().splitlines()) < 6:
        assert t.running(), t.tail()
        time.sleep(0.2)
    t.signal(signal.SIGSTOP)
    server.wait_for(r"trainer trainer_0_1 missed heartbeats .* marking it LOST", timeout=30)
    t.signal(signal.SIGCONT)
    assert t.wait(120) == 0, t.tail()
    out = t.output()
    assert "trainer_0_1 was evicted by the psserver" in out and "reconnected as trainer_0_2" in out, out
    assert "resumed True" in out, out
    steps = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len({s["pid"] for s in steps}) == 1  # one process: re-executed in place
    for epoch in (0, 1):
        ids = sorted(i for s in steps if s["epoch"] == epoch for i in s["ids"])
        assert ids == list(range(256)), (epoch, len(ids))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
@pytest.mark.parametrize(("transport", "shown"), [
    ("auto", "transport device-map cuda:0 -> server cuda:0: both on CUDA on one host"),
    ("staged", "transport staged: --transport staged: through pinned host memory"),
    ("cpu", "transport cpu: --transport cpu"),
])
def test_a_replica_on_the_gpu_trains_as_the_local_loop(procs, port, tmp_path, transport, shown):
    """``connect(device="cuda:0")`` beside a server whose model is on cuda:0: the replica, its
    forward and backward on the GPU, the flat buffers device to device by default (or through
    pinned or pageable host memory, asked for); 20 sync Adam steps give the parameters of a local
    loop on the same device to 1e-5."""
    procs.server(port, *SYNC_ADAM, "--devices", "cuda:0")
    out = tmp_path / "state.pt"
    t = entry(procs, port, "through_step", "--device", "cuda:0", "--transport", transport, args={"out": str(out)})
    assert t.wait(120) == 0, t.tail()
    assert shown in t.output(), t.tail()
    state = {k: v.cpu() for k, v in torch.load(out).items()}
    assert same(state, loops.local_adam(device="cuda:0")) < 1e-5


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (a trainer on one, the server on another)")
def test_a_trainer_on_another_gpu_of_the_host_maps_its_device_to_the_servers(procs, port, tmp_path):
    """The trainer on cuda:1, the server's model on cuda:0: the device map takes cuda:1 to cuda:0
    (CUDA IPC between the GPUs), and 20 sync Adam steps still give the local loop's parameters."""
    procs.server(port, *SYNC_ADAM, "--devices", "cuda:0")
    out = tmp_path / "state.pt"
    t = entry(procs, port, "through_step", "--device", "cuda:1", args={"out": str(out)})
    assert t.wait(120) == 0, t.tail()
    assert "transport device-map cuda:1 -> server cuda:0" in t.output(), t.tail()
    state = {k: v.cpu() for k, v in torch.load(out).items()}
    assert same(state, loops.local_adam(device="cuda:1")) < 1e-5


def test_help_lists_the_librarys_names():
    import pydoc

    import psserver

    text = pydoc.render_doc(psserver, renderer=pydoc.plaintext)
    for name in ("connect", "Connection", "DistributedOptimizer", "replica", "sampler", "parameter_rrefs",
                 "backward_passes_per_step", "Evicted", "ServerLost", "UsageError"):
        assert name in text, name
    for name in psserver.__all__:
        assert getattr(psserver, name).__doc__, name


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_clean_run_of_two_library_scripts_prints_no_tensorpipe_warning(procs, port, tmp_path):
    """Each peer that leaves used to make every other one log a C++ WARNING (EOF on its pipe),
    in the trainers (which imported torch before psserver) and in the server."""
    server = procs.server(port)
    scripts = [procs.start(["shard_epochs", str(port), f"out={tmp_path / f'seen{r}.jsonl'}", "epochs=1", "delay=0"],
                           f"script{r}", prefix=SCRIPT, env={"RANK": str(r), "WORLD_SIZE": "2"}) for r in (0, 1)]
    for t in scripts:
        assert t.wait(120) == 0, t.tail()
    assert procs.stop(server) == 0, server.tail()
    for p in (server, *scripts):
        assert "tensorpipe_agent" not in p.output() and "[W" not in p.output(), p.tail()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_script_stopped_and_started_again_by_hand_continues_where_its_rank_stopped(procs, port, tmp_path):
    """Ctrl-C (SIGINT) mid-epoch, then the same script again under the same rank, without
    ``reconnect``: the server tells it where its rank's last trainer stopped, and its sampler
    continues the epoch: every sample of both epochs once. A run that ended starts over."""
    server = procs.server(port)
    seen = tmp_path / "seen.jsonl"
    args = ["shard_epochs", str(port), f"out={seen}", "delay=0.05", "record=before", "samples=128"]
    first = procs.start(args, "script", prefix=SCRIPT)
    while not seen.exists() or len(seen.read_text().splitlines()) < 3:
        assert first.running(), first.tail()
        time.sleep(0.05)
    first.signal(signal.SIGINT)
    assert first.wait(60) == 130, first.tail()
    again = procs.start(args, "script-again", prefix=SCRIPT)
    assert again.wait(120) == 0, again.tail()
    assert re.search(r"rank 0 continues where its last trainer stopped: epoch 0, \d+ of its samples", again.output())
    steps = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len({s["pid"] for s in steps}) == 2
    for epoch in (0, 1):
        ids = sorted(i for s in steps if s["epoch"] == epoch for i in s["ids"])
        assert ids == list(range(128)), (epoch, len(ids))
    # It finished: the next trainer of rank 0 starts over, and says nothing about it.
    seen.unlink()
    third = procs.start(args, "script-third", prefix=SCRIPT)
    assert third.wait(120) == 0, third.tail()
    assert "continues" not in third.output() and len(seen.read_text().splitlines()) == 2 * 128 // loops.BATCH
    assert procs.stop(server) == 0


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_trainers_average_a_metric_through_the_server_as_horovods_allreduce(procs, port):
    procs.server(port)
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--entry", f"{ENTRY}:averaged") for r in (0, 1)]
    for t in trainers:
        assert t.wait(120) == 0, t.tail()
        got = json.loads(t.output().strip().splitlines()[-1])
        assert got == {"mean": 0.5, "total": [3.0, 3.0], "dtype": "torch.float32"}, t.tail()
