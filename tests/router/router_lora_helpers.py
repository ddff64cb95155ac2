"""Helpers of the router's LoRA tests: what the router has learnt of its replicas' adapters, and its affinity counts."""

from __future__ import annotations

import httpx
from router_helpers import metric_value

from tidepool.contract.router_metrics_names import LORA_AFFINITY_HITS, LORA_AFFINITY_MISSES


def adapters_seen(router_url: str, pool: str = "unified") -> dict[str, list[str] | None]:
    """Replica URL -> the adapters the router last read from its /v1/models (None: not known)."""
    return {r["url"]: r["adapters"] for r in httpx.get(f"{router_url}/debug/replicas", timeout=5).json()[pool]}


def serving_with_adapters(router_url: str, pool: str = "unified") -> bool:
    """Every replica of `pool` is ready in the router's view and its adapters are known (an engine that started
    after the router was ejected by the first probe and comes back only after the ejection period)."""
    replicas = httpx.get(f"{router_url}/debug/replicas", timeout=5).json()[pool]
    return all(r["state"] == "ready" and r["adapters"] for r in replicas)


def affinity(router_url: str, pool: str = "unified") -> tuple[float, float]:
    """The router's (LoRA affinity hits, misses) counters for `pool`."""
    return (
        metric_value(router_url, f'{LORA_AFFINITY_HITS}_total{{pool="{pool}"}}'),
        metric_value(router_url, f'{LORA_AFFINITY_MISSES}_total{{pool="{pool}"}}'),
    )
