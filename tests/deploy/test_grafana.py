"""deploy/grafana/psserver.json: one dashboard over the metrics the server really exports.

Every query's metric names are checked against the names of a real exposition (the collector
with a status that has every family: server processes, embedding tables, a checkpoint), so a
renamed or misspelt metric fails here instead of drawing an empty panel; the checker itself is
tested (a bogus name is caught). ``promtool`` parses every query, Grafana's variables replaced.
The live test in test_prometheus.py evaluates them in a real Prometheus.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.commands import DEPLOY
from tests.deploy.exposition import PROMETHEUS_OWN, exported_names
from tests.deploy.promql import grafana_queries, metric_names, substitute, unknown_metrics

DASHBOARD = DEPLOY / "grafana" / "psserver.json"


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_names() | PROMETHEUS_OWN


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested ones included, rows left out."""
    out = []
    for p in dashboard["panels"]:
        out += [p, *p.get("panels", [])]
    return [p for p in out if p["type"] != "row"]


def test_dashboard_queries_name_only_exported_metrics(dashboard, exported):
    queries = grafana_queries(dashboard)
    assert len(queries) > 20
    assert unknown_metrics(queries, exported) == {}


def test_checker_catches_a_metric_that_does_not_exist(dashboard, exported):
    broken = copy.deepcopy(dashboard)
    loss = next(p for p in panels(broken) if p["title"] == "Loss")
    loss["targets"][0]["expr"] = loss["targets"][0]["expr"].replace("psserver_loss", "psserver_training_loss")
    broken["templating"]["list"][1]["query"]["query"] = "label_values(psserver_upp, job)"
    assert unknown_metrics(grafana_queries(broken), exported) == {
        "panel 'Loss' target A": {"psserver_training_loss"}, "variable $job": {"psserver_upp"}}
    # A counter read without its _total suffix does not exist either.
    assert unknown_metrics([("q", "rate(psserver_steps[5m])")], exported) == {"q": {"psserver_steps"}}
    assert unknown_metrics([("q", "vector(1)")], exported) == {"q": {"(no metric)"}}


@pytest.mark.parametrize(("expr", "names"), [
    ('rate(psserver_steps_total{job=~"$job"}[$__rate_interval])', {"psserver_steps_total"}),
    ("histogram_quantile(0.99, sum by (le, method) (rate(psserver_rpc_duration_seconds_bucket[5m])))",
     {"psserver_rpc_duration_seconds_bucket"}),
    ('max by (rank) (psserver_trainer_state{state="LOST"}) unless on (rank) group_left (name) psserver_trainer_up',
     {"psserver_trainer_state", "psserver_trainer_up"}),
    ('sum(psserver_loss) without (instance) / 1e3 > bool Inf', {"psserver_loss"}),
    ('{__name__="psserver_up", job="a{b}"} or label_replace(psserver_info, "v", "$1", "version", "(.*)")',
     {"psserver_up", "psserver_info"}),
    ("psserver_steps_total offset 5m - psserver_checkpoint_last_step", {"psserver_steps_total",
                                                                        "psserver_checkpoint_last_step"}),
])
def test_metric_names_of_an_expression(expr, names):
    assert metric_names(expr) == names


def test_dashboard_covers_what_an_operator_watches(dashboard):
    titles = " | ".join(p["title"] for p in panels(dashboard)).lower()
    for topic in ("throughput", "loss", "trainers by state", "staleness", "server processes", "embedding rows",
                  "checkpoint age", "rpc handling time"):
        assert topic in titles, f"no panel about {topic}: {titles}"
    read = set().union(*(metric_names(e) for _, e in grafana_queries(dashboard)))
    for name in ("psserver_samples_per_second", "psserver_loss", "psserver_trainers", "psserver_trainer_staleness",
                 "psserver_server_process_up", "psserver_embedding_rows", "psserver_checkpoint_age_seconds"):
        assert name in read, name


def test_dashboard_is_importable(dashboard):
    """What Grafana needs to import it: unique panel ids and refIds, every panel on the grid and
    on the dashboard's Prometheus data source variable."""
    assert dashboard["uid"] == "psserver" and dashboard["title"] and dashboard["schemaVersion"] >= 30
    everything = [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]
    ids = [p["id"] for p in everything]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in panels(dashboard):
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_parses_every_dashboard_query(dashboard, tmp_path):
    """Each query, Grafana's variables replaced, as a recording rule: Prometheus's own parser."""
    rules = [{"record": f"dashboard:query_{i}", "expr": substitute(expr)}
             for i, (_, expr) in enumerate(grafana_queries(dashboard))]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
