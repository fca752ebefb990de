"""deploy/prometheus/: the scrape configuration and alert rules, checked by the real tools.

- ``promtool check config`` / ``check rules`` / ``test rules`` (the rule unit tests in
  ``rules.test.yml``) on the shipped files;
- ``promtool check metrics`` on a full exposition of the collector (every family, embedding and
  checkpoint ones included) and on a live server's;
- the real ``prometheus`` binary, on the shipped configuration's jobs and rules, scraping a live
  job of two server processes while a trainer trains: the trainer is SIGKILLed and
  PsserverTrainerLost must fire within its ``for:`` window (read from Prometheus's HTTP API);
  on the way, the Grafana dashboard's queries are evaluated by that Prometheus.

Skipped, with the reason, where the binaries are missing (``apt-get install prometheus``).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.commands import DEPLOY
from tests.deploy.promql import grafana_queries, substitute
from tests.procs import free_port, start_servers, wait_until

PROMETHEUS_DIR = DEPLOY / "prometheus"
CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULES = PROMETHEUS_DIR / "rules.yml"
RULE_TESTS = PROMETHEUS_DIR / "rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "psserver.json"

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None,
                                      reason="prometheus not installed (apt-get install prometheus)")


def promtool(*args: str, stdin: str | None = None, cwd: Path = PROMETHEUS_DIR) -> str:
    """Run promtool; fails the test with its output unless it exits 0."""
    assert PROMTOOL is not None
    r = subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60, cwd=cwd)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"promtool {' '.join(args)} exited {r.returncode}:\n{out[-3000:]}"
    return out


def rules() -> dict[str, dict[str, Any]]:
    """{alert name: rule} of the shipped rule file."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def duration_s(text: str) -> float:
    """A Prometheus duration of one unit (``30s``, ``1m``, ``2h``) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit) and text[: -len(unit)].isdigit():
            return int(text[: -len(unit)]) * units[unit]
    raise ValueError(f"not a one-unit duration: {text!r}")


# ---- the shipped files, by promtool ----------------------------------------------------


@needs_promtool
def test_promtool_accepts_the_scrape_config_and_its_rule_file():
    out = promtool("check", "config", CONFIG.name)
    assert "SUCCESS" in out and "rules.yml" in out


@needs_promtool
def test_promtool_accepts_the_rules():
    out = promtool("check", "rules", RULES.name)
    assert f"SUCCESS: {len(rules())} rules found" in out


@needs_promtool
def test_rule_unit_tests_pass_and_cover_every_alert():
    """``rules.test.yml`` tests every alert of ``rules.yml``: a new alert without a test fails here."""
    out = promtool("test", "rules", RULE_TESTS.name)
    assert "SUCCESS" in out
    tested = {case["alertname"] for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in t.get("alert_rule_test", [])}
    assert set(rules()) <= tested, f"alerts without a unit test: {sorted(set(rules()) - tested)}"


def test_operator_alerts_are_there_with_severities():
    """The alerts psserver ships, each with a severity and a summary (what an on-call page shows)."""
    wanted = {"PsserverTrainerLost", "PsserverServerProcessLost", "PsserverJobWaiting", "PsserverTargetDown",
              "PsserverNoSteps", "PsserverNonFiniteGradients", "PsserverCheckpointLate", "PsserverRpcRefused",
              "PsserverControlRefused"}
    have = rules()
    assert wanted <= set(have), sorted(wanted - set(have))
    for name, rule in have.items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert rule["annotations"]["summary"], name


def test_scrape_config_names_the_jobs_the_rules_and_docs_use():
    config = yaml.safe_load(CONFIG.read_text())
    jobs = {c["job_name"] for c in config["scrape_configs"]}
    assert jobs == {"psserver", "psserver-servers", "psserver-collective"}
    assert config["rule_files"] == ["rules.yml"]
    for c in config["scrape_configs"]:  # a target label `server` would rename the metrics' own label
        for sc in c.get("static_configs", []):
            assert "server" not in sc.get("labels", {}), c["job_name"]


def test_rules_read_only_metrics_the_server_exports():
    """A renamed metric would leave an alert that never fires: every name an expression reads
    is in the server's exposition (or one Prometheus adds, like ``up``)."""
    from tests.deploy.exposition import PROMETHEUS_OWN, exported_names
    from tests.deploy.promql import metric_names

    exported = exported_names() | PROMETHEUS_OWN
    for name, rule in rules().items():
        read = metric_names(rule["expr"])
        assert read, f"{name}: no metric found in {rule['expr']!r}"
        assert read <= exported, f"{name} reads metrics the server does not export: {sorted(read - exported)}"


@needs_promtool
def test_promtool_finds_no_problem_in_a_full_exposition():
    """Every family the collector can produce (server processes, embedding tables, a checkpoint,
    refusals, the RPC histogram), linted by ``promtool check metrics``."""
    from psserver.config import ObservabilityConfig
    from psserver.exporters import observe_rpc, start_exporters
    from tests.deploy.exposition import realistic_target

    with start_exporters(realistic_target(), ObservabilityConfig(metrics_port=0)) as ex:
        observe_rpc("exchange", 0.004)
        text = fetch(f"http://127.0.0.1:{ex.metrics_port}/metrics")
    assert "psserver_embedding_rows{" in text and "psserver_checkpoint_age_seconds" in text
    assert "psserver_server_process_up{" in text and "psserver_rpc_duration_seconds_bucket{" in text
    promtool("check", "metrics", stdin=text)


# ---- the real Prometheus against a live server -----------------------------------------


def fetch(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def api(port: int, path: str, **params: str) -> Any:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    body = json.loads(fetch(f"http://127.0.0.1:{port}/api/v1/{path}{query}"))
    assert body["status"] == "success", body
    return body["data"]


def live_config(server0: int, server1: int, interval: str) -> dict[str, Any]:
    """The shipped configuration with its `psserver` job pointed at the live server 0 and its
    `psserver-servers` job at server 1, the shipped rule file by absolute path, and short scrape
    and evaluation intervals (the rules, their `for:` windows included, are the shipped ones)."""
    config = yaml.safe_load(CONFIG.read_text())
    config["global"] = {"scrape_interval": interval, "evaluation_interval": interval}
    config["rule_files"] = [str(RULES)]
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    jobs["psserver"]["static_configs"] = [{"targets": [f"127.0.0.1:{server0}"]}]
    jobs["psserver-servers"]["static_configs"] = [{"targets": [f"127.0.0.1:{server1}"]}]
    config["scrape_configs"] = [jobs["psserver"], jobs["psserver-servers"]]
    return config


@needs_prometheus
@needs_promtool
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.timeout(150)
def test_real_prometheus_fires_trainer_lost_within_its_for_window(tmp_path, procs):
    lost = rules()["PsserverTrainerLost"]
    for_s = duration_s(lost["for"])
    trainer_timeout = 2.0
    port, metrics_port, metrics1, prom_port = free_port(), free_port(), free_port(), free_port()
    one_thread = {"OMP_NUM_THREADS": "1"}
    # Two server processes, as on a cluster: server 0 (the job's state) and server 1 (its process).
    server, server1 = start_servers(procs, port, 2, "--model", "mlp", "--compute-threads", "1",
                                    "--trainer-timeout", str(trainer_timeout),
                                    per_server={0: ["--metrics-port", str(metrics_port)],
                                                1: ["--metrics-port", str(metrics1)]})
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(live_config(metrics_port, metrics1, "1s")))
    promtool("check", "config", str(config), cwd=tmp_path)
    prometheus = procs.start(
        ["--config.file", str(config), "--storage.tsdb.path", str(tmp_path / "tsdb"),
         "--web.listen-address", f"127.0.0.1:{prom_port}", "--log.level", "warn"],
        "prometheus", prefix=[PROMETHEUS], cwd=tmp_path, log=tmp_path / "prometheus.log")
    wait_until(lambda: "Ready" in fetch(f"http://127.0.0.1:{prom_port}/-/ready"), 30, "Prometheus ready",
               [prometheus])
    trainer = procs.trainer(port, 0, "--epochs", "1000", "--max-steps", "100000", env=one_thread,
                            log=tmp_path / "trainer.log")

    def training_in_prometheus() -> bool:
        """Prometheus itself scraped the trainer as up, the step moving, and both server processes."""
        queries = ('psserver_trainer_up{job="psserver",rank="0"} == 1', 'psserver_steps_total{job="psserver"} > 0',
                   'psserver_server_process_up{job="psserver",server="1"} == 1',
                   'psserver_server_rank{job="psserver-servers"} == 1',
                   'psserver_rpc_duration_seconds_count{job="psserver-servers"} > 0')
        return all(api(prom_port, "query", query=q)["result"] for q in queries)

    wait_until(training_in_prometheus, 60, "Prometheus to see the trainer train on both servers",
               [server, server1, trainer, prometheus])
    # The live expositions, mid-training, are clean for promtool too.
    promtool("check", "metrics", stdin=fetch(f"http://127.0.0.1:{metrics_port}/metrics"))
    promtool("check", "metrics", stdin=fetch(f"http://127.0.0.1:{metrics1}/metrics"))
    assert {t["labels"]["job"]: t["health"] for t in api(prom_port, "targets")["activeTargets"]} == {
        "psserver": "up", "psserver-servers": "up"}
    # The dashboard's queries, evaluated by this Prometheus: every one is accepted (api() fails on
    # an error), and the panels this job fills (it has no embedding table and no checkpoint) have
    # data once there are two scrapes for the rates.
    queries = grafana_queries(json.loads(DASHBOARD.read_text()))
    filled = {"panel 'Throughput' target A", "panel 'Throughput' target B", "panel 'Loss' target A",
              "panel 'Trainers by state' target A", "panel 'Staleness' target A", "panel 'Server processes' target A",
              "panel 'Memory per process' target A", "panel 'RPC handling time (p99)' target A", "variable $job"}
    assert filled <= {where for where, _ in queries}

    def dashboard_filled() -> bool:
        results = {where: api(prom_port, "query", query=substitute(expr))["result"] for where, expr in queries}
        empty = sorted(where for where in filled if not results[where])
        assert not empty, f"no data for {empty}"  # kept as the last error if time runs out
        return True

    wait_until(dashboard_filled, 20, "the dashboard's panels to have data", [server, server1, trainer, prometheus])
    assert not [a for a in api(prom_port, "alerts")["alerts"] if a["labels"]["alertname"] == "PsserverTrainerLost"]

    trainer.signal(signal.SIGKILL)
    killed_at = time.time()
    trainer.wait(10)

    def lost_alert(state: str) -> dict | None:
        for a in api(prom_port, "alerts")["alerts"]:
            if a["labels"]["alertname"] == "PsserverTrainerLost" and a["state"] == state:
                return a
        return None

    pending = wait_until(lambda: lost_alert("pending") or lost_alert("firing"), trainer_timeout + 20,
                         "PsserverTrainerLost pending", [server, server1, prometheus])
    firing = wait_until(lambda: lost_alert("firing"), for_s + 15, "PsserverTrainerLost firing",
                        [server, server1, prometheus])
    fired_at = time.time()
    assert firing["labels"] == {"alertname": "PsserverTrainerLost", "job": "psserver", "rank": "0",
                                "instance": f"127.0.0.1:{metrics_port}", "severity": "critical"}
    assert "rank 0 lost" in firing["annotations"]["summary"]
    assert pending["activeAt"] == firing["activeAt"]  # one alert: pending, then firing
    # Not before its `for:` (from the eviction), and within it plus the eviction and a few
    # scrape/evaluation intervals after the kill.
    assert for_s <= fired_at - killed_at <= trainer_timeout + for_s + 15, fired_at - killed_at
    assert server.running() and server1.running(), server.tail()
