"""Embedding tables benchmark: its summaries, targets and Markdown report.

What ``benchmarks.studies.embedding.tables`` writes from the runs it measured: the medians over paired
rounds and the ratios within a round (``summarize_bytes``, ``fixed_cost``, ``summarize_rates``),
the bytes targets, the Markdown report with its method note, and the one-line log of a
run. Kept apart from running and measuring so that a result is summarized and rendered without
either; it imports no other ``embedding_*`` module."""

from __future__ import annotations

import statistics

from benchmarks.harness import report

BYTES_TARGET = 1.1
"""(A): bytes over the network per trainer step <= 1.1 x the ideal."""
SAME_TOLERANCE = 0.02
"""(A): "the same at 10^4 and 10^7 rows": the ratio between them within 1 +- 0.02 (ours)."""


# ---- summaries and targets -----------------------------------------------------------------------


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize_bytes(setups: list[dict], runs: dict[str, list[dict]]) -> dict:
    """Per setup the medians over rounds; the ratio of each setup's bytes/ideal to the first
    setup's (10^4 rows) of the same round."""
    base = setups[0]["name"]
    out: dict = {"baseline": base, "setups": {}}
    for s in setups:
        legs = runs.get(s["name"], [])
        row: dict = {**s, "rounds": len(legs)}
        for key in ("ratio", "ratio_up", "ratio_down", "bytes_per_step", "ideal_per_step", "packets_per_step",
                    "header_share", "payload_share", "payload_overhead_per_step", "samples_per_s",
                    "whole_run_ratio", "up_packets_per_step", "down_packets_per_step", "payload_overhead_up_per_step",
                    "payload_overhead_down_per_step"):
            row[key] = [leg.get(key) for leg in legs]
            row[f"median_{key}"] = _median(row[key])
        row["x_baseline"] = [None if a.get("ratio") is None or not b.get("ratio") else a["ratio"] / b["ratio"]
                             for a, b in zip(legs, runs.get(base, []), strict=False)] if s["role"] == "rows" else []
        row["median_x_baseline"] = _median(row["x_baseline"])
        out["setups"][s["name"]] = row
    small = next((r for r in out["setups"].values() if r["role"] == "batch"), None)
    out["fit"] = fixed_cost(out["setups"][base], small) if small else None
    return out


def fixed_cost(big: dict, small: dict) -> dict | None:
    """Bytes per step = fixed + k x ideal, through the medians of two batch sizes on one server:
    ``fixed`` is what every step costs whatever its ids (framing, the dense part, the headers of
    its smallest packets), ``k`` what each ideal byte costs (1 + its headers); and the ratio
    bytes / ideal at each batch, ``k + fixed / ideal``."""
    b1, i1 = big["median_bytes_per_step"], big["median_ideal_per_step"]
    b2, i2 = small["median_bytes_per_step"], small["median_ideal_per_step"]
    if None in (b1, i1, b2, i2) or i1 == i2:
        return None
    k = (b1 - b2) / (i1 - i2)
    fixed = b1 - k * i1
    return {"fixed_bytes_per_step": fixed, "k": k, "batches": [big["batch_size"], small["batch_size"]],
            "ideal_per_step": [i1, i2], "ideal_for_target": fixed / (BYTES_TARGET - k) if k < BYTES_TARGET else None}


def summarize_rates(counts: list[int], runs: dict[int, list[dict]]) -> dict:
    """Per server count the medians over rounds of the totals, per server, and over the
    1-server run (the fewest servers) of the same round."""
    base = min(counts)
    out: dict = {"baseline_servers": base, "setups": {}}
    for s in counts:
        legs = runs.get(s, [])
        row: dict = {"servers": s, "rounds": len(legs)}
        for key in ("total_lookups_per_s", "total_updates_per_s", "samples_per_s", "step_ms", "machine_busy",
                    "link_utilization", "bytes_per_step"):
            values = [leg.get(key) for leg in legs]
            row[key] = values
            row[f"median_{key}"] = _median(values)
            if key.startswith("total_") or key == "samples_per_s":
                ratios = [None if v is None or not b.get(key) else v / b[key]
                          for v, b in zip(values, runs.get(base, []), strict=False)]
                row[f"x_{key}"] = ratios
                row[f"median_x_{key}"] = _median(ratios)
        for key in ("lookups_per_s", "updates_per_s", "server_cores", "lookups_per_cpu_s", "server_ms_per_step",
                    "rows"):
            per = [leg.get(key) for leg in legs if leg.get(key) is not None]
            row[f"median_{key}"] = [_median(list(x)) for x in zip(*per, strict=True)] if per else None
        out["setups"][s] = row
    return out


def targets(bytes_summary: dict | None) -> list[dict]:
    """The bytes targets, from the medians over rounds (None where not measured)."""
    if not bytes_summary:
        return []
    rows = []
    setups = bytes_summary["setups"]
    for name, row in setups.items():
        if row.get("role") != "rows":
            continue
        v = row["median_ratio"]
        rows.append({"name": f"table bytes per trainer step / ideal, {row['label']}", "value": v, "op": "<=",
                     "target": BYTES_TARGET, "per_round": row["ratio"],
                     "met": None if v is None else v <= BYTES_TARGET})
        if name != bytes_summary["baseline"]:
            base = setups[bytes_summary["baseline"]]
            v = row["median_x_baseline"]
            rows.append({"name": f"bytes / ideal, {row['label']} over {base['label']} (same round)", "value": v,
                         "op": "within", "target": SAME_TOLERANCE, "per_round": row["x_baseline"],
                         "met": None if v is None else abs(v - 1) <= SAME_TOLERANCE})
    return rows


# ---- markdown ----------------------------------------------------------------------------------


def _f(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _fs(values: list | None, fmt: str, sep: str = " ") -> str:
    return "-" if not values else sep.join(_f(v, fmt) for v in values)


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = ["## Embedding tables", "", f"`{result['command']}` ({result['time']}, "
             f"{result['wall_s'] / 60:.1f} min, {cfg['cores']} cores)", ""]
    a = result.get("bytes") or {}
    if a.get("summary"):
        ca = cfg["bytes"]
        lines += [f"### (A) Table bytes per trainer step: mf on MovieLens-100k, dim {ca['dim']} (rows of "
                  f"{ca['dim'] + 1} floats), {ca['trainers']} trainers, 1 server process, links of "
                  f"{ca['rate_mbit']:g} Mbit/s, packets: {ca['packets']}", ""]
        rows = []
        for row in a["summary"]["setups"].values():
            rows.append([row["label"], str(row["batch_size"]), _f(row.get("rows_in_table"), "{:,}"),
                         _f(row.get("server_rss_mb"), "{:,.0f}"),
                         _f(row["median_ideal_per_step"], "{:,.0f}"), _f(row["median_bytes_per_step"], "{:,.0f}"),
                         _f(row["median_ratio"], "{:.3f}"), _fs(row["ratio"], "{:.3f}"),
                         f"{_f(row['median_ratio_up'], '{:.3f}')} / {_f(row['median_ratio_down'], '{:.3f}')}",
                         _f(row["median_packets_per_step"], "{:.1f}"),
                         _f(row["median_header_share"], "{:.1%}"),
                         f"{_f(row['median_payload_overhead_per_step'], '{:,.0f}')} "
                         f"({_f(row['median_payload_overhead_up_per_step'], '{:,.0f}')} / "
                         f"{_f(row['median_payload_overhead_down_per_step'], '{:,.0f}')})",
                         _f(row["median_x_baseline"], "{:.3f}"), _f(row["median_whole_run_ratio"], "{:.3f}"),
                         _f(row["median_samples_per_s"], "{:,.0f}")])
        lines += [report.md_table(
            ["setup", "batch", "rows per table at the end (status)", "server RSS MB", "ideal B/step", "measured B/step",
             "bytes / ideal (median)", "per round", "up / down", "packets per step", "headers (of ideal)",
             "other payload B/step (up / down)", "ratio x baseline (same round)", "whole run / ideal",
             "samples/s"], rows), ""]
        pk = a.get("rpc_pickles")
        if pk:
            lines += [f"Pickled parts of one step's exchange (torch's RPC pickler, computed here): the call up "
                      f"{pk['request']} B (of which the trainer's progress report, carried on every call, "
                      f"{pk['report']} B), the reply down {pk['reply']} B; {pk['request_tensors']} tensors up and "
                      f"{pk['reply_tensors']} down. The rest of the other payload is torch RPC's and TensorPipe's "
                      "framing of the two messages and their tensors, and one heartbeat per trainer per second.", ""]
        fit = a["summary"].get("fit")
        if fit:
            lines += [f"Bytes per step = fixed + k x ideal, through batches {fit['batches'][0]} and "
                      f"{fit['batches'][1]} (medians): fixed = {fit['fixed_bytes_per_step']:,.0f} B per step, "
                      f"k = {fit['k']:.3f}" + (f"; <= {BYTES_TARGET:g}x from an ideal of "
                                               f"{fit['ideal_for_target']:,.0f} B per step on"
                                               if fit.get("ideal_for_target") else "") + ".", ""]
    if result.get("targets"):
        trows = [[t["name"], _f(t["value"], "{:.3f}"), _fs(t["per_round"], "{:.3f}"),
                  f"{t['op']} {t['target']:g}" if t["op"] != "within" else f"1 +- {t['target']:g}",
                  "-" if t["met"] is None else ("yes" if t["met"] else "NO")] for t in result["targets"]]
        lines += ["Targets (medians over paired rounds):", "",
                  report.md_table(["ratio", "measured", "per round", "target", "met"], trows), ""]
    b = result.get("rates") or {}
    if b.get("summary"):
        cb = cfg["rates"]
        lines += [f"### (B) Row lookups and updates per second: dlrm_tiny on synthetic_clicks, dim {cb['dim']}, "
                  f"{cb['trainers']} trainers, batch {cb['batch_size']}, links of {cb['rate_mbit']:g} Mbit/s", ""]
        rows = []
        for s, row in b["summary"]["setups"].items():
            rows.append([str(s), _f(row["median_total_lookups_per_s"], "{:,.0f}"),
                         _f(row.get("median_x_total_lookups_per_s"), "{:.2f}"),
                         _fs(row.get("x_total_lookups_per_s"), "{:.2f}"),
                         _fs(row["median_lookups_per_s"], "{:,.0f}", " / "),
                         _f(row["median_total_updates_per_s"], "{:,.0f}"),
                         _f(row.get("median_x_total_updates_per_s"), "{:.2f}"),
                         _fs(row["median_updates_per_s"], "{:,.0f}", " / "),
                         _f(row["median_samples_per_s"], "{:,.0f}"),
                         _fs(row["median_server_cores"], "{:.2f}", " / "),
                         _fs(row["median_lookups_per_cpu_s"], "{:,.0f}", " / "),
                         _fs(row["median_server_ms_per_step"], "{:.2f}", " / "),
                         _f(row["median_link_utilization"], "{:.0%}"), _f(row["median_machine_busy"], "{:.0%}")])
        lines += [report.md_table(
            ["servers", "lookups/s, total (median)", "x 1 server", "per round", "lookups/s per server",
             "updates/s, total", "x 1 server", "updates/s per server", "samples/s", "server CPU (cores each)",
             "lookups per server CPU-second", "server CPU ms per trainer step", "server links busy",
             "machine CPU busy"], rows), ""]
    for part, key in (("(A)", "bytes"), ("(B)", "rates")):
        if (result.get(key) or {}).get("error"):
            lines += [f"**{part} stopped early:** {result[key]['error']}", ""]
    if result.get("error"):
        lines += [f"**Stopped early:** {result['error']}", ""]
    lines += [METHOD, ""]
    return "\n".join(lines).rstrip() + "\n"


METHOD = ("Method: every server process and trainer in a network namespace of its own behind a tc-limited veth link "
          "to one bridge (benchmarks/harness/multihost.py), servers with TensorPipe's basic channel; one torch thread "
          "each. "
          "(A) bytes over the server's link, both directions, headers included (bridge-port counters every 0.1 s), "
          "between the first and last readings inside the interval in which every trainer steps; the ideal of the "
          "steps that end between them, computed per step from the trainers' own batches and checked against their "
          "row_payload_bytes; 'headers' = 66 B per packet; 'other payload' = bytes - headers - ideal. (B) each server "
          "process's lookups and updates counters (server 0's status, read every 0.5 s in its namespace) between "
          "its first and last readings inside that interval. Ratios to the baseline of the same round; medians over "
          "rounds (benchmarks/studies/embedding/tables.py).")


# ---- one run, one log line -----------------------------------------------------------------------


def _bytes_line(leg: dict) -> str:
    return (f"{leg['window_steps']} steps in {leg['window_s']:.1f} s, {leg['bytes_per_step']:,.0f} B/step, ideal "
            f"{leg['ideal_per_step']:,.0f}: {leg['ratio']:.3f}x (up {leg['ratio_up']:.3f}, down "
            f"{leg['ratio_down']:.3f}; {leg['packets_per_step']:.1f} packets/step, headers {leg['header_share']:.1%}, "
            f"other payload {leg['payload_overhead_per_step']:,.0f} B/step); whole run {leg['whole_run_ratio']:.3f}x")


def _rates_line(leg: dict) -> str:
    return (f"{leg['samples_per_s']:,.0f} samples/s, lookups/s {_f(leg['total_lookups_per_s'], '{:,.0f}')} "
            f"({_fs(leg['lookups_per_s'], '{:,.0f}', ' / ')}), updates/s {_f(leg['total_updates_per_s'], '{:,.0f}')}, "
            f"server CPU {_fs(leg.get('server_cores'), '{:.2f}', ' / ')} cores, links "
            f"{_f(leg.get('link_utilization'), '{:.0%}')} busy, machine {_f(leg.get('machine_busy'), '{:.0%}')} busy")
