"""The throughput study's report: the table of every setup, the server-compute targets and
the chart, made from the run's JSON (``run.run_args``)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.report import (
    _bytes,
    _num,
    _rss,
    markdown_rows,
    md_table,
    trainer_compute_markdown,
)

COLUMNS = ["setup", "samples/s", "x local", "x local, paired", "step p50 ms", "step p95 ms", "bytes/step",
           "x lower bound", "server CPU idle (% core)", "server CPU training (% core)", "peak RSS MB"]


def setup_rows(result: dict) -> list[list[str]]:
    rows = []
    for s in result["setups"]:
        if s.get("error"):
            rows.append([s["name"], "failed", *["-"] * (len(COLUMNS) - 2)])
            continue
        b = s.get("bytes_per_step")
        bytes_cell = _bytes(b) + (" (est.)" if s.get("bytes_method", "").startswith("estimate") else "")
        idle = s.get("server_idle_cpu_pct")
        idle_cell = "-" if idle is None else f"{idle:.2f} (alone {s.get('server_idle_alone_cpu_pct', 0):.2f})"
        rows.append([
            s["name"] + (" (disturbed)" if s.get("disturbed") else ""),
            _num(s.get("samples_per_s")),
            _num(s.get("ratio_to_local"), "{:.2f}"),
            _num(s.get("paired_x_local"), "{:.3f}"),
            _num(s.get("step_p50_ms"), "{:.1f}"),
            _num(s.get("step_p95_ms"), "{:.1f}"),
            bytes_cell,
            _num(s.get("bytes_vs_lower_bound"), "{:.2f}x"),
            idle_cell,
            _num(s.get("server_train_cpu_pct"), "{:.0f}"),
            _rss(s.get("peak_rss_mb")),
        ])
    return rows


def target_rows(result: dict) -> list[list[str]]:
    rows = []
    for r in result["ratios"]:
        value = "-" if r["value"] is None else f"{r['value']:.3g}"
        one = "-" if r.get("one_window") is None else f"{r['one_window']:.3g}"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        note = "" if r.get("issue_config", True) else " (issue target set for another model/batch)"
        rows.append([r["name"], value, r.get("method", "one run"), one, f"{r['op']} {r['target']:g}", met + note])
    return rows


def markdown(result: dict) -> str:
    m, c = result["machine"], result["config"]
    lb = result["lower_bound"]
    devices = ", ".join(f"{k}: {v}" for k, v in result["devices_used"].items()) or "-"
    parts = [
        f"## psserver benchmark: {c['model']}, batch {c['batch_size']}",
        "",
        f"`{result['command']}`",
        "",
        f"{result['time']} on {m['cores_logical']} cores ({m.get('cpu_model') or 'unknown CPU'}), "
        f"torch {m['torch']}, GPUs: {len(m['gpus'])}; devices: {devices}. "
        f"{c['seconds']:g} s per setup, windows of {c['window_s']:.1f} s after {c['warmup_s']:g} s warm-up, "
        f"median window; load average at start/end: {m['load_avg_start']} / {m['load_avg_end']}. "
        f"`x local` divides by the best local loop (`{c['ceiling']}`); PS server TensorPipe channels: "
        f"{c['tp_channels']}.",
        "",
        md_table(COLUMNS, setup_rows(result)),
        "",
        f"PS lower bound per step: input {_bytes(lb['input'])} + output {_bytes(lb['output'])} + output "
        f"gradient {_bytes(lb['grad_output'])} = {_bytes(lb['total'])}. Bytes/step: measured with `ss` "
        "on the TCP sockets of the setup's processes (every byte counted once, at its sender) "
        "per trainer step, in the measured windows; DDP/FSDP: all bytes the ranks sent over the whole "
        "run (set-up included) per rank step, i.e. per batch, like PS. Trainer compute (`pull`, `pushpull`): "
        "`x lower bound` divides by the gradient up plus the parameters down in the wire dtype; DDP ranks "
        "started by the harness (`ddp-N`): bytes sent on their sockets in the measured windows per rank step.",
        "",
        "### Targets: server compute",
        "",
        md_table(["ratio", "measured", "from", "one window", "target", "met"], target_rows(result)),
        "",
    ]
    pr = result.get("paired")
    if pr and not pr.get("error"):
        parts += [f"### Paired rounds: {pr['rounds']} rounds of {pr['steps']} steps per trainer "
                  f"({pr['skip']} skipped)", "",
                  "Each round runs every setup once, back to back, in an order that rotates each round; "
                  "`x best local` divides by the best local loop of the same round.", "",
                  *markdown_rows(pr), ""]
    elif pr:
        parts += [f"- paired rounds failed: {pr['error'].splitlines()[0]}"]
    targets = result.get("trainer_compute_targets") or []
    parts += trainer_compute_markdown(targets, result.get("server_capacity"))
    failed = [s for s in result["setups"] if s.get("error")]
    for s in failed:
        parts.append(f"- {s['name']} failed: {s['error'].splitlines()[0]}")
    return "\n".join(parts).rstrip() + "\n"


def chart(result: dict, path: Path) -> bool:
    """Bar chart of samples/s per setup and samples/s against trainers; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [s for s in result["setups"] if not s.get("error") and s.get("samples_per_s")]
    locals_ = {s["name"]: s["samples_per_s"] for s in ok if s["kind"] == "local"}
    ceiling = result["config"].get("ceiling")
    if ceiling not in locals_:
        ceiling = max(locals_, key=locals_.get, default=None)
    local = locals_.get(ceiling) if ceiling else None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"local": "tab:gray", "ps": "tab:blue", "ddp": "tab:green", "fsdp": "tab:olive"}
    names = [s["name"] for s in ok]
    values = [s["samples_per_s"] for s in ok]
    ax1.bar(names, values, color=[colors.get(s["kind"], "tab:blue") if s.get("update") != "sync" else "tab:orange"
                                  for s in ok])
    for i, v in enumerate(values):
        ax1.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("samples/s (median window)")
    ax1.set_title("samples/s per setup")
    ax1.tick_params(axis="x", rotation=35)
    for label in ax1.get_xticklabels():
        label.set_ha("right")
    # One line per update mode and step protocol (fp32 wire, default server threads, no straggler).
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for s in ok:
        if s["kind"] == "ps" and not s.get("straggler") and s.get("wire", "fp32") == "fp32" \
                and not s.get("server_threads"):
            lines.setdefault((s["update"], s.get("step", "plain")), []).append((s["trainers"], s["samples_per_s"]))
    for (update, step), pts in lines.items():
        pts.sort()
        label = f"PS {update}" + ("" if step == "plain" else f", {step} step")
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    for kind, color in (("ddp", "tab:green"), ("fsdp", "tab:olive")):
        pts = [(s["trainers"], s["samples_per_s"]) for s in ok if s["kind"] == kind and not s.get("straggler")]
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], "s", color=color, label=kind.upper())
    if local:
        ax2.axhline(local, color="tab:gray", linestyle="--", label=f"best local loop ({ceiling})")
    ax2.set_xlabel("trainers / processes")
    ax2.set_ylabel("samples/s (total)")
    ax2.set_title("samples/s against number of trainers")
    ax2.set_ylim(bottom=0)
    ax2.legend()
    c = result["config"]
    fig.suptitle(f"psserver {c['model']} batch {c['batch_size']} on {result['machine']['cores_logical']} cores "
                 f"({', '.join(sorted(set(result['devices_used'].values()))) or 'cpu'}), {result['time']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True

