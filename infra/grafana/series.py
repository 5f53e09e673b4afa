"""Which metric series the Grafana dashboard queries, and which a /metrics scrape exposes, in the same naming.

`dashboard_series() <= exposed_series(scrape)` is the check that every panel has data to show. Names follow
the exposition format: histograms by their base name (the dashboard's `_bucket`/`_sum`/`_count` stripped),
counters with their `_total` suffix, gauges as they are.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

DASHBOARD = Path(__file__).with_name("multiplex.json")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_VALUES = re.compile(r"\blabel_values\(\s*(?:([^,()]*?)\s*,\s*)?[a-zA-Z_]\w*\s*\)")  # Grafana: (series, label)
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# PromQL words that look like identifiers but are not series names.
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "inf", "nan", "le",
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
}


def promql_series(expr: str) -> set[str]:
    """Metric names selected by one PromQL expression (functions, labels, keywords and variables removed)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGE.sub("", text)
    text = _LABEL_VALUES.sub(lambda m: m.group(1) or "", text)
    text = _GROUPING.sub("", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, rest = match.group(1), text[match.end():].lstrip()
        if rest.startswith("(") or name.lower() in _KEYWORDS or re.fullmatch(r"\d.*", name):
            continue  # a function call, an operator keyword or a number
        names.add(name)
    return names


def base_name(series: str) -> str:
    for suffix in _HISTOGRAM_SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def _queries(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                yield value["query"]  # templating variable backed by a query
            elif key == "definition" and isinstance(value, str):
                yield value
            else:
                yield from _queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def dashboard_queries(path: Path = DASHBOARD) -> list[str]:
    return list(_queries(json.loads(Path(path).read_text())))


def dashboard_series(path: Path = DASHBOARD) -> set[str]:
    """Base names of every metric the dashboard queries (panels and templating)."""
    return {base_name(name) for expr in dashboard_queries(path) for name in promql_series(expr)}


def exposed_series(metrics_text: str) -> set[str]:
    """Names a Prometheus text exposition offers, comparable with dashboard_series()."""
    names: set[str] = set()
    typed: dict[str, str] = {}
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            typed[name] = kind.strip()
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    for name, kind in typed.items():
        if kind in ("histogram", "summary", "gaugehistogram"):
            names.add(name)
            names -= {name + s for s in _HISTOGRAM_SUFFIXES}
        elif kind == "counter":
            names.add(name if name.endswith("_total") else name + "_total")
    return names


if __name__ == "__main__":
    print("\n".join(sorted(dashboard_series())))
