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
