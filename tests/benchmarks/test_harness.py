"""The benchmark harness's pieces: setup names and their command lines, the straggler
throttle (cgroup cleanup, SIGSTOP duty cycling), the namespace byte counter, the per-step
regression, and the arithmetic of the targets and of the server capacity table."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.harness import capacity, measure, netns, paired, setups, targets, throttle
from benchmarks.studies.throughput import run


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_new_setup_names_parse_and_build_their_command_lines():
    pair = setups.parse_setup("local-1t-x2")
    assert (pair.kind, pair.procs, pair.threads) == ("local", 2, 1)
    assert not setups.is_ceiling(pair) and setups.is_ceiling(setups.parse_setup("local-1t"))
    assert setups.process_env(pair) == {"OMP_NUM_THREADS": "1"}
    assert setups.process_env(setups.parse_setup("local")) == {}

    # Every PS trainer names its --step: trainer compute is the default.
    plain = setups.trainer_argv(setups.parse_setup("ps-async-1"), 0, port=1, batch_size=8, steps=9, stats_out="s")
    assert _value(plain, "--step") == "plain" and "--wire-dtype" not in plain
    assert setups.process_env(setups.parse_setup("ps-chained-async-2")) == {}

    pp = setups.parse_setup("ps-pushpull-bf16-async-2")
    assert (pp.step, pp.wire, pp.compute, pp.update, pp.trainers) == ("pushpull", "bf16", "trainer",
                                                                                      "async", 2)
    argv = setups.trainer_argv(pp, 1, port=4242, batch_size=64, steps=80, stats_out="/x.json")
    assert _value(argv, "--step") == "pushpull" and _value(argv, "--wire-dtype") == "bf16"
    assert _value(argv, "--rank") == "1" and _value(argv, "--num-trainers") == "2"
    assert _value(argv, "--server") == "127.0.0.1:4242" and _value(argv, "--max-steps") == "80"
    assert setups.process_env(pp) == {}  # a PS trainer sizes its own threads
    assert setups.parse_setup("ps-pull-async-1").wire == "fp32"

    ssp = setups.parse_setup("ps-pushpull-ssp4-2-straggler")
    assert (ssp.update, ssp.staleness, ssp.straggler) == ("ssp", 4, True)
    server = setups.server_argv(ssp, model="mnist_cnn", port=7, devices=None, tp_channels="basic")
    assert _value(server, "--update") == "ssp" and _value(server, "--staleness") == "4"
    assert "--staleness" not in setups.server_argv(setups.parse_setup("ps-async-2"), model="mnist_cnn", port=7,
                                                   devices=None, tp_channels="basic")
    assert setups.server_key(ssp) != setups.server_key(setups.parse_setup("ps-pushpull-async-2"))
    # -sock: the server's tensors cross the sockets (TensorPipe basic), whatever the run's channels.
    sock = setups.parse_setup("ps-pushpull-bf16-async-2-sock")
    assert sock.sock and sock.wire == "bf16" and setups.channels_of(sock, "default") == "basic"
    assert setups.server_key(sock) != setups.server_key(setups.parse_setup("ps-pushpull-bf16-async-2"))
    assert _value(setups.server_argv(sock, model="m", port=7, devices=None, tp_channels="default"),
                  "--channels") == "basic"
    assert "--channels" not in setups.server_argv(pp, model="m", port=7, devices=None, tp_channels="default")
    assert setups.counts_bytes(sock, "default") and not setups.counts_bytes(pp, "default")
    assert setups.counts_bytes(pp, "basic")
    # An async/ssp straggler (the last trainer) runs the given steps, the others twice as many.
    assert setups.straggler_index(ssp) == 1
    assert [setups.steps_for(ssp, r, 80) for r in range(2)] == [160, 80]
    assert setups.steps_for(setups.parse_setup("ps-pushpull-async-2"), 0, 80) == 80

    ddp = setups.parse_setup("ddp-2-straggler")
    assert (ddp.kind, ddp.threads, setups.straggler_index(ddp)) == ("ddp", 1, 1)
    assert setups.steps_for(ddp, 0, 80) == 80  # lockstep
    rank = setups.ddp_rank_argv(ddp, model="mnist_cnn", batch_size=64, steps=50, stats_out="r.json")
    assert rank[1:4] == ["-m", "benchmarks.harness.workers", "ddp"] and _value(rank, "--threads") == "1"
    env = setups.ddp_rank_env(ddp, 1, master_port=1234)
    assert env == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "OMP_NUM_THREADS": "1"}
    assert not setups.parse_setup("ddp-2").straggler

    for bad in ("ps-chained-bf16-async-1", "ps-bf16-async-1", "ps-pushpull-async-1-straggler", "local-1t-x1",
                "fsdp-2-straggler", "ps-pushpull-ssp-2", "ps-pushpull-fp8-async-2"):
        with pytest.raises(ValueError):
            setups.parse_setup(bad)
    named = paired.TRAINER_COMPUTE_SETUPS
    assert [s.name for s in setups.parse_setups(named)] == named.split(",")
    assert all(paired.pairable(s) for s in setups.parse_setups(run.FULL_SETUPS) if s.kind != "fsdp")


def test_run_and_paired_flags(capsys):
    for argv in (["--setups", "ps-chained-bf16-async-1"], ["--setups", "ps-pushpull-async-1-straggler"],
                 ["--throttle", "nope"], ["--netns", "maybe"]):
        with pytest.raises(SystemExit) as e:
            run.run(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert "error:" in err and "Traceback" not in err, argv
    args = paired.parse_args(["--setups", "trainer-compute", "--warm-up-steps", "0"])
    assert [s.name for s in args.setups] == paired.TRAINER_COMPUTE_SETUPS.split(",") and args.warm_up_steps == 0
    for argv in (["--setups", "local-1t-x2,ps-pushpull-async-2"], ["--warm-up-steps", "-1"]):
        with pytest.raises(SystemExit) as e:  # the pair is no ceiling; negative warm-up
            paired.parse_args(argv)
        assert e.value.code == 2, argv
    capsys.readouterr()


def _busy() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _cores(pid: int, seconds: float = 1.0) -> float:
    a = measure.proc_cpu_seconds(pid)
    time.sleep(seconds)
    return (measure.proc_cpu_seconds(pid) - a) / seconds


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_cgroup_throttle_holds_the_process_and_removes_its_cgroup():
    if throttle.cgroup_available() is None:
        pytest.skip("no writable CPU cgroup here (cgroup v2 without the cpu controller delegated, or not root): "
                    "the harness falls back to SIGSTOP/SIGCONT")
    busy = _busy()
    try:
        t = throttle.start(busy.pid, 0.5, "cgroup")
        try:
            assert t.method in ("cgroup1", "cgroup2") and t.path.is_dir()
            assert t.procs() == [busy.pid]
            quota = (t.path / "cpu.max").read_text().split() if t.method == "cgroup2" else \
                [(t.path / "cpu.cfs_quota_us").read_text().strip(), (t.path / "cpu.cfs_period_us").read_text().strip()]
            assert quota == ["50000", "100000"]
            assert _cores(busy.pid) < 0.7
        finally:
            t.close()
        assert not t.path.exists()  # moved back out, cgroup removed
        assert busy.poll() is None
        # Closing after the process died removes the cgroup as well.
        t2 = throttle.start(busy.pid, 0.5, "cgroup")
        busy.kill()
        busy.wait()
        t2.close()
        assert not t2.path.exists()
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_sigstop_duty_cycle_holds_the_process_and_always_continues_it():
    busy = _busy()
    try:
        with throttle.throttle(busy.pid, 0.5, "sigstop") as t:
            assert t.method == "sigstop"
            assert _cores(busy.pid) < 0.75
        state = open(f"/proc/{busy.pid}/stat").read().rsplit(")", 1)[1].split()[0]
        assert state != "T"  # continued
        assert _cores(busy.pid, 0.5) > 0.05
    finally:
        busy.kill()
        busy.wait()
    with pytest.raises(ValueError):
        throttle.start(busy.pid, 1.5)


NET_DEV = "\n".join([
    "Inter-|   Receive                                                |  Transmit",
    " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier "
    "compressed",
    "    lo:  123456     100    0    0    0     0          0         0   123456     100    0    0    0     0       0  "
    "        0",
    "  eth0: 9999999    5000    0    0    0     0          0         0  777777    4000    0    0    0     0       0  "
    "        0", ""])


def test_net_dev_parsing():
    assert netns.parse_net_dev(NET_DEV) == (123456, 123456)
    assert netns.parse_net_dev(NET_DEV, "eth0") == (9999999, 777777)
    with pytest.raises(ValueError):
        netns.parse_net_dev(NET_DEV, "wlan0")


SEND = "import socket, sys; c = socket.create_connection(('127.0.0.1', 5555)); c.sendall(b'x' * 2_000_000); c.close()"
RECV = ("import socket; s = socket.socket(); s.bind(('127.0.0.1', 5555)); s.listen(); print('up', flush=True)\n"
        "c, _ = s.accept(); n = 0\nwhile d := c.recv(1 << 20): n += len(d)\nprint(n)")



def send_two_megabytes(ns: netns.NetNamespace) -> float:
    """2 MB from one process of ``ns`` to another over its loopback; seconds from the send's
    start until the receiver counted them all."""
    recv = subprocess.Popen(ns.wrap([sys.executable, "-c", RECV]), stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout.readline().strip() == "up"
        t = time.perf_counter()
        subprocess.run(ns.wrap([sys.executable, "-c", SEND]), check=True, timeout=30)
        assert recv.stdout.readline().strip() == "2000000"
        return time.perf_counter() - t
    finally:
        if recv.poll() is None:
            recv.kill()
        recv.wait(10)


def needs_namespaces(*commands: str) -> None:
    """Skip, saying why, where no network namespace can be made (or a command is missing)."""
    reason = netns.available() or next((f"no {c} command" for c in commands if shutil.which(c) is None), None)
    if reason:
        pytest.skip(f"no network namespace here: {reason}")


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_namespace_counts_the_bytes_sent_inside_it_and_is_deleted():
    needs_namespaces()
    with netns.NetNamespace.create() as ns:
        assert ns.counters() == (0, 0)  # a fresh loopback: nothing of the host's
        before = ns.tx_bytes()
        send_two_megabytes(ns)
        sent = ns.tx_bytes() - before
        # The payload, plus TCP/IP headers, the handshake and the receiver's ACKs and window
        # updates, of which a slow receiver (a loaded machine) sends many more: 2.36 MB seen in CI.
        assert 2_000_000 <= sent < 3_000_000
        name = ns.name
        assert netns.exists(name)
    assert not netns.exists(name)
    with pytest.raises(RuntimeError), netns.NetNamespace.create() as ns:  # deleted on failure too
        name = ns.name
        raise RuntimeError("boom")
    assert not netns.exists(name)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_qdisc_shapes_every_packet_of_the_namespaces_loopback():
    """``--qdisc 'tbf rate 8mbit ...'``: 2 MB inside the namespace take 1.7 s at least (far more
    than the sender's start-up, which the time includes)."""
    needs_namespaces("tc")
    with netns.NetNamespace.create() as ns:
        ns.shape("tbf rate 8mbit burst 256kb latency 2s".split())  # a burst above lo's 64 KB MTU
        elapsed = send_two_megabytes(ns)
        assert elapsed > 1.2, elapsed  # 2 MB at 1 MB/s, less the burst
        with pytest.raises(OSError, match="tc qdisc bogus"):
            ns.shape(["bogus"])


def test_per_step_is_the_slope_of_the_readings_against_the_steps():
    # Two processes at 10 steps/s each; 1 MB and 5 ms of server CPU per step, the bytes of a
    # step sent 50 ms before its end (so readings and step ends are out of phase).
    ends = [[0.1 * i for i in range(1, 101)], [0.1 * i + 0.05 for i in range(1, 101)]]
    all_ends = sorted(t for e in ends for t in e)
    samples = []
    for k in range(110):
        t = 0.093 * k
        done = sum(1 for x in all_ends if x - 0.05 <= t)
        samples.append(measure.ProbeSample(t, 0.005 * done + 1.0, 1_000_000 * done + 12345))
    got = measure.per_step(samples, ends, 2.0, 8.0)
    assert got["bytes_per_step"] == pytest.approx(1e6, rel=0.02)
    assert got["server_cpu_ms_per_step"] == pytest.approx(5.0, rel=0.02)
    assert got["server_cpu_cores"] == pytest.approx(0.1, rel=0.05)
    assert measure.per_step(samples[:2], ends, 0.0, 0.1) == {}
    snaps = [measure.ProbeSample(s.t, None, {("a", "b"): s.wire}) for s in samples]  # ss snapshots
    assert measure.per_step(snaps, ends, 2.0, 8.0)["bytes_per_step"] == pytest.approx(1e6, rel=0.02)
    assert measure.slope([1, 2, 3], [2, 4, 6]) == pytest.approx(2)
    assert measure.slope([1, 1, 1], [2, 4, 6]) is None


def test_proc_cpu_seconds_reads_this_process():
    t0 = measure.proc_cpu_seconds(os.getpid())
    x = 0
    start = time.process_time()
    while time.process_time() - start < 0.15:
        x += 1
    assert measure.proc_cpu_seconds(os.getpid()) - t0 >= 0.1
    assert measure.proc_cpu_seconds(2**22 + 12345) is None


def test_capacity_table_arithmetic():
    # 9.6 MB per step, 7 ms of server CPU per step, 12.5 steps/s per trainer, 2 cores.
    rows = capacity.capacity(9.6e6, 0.007, 12.5, 2)
    assert [r["link_gbit"] for r in rows] == [10, 25, 100]
    ten = rows[0]
    assert ten["bandwidth_bound"] == pytest.approx(1.25e9 / (9.6e6 * 12.5))  # 10.4
    assert ten["cpu_bound"] == pytest.approx(2 / (0.007 * 12.5))  # 22.9
    assert (ten["trainers"], ten["binds"]) == (10, "bandwidth")
    hundred = rows[2]
    assert (hundred["trainers"], hundred["binds"]) == (math.floor(2 / (0.007 * 12.5)), "CPU")
    with pytest.raises(ValueError):
        capacity.capacity(0, 0.007, 12.5, 2)


def _row(rates, **extra):
    return {"samples_per_s": rates, "step_ms": [50.0] * len(rates), "median_samples_per_s": sorted(rates)[1],
            **extra}


def test_trainer_compute_targets_and_capacity_from_paired_rounds():
    pbytes = targets.parameter_bytes("mnist_cnn")
    assert pbytes == 4 * 1199882 and targets.trainer_compute_floor("mnist_cnn", "bf16") == pbytes
    fabricated = {"rounds": 3, "bytes_method": "loopback", "setups": {
        "local-1t": _row([1200, 1100, 1000]),
        "local-1t-x2": _row([1500, 1400, 1300]),
        "ddp-2": _row([1200, 1050, 1100]),
        "ps-pushpull-async-1": _row([800, 700, 760], median_bytes_per_step=2.01 * pbytes,
                                    median_server_cpu_ms_per_step=7.0, median_steps_per_s_per_process=12.0),
        "ps-pushpull-async-2": _row([1440, 1260, 1300], median_bytes_per_step=2.02 * pbytes,
                                    median_server_cpu_ms_per_step=8.0, median_steps_per_s_per_process=10.0),
        "ps-pushpull-bf16-async-1": _row([900, 800, 850], median_bytes_per_step=1.06 * pbytes,
                                         median_server_cpu_ms_per_step=6.0, median_steps_per_s_per_process=13.0),
        "ddp-2-straggler": _row([700, 600, 650]),
        "ps-pushpull-async-2-straggler": _row([1050, 900, 800]),
        "ps-pushpull-ssp4-2-straggler": _row([800, 800, 800])}}
    rows = {r["name"]: r for r in targets.trainer_compute_ratios(fabricated, "mnist_cnn", 64)}

    def row(prefix):
        return next(r for n, r in rows.items() if n.startswith(prefix))

    side = row("2 trainers async, --step pushpull / two one-thread local loops")
    assert side["per_round"] == pytest.approx([0.96, 0.9, 1.0]) and side["value"] == pytest.approx(0.96)
    assert side["met"] is True and "ps-pushpull-async-2 / local-1t-x2" in side["from"]
    assert row("2 trainers async, --step pushpull / 1 trainer")["value"] == pytest.approx(1.8)
    assert row("2 trainers async, --step pushpull / DDP")["value"] == pytest.approx(1.2)
    strag = row("straggler at half a core: PS async")
    assert strag["per_round"] == pytest.approx([1.5, 1.5, 800 / 650]) and strag["target"] == 1.3
    ssp = row("straggler at half a core: PS ssp S=4")
    assert ssp["value"] == pytest.approx(800 / 650) and ssp["target"] == 1.2 and ssp["met"] is True
    fp32 = row("bytes per trainer step / parameter bytes (fp32), --wire-dtype fp32")
    assert fp32["value"] == pytest.approx(2.02) and "ps-pushpull-async-2" in fp32["name"] and fp32["met"] is True
    bf16 = row("bytes per trainer step / parameter bytes (fp32), --wire-dtype bf16")
    assert bf16["value"] == pytest.approx(1.06) and bf16["met"] is False
    assert not any("--step pull" in n for n in rows)  # no pull setups in these rounds

    cost = capacity.from_paired(fabricated, "mnist_cnn", 64, cores=2)
    assert [c["setup"] for c in cost["costs"]] == ["ps-pushpull-async-1", "ps-pushpull-async-2",
                                                   "ps-pushpull-bf16-async-1"]
    # One table per step protocol and wire dtype: the setup with the fewest trainers, at its own rate.
    assert [t["setup"] for t in cost["tables"]] == ["ps-pushpull-async-1", "ps-pushpull-bf16-async-1"]
    assert cost["tables"][0]["rows"] == capacity.capacity(2.01 * pbytes, 0.007, 12.0, 2)
    md = "\n".join(capacity.markdown(cost))
    assert "| ps-pushpull-async-1 | 10 Gbit/s |" in md and "x parameter bytes" in md
    assert targets.trainer_compute_ratios(None, "mnist_cnn", 64) == []
    assert capacity.from_paired(None, "mnist_cnn", 64) is None
    # Setups whose tensors crossed outside the sockets (cma) carry no bytes: no bytes rows, no table.
    cma = {**fabricated, "setups": {n: {k: v for k, v in r.items() if "bytes" not in k}
                                    for n, r in fabricated["setups"].items()}}
    assert not any(r["name"].startswith("bytes") for r in targets.trainer_compute_ratios(cma, "mnist_cnn", 64))
    assert capacity.from_paired(cma, "mnist_cnn", 64) is None


def test_server_half_times_an_exchange_without_rpc(caplog):
    from benchmarks.studies import server_half
    from psserver.server.engine import shard

    wall, cpu = server_half.measure("mlp", 5, "bf16", 1)
    assert 0 < wall < 1000 and 0 < cpu < 1000
    with caplog.at_level("INFO", logger="benchmarks.studies.server_half"):
        assert server_half.main(["--model", "mlp", "--steps", "3"]) == 0
    assert "pushpull exchange in-process, mlp, adam, wire fp32" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="benchmarks.studies.server_half"):
        assert server_half.main(["--model", "mlp", "--steps", "3", "--optimizer", "sgd", "--momentum", "0.9",
                                 "--unfused-rounds", "2"]) == 0
    assert caplog.text.count("torch's default") == 3 and "median" in caplog.text
    assert shard.FUSED == ("adam", "adamw", "sgd")  # the comparison's unfused build put it back
    for bad in (["--steps", "0"], ["--unfused-rounds", "-1"]):
        with pytest.raises(SystemExit) as e:
            server_half.main(bad)
        assert e.value.code == 2


def test_sigterm_exits_once_and_a_second_one_leaves_the_cleanup_to_finish():
    before, cleaned = signal.getsignal(signal.SIGTERM), []
    with pytest.raises(SystemExit) as stopped:
        with paired.exit_on_sigterm():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)  # not reached: the handler raises as the signal lands
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # `timeout` and a user both signalling: ignored here
                cleaned.append("namespaces removed")
    assert stopped.value.code == 128 + signal.SIGTERM and cleaned == ["namespaces removed"]
    assert signal.getsignal(signal.SIGTERM) is before
