"""Actuation: the autoscaler's step for one InferenceService, run by the controller under its key.

Every `TIDEPOOL_AUTOSCALE_INTERVAL` seconds (default 15) for each InferenceService with
`autoscaling.enabled`, the controller's worker for that object (so never concurrently with its
reconcile) calls `Autoscaler.tick` with the sync's one parsed spec (`ServiceView`) and the service's
`AutoscaleState` (what is kept in memory for it: policy history, next tick, last write, metric series
and windows; it lives in the controller's per-service state and goes with it): scrape the pools
(collector), read current replicas and unschedulable pods (the pod cache), run `policy.decide`, then
write `status.autoscaling`:
mode, lastScaleTime, lastDecision, per-pool desiredReplicas and inputs, `limited`, and the policy's
stabilization state (recent recommendations, lastActiveTime). In active mode the reconcile that
follows applies `status.autoscaling.pools[*].desiredReplicas` (`applied_replicas(view, status)`); in advisory
mode nothing but status, an Event and the metrics change. With autoscaling disabled, or in external mode,
the autoscaler never ticks (no scrape, no decision, no replicas): the spec's replicas apply and HPA/KEDA
drive the scale subresource (`spec.replicas`, the scaled pool's); `clear` removes what an earlier mode
left in `status.autoscaling` and the service's metric series. A switch between active and advisory
starts afresh: the other mode's stabilization state, lastScaleTime and metric series are dropped.
With `autoscaling.idle: sleep` the decision's sleep state is then carried out on the serving engine pods
(sleep.py: `POST /sleep` / `/wake_up`, an Event on change) and kept in `status.autoscaling.asleepSince`.

Durability: everything the policy decided lives in the cluster, so a restarted (or newly elected)
operator resumes from it without scaling anything down: replicas come from status, and so does the
stabilization state. Quiet at scale: status is written only when the decision or the state changes
materially (`_material`: mode, desired replicas, limits, lastScaleTime, the newest raw recommendation,
whether the deciding tick saw requests), never to refresh times; the inputs and the reason's wording
in status are those of the last write. That is enough to restore from, because the newest
recommendation holds until a different one is made (a different one is a write) and so does
activity (a tick that sees none after one that did is a write): `restore_history` takes the newest
recommendation as made now, and lastActiveTime as now when the write's tick saw requests; every
other time is exact (it was written when it stopped moving). Recommendations that age out of the
windows need no write: restored, they age out by their times. A restart can thus delay a
scale-down by at most its windows, never hasten one. Only the metrics windows live in memory
(losing them costs one window; incomplete data never scales down). Every write carries the
resourceVersion it was computed from.

Events: `Scaled` (active) and `AdvisoryScale` (advisory) are posted when the decision scales and its
desired replicas differ from those status held, i.e. on change, never per tick; AdvisoryScale is one
aggregated Event per service (`DECISION_EVENT_KEY`, see operator/events.py), updated in place; Scaled is one
per transition (its message's "<pool> <from>-><to>"), so what was done stays in the history.

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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from prometheus_client import Counter, Gauge

from tidepool.operator.api import KIND, ServiceView
from tidepool.operator.cache import Key, PodInfo
from tidepool.operator.pod_problems import SCHEDULING_REASONS

from .collector import Collector, MetricsSource, PodsSource, PrometheusSource, UrlTemplateSource, snapshots
from .config import config_from_view
from .forecast import Prediction
from .policy import decide
from .policy_types import Decision, History, PoolSnapshot, PoolState
from .sleep import SleepApi, Sleeper, SleepMemory, serving_pods
from .window import PoolWindow

DECISIONS = Counter("tidepool_autoscaler_decisions", "Autoscaler decisions", ["namespace", "name", "mode", "action"])
DESIRED = Gauge("tidepool_autoscaler_desired_replicas", "Replicas the autoscaler wants", ["namespace", "name", "pool"])
CURRENT = Gauge("tidepool_autoscaler_current_replicas", "Replicas when deciding", ["namespace", "name", "pool"])
READY = Gauge(
    "tidepool_autoscaler_ready_replicas", "Ready replicas when deciding (status.pools)", ["namespace", "name", "pool"]
)
MAX_RECOMMENDATIONS = 64
# AdvisoryScale Events group under this key: one per service, updated in place (Scaled: one per transition).
DECISION_EVENT_KEY = "decision"
logger = logging.getLogger("tidepool.operator.autoscaler")

Series = tuple[Any, tuple[str, ...]]  # (metric, label values)
EventSink = Callable[[Mapping[str, Any], str, str, str, str | None], Awaitable[None]]  # obj, type, reason, msg, key


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def applied_replicas(
    view: ServiceView, status: Mapping[str, Any]
) -> tuple[dict[str, int] | None, tuple[str, str] | None]:
    """(replicas per pool, ScalingLimited reason/message) the autoscaler decided, from `status` (the object's);
    None unless the spec autoscales in active mode and status holds an active decision."""
    auto = status.get("autoscaling") or {}
    if not view.is_autoscaled or view.autoscaling.mode != "active" or auto.get("mode") != "active":
        return None, None
    replicas = {p: int(v["desiredReplicas"]) for p, v in (auto.get("pools") or {}).items() if p in view.pools}
    limited = ("CapacityOrBounds", str(auto["limited"])[:1000]) if auto.get("limited") else None
    return (replicas or None), limited


def restore_history(auto: Mapping[str, Any], now: float) -> History:
    """The policy's state from status (see the module docstring): every recommendation at its recorded time but
    the newest, which still holds (as made `now`); lastActiveTime `now` when the writing tick saw requests."""
    recs = []
    for rec in auto.get("recommendations") or []:
        t = _epoch(rec.get("time"))
        if t is not None:
            recs.append((min(t, now), {k: int(v) for k, v in (rec.get("replicas") or {}).items()}))
    if recs:
        recs[-1] = (now, recs[-1][1])
    last_active = _epoch(auto.get("lastActiveTime"))
    return History(
        recommendations=tuple(recs),
        last_scale_time=_epoch(auto.get("lastScaleTime")),
        last_active_time=now if _was_active(auto) else (None if last_active is None else min(last_active, now)),
        asleep_since=_epoch(auto.get("asleepSince")),
    )


def _was_active(auto: Mapping[str, Any]) -> bool:
    """Whether the tick that wrote `auto` saw requests: lastActiveTime is that tick's time, which is also the
    time of the newest recommendation (every tick adds one, an equal earlier one dropped)."""
    recs = auto.get("recommendations") or []
    active, decided = _epoch(auto.get("lastActiveTime")), _epoch(recs[-1].get("time")) if recs else None
    return active is not None and decided is not None and active >= decided


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
        "asleepSince": _rfc3339(history.asleep_since) if decision.is_asleep and history.asleep_since else None,
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
    """What a status write is for: the decision and what restoring the state needs (module docstring), not
    the inputs, the reason's wording (its numbers move with every scrape) or times that only move."""
    recs = auto.get("recommendations") or []
    return (
        auto.get("mode"),
        auto.get("limited"),
        auto.get("lastScaleTime"),
        {p: v.get("desiredReplicas") for p, v in (auto.get("pools") or {}).items()},
        recs[-1].get("replicas") if recs else None,
        _was_active(auto),
        auto.get("asleepSince"),
    )


def metrics_source(pods_of: Callable[[str, str], Sequence[PodInfo]], http: httpx.AsyncClient) -> MetricsSource:
    template = os.environ.get("TIDEPOOL_METRICS_SOURCE_URL_TEMPLATE")
    prometheus = os.environ.get("TIDEPOOL_PROMETHEUS_URL")
    if template:
        return UrlTemplateSource(template, http)
    if prometheus:
        return PrometheusSource(prometheus, http)
    return PodsSource(pods_of, http)


@dataclass(slots=True)
class AutoscaleState:
    """What the autoscaler keeps in memory for one InferenceService (a part of its `ServiceState`)."""

    history: History | None = None  # the policy's state; None: read back from status at the next tick
    next_tick: float = 0.0  # when the next decision is due (the autoscaler's clock)
    series: set[Series] = field(default_factory=set)  # the metric series labelled with this service
    windows: dict[str, PoolWindow] = field(default_factory=dict)  # per pool, the metrics of the last window
    sleep: SleepMemory = field(default_factory=SleepMemory)  # autoscaling.idle sleep: pods a wake missed (sleep.py)

    def drop_series(self) -> None:
        for metric, labels in self.series:
            metric.remove(*labels)  # a no-op when already gone
        self.series.clear()

    def reset(self) -> None:
        """Forget everything, its metric series included (a scrape must not see stale ones)."""
        self.drop_series()
        self.history, self.next_tick = None, 0.0
        self.windows.clear()
        self.sleep.reset()


class Autoscaler:
    """Per-InferenceService ticks; `client` writes status, `pods_of` reads the pod cache, `event` posts.
    What it remembers of a service lives in that service's `AutoscaleState`, passed in."""

    def __init__(
        self,
        client: Any,
        pods_of: Callable[[str, str], Sequence[PodInfo]],
        event: EventSink,
        source: MetricsSource,
        interval_s: float | None = None,
        window_s: float | None = None,
        clock: Callable[[], float] = time.time,
        sleep_api: SleepApi | None = None,
    ) -> None:
        self.client, self.pods_of, self.event = client, pods_of, event
        self.sleeper = Sleeper(sleep_api, event)  # autoscaling.idle sleep: engines put to sleep and woken (sleep.py)
        self.interval_s = interval_s or float(os.environ.get("TIDEPOOL_AUTOSCALE_INTERVAL", "15"))
        window = window_s or float(os.environ.get("TIDEPOOL_AUTOSCALE_WINDOW", "60"))
        self.collector = Collector(source, window)
        self.clock = clock

    async def clear(self, key: Key, body: Mapping[str, Any], state: AutoscaleState) -> Mapping[str, Any]:
        """The autoscaler no longer ticks for `key` (disabled, or external mode): forget it, and remove the
        `status.autoscaling` an earlier mode left (it is no longer applied, and would mislead a reader or a
        KEDA scaler reading it). Returns the object as updated (or `body` when nothing was stale)."""
        state.reset()
        if not (body.get("status") or {}).get("autoscaling"):
            return body
        namespace, name = key
        version = (body.get("metadata") or {}).get("resourceVersion")
        logger.info("[%s/%s] autoscaler off: clearing status.autoscaling", namespace, name)
        updated = await self.client.patch_status(KIND, namespace, name, {"autoscaling": None}, version)
        return updated or body

    def seconds_until_due(self, state: AutoscaleState) -> float:
        return max(state.next_tick - self.clock(), 0.0)

    def _current(self, key: Key, view: ServiceView, body: Mapping[str, Any]) -> dict[str, PoolState]:
        """Replicas in force per pool and stuck pods. Replicas: our own last decision when it acts (the
        reconcile applies it), else what the reconcile last drove towards, else the spec's declared replicas
        (the view's: spec.replicas wins for the scaled pool)."""
        status = body.get("status") or {}
        recorded = status.get("pools") or {}
        decided = applied_replicas(view, status)[0] or {}
        pods = self.pods_of(*key)
        states = {}
        for pool in view.pool_names:
            replicas = decided.get(pool, (recorded.get(pool) or {}).get("desiredReplicas"))
            if replicas is None:
                replicas = view.declared_replicas[pool]
            stuck = [
                msg
                for p in pods
                if p.pool == pool and not p.is_ready
                for r, msg in p.problems
                if r in SCHEDULING_REASONS
            ]
            ready = (recorded.get(pool) or {}).get("readyReplicas")
            states[pool] = PoolState(
                int(replicas), len(stuck), stuck[0] if stuck else "", int(ready) if ready is not None else None
            )
        return states

    async def tick(
        self, key: Key, view: ServiceView, body: Mapping[str, Any], state: AutoscaleState, api_key: str | None = None
    ) -> Mapping[str, Any]:
        """One decision; returns the object as updated by the status write (or `body` when nothing was written).
        `api_key`: what the sleep calls send to pods of a service with spec.auth."""
        namespace, name = key
        now = self.clock()
        state.next_tick = now + self.interval_s
        if not view.is_autoscaled:  # external mode (or off): HPA/KEDA own the replicas; never scrape
            return body
        pools = view.pool_names
        written = (body.get("status") or {}).get("autoscaling") or {}
        previous = written
        if written.get("mode") and written["mode"] != view.autoscaling.mode:
            # active <-> advisory: the other mode's decisions, stabilization state and series are stale.
            logger.info("[%s/%s] autoscaling mode changed from %s: starting afresh", namespace, name, written["mode"])
            state.history = None
            state.drop_series()
            previous = {}
        history = state.history or restore_history(previous, now)
        await self.collector.collect(state.windows, namespace, name, pools, now)
        snaps = snapshots(state.windows, pools)
        current = self._current(key, view, body)
        decision = decide(config_from_view(view), snaps, current, history, now)
        state.history = decision.history
        told = {p: v.get("desiredReplicas") for p, v in (previous.get("pools") or {}).items()}
        await self._report(key, body, state, decision, current, is_news=decision.desired != told)
        serving = serving_pods(self.pods_of(*key), pools)
        await self.sleeper.step(body, decision, bool(written.get("asleepSince")), serving, state.sleep, api_key)
        new = autoscaling_status(decision, snaps, previous, now)
        if _material(new) == _material(written):
            return body
        auto_patch: dict[str, Any] = {**{k: None for k in written if k not in new}, **new}
        gone = {p: None for p in written.get("pools") or {} if p not in new["pools"]}
        if gone:  # a merge patch keeps map keys it does not mention
            auto_patch["pools"] = {**new["pools"], **gone}
        version = (body.get("metadata") or {}).get("resourceVersion")
        updated = await self.client.patch_status(KIND, namespace, name, {"autoscaling": auto_patch}, version)
        return updated or body

    async def _report(
        self,
        key: Key,
        body: Mapping[str, Any],
        state: AutoscaleState,
        decision: Decision,
        current: Mapping[str, PoolState],
        is_news: bool,
    ) -> None:
        """The decision's metric series (remembered in `state`, to be dropped with it) and, when it scales to
        replicas status did not hold already (`is_news`), an Event."""
        namespace, name = key

        def observe(metric: Any, *labels: str) -> Any:
            state.series.add((metric, labels))
            return metric.labels(*labels)

        mode = "advisory" if decision.is_advisory else "active"
        for pool, d in decision.pools.items():
            observe(DESIRED, namespace, name, pool).set(d.desired)
            observe(CURRENT, namespace, name, pool).set(d.current)
            observe(READY, namespace, name, pool).set(current[pool].num_ready or 0)
        observe(DECISIONS, namespace, name, mode, "scale" if decision.is_scaling else "hold").inc()
        if decision.is_scaling and is_news:
            reason = "AdvisoryScale" if decision.is_advisory else "Scaled"
            logger.info("[%s/%s] %s: %s", namespace, name, reason, decision.reason)
            # Advisory: one Event per service, updated in place (nothing acts on it, so only the latest matters).
            # Active: one per transition ("unified 1->2"), as the HPA's per-size events: the history of what was
            # done stays readable, and flapping between the same sizes counts up instead of adding objects.
            key = DECISION_EVENT_KEY if decision.is_advisory else decision.reason.split(":", 1)[0]
            await self.event(body, "Normal", reason, decision.reason[:1000], key)
