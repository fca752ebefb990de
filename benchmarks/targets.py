"""Issue 6's targets: the bytes a PS step must move, and the ratios a run is held to."""

from __future__ import annotations

import math

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


def ratios(result: dict) -> list[dict]:
    """The issue's targets. Throughput ratios read the paired rounds' median where the run has
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
    for n, target, issue_config in ((1, target1, key in ONE_TRAINER_TARGETS), (2, 0.95, mnist)):
        what = "1 trainer async" if n == 1 else "2 trainers async (total)"
        out.append(throughput(f"PS {what}, --step plain / local ({c['model']} b{c['batch_size']})",
                              f"ps-async-{n}", target, issue_config))
        if f"ps-chained-async-{n}" in by:
            out.append(throughput(f"PS {what}, --step chained / local", f"ps-chained-async-{n}", target,
                                  issue_config))
    idle = by.get("ps-async-2", {}).get("server_idle_cpu_pct")
    out.append({"name": "server idle CPU, 2 trainers joined and waiting (% of one core)", "value": idle,
                "op": "<", "target": 2.0, "issue_config": True})
    ps = [s for s in by.values() if s["kind"] == "ps" and s.get("bytes_vs_lower_bound") is not None]
    one = by.get("ps-async-1", {}).get("bytes_vs_lower_bound")
    out.append({"name": "PS bytes per step / lower bound (1 trainer async)", "value": one, "op": "<=",
                "target": 1.2, "issue_config": True})
    if ps:
        worst = max(ps, key=lambda s: s["bytes_vs_lower_bound"])
        out.append({"name": f"PS bytes per step / lower bound (worst: {worst['name']})",
                    "value": worst["bytes_vs_lower_bound"], "op": "<=", "target": 1.2, "issue_config": True})
    for r in out:
        v = r["value"]
        r["met"] = None if v is None else (v >= r["target"] if r["op"] == ">=" else
                                           v < r["target"] if r["op"] == "<" else v <= r["target"])
    return out
