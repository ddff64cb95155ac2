"""The chart's Grafana dashboard: Grafana's shape, and every metric its PromQL reads is really exported.

Engine names are checked against a live `tidepool serve` `/metrics` (the tiny test model), operator
names against the operator's prometheus-client registry (autoscaler/handlers.py and metrics.py define them).
A name is exported when a family of the right type exposes it as a sample: a gauge as its name, a
counter as `_total`, a histogram as `_bucket`/`_sum`/`_count` (so `X_bucket` maps back to family X).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from serve_proc import Server

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "tidepool" / "dashboards" / "tidepool.json"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
# PromQL functions, aggregations and keywords that may appear as bare identifiers in an expression.
PROMQL_WORDS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "count",
        "stddev",
        "stdvar",
        "topk",
        "bottomk",
        "quantile",
        "count_values",
        "group",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "and",
        "or",
        "unless",
        "rate",
        "irate",
        "increase",
        "delta",
        "idelta",
        "deriv",
        "histogram_quantile",
        "abs",
        "ceil",
        "floor",
        "round",
        "clamp",
        "clamp_min",
        "clamp_max",
        "label_replace",
        "label_join",
        "vector",
        "scalar",
        "time",
        "absent",
        "avg_over_time",
        "max_over_time",
        "min_over_time",
        "sum_over_time",
        "count_over_time",
        "last_over_time",
        "label_values",
    }
)
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_VARIABLES = re.compile(r"\$\{?\w+\}?")
_LABEL_VALUES = re.compile(r"\blabel_values\(\s*([^,()]+?)\s*(?:,[^()]*)?\)")  # Grafana's: (metric, label)
_IDENT = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (label matchers, ranges, groupings and variables removed)."""
    text = _LABEL_VALUES.sub(r" \1 ", _STRINGS.sub('""', expr))
    for pattern in (_MATCHERS, _RANGES, _GROUPING, _VARIABLES):
        text = pattern.sub(" ", text)
    return {word for word in _IDENT.findall(text) if word not in PROMQL_WORDS}


def test_metric_names_of_an_expression() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, model_name) (rate(vllm:x_seconds_bucket{model_name=~"$m"}'
        '[$__rate_interval]))) / on (pool) group_left max(tidepool_y{a="rate(b)"}) + label_values(vllm:z, model_name)'
    )
    assert metric_names(expr) == {"vllm:x_seconds_bucket", "tidepool_y", "vllm:z"}


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs(dashboard: dict[str, Any]) -> Iterator[str]:
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            yield target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield query["query"] if isinstance(query, dict) else query


def exported_samples(families: Iterable[tuple[str, str]]) -> set[str]:
    """Sample names (name, type) families are scraped as."""
    return {name + suffix for name, kind in families for suffix in SUFFIXES.get(kind, ("",))}


def test_dashboard_has_grafanas_shape() -> None:
    dashboard = load_dashboard()
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)) >= 6 and all(isinstance(i, int) for i in ids)
    for panel in panels:
        assert panel["type"] in {"timeseries", "stat", "gauge", "bargauge", "table"}, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert target["datasource"] == panel["datasource"]
    titles = " ".join(panel["title"].lower() for panel in panels)
    for topic in ("first token", "inter-token", "kv", "queue", "replicas", "scaling"):
        assert topic in titles, topic


def test_every_promql_name_is_exported(server: Server) -> None:
    import tidepool.operator.autoscaler.handlers  # registers the autoscaler's metrics
    import tidepool.operator.metrics  # noqa: F401  (and the controller's)

    text = httpx.get(server.url + "/metrics", timeout=10).text
    engine = exported_samples((f.name, f.type) for f in text_string_to_metric_families(text))
    operator_prefixes = ("tidepool_", "controller_runtime_", "workqueue_", "rest_client_", "leader_election_")
    operator = exported_samples((f.name, f.type) for f in REGISTRY.collect() if f.name.startswith(operator_prefixes))
    assert "vllm:time_to_first_token_seconds_bucket" in engine and "tidepool_autoscaler_decisions_total" in operator
    used: set[str] = set()
    for expr in _exprs(load_dashboard()):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        used |= names
    assert used - engine - operator == set(), "dashboard reads metrics nobody exports"
    assert used & engine and used & operator  # both halves are on the dashboard
