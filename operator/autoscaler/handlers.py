"""Actuation: the autoscaler's step for one InferenceService, run by the controller under its key.

Every `TIDEPOOL_AUTOSCALE_INTERVAL` seconds (default 15) for each InferenceService with
`autoscaling.enabled`, the controller's worker for that object (so never concurrently with its
reconcile) calls `Autoscaler.tick`: scrape the pools (collector), read current replicas and
unschedulable pods (the pod cache), run `policy.decide`, then write `status.autoscaling`:
mode, lastScaleTime, lastDecision, per-pool desiredReplicas and inputs, `limited`, and the policy's
stabilization state (recent recommendations, lastActiveTime). In active mode the reconcile that
follows applies `status.autoscaling.pools[*].desiredReplicas` (`applied_replicas()`); in advisory
mode nothing but status, an Event and the metrics change. With autoscaling disabled, or in external mode,
the autoscaler never ticks (no scrape, no decision, no replicas): the spec's replicas apply and HPA/KEDA
drive the scale subresource (`spec.replicas`, the scaled pool's); `clear` removes what an earlier mode
left in `status.autoscaling` and the service's metric series. A switch between active and advisory
starts afresh: the other mode's stabilization state, lastScaleTime and metric series are dropped.

Durability: everything the policy decided lives in the cluster, so a restarted (or newly elected)
operator resumes from it without scaling anything down: replicas come from status, and the
stabilization state is read back with its times moved `PERSIST_S` later (status is refreshed at
least that often, so restored times are never earlier than the truth; a restart can delay a
scale-down by at most `PERSIST_S`, never hasten one). Only the metrics windows live in memory
(losing them costs one window; incomplete data never scales down). Status is written when the
decision changes, else at most every `PERSIST_S`, with the resourceVersion it was computed from.

Environment: TIDEPOOL_METRICS_SOURCE_URL_TEMPLATE (synthetic feed, see collector.UrlTemplateSource),
else TIDEPOOL_PROMETHEUS_URL (a Prometheus server's /federate), else the ready pods in the
operator's cache; TIDEPOOL_AUTOSCALE_INTERVAL, TIDEPOOL_AUTOSCALE_WINDOW (metrics window, 60 s),
TIDEPOOL_OPERATOR_METRICS_PORT (prometheus-client endpoint, default 9090; 0 disables).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import httpx
from prometheus_client import Counter, Gauge

from tidepool.operator.api import KIND
from tidepool.operator.cache import PodInfo

from .collector import Collector, MetricsSource, PodsSource, PrometheusSource, UrlTemplateSource
from .config import config_from_spec, declared_replicas, is_enabled, pool_names
from .forecast import Prediction
from .policy import decide
from .policy_types import Decision, History, PoolSnapshot, PoolState

DECISIONS = Counter("tidepool_autoscaler_decisions", "Autoscaler decisions", ["namespace", "name", "mode", "action"])
DESIRED = Gauge("tidepool_autoscaler_desired_replicas", "Replicas the autoscaler wants", ["namespace", "name", "pool"])
CURRENT = Gauge("tidepool_autoscaler_current_replicas", "Replicas when deciding", ["namespace", "name", "pool"])
READY = Gauge(
    "tidepool_autoscaler_ready_replicas", "Ready replicas when deciding (status.pools)", ["namespace", "name", "pool"]
)
PERSIST_S = 60.0
MAX_RECOMMENDATIONS = 64
logger = logging.getLogger("tidepool.operator.autoscaler")

Key = tuple[str, str]
EventSink = Callable[[Mapping[str, Any], str, str, str], Awaitable[None]]


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def is_autoscaled(body: Mapping[str, Any]) -> bool:
    """Tidepool's autoscaler ticks for this object: enabled, in active or advisory mode (never external)."""
    auto = (body.get("spec") or {}).get("autoscaling") or {}
    return bool(auto.get("enabled")) and auto.get("mode", "active") != "external"


def is_active(body: Mapping[str, Any]) -> bool:
    """Autoscaling enabled in active mode: its decisions set the replicas."""
    spec = body.get("spec") or {}
    return is_enabled(spec) and (spec.get("autoscaling") or {}).get("mode", "active") == "active"


def applied_replicas(body: Mapping[str, Any]) -> tuple[dict[str, int] | None, tuple[str, str] | None]:
    """(replicas per pool, ScalingLimited reason/message) the autoscaler decided, from status; None when off."""
    auto = (body.get("status") or {}).get("autoscaling") or {}
    if not is_active(body) or auto.get("mode") != "active":
        return None, None
    pools = pool_names(body.get("spec") or {})
    replicas = {p: int(v["desiredReplicas"]) for p, v in (auto.get("pools") or {}).items() if p in pools}
    limited = ("CapacityOrBounds", str(auto["limited"])[:1000]) if auto.get("limited") else None
    return (replicas or None), limited


def restore_history(auto: Mapping[str, Any], now: float) -> History:
    """The policy's state from status, times moved PERSIST_S later (never past now): see the module docstring."""

    def later(t: float | None) -> float | None:
        return None if t is None else min(t + PERSIST_S, now)

    recs = []
    for rec in auto.get("recommendations") or []:
        t = _epoch(rec.get("time"))
        if t is not None:
            recs.append((later(t), {k: int(v) for k, v in (rec.get("replicas") or {}).items()}))
    return History(
        recommendations=tuple(recs),
        last_scale_time=_epoch(auto.get("lastScaleTime")),
        last_active_time=later(_epoch(auto.get("lastActiveTime"))),
    )


def _recommendations(history: History) -> list[dict[str, Any]]:
    """Recent recommendations, an earlier one dropped when a later one is equal (it can never matter
    again: the later one stays in every window at least as long, for both min and max)."""
    out: list[tuple[float, dict[str, int]]] = []
    for t, replicas in history.recommendations:
        out = [(u, r) for u, r in out if r != dict(replicas)]
        out.append((t, dict(replicas)))
    return [{"time": _rfc3339(t), "replicas": r} for t, r in out[-MAX_RECOMMENDATIONS:]]


def autoscaling_status(
    decision: Decision, snapshots: Mapping[str, PoolSnapshot], previous: Mapping[str, Any], now: float
) -> dict[str, Any]:
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
            **_prediction_inputs(d.prediction),
        }
        pools[pool] = {"desiredReplicas": d.desired, "inputs": {k: v for k, v in inputs.items() if v is not None}}
    scaled = decision.is_scaling and not decision.is_advisory
    history = decision.history
    out = {
        "mode": "advisory" if decision.is_advisory else "active",
        "lastScaleTime": _rfc3339(now) if scaled else previous.get("lastScaleTime"),
        "lastDecision": decision.reason[:4096],
        "pools": pools,
        "limited": decision.limited_reason[:1024] if decision.is_limited else None,
        "lastActiveTime": _rfc3339(history.last_active_time) if history.last_active_time is not None else None,
        "recommendations": _recommendations(history),
    }
    return {k: v for k, v in out.items() if v is not None}


def _prediction_inputs(prediction: Prediction | None) -> dict[str, float | None]:
    """What anticipation based the decision on: forecast (tokens/s, `lookaheadSeconds` ahead), burst
    headroom, learned capacity per replica at the target and at the limit, and the replicas it asked for."""
    if prediction is None:
        return {}
    return {
        "forecastTokensPerSecond": round(prediction.forecast, 3),
        "lookaheadSeconds": round(prediction.lookahead_s, 1),
        "headroom": round(prediction.headroom, 4),
        "capacityTokensPerSecond": None if prediction.capacity is None else round(prediction.capacity, 3),
        "capacityLimitTokensPerSecond": (
            None if prediction.capacity_limit is None else round(prediction.capacity_limit, 3)
        ),
        "predictedReplicas": None if prediction.replicas is None else float(prediction.replicas),
    }


def _material(auto: Mapping[str, Any]) -> Any:
    """What must reach the cluster at once: the decision and the state, not the inputs, the reason's
    wording (its numbers move with every scrape) or the times of the state (refreshed every PERSIST_S)."""
    return (
        auto.get("mode"),
        auto.get("limited"),
        auto.get("lastScaleTime"),
        {p: v.get("desiredReplicas") for p, v in (auto.get("pools") or {}).items()},
        [r.get("replicas") for r in auto.get("recommendations") or []],
    )


def metrics_source(pods_of: Callable[[str, str], Sequence[PodInfo]], http: httpx.AsyncClient) -> MetricsSource:
    template = os.environ.get("TIDEPOOL_METRICS_SOURCE_URL_TEMPLATE")
    prometheus = os.environ.get("TIDEPOOL_PROMETHEUS_URL")
    if template:
        return UrlTemplateSource(template, http)
    if prometheus:
        return PrometheusSource(prometheus, http)
    return PodsSource(pods_of, http)


class Autoscaler:
    """Per-InferenceService ticks; `client` writes status, `pods_of` reads the pod cache, `event` posts."""

    def __init__(
        self,
        client: Any,
        pods_of: Callable[[str, str], Sequence[PodInfo]],
        event: EventSink,
        source: MetricsSource,
        interval_s: float | None = None,
        window_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client, self.pods_of, self.event = client, pods_of, event
        self.interval_s = interval_s or float(os.environ.get("TIDEPOOL_AUTOSCALE_INTERVAL", "15"))
        window = window_s or float(os.environ.get("TIDEPOOL_AUTOSCALE_WINDOW", "60"))
        self.collector = Collector(source, window)
        self.clock = clock
        self.histories: dict[Key, History] = {}
        self.next_tick: dict[Key, float] = {}
        self.written_at: dict[Key, float] = {}
        self.series: dict[Key, set[tuple[Any, tuple[str, ...]]]] = {}  # (metric, label values) set per key

    def forget(self, key: Key) -> None:
        """Drop what is kept in memory for `key`, and its metric series (a scrape must not see stale ones)."""
        for table in (self.histories, self.next_tick, self.written_at):
            table.pop(key, None)
        self.collector.forget(*key)
        self._drop_series(key)

    def _observe(self, key: Key, metric: Any, labels: tuple[str, ...]) -> Any:
        self.series.setdefault(key, set()).add((metric, labels))
        return metric.labels(*labels)

    def _drop_series(self, key: Key) -> None:
        for metric, labels in self.series.pop(key, set()):
            metric.remove(*labels)  # a no-op when already gone

    async def clear(self, key: Key, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """The autoscaler no longer ticks for `key` (disabled, or external mode): forget it, and remove the
        `status.autoscaling` an earlier mode left (it is no longer applied, and would mislead a reader or a
        KEDA scaler reading it). Returns the object as updated (or `body` when nothing was stale)."""
        self.forget(key)
        if not (body.get("status") or {}).get("autoscaling"):
            return body
        namespace, name = key
        version = (body.get("metadata") or {}).get("resourceVersion")
        logger.info("[%s/%s] autoscaler off: clearing status.autoscaling", namespace, name)
        updated = await self.client.patch_status(KIND, namespace, name, {"autoscaling": None}, version)
        return updated or body

    def seconds_until_due(self, key: Key) -> float:
        return max(self.next_tick.get(key, 0.0) - self.clock(), 0.0)

    def _current(self, key: Key, body: Mapping[str, Any], pools: Sequence[str]) -> dict[str, PoolState]:
        """Replicas in force per pool and stuck pods. Replicas: our own last decision when it acts (the
        reconcile applies it), else what the reconcile last drove towards, else the spec's declared replicas
        (the view's: spec.replicas wins for the scaled pool)."""
        declared = declared_replicas(body.get("spec") or {})
        recorded = (body.get("status") or {}).get("pools") or {}
        decided = applied_replicas(body)[0] or {}
        pods = self.pods_of(*key)
        states = {}
        for pool in pools:
            replicas = decided.get(pool, (recorded.get(pool) or {}).get("desiredReplicas"))
            if replicas is None:
                replicas = declared[pool]
            stuck = [
                msg for p in pods if p.pool == pool and not p.is_ready for r, msg in p.problems if r == "Unschedulable"
            ]
            ready = (recorded.get(pool) or {}).get("readyReplicas")
            states[pool] = PoolState(
                int(replicas), len(stuck), stuck[0] if stuck else "", int(ready) if ready is not None else None
            )
        return states

    async def tick(self, key: Key, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """One decision; returns the object as updated by the status write (or `body` when nothing was written)."""
        namespace, name = key
        now = self.clock()
        self.next_tick[key] = now + self.interval_s
        if not is_autoscaled(body):  # external mode (or off): HPA/KEDA own the replicas; never scrape
            return body
        spec = dict(body.get("spec") or {})
        pools = pool_names(spec)
        written = (body.get("status") or {}).get("autoscaling") or {}
        previous = written
        if written.get("mode") and written["mode"] != (spec.get("autoscaling") or {}).get("mode", "active"):
            # active <-> advisory: the other mode's decisions, stabilization state and series are stale.
            logger.info("[%s/%s] autoscaling mode changed from %s: starting afresh", namespace, name, written["mode"])
            self.histories.pop(key, None)
            self._drop_series(key)
            previous = {}
        history = self.histories.get(key) or restore_history(previous, now)
        await self.collector.collect(namespace, name, pools, now)
        snapshots = self.collector.snapshots(namespace, name, pools)
        states = self._current(key, body, pools)
        decision = decide(config_from_spec(spec), snapshots, states, history, now)
        self.histories[key] = decision.history
        mode = "advisory" if decision.is_advisory else "active"
        for pool, d in decision.pools.items():
            self._observe(key, DESIRED, (namespace, name, pool)).set(d.desired)
            self._observe(key, CURRENT, (namespace, name, pool)).set(d.current)
            self._observe(key, READY, (namespace, name, pool)).set(states[pool].num_ready or 0)
        action = "scale" if decision.is_scaling else "hold"
        self._observe(key, DECISIONS, (namespace, name, mode, action)).inc()
        if decision.is_scaling:
            reason = "AdvisoryScale" if decision.is_advisory else "Scaled"
            logger.info("[%s/%s] %s: %s", namespace, name, reason, decision.reason)
            await self.event(body, "Normal", reason, decision.reason[:1000])
        new = autoscaling_status(decision, snapshots, previous, now)
        stale = now - self.written_at.get(key, float("-inf")) >= PERSIST_S
        if _material(new) == _material(written) and not stale:
            return body
        auto_patch: dict[str, Any] = {**{k: None for k in written if k not in new}, **new}
        gone = {p: None for p in written.get("pools") or {} if p not in new["pools"]}
        if gone:  # a merge patch keeps map keys it does not mention
            auto_patch["pools"] = {**new["pools"], **gone}
        patch = {"autoscaling": auto_patch}
        updated = await self.client.patch_status(
            KIND, namespace, name, patch, (body.get("metadata") or {}).get("resourceVersion")
        )
        self.written_at[key] = now
        return updated or body
