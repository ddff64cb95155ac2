"""The chart's Grafana dashboard: Grafana's shape, and every metric its PromQL reads is really exported.

Engine names are checked against a live `tidepool serve` `/metrics` (the tiny test model), operator
names against the operator's prometheus-client registry (autoscaler/handlers.py and metrics.py define them).
Every expression is parsed with a real PromQL parser (tests/promql_kit.py). A name is exported when a
family of the right type exposes it as a sample: a gauge as its name, a counter as `_total`, a
histogram as `_bucket`/`_sum`/`_count`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from promql_kit import exported, operator_samples, parse, selected
from serve_proc import Server

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "tidepool" / "dashboards" / "tidepool.json"
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*([^,()]+?)\s*(?:,[^()]*)?\)\s*$")  # Grafana's, not PromQL


def metric_names(expr: str) -> set[str]:
    """Metric names a panel or variable query reads: PromQL parsed for real, or Grafana's label_values()."""
    match = _LABEL_VALUES.match(expr)
    return {match[1]} if match else selected(expr)


def test_metric_names_of_an_expression() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, model_name) (rate(vllm:x_seconds_bucket{model_name=~"$m"}'
        '[$__rate_interval]))) / on (pool) group_left max(tidepool_y{a="rate(b)"})'
    )
    assert metric_names(expr) == {"vllm:x_seconds_bucket", "tidepool_y"}
    assert metric_names("label_values(vllm:z, model_name)") == {"vllm:z"}
    with pytest.raises(ValueError):
        metric_names("sum(rate(x[5m])")


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
            parse(target["expr"])  # raises on what Prometheus would refuse
            assert target["datasource"] == panel["datasource"]
    titles = " ".join(panel["title"].lower() for panel in panels)
    for topic in ("first token", "inter-token", "kv", "queue", "replicas", "scaling"):
        assert topic in titles, topic


def test_every_promql_name_is_exported(server: Server) -> None:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    engine = exported((f.name, f.type) for f in text_string_to_metric_families(text))
    operator = operator_samples()
    assert "vllm:time_to_first_token_seconds_bucket" in engine and "tidepool_autoscaler_decisions_total" in operator
    used: set[str] = set()
    for expr in _exprs(load_dashboard()):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        used |= names
    assert used - engine - operator == set(), "dashboard reads metrics nobody exports"
    assert used & engine and used & operator  # both halves are on the dashboard
