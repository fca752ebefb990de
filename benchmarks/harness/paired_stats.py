"""The arithmetic of paired rounds (``benchmarks.harness.paired``) on step times and result dicts:
one run's throughput, each setup's per-round ratios to the best single local loop of the same
round and their medians, and the ratio between two setups round by round.

Plain functions on plain data, below every module that measures, reports or checks targets,
so each of them reads paired rounds' results without importing the harness that runs them.
"""

from __future__ import annotations

import itertools
import statistics

from benchmarks.harness.setups import Setup, is_ceiling


def leg_rate(step_ends: list[list[float]], batch_size: int, skip: int) -> dict:
    """Throughput of one run: step ends of every process after its first ``skip`` steps, over
    the interval in which all of them step (a trainer that finishes early would otherwise
    leave the other one alone and fast)."""
    first = [min(e) if e else None for e in step_ends]
    ends = [sorted(e)[skip:] for e in step_ends]
    if any(len(e) < 6 for e in ends):
        raise RuntimeError(f"a run has {min(len(e) for e in ends)} steps after the {skip} skipped: too few to time "
                           "(raise --steps)")
    start, end = max(e[0] for e in ends), min(e[-1] for e in ends)
    per_process = [sum(1 for t in e if start < t <= end) for e in ends]
    count = sum(per_process)
    if end <= start or count < 5:
        return _apart(ends, first, batch_size)
    gaps = [[b - a for a, b in itertools.pairwise(e) if start < b <= end] for e in ends]
    return {"samples_per_s": count * batch_size / (end - start),
            "step_ms": 1000 * statistics.median(g for p in gaps for g in p),
            "steps": count, "seconds": end - start, "start": start, "end": end, "steps_per_process": per_process,
            "step_ms_per_process": [1000 * statistics.median(p) if p else None for p in gaps],
            "steps_per_s_per_process": count / (end - start) / len(ends),
            "first_step_skew_s": [f - min(first) for f in first]}


DISTURBED = "disturbed"
"""Key of a figure measured while the machine did not let the run's processes step together."""


def _apart(ends: list[list[float]], first: list[float | None], batch_size: int) -> dict:
    """A run whose processes never stepped at the same time after their warm-up (a loaded
    machine ran them one after another): each process's own rate over its own steps, summed,
    flagged as disturbed. The figure stands in the report, marked; it is not a failure."""
    rates = [(len(e) - 1) / (e[-1] - e[0]) if e[-1] > e[0] else 0.0 for e in ends]
    gaps = [[b - a for a, b in itertools.pairwise(e)] for e in ends]
    start, end = min(e[0] for e in ends), max(e[-1] for e in ends)
    return {"samples_per_s": sum(rates) * batch_size,
            "step_ms": 1000 * statistics.median(g for p in gaps for g in p),
            "steps": sum(len(e) - 1 for e in ends), "seconds": end - start, "start": start, "end": end,
            "steps_per_process": [len(e) - 1 for e in ends],
            "step_ms_per_process": [1000 * statistics.median(p) if p else None for p in gaps],
            "steps_per_s_per_process": sum(rates) / len(ends),
            "first_step_skew_s": [f - min(first) for f in first],
            DISTURBED: "its processes never stepped together after their warm-up (a loaded machine): each "
                       "one's own rate, summed"}


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(setups: list[Setup], runs: dict[str, list[dict]]) -> dict:
    """Per-round ratios to the best single local loop of the round, and their medians; the
    medians of bytes and server CPU per step where the runs measured them."""
    locals_ = [s.name for s in setups if is_ceiling(s)]
    rounds = len(next(iter(runs.values())))
    out: dict = {"ceiling_per_round": [], "setups": {}}
    best = []
    for r in range(rounds):
        if locals_:
            name = max(locals_, key=lambda n: runs[n][r]["samples_per_s"])
            out["ceiling_per_round"].append(name)
            best.append(runs[name][r]["samples_per_s"])
    for s in setups:
        legs = runs[s.name]
        rates = [leg["samples_per_s"] for leg in legs]
        row = {"samples_per_s": rates, "step_ms": [leg["step_ms"] for leg in legs],
               "median_samples_per_s": statistics.median(rates)}
        disturbed = [r for r, leg in enumerate(legs) if leg.get(DISTURBED)]
        if disturbed:
            row["disturbed_rounds"] = disturbed
        if best:
            row["x_local"] = [a / b for a, b in zip(rates, best, strict=True)]
            row["median_x_local"] = statistics.median(row["x_local"])
            row["rounds_at_or_above_0.90"] = sum(x >= 0.90 for x in row["x_local"])
        for key in ("steps_per_s_per_process", "bytes_per_step", "server_cpu_ms_per_step", "server_cpu_cores"):
            values = [leg.get(key) for leg in legs]
            if any(v is not None for v in values):
                row[key] = values
                row[f"median_{key}"] = _median(values)
        out["setups"][s.name] = row
    return out


def ratio_between(paired: dict, num: str, den: str) -> dict | None:
    """samples/s of ``num`` over ``den``, round by round, and the median (None: one is missing)."""
    a, b = paired["setups"].get(num), paired["setups"].get(den)
    if a is None or b is None:
        return None
    per = [x / y for x, y in zip(a["samples_per_s"], b["samples_per_s"], strict=True)]
    return {"per_round": per, "median": statistics.median(per)}
