"""The metric names a PromQL expression reads (for checking dashboards and rules against the
names the server exports).

Not a full parser, but enough for the expressions we ship: strings, label matchers, range and
subquery brackets, grouping label lists (``by``/``without``/``on``/``ignoring``/``group_*``)
and Grafana variables are dropped; what remains that looks like an identifier and is neither a
function, an aggregation, a keyword nor a number is a metric name. ``{__name__="x"}`` selectors
count as ``x``. The syntax itself is left to the real parser (``promtool check rules``).
"""

from __future__ import annotations

import re

KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
    "atan2", "inf", "nan", "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio", "start", "end",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_NAME_MATCHER = re.compile(r'__name__\s*=\s*"([a-zA-Z_:][a-zA-Z0-9_:]*)"')
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects."""
    text = _GRAFANA_VAR.sub("1", expr)
    names = set(_NAME_MATCHER.findall(text))
    text = _STRING.sub('""', text)  # first: a label value may hold braces
    text = _MATCHERS.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(r"\1 ", text)
    for m in _IDENT.finditer(text):
        ident, call = m.group(1), m.group(2)
        if call or ident.lower() in KEYWORDS:
            continue
        names.add(ident)
    return names


# ---- Grafana dashboards ------------------------------------------------------------------

_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*\w+\s*\)\s*$", re.S)
GRAFANA_VALUES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def grafana_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every query of a dashboard: each panel target's ``expr`` (rows' nested
    panels included) and each query variable's selector (``label_values(SELECTOR, label)``)."""
    out = []

    def panels(items: list[dict]):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dashboard.get("panels", [])):
        for t in p.get("targets", []):
            out.append((f"panel {p.get('title')!r} target {t.get('refId')}", t["expr"]))
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = _LABEL_VALUES.match(q)
            out.append((f"variable ${v['name']}", m.group(1) if m else q))
    return out


def substitute(expr: str) -> str:
    """``expr`` with Grafana's variables replaced by values Prometheus accepts (intervals by a
    duration, dashboard variables by ``.*``: they only appear in ``=~`` matchers)."""
    for name, value in GRAFANA_VALUES.items():
        expr = expr.replace(name, value)
    return _GRAFANA_VAR.sub(".*", expr)


def unknown_metrics(queries: list[tuple[str, str]], exported: set[str]) -> dict[str, set[str]]:
    """{where: names not in ``exported``} of the queries that read a metric nobody exports, or none."""
    out = {}
    for where, expr in queries:
        names = metric_names(expr)
        if not names:
            out[where] = {"(no metric)"}
        elif names - exported:
            out[where] = names - exported
    return out
