"""The autoscaling policy: (config, per-pool snapshots, current replicas, history, now) -> Decision.

Pure: no client, no clock (`now` is an argument), no I/O; the operator and the simulator
(bench/autoscale_sim.py) call the same function.

How a pool's replicas are chosen, in order:
1. Load ratio = the largest of its signals over their targets. Prefill: TTFT p95 / SLO (capped
   at LATENCY_RATIO_CAP) and (waiting + in-prefill requests) per replica vs queueDepthTarget,
   compared as utilizations (queue depth L -> L / (1 + L), so the ratio is proportional to load). Decode: ITL p95 / SLO,
   KV-cache usage / kvCacheTarget, waiting per replica / queueDepthTarget, and preemptions
   (any preemption reads as over target). Unified: all of them (the stricter pool wins).
   Recommendation = ceil(ratio x measured replicas), never below current when ratio > 1.
   Within the tolerance band |ratio - 1| <= tolerance nothing changes. Scale-down uses the
   utilization signals only, and only while every latency p95 is below
   `down_latency_headroom` x its SLO (latency is not proportional to load near saturation).
   Anticipation (`config.is_predictive`, anticipate.py / forecast.py / capacity.py): once a pool's
   per-replica capacity is learned, the replicas for its demand forecast one start-up ahead (with
   burst headroom) join in: they raise any recommendation, and replace it when the pool may shrink
   (never while latency is near the SLO or data is incomplete).
2. Stabilization as in the Kubernetes HPA: up = min of the recommendations of the last
   `up_seconds`, down = max of those of the last `down_seconds` (fast up, slow down).
3. Step bound: at most `max_step_percent` of current per decision (up: at least
   `min_step_replicas`), then [minReplicas, maxReplicas].
4. Capacity: a pool with unschedulable pending pods does not grow (ScalingLimited).
5. Missing data: a pool whose ready pods did not all answer never shrinks.
6. prefill:decode ratio kept within [pd_ratio_min, pd_ratio_max] by growing the smaller
   side (or, when it cannot grow, trimming the other side's growth, never past the band's other edge).
7. Zero: only after `idle_seconds` without any request (complete data) does every pool go to 0
   (utilization never takes a running pool below 1, even with minReplicas 0); from 0, a pool
   whose router holds requests goes to max(minReplicas, 1), and so do the others.
8. Sleep (`autoscaling.idle: sleep`, idle.py): where step 7 would go to zero, the replicas stay and the
   decision says the engines sleep (`is_asleep`); a request the router holds wakes them.
9. Advisory: the decision is reported, `replicas` stays the current replicas (and nothing sleeps or wakes).

Invariants (property-tested in tests/autoscaler): desired within [min, max] (or 0 when scaled to
zero); monotone in load; a constant load settles without flapping; ratio bounds held when
feasible; missing data never shrinks a pool; advisory never acts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .anticipate import after_decision, anticipate, combine, describe, queue_utilization
from .idle import SleepStep, sleep_step
from .policy_types import (
    DECODE,
    PREFILL,
    UNIFIED,
    AutoscaleConfig,
    Decision,
    History,
    PoolDecision,
    PoolSnapshot,
    PoolState,
)

_EPS = 1e-9
# Latency grows without bound near saturation (and while a backlog drains), so a latency ratio of 10
# does not mean 10x the replicas; each decision grows a pool at most this much on latency alone.
LATENCY_RATIO_CAP = 2.0


@dataclass(frozen=True, slots=True)
class _Evaluation:
    recommendation: int
    ratio: float | None
    signal: str
    is_complete: bool
    may_shrink: bool = False  # complete data, latency well below the SLO, a utilization signal: may go down


def decide(
    config: AutoscaleConfig,
    snapshots: Mapping[str, PoolSnapshot],
    current: Mapping[str, PoolState],
    history: History | None,
    now: float,
) -> Decision:
    pool_names = list(config.pools)
    if set(pool_names) not in ({UNIFIED}, {PREFILL, DECODE}):
        raise ValueError(f"pools must be 'unified' or 'prefill' and 'decode', got {pool_names}")
    missing = [name for name in pool_names if name not in current]
    if missing:
        raise ValueError(f"no current replicas given for pool(s) {missing}")
    history = history or History()
    snaps = {name: snapshots.get(name) or PoolSnapshot() for name in pool_names}
    evals = {name: _evaluate(name, config, snaps[name], current[name]) for name in pool_names}
    anticipated = {
        name: anticipate(
            name, config, snaps[name], current[name], evals[name].is_complete, history.forecasts.get(name), now
        )
        for name in pool_names
    }
    predictions = {name: a[1] if config.is_predictive else None for name, a in anticipated.items()}

    horizon = max(config.up_seconds, config.down_seconds)
    raw = {
        name: combine(e.recommendation, e.may_shrink, current[name].replicas, predictions[name], config)
        for name, e in evals.items()
    }
    kept = tuple((t, r) for t, r in history.recommendations if t > now - horizon - _EPS)
    recs = (*kept, (now, raw))

    desired: dict[str, int] = {}
    limited: dict[str, str] = {}
    for name in pool_names:
        stabilized = _stabilize(name, current[name].replicas, recs, now, config)
        desired[name], note = _bounded(name, stabilized, config, current[name], evals[name].is_complete)
        if note:
            limited[name] = note

    last_active = history.last_active_time if history.last_active_time is not None else now
    if any(_is_active(s) for s in snaps.values()):
        last_active = now
    zero_note = _zero(desired, config, current, snaps, evals, last_active, now)
    sleep = _sleep(config, history, current, snaps, evals, now - last_active, now)
    zero_note = "; ".join(x for x in (zero_note, sleep.note) if x)

    # After the zero rules: waking both pools from zero must respect (or report) the ratio too.
    if PREFILL in desired:
        ratio_note = _guard_ratio(desired, config, current, evals)
        if ratio_note:
            limited[PREFILL] = "; ".join(x for x in (limited.get(PREFILL), ratio_note) if x)

    pools = {
        name: PoolDecision(
            current=current[name].replicas,
            desired=desired[name],
            recommendation=raw[name],
            load_ratio=evals[name].ratio,
            signal=evals[name].signal,
            is_limited=name in limited,
            limited_reason=limited.get(name, ""),
            has_complete_data=evals[name].is_complete,
            prediction=predictions[name],
        )
        for name in pool_names
    }
    is_scaling = any(p.desired != p.current for p in pools.values())
    applied = {name: (p.current if config.is_advisory else p.desired) for name, p in pools.items()}
    next_history = History(
        recommendations=recs,
        last_scale_time=now if is_scaling and not config.is_advisory else history.last_scale_time,
        last_active_time=last_active,
        forecasts={name: after_decision(a[0], current[name], applied[name]) for name, a in anticipated.items()},
        asleep_since=history.asleep_since if config.is_advisory else sleep.asleep_since,
    )
    reason = _reason(pools, zero_note, config.is_advisory and (is_scaling or sleep.change is not None))
    is_asleep, change = next_history.asleep_since is not None, None if config.is_advisory else sleep.change
    return Decision(pools, applied, config.is_advisory, reason, next_history, is_asleep, change, sleep.note)


def _bounded(name: str, value: int, config: AutoscaleConfig, state: PoolState, is_complete: bool) -> tuple[int, str]:
    """A pool's stabilized recommendation within the step bound, [min, max], capacity and missing data (steps
    3-5 of the docstring); with why it was limited ("" when it was not)."""
    bounds, cur = config.pools[name], state.replicas
    note = ""
    up_step = max(math.ceil(cur * config.max_step_percent / 100 - _EPS), config.min_step_replicas, 1)
    down_step = max(math.floor(cur * config.max_step_percent / 100 + _EPS), 1)
    value = min(max(value, cur - down_step), cur + up_step)
    if value > bounds.max_replicas:
        note = f"load wants {value} replicas; capped at maxReplicas {bounds.max_replicas}"
    # Only the idle rule (step 7) takes a running pool to zero, even when minReplicas is 0.
    floor = max(bounds.min_replicas, 1) if cur > 0 else bounds.min_replicas
    value = min(max(value, floor), bounds.max_replicas)
    if state.num_unschedulable > 0:
        detail = f": {state.unschedulable_message}" if state.unschedulable_message else ""
        note = f"{state.num_unschedulable} pod(s) unschedulable{detail}; not scaling up"
        value = min(value, max(cur, bounds.min_replicas))
    if not is_complete and cur <= bounds.max_replicas:
        value = max(value, cur)
    return value, note


def _reason(pools: Mapping[str, PoolDecision], zero_note: str, is_advisory_scale: bool) -> str:
    reason = "; ".join(_describe(name, p) for name, p in pools.items())
    if zero_note:
        reason = f"{zero_note}; {reason}"
    if is_advisory_scale:
        reason = f"advisory (not applied): {reason}"
    return reason


def _evaluate(name: str, config: AutoscaleConfig, snap: PoolSnapshot, state: PoolState) -> _Evaluation:
    """The raw recommendation for one pool from its own signals (steps 1 and 5 of the docstring)."""
    cur = state.replicas
    measured = snap.num_pods_scraped
    expected = max(cur - state.num_unschedulable, 0)
    is_complete = snap.num_pods_failed == 0 and measured >= expected and snap.num_requests is not None
    if measured == 0:
        return _Evaluation(cur, None, "no pods measured", is_complete and cur == 0)

    serves_prefill = name in (PREFILL, UNIFIED)
    serves_decode = name in (DECODE, UNIFIED)
    latency: list[tuple[float, str]] = []
    if serves_prefill and config.ttft_p95_s and snap.ttft_p95_s is not None:
        latency.append(
            (snap.ttft_p95_s / config.ttft_p95_s, f"ttft_p95 {snap.ttft_p95_s:.3f}s / slo {config.ttft_p95_s:.3f}s")
        )
    if serves_decode and config.itl_p95_s and snap.itl_p95_s is not None:
        latency.append(
            (snap.itl_p95_s / config.itl_p95_s, f"itl_p95 {snap.itl_p95_s:.3f}s / slo {config.itl_p95_s:.3f}s")
        )
    utilization: list[tuple[float, str]] = []
    if serves_decode and snap.kv_cache_usage is not None:
        label = f"kv_cache {snap.kv_cache_usage:.2f} / {config.kv_cache_target:.2f}"
        utilization.append((snap.kv_cache_usage / config.kv_cache_target, label))
    if snap.num_waiting is not None:
        queued = snap.num_waiting + ((snap.num_running or 0.0) if name == PREFILL else 0.0)
        per_replica = queued / measured
        label = f"queue {per_replica:.1f}/replica / {config.queue_depth_target:g}"
        utilization.append((queue_utilization(per_replica) / queue_utilization(config.queue_depth_target), label))
    if serves_decode and snap.preemptions_per_s:
        rate = snap.preemptions_per_s / measured
        utilization.append((1 + 2 * config.tolerance + min(rate, 1.0), f"preemptions {rate:.2f}/s/replica"))

    latency = [(min(r, LATENCY_RATIO_CAP), text) for r, text in latency]
    signals = latency + utilization
    if not signals:
        return _Evaluation(cur, None, "no signals", is_complete)
    ratio, signal = max(signals, key=lambda s: s[0])
    if ratio > 1 + config.tolerance:
        return _Evaluation(max(cur, math.ceil(ratio * measured - _EPS)), ratio, signal, is_complete)
    near_slo = any(r > config.down_latency_headroom for r, _ in latency)
    if not is_complete or near_slo or not utilization:
        return _Evaluation(cur, ratio, signal, is_complete)
    down_ratio, down_signal = max(utilization, key=lambda s: s[0])
    if down_ratio < 1 - config.tolerance:
        return _Evaluation(min(cur, math.ceil(down_ratio * expected - _EPS)), down_ratio, down_signal, True, True)
    return _Evaluation(cur, ratio, signal, is_complete, True)


def _stabilize(
    name: str, cur: int, recs: tuple[tuple[float, Mapping[str, int]], ...], now: float, config: AutoscaleConfig
) -> int:
    """HPA-style: move up to the lowest recent recommendation, down to the highest recent one."""
    up_window = [r[name] for t, r in recs if t >= now - config.up_seconds - _EPS and name in r]
    down_window = [r[name] for t, r in recs if t >= now - config.down_seconds - _EPS and name in r]
    up_rec, down_rec = min(up_window), max(down_window)
    if cur < up_rec:
        return up_rec
    if cur > down_rec:
        return down_rec
    return cur


def _guard_ratio(
    desired: dict[str, int], config: AutoscaleConfig, current: Mapping[str, PoolState], evals: Mapping[str, _Evaluation]
) -> str:
    """Keep prefill/decode within [pd_ratio_min, pd_ratio_max]; returns a note when it cannot."""
    lo, hi = config.pd_ratio_min, config.pd_ratio_max
    p, d = desired[PREFILL], desired[DECODE]
    if p == 0 or d == 0:
        return ""

    def cap(name: str) -> int:
        grows = current[name].num_unschedulable == 0
        return config.pools[name].max_replicas if grows else max(desired[name], current[name].replicas)

    def floor(name: str) -> int:
        keep = current[name].replicas if not evals[name].is_complete else 0
        return max(config.pools[name].min_replicas, min(keep, desired[name]), 1)

    # Trimming one side's growth stops at the band's other edge: where no integer pair fits the band
    # (e.g. 7 prefill at exactly 0.75), trimming past it would swap one violation for the other and make
    # the decision depend on which side grew (more load could then mean fewer replicas).
    if p > hi * d + _EPS:
        d = max(d, min(math.ceil(p / hi - _EPS), cap(DECODE)))
        if p > hi * d + _EPS:
            p = max(math.floor(hi * d + _EPS), floor(PREFILL), min(p, math.ceil(lo * d - _EPS)))
    elif p < lo * d - _EPS:
        p = max(p, min(math.ceil(lo * d - _EPS), cap(PREFILL)))
        if p < lo * d - _EPS:
            d = max(math.floor(p / lo + _EPS), floor(DECODE), min(d, math.ceil(p / hi - _EPS)))
    desired[PREFILL], desired[DECODE] = p, d
    if p > hi * d + _EPS or p < lo * d - _EPS:
        return f"prefill:decode {p}:{d} outside [{lo:g}, {hi:g}] (pool limits)"
    return ""


def _is_active(snap: PoolSnapshot) -> bool:
    return bool(snap.num_requests or snap.num_running or snap.num_waiting or snap.held_requests)


def _zero(
    desired: dict[str, int],
    config: AutoscaleConfig,
    current: Mapping[str, PoolState],
    snaps: Mapping[str, PoolSnapshot],
    evals: Mapping[str, _Evaluation],
    last_active: float,
    now: float,
) -> str:
    """Scale to zero when idle long enough; wake every pool when the router holds requests."""
    is_held = any(s.held_requests > 0 for s in snaps.values())
    at_zero = any(state.replicas == 0 for state in current.values())
    if is_held and at_zero:
        for name in desired:
            desired[name] = max(desired[name], config.pools[name].min_replicas, 1)
        return "router holds requests: scaling up from zero"
    if not config.scale_to_zero:
        return ""
    if all(state.replicas == 0 for state in current.values()):
        for name in desired:
            desired[name] = 0
        return "scaled to zero (idle)"
    idle_for = now - last_active
    if idle_for >= config.idle_seconds and all(e.is_complete for e in evals.values()):
        for name in desired:
            desired[name] = 0
        return f"no requests for {idle_for:.0f}s >= idleSeconds {config.idle_seconds:g}: scaling to zero"
    return ""


def _sleep(
    config: AutoscaleConfig,
    history: History,
    current: Mapping[str, PoolState],
    snaps: Mapping[str, PoolSnapshot],
    evals: Mapping[str, _Evaluation],
    idle_for: float,
    now: float,
) -> SleepStep:
    """`autoscaling.idle: sleep` (idle.py): the pools' sleep state after this decision."""
    return sleep_step(
        history.asleep_since,
        is_enabled=config.sleep_when_idle,
        is_held=any(s.held_requests > 0 for s in snaps.values()),
        idle_for=idle_for,
        idle_seconds=config.idle_seconds,
        is_complete=all(e.is_complete for e in evals.values()),
        has_replicas=any(state.replicas > 0 for state in current.values()),
        now=now,
    )


def _describe(name: str, pool: PoolDecision) -> str:
    move = f"{pool.current}->{pool.desired}" if pool.desired != pool.current else f"{pool.current}"
    ratio = f" (ratio {pool.load_ratio:.2f})" if pool.load_ratio is not None else ""
    text = f"{name} {move}: {pool.signal}{ratio}"
    if pool.prediction is not None:
        text += f"; {describe(pool.prediction)}"
    if not pool.has_complete_data:
        text += ", incomplete data: no scale-down"
    if pool.is_limited:
        text += f", limited: {pool.limited_reason}"
    return text
