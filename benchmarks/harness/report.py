"""The one report writer of the harness: every study writes its result as JSON and the
Markdown made from it (``write_result``), so ``python -m benchmarks tables`` can make every
table of ``benchmarks/results`` again from the committed JSON; and the tables of paired
rounds (``paired``) that several studies print."""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import capacity
from benchmarks.harness.setups import STRAGGLER_SHARE

log = logging.getLogger(__name__)


def write_result(stem: Path, result: dict, study: str, render: Callable[[dict], str]) -> str:
    """Write ``<stem>.json`` (the result, its study named, for ``tables``) and ``<stem>.md``
    (``render`` of that JSON); the Markdown is returned. The JSON goes first, so a table that
    fails to render loses no measurement."""
    result = {"study": study, **{k: v for k, v in result.items() if k != "study"}}
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path = stem.with_name(stem.name + ".json")
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md = render(json.loads(json_path.read_text()))  # the table is what the JSON holds, nothing more
    stem.with_name(stem.name + ".md").write_text(md)
    log.info("wrote %s.json and .md", stem)
    return md


def _num(v, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _bytes(v) -> str:
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.2f} MB"
    return f"{v / 1e3:.1f} kB"


def _rss(peaks: dict[str, float] | None) -> str:
    if not peaks:
        return "-"
    return " / ".join(f"{k} {v:.0f}" for k, v in peaks.items())


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def trainer_compute_target_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        value = "-" if r["value"] is None else f"{r['value']:.3g}"
        per = " ".join(f"{x:.2f}" for x in r["per_round"]) if r.get("per_round") else "-"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        out.append([r["name"], value, r["from"], per, f"{r['op']} {r['target']:g}", met])
    return out


def markdown_rows(paired: dict) -> list[str]:
    """The table of paired rounds (``paired_stats.summarize`` plus ``rounds``): one row per setup."""
    lines = ["| setup | samples/s (median over rounds) | x best local (median over rounds) | rounds >= 0.90 "
             "| x best local, per round | step ms (median over rounds) | MB/step (median) "
             "| server CPU ms/step (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in paired["setups"].items():
        per = " ".join(f"{x:.3f}" for x in row.get("x_local", []))
        mb = row.get("median_bytes_per_step")
        flag = f" (disturbed in round {', '.join(str(r + 1) for r in row['disturbed_rounds'])})" \
            if row.get("disturbed_rounds") else ""
        lines.append(f"| {name}{flag} | {row['median_samples_per_s']:.0f} | "
                     f"{row.get('median_x_local', float('nan')):.3f} | "
                     f"{row.get('rounds_at_or_above_0.90', '-')}/{paired['rounds']} | {per} | "
                     f"{statistics.median(row['step_ms']):.1f} | {_num(None if mb is None else mb / 1e6, '{:.2f}')} | "
                     f"{_num(row.get('median_server_cpu_ms_per_step'), '{:.1f}')} |")
    return lines


def protection_markdown(rows: list[dict], title: str = "the protections' cost") -> list[str]:
    """Ratio targets between paired setups (``targets.protection_ratios``,
    ``targets.memory_state_ratios``), where the rounds held their setups."""
    if not rows:
        return []
    return [f"### Targets: {title} (from the paired rounds)", "",
            md_table(["ratio", "measured", "from", "per round", "target", "met"], trainer_compute_target_rows(rows)),
            ""]


def trainer_compute_markdown(rows: list[dict], cost: dict | None) -> list[str]:
    """The trainer-compute targets (``targets.trainer_compute_ratios``) and the server's capacity table
    (``capacity.from_paired``), where the rounds held their setups."""
    out = []
    if rows:
        out += ["### Targets: trainer compute (from the paired rounds)", "",
                md_table(["ratio", "measured", "from", "per round", "target", "met"],
                         trainer_compute_target_rows(rows)), ""]
    if cost:
        out += capacity.markdown(cost)
    return out


def paired_markdown(result: dict) -> str:
    """The report of ``python -m benchmarks.paired``: its command, the rounds' table, the notes on
    bytes and stragglers, and the ratio targets the rounds held."""
    paired, c = result["paired"], result["config"]
    notes = []
    if paired.get("bytes_method"):
        notes.append(f"Bytes: {paired['bytes_method']}.")
    if paired.get("throttle_methods"):
        notes.append(f"Stragglers held to {STRAGGLER_SHARE:g} core by: {', '.join(paired['throttle_methods'])}.")
    return "\n".join([f"## Paired rounds: {c['model']}, batch {c['batch_size']}", "",
                      f"`{result['command']}` ({result['time']}, {result['wall_s'] / 60:.1f} min)", "",
                      *markdown_rows(paired), "", *([" ".join(notes), ""] if notes else []),
                      *trainer_compute_markdown(result.get("trainer_compute_targets") or [],
                                                result.get("server_capacity")),
                      *protection_markdown(result.get("protection_targets") or []),
                      *protection_markdown(result.get("memory_state_targets") or [],
                                           "the state in shared memory")]).rstrip() + "\n"
