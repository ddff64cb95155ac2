"""The PromQL the chart ships (dashboard panels, alert rules), read with a real PromQL parser
(`promql-parser`, the Rust crate Prometheus-compatible databases use): `parse` raises on what Prometheus
would refuse, `selected` names the metrics an expression selects, `exported` the sample names a set of
metric families is scraped as (a counter X as X_total, a histogram as X_bucket/_sum/_count), and
`operator_samples` those of the operator's own metrics.

Grafana's variables are not PromQL: `$__rate_interval` and `$__interval` read as 5m, any other `$name`
or `${name}` (used inside label matchers) as the text `name`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import promql_parser
from prometheus_client import REGISTRY

SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
_INTERVALS = re.compile(r"\$\{?__(rate_)?interval\}?")
_VARIABLES = re.compile(r"\$\{?(\w+)\}?")
_CHILDREN = ("lhs", "rhs", "expr", "param", "vector_selector")
OPERATOR_PREFIXES = ("tidepool_", "controller_runtime_", "workqueue_", "rest_client_", "leader_election_")


def parse(expr: str) -> Any:
    return promql_parser.parse(_VARIABLES.sub(r"\1", _INTERVALS.sub("5m", expr)))


def selected(expr: str) -> set[str]:
    """Metric names the expression selects (every vector selector in its tree)."""
    names: set[str] = set()
    todo = [parse(expr)]
    while todo:
        node = todo.pop()
        if type(node).__name__ == "VectorSelector":
            names.add(node.name)
            continue
        todo += [child for attr in _CHILDREN if (child := getattr(node, attr, None)) is not None]
        todo += list(getattr(node, "args", None) or [])
    return names


def operator_samples() -> set[str]:
    """Sample names of the operator's metrics (autoscaler/handlers.py and metrics.py register them)."""
    import tidepool.operator.autoscaler.handlers
    import tidepool.operator.metrics  # noqa: F401

    return exported((f.name, f.type) for f in REGISTRY.collect() if f.name.startswith(OPERATOR_PREFIXES))


def exported(families: Iterable[tuple[str, str]]) -> set[str]:
    """Sample names (name, type) families are scraped as."""
    return {name + suffix for name, kind in families for suffix in SUFFIXES.get(kind, ("",))}
