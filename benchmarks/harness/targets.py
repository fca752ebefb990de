"""The server-compute targets (the bytes a PS step must move, the ratios a run is held to)
and the trainer-compute ones (trainer compute against side-by-side local loops and DDP, stragglers, bytes
per step against the parameter bytes), each with the source of its value."""

from __future__ import annotations

import functools
import itertools
import math

from benchmarks.harness.paired_stats import ratio_between
from benchmarks.harness.setups import parse_setup

# (model, batch) -> minimum of PS 1 trainer / local.
ONE_TRAINER_TARGETS = {("mnist_cnn", 64): 0.90, ("resnet18", 32): 0.85}


def lower_bound(model: str, batch_size: int) -> dict:
    """Bytes a PS step must move: the input batch, the output, the output's gradient."""
    import torch

    from psserver.models import get_model_spec

    spec = get_model_spec(model)
    elem = torch.empty((), dtype=spec.input_dtype).element_size()
    inp = batch_size * math.prod(spec.input_shape) * elem
    outb = batch_size * spec.num_classes * 4
    return {"input": inp, "output": outb, "grad_output": outb, "total": inp + 2 * outb}


def trainer_compute_floor(model: str, wire: str = "fp32") -> int:
    """Bytes a trainer-compute step must move: the gradient up and the parameters down, once
    each, in the wire dtype."""
    return parameter_bytes(model) // 4 * 2 * (4 if wire == "fp32" else 2)


def ratios(result: dict) -> list[dict]:
    """The server-compute targets. Throughput ratios read the paired rounds' median where the run has
    them (``method``); the one-window ratio is kept beside it."""
    by = {s["name"]: s for s in result["setups"] if not s.get("error")}
    c = result["config"]
    key = (c["model"], c["batch_size"])
    mnist = key == ("mnist_cnn", 64)

    def throughput(label: str, name: str, target: float, issue_config: bool) -> dict:
        s = by.get(name, {})
        paired_x, one = s.get("paired_x_local"), s.get("ratio_to_local")
        return {"name": label, "value": paired_x if paired_x is not None else one, "op": ">=", "target": target,
                "issue_config": issue_config, "one_window": one,
                "method": "paired rounds, median" if paired_x is not None else "one window" if one is not None else "-"}

    out = []
    target1 = ONE_TRAINER_TARGETS.get(key, 0.90)
    # Server compute; the rows of setups this run measured (trainer compute: trainer_compute_ratios).
    for n, target, issue_config in ((1, target1, key in ONE_TRAINER_TARGETS), (2, 0.95, mnist)):
        what = "1 trainer async" if n == 1 else "2 trainers async (total)"
        if f"ps-async-{n}" in by:
            out.append(throughput(f"PS {what}, --step plain / local ({c['model']} b{c['batch_size']})",
                                  f"ps-async-{n}", target, issue_config))
        if f"ps-chained-async-{n}" in by:
            out.append(throughput(f"PS {what}, --step chained / local", f"ps-chained-async-{n}", target,
                                  issue_config))
    idle_from = [n for n in by if by[n]["kind"] == "ps" and by[n].get("server_idle_cpu_pct") is not None
                 and parse_setup(n).trainers == 2]
    if idle_from:
        name = "ps-async-2" if "ps-async-2" in idle_from else idle_from[0]
        out.append({"name": f"server idle CPU, 2 trainers joined and waiting (% of one core, {name})",
                    "value": by[name]["server_idle_cpu_pct"], "op": "<", "target": 2.0, "issue_config": True})
    ps = [s for s in by.values() if s["kind"] == "ps" and s.get("bytes_vs_lower_bound") is not None
          and s.get("compute") != "trainer"]  # trainer compute: trainer_compute_ratios (parameter bytes)
    if "ps-async-1" in by:
        out.append({"name": "PS bytes per step / lower bound (1 trainer async)", "op": "<=", "target": 1.2,
                    "value": by["ps-async-1"].get("bytes_vs_lower_bound"), "issue_config": True})
    if ps:
        worst = max(ps, key=lambda s: s["bytes_vs_lower_bound"])
        out.append({"name": f"PS bytes per step / lower bound (worst: {worst['name']})",
                    "value": worst["bytes_vs_lower_bound"], "op": "<=", "target": 1.2, "issue_config": True})
    for r in out:
        v = r["value"]
        r["met"] = None if v is None else (v >= r["target"] if r["op"] == ">=" else
                                           v < r["target"] if r["op"] == "<" else v <= r["target"])
    return out


# ---- trainers that compute -------------------------------------------------------------------

BYTES_PER_STEP_TARGETS = {"fp32": 2.05, "bf16": 1.05, "fp16": 1.05}
"""Bytes per trainer step / the model's parameter bytes at fp32: the floor is the gradient up
and the parameters down once each (2x at fp32, 1x at 16 bits)."""


@functools.cache
def parameter_bytes(model: str) -> int:
    """The model's parameters at fp32, in bytes."""
    from psserver.models import build_model

    return 4 * sum(p.numel() for p in build_model(model, seed=0).parameters())


def _check(row: dict) -> dict:
    v = row["value"]
    row["met"] = None if v is None else (v >= row["target"] if row["op"] == ">=" else v <= row["target"])
    return row


def trainer_compute_ratios(paired: dict | None, model: str, batch_size: int) -> list[dict]:
    """The trainer-compute targets from paired rounds (``benchmarks.harness.paired``): each throughput ratio is
    taken round by round between two setups of the same round, then the median; bytes per step
    are the medians over rounds over the model's fp32 parameter bytes. Only the rows whose
    setups the rounds hold."""
    if not paired or paired.get("error") or not paired.get("setups"):
        return []
    setups = paired["setups"]
    rows = []

    def ratio(label: str, num: str, den: str, target: float) -> None:
        r = ratio_between(paired, num, den)
        if r is not None:
            rows.append(_check({"name": label, "value": r["median"], "op": ">=", "target": target,
                                "per_round": r["per_round"], "from": f"{num} / {den}, paired rounds, median"}))

    for step, server in itertools.product(("pushpull", "pull"), ("", "-server1t")):
        two, one = f"ps-{step}-async-2{server}", f"ps-{step}-async-1{server}"
        what = f"--step {step}" + (", server 1 thread" if server else "")
        ratio(f"2 trainers async, {what} / two one-thread local loops side by side", two, "local-1t-x2", 0.90)
        ratio(f"2 trainers async, {what} / 1 trainer", two, one, 1.8)
        ratio(f"2 trainers async, {what} / DDP 2 ranks", two, "ddp-2", 1.0)
    for name in setups:
        s = parse_setup(name)
        if s.kind == "ps" and s.straggler and s.update in ("async", "ssp") and s.trainers == 2:
            den = "ddp-2-straggler"
            what = ("async" if s.update == "async" else f"ssp S={s.staleness}") + f", --step {s.step}"
            if s.server_threads:
                what += f", server {s.server_threads} thread(s)"
            ratio(f"straggler at half a core: PS {what} / DDP 2 ranks, same throttle", name, den,
                  1.3 if s.update == "async" else 1.2)
    pbytes = None
    by_wire: dict[str, list[tuple[str, float]]] = {}
    for name, row in setups.items():
        s = parse_setup(name)
        if s.kind == "ps" and s.compute == "trainer" and row.get("median_bytes_per_step") is not None:
            pbytes = pbytes or parameter_bytes(model)
            by_wire.setdefault(s.wire, []).append((name, row["median_bytes_per_step"] / pbytes))
    for wire, values in by_wire.items():
        worst = max(values, key=lambda v: v[1])
        rows.append(_check({"name": f"bytes per trainer step / parameter bytes (fp32), --wire-dtype {wire} "
                                    f"(worst of {len(values)}: {worst[0]})",
                            "value": worst[1], "op": "<=", "target": BYTES_PER_STEP_TARGETS[wire],
                            "per_round": None, "from": f"{paired.get('bytes_method') or 'bytes'}, median over rounds"}))
    return rows


def protection_ratios(paired: dict | None) -> list[dict]:
    """The protections' target: throughput with them on (a join token and the RPC
    allow-list, ``-token`` setups) within 3 % of without (``-open``: neither), round by round
    between the two setups of each pair, then the median."""
    return _pair_ratios(paired, "-token", "-open", "protections on / off", 0.97)


def memory_state_ratios(paired: dict | None) -> list[dict]:
    """The state in shared memory's target: throughput with it (``-shm`` setups) within 2 % of
    the same setup without, round by round between the two, then the median."""
    return _pair_ratios(paired, "-shm", "", "state in shared memory / in the process", 0.98)


def _pair_ratios(paired: dict | None, suffix: str, base_suffix: str, label: str, target: float) -> list[dict]:
    """``<base><suffix> / <base><base_suffix>`` for every such pair the rounds held."""
    if not paired or paired.get("error") or not paired.get("setups"):
        return []
    rows = []
    for name in paired["setups"]:
        base = name.removesuffix(suffix)
        if name.endswith(suffix) and f"{base}{base_suffix}" in paired["setups"]:
            r = ratio_between(paired, name, f"{base}{base_suffix}")
            if r is not None:
                rows.append(_check({"name": f"{label}, {base}", "value": r["median"], "op": ">=",
                                    "target": target, "per_round": r["per_round"],
                                    "from": f"{name} / {base}{base_suffix}, paired rounds, median"}))
    return rows

