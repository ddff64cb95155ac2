"""Actuation: a kopf timer per InferenceService that collects, decides and (active mode) scales.

Every `TIDEPOOL_AUTOSCALE_INTERVAL` seconds (default 15) for each InferenceService with
`autoscaling.enabled`: scrape its pools (collector), read current replicas and unschedulable pods,
run `policy.decide`, then
- active: store the decision in the reconcile seam (`OperatorState.replicas_overrides` and
  `scaling_limits`, keyed by (namespace, name)) and reconcile at once when replicas change, so
  the builders render the new `replicas_by_pool`;
- advisory: change nothing but status, an Event and the metrics;
- always: merge-patch `status.autoscaling` (mode, lastScaleTime, lastDecision, per-pool
  desiredReplicas and inputs), an Event on every scale decision, operator metrics.
With autoscaling disabled the seam is cleared and HPA/KEDA may drive the scale subresource.

Environment (keeps `tidepool operator`'s flags untouched): TIDEPOOL_METRICS_SOURCE_URL_TEMPLATE
(synthetic feed, see collector.UrlTemplateSource), else TIDEPOOL_PROMETHEUS_URL (read a Prometheus
server's /federate), else scrape the pods found in EndpointSlices; TIDEPOOL_AUTOSCALE_INTERVAL,
TIDEPOOL_AUTOSCALE_WINDOW (metrics window, 60 s), TIDEPOOL_OPERATOR_METRICS_PORT (prometheus-client
endpoint, default 9090; 0 disables).
State (windows, histories) lives in kopf's memo; losing it only costs one window of data.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import kopf
from prometheus_client import Counter, Gauge, start_http_server

from tidepool.operator.api import GROUP, KIND, PLURAL, VERSION, now_rfc3339
from tidepool.operator.builders import LABEL_POOL, LABEL_SERVICE

from .collector import Collector, EndpointsSource, PrometheusSource, UrlTemplateSource
from .config import config_from_spec, declared_replicas, is_enabled, pool_names
from .policy import decide
from .policy_types import Decision, History, PoolSnapshot, PoolState

DECISIONS = Counter("tidepool_autoscaler_decisions", "Autoscaler decisions", ["namespace", "name", "mode", "action"])
DESIRED = Gauge("tidepool_autoscaler_desired_replicas", "Replicas the autoscaler wants", ["namespace", "name", "pool"])
CURRENT = Gauge("tidepool_autoscaler_current_replicas", "Replicas when deciding", ["namespace", "name", "pool"])


@dataclass(slots=True)
class AutoscalerState:
    collector: Collector
    http: httpx.AsyncClient
    histories: dict[tuple[str, str], History] = field(default_factory=dict)


def _state(memo: Any) -> AutoscalerState:
    state = getattr(memo, "tidepool_autoscaler", None)
    if state is None:
        http = httpx.AsyncClient()
        template = os.environ.get("TIDEPOOL_METRICS_SOURCE_URL_TEMPLATE")
        prometheus = os.environ.get("TIDEPOOL_PROMETHEUS_URL")
        if template:
            source = UrlTemplateSource(template, http)
        elif prometheus:
            source = PrometheusSource(prometheus, http)
        else:
            source = EndpointsSource(memo.tidepool.client, http)
        window = float(os.environ.get("TIDEPOOL_AUTOSCALE_WINDOW", "60"))
        state = memo.tidepool_autoscaler = AutoscalerState(Collector(source, window), http)
    return state


async def current_pools(client: Any, namespace: str, name: str, body: Mapping[str, Any], override: dict | None) -> dict:
    """Replicas in force per pool and unschedulable pods.

    Replicas: the seam's override; after an operator restart (memo lost) the desiredReplicas the
    reconcile recorded in status, so a scaled-up pool is not mistaken for its spec's replicas;
    else the spec.
    """
    spec = body.get("spec") or {}
    recorded = (body.get("status") or {}).get("pools") or {}
    pods = await client.list("Pod", namespace, f"{LABEL_SERVICE}={name}")
    states = {}
    for pool in pool_names(spec):
        replicas = (override or {}).get(pool)
        if replicas is None:
            replicas = (recorded.get(pool) or {}).get("desiredReplicas")
        if replicas is None:
            replicas = declared_replicas(spec)[pool]
        stuck = [
            c.get("message", "")
            for p in pods
            if (p["metadata"].get("labels") or {}).get(LABEL_POOL) == pool
            and p.get("status", {}).get("phase") == "Pending"
            for c in p["status"].get("conditions") or []
            if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
        ]
        states[pool] = PoolState(int(replicas), len(stuck), stuck[0] if stuck else "")
    return states


def status_patch(decision: Decision, snapshots: dict[str, PoolSnapshot], previous: dict | None) -> dict:
    pools = {}
    for pool, d in decision.pools.items():
        snap = snapshots.get(pool) or PoolSnapshot()
        inputs = {
            "ttftP95Ms": None if snap.ttft_p95_s is None else round(snap.ttft_p95_s * 1000, 3),
            "itlP95Ms": None if snap.itl_p95_s is None else round(snap.itl_p95_s * 1000, 3),
            "kvCacheUsage": snap.kv_cache_usage,
            "queueDepth": snap.num_waiting,
            "heldRequests": snap.held_requests,
            "podsScraped": float(snap.num_pods_scraped),
            "loadRatio": d.load_ratio,
        }
        pools[pool] = {"desiredReplicas": d.desired, "inputs": {k: v for k, v in inputs.items() if v is not None}}
    scaled = decision.is_scaling and not decision.is_advisory
    return {
        "autoscaling": {
            "mode": "advisory" if decision.is_advisory else "active",
            "lastScaleTime": now_rfc3339() if scaled else (previous or {}).get("lastScaleTime"),
            "lastDecision": decision.reason[:4096],
            "pools": pools,
        }
    }


async def on_autoscale(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    meta, spec = body["metadata"], dict(body.get("spec") or {})
    namespace, name = meta["namespace"], meta["name"]
    key = (namespace, name)
    operator = memo.tidepool
    if meta.get("deletionTimestamp") or not is_enabled(spec):
        operator.replicas_overrides.pop(key, None)
        operator.scaling_limits.pop(key, None)
        return
    auto = _state(memo)
    pools = pool_names(spec)
    config = config_from_spec(spec)
    now = time.monotonic()
    await auto.collector.collect(namespace, name, pools, now)
    snapshots = auto.collector.snapshots(namespace, name, pools)
    current = await current_pools(operator.client, namespace, name, body, operator.replicas_overrides.get(key))
    decision = decide(config, snapshots, current, auto.histories.get(key), now)
    auto.histories[key] = decision.history
    mode = "advisory" if decision.is_advisory else "active"
    for pool, d in decision.pools.items():
        DESIRED.labels(namespace, name, pool).set(d.desired)
        CURRENT.labels(namespace, name, pool).set(d.current)
    DECISIONS.labels(namespace, name, mode, "scale" if decision.is_scaling else "hold").inc()

    if not decision.is_advisory:
        operator.replicas_overrides[key] = dict(decision.replicas)
        if decision.is_limited:
            operator.scaling_limits[key] = ("CapacityOrBounds", decision.limited_reason[:1000])
        else:
            operator.scaling_limits.pop(key, None)
    if decision.is_scaling:
        reason = "AdvisoryScale" if decision.is_advisory else "Scaled"
        kopf.event(dict(body), type="Normal", reason=reason, message=decision.reason[:1000])
        logger.info("%s: %s", reason, decision.reason)
    previous = (body.get("status") or {}).get("autoscaling")
    await operator.client.patch_status(KIND, namespace, name, status_patch(decision, snapshots, previous))
    if not decision.is_advisory and (decision.is_scaling or decision.is_limited):
        from tidepool.operator.handlers import reconcile_object

        await reconcile_object(body, memo)


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the autoscaler timer and its metrics endpoint on the operator's registry."""
    interval = float(os.environ.get("TIDEPOOL_AUTOSCALE_INTERVAL", "15"))

    @kopf.on.startup(registry=registry)
    async def autoscaler_startup(**_: Any) -> None:
        port = int(os.environ.get("TIDEPOOL_OPERATOR_METRICS_PORT", "9090"))
        if port:
            start_http_server(port)

    @kopf.on.cleanup(registry=registry)
    async def autoscaler_cleanup(memo: kopf.Memo, **_: Any) -> None:
        state = getattr(memo, "tidepool_autoscaler", None)
        if state is not None:
            await state.http.aclose()

    kopf.timer(GROUP, VERSION, PLURAL, registry=registry, id="autoscale", interval=interval, initial_delay=interval)(
        on_autoscale
    )
