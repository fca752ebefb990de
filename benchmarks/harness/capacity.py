"""How many trainers one PS server process can feed, from its measured cost per trainer step.

For a trainer-compute setup the paired rounds measure, per trainer step, the bytes on the wire
(gradient up, parameters down, protocol and TCP/IP overhead) and the server's CPU time; a
trainer steps ``r`` times a second. A link of ``L`` bytes/s then feeds ``L / (bytes x r)``
trainers (the bandwidth bound; up and down counted together, as on a link that carries one
direction at a time: a full-duplex link carries the two halves at once, up to 2x more), and
``cores`` cores feed ``cores / (CPU s x r)`` (the CPU bound). The smaller one binds.
"""

from __future__ import annotations

import math
import os

from benchmarks.harness.setups import parse_setup
from benchmarks.harness.targets import parameter_bytes

LINKS_GBIT = (10, 25, 100)


def capacity(bytes_per_step: float, cpu_s_per_step: float, steps_per_s: float, cores: float,
             links_gbit: tuple[float, ...] = LINKS_GBIT) -> list[dict]:
    """One row per link speed: the bandwidth and CPU bounds (trainers, fractional), the whole
    number of trainers the smaller allows, and which bound binds."""
    if bytes_per_step <= 0 or cpu_s_per_step <= 0 or steps_per_s <= 0 or cores <= 0:
        raise ValueError("bytes, CPU time, step rate and cores must all be positive")
    cpu = cores / (cpu_s_per_step * steps_per_s)
    out = []
    for gbit in links_gbit:
        bw = gbit * 1e9 / 8 / (bytes_per_step * steps_per_s)
        out.append({"link_gbit": gbit, "bandwidth_bound": bw, "cpu_bound": cpu, "trainers": math.floor(min(bw, cpu)),
                    "binds": "bandwidth" if bw <= cpu else "CPU"})
    return out


def from_paired(paired: dict | None, model: str, batch_size: int, cores: float | None = None) -> dict | None:
    """The cost per trainer step of every trainer-compute setup the rounds measured (no
    stragglers), and the capacity table of the one with the fewest trainers per step protocol,
    wire dtype and server thread count (at its own trainer step rate)."""
    if not paired or paired.get("error"):
        return None  # (setups whose tensors crossed outside the sockets have no bytes: -sock setups do)
    cores = cores or os.cpu_count() or 1
    costs = []
    for name, row in paired.get("setups", {}).items():
        s = parse_setup(name)
        if s.kind != "ps" or s.compute != "trainer" or s.straggler:
            continue
        b, c = row.get("median_bytes_per_step"), row.get("median_server_cpu_ms_per_step")
        r = row.get("median_steps_per_s_per_process")
        if b is None or c is None or not r:
            continue
        costs.append({"setup": name, "step": s.step, "wire": s.wire, "trainers": s.trainers,
                      "server_threads": (s.server_threads or 0),
                      "update": s.update, "bytes_per_step": b, "server_cpu_ms_per_step": c,
                      "steps_per_s_per_trainer": r})
    if not costs:
        return None
    pbytes = parameter_bytes(model)
    for c in costs:
        c["x_parameter_bytes"] = c["bytes_per_step"] / pbytes
    tables = []
    def kind(c: dict) -> tuple:
        return c["step"], c["wire"], c["server_threads"]

    for key in dict.fromkeys(map(kind, costs)):
        pick = min((c for c in costs if kind(c) == key), key=lambda c: c["trainers"])
        tables.append({"setup": pick["setup"], "rows": capacity(pick["bytes_per_step"],
                                                                pick["server_cpu_ms_per_step"] / 1e3,
                                                                pick["steps_per_s_per_trainer"], cores)})
    return {"model": model, "batch_size": batch_size, "parameter_bytes": pbytes, "cores": cores, "costs": costs,
            "tables": tables}


def markdown(cost: dict) -> list[str]:
    lines = [f"### Server cost per trainer step and trainers per server process ({cost['model']}, "
             f"batch {cost['batch_size']}, {cost['parameter_bytes'] / 1e6:.2f} MB of fp32 parameters)", "",
             "| setup | MB/step | x parameter bytes | server CPU ms/step | trainer steps/s (per trainer) |",
             "|---|---|---|---|---|"]
    for c in cost["costs"]:
        lines.append(f"| {c['setup']} | {c['bytes_per_step'] / 1e6:.2f} | {c['x_parameter_bytes']:.3f} | "
                     f"{c['server_cpu_ms_per_step']:.2f} | {c['steps_per_s_per_trainer']:.1f} |")
    lines += ["", f"Trainers one server process can feed at that step rate, on {cost['cores']:g} cores "
              "(CPU bound: cores / (CPU s per step x steps/s); bandwidth bound: link bytes/s / (bytes per step "
              "x steps/s), up and down together, so a full-duplex link allows up to twice as many):", "",
              "| setup | link | bandwidth bound | CPU bound | trainers | binds |", "|---|---|---|---|---|---|"]
    for t in cost["tables"]:
        for r in t["rows"]:
            lines.append(f"| {t['setup']} | {r['link_gbit']:g} Gbit/s | {r['bandwidth_bound']:.1f} | "
                         f"{r['cpu_bound']:.1f} | {r['trainers']} | {r['binds']} |")
    return [*lines, ""]
