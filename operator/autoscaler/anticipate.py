"""The policy's glue to forecast.py and capacity.py: a pool's snapshot -> demand channels -> one prediction.

Pure (no clock, no I/O). `anticipate` turns a pool's snapshot into the loads of its channels
(prefill: prompt tokens/s through a queue; decode: generated tokens/s in a batch), updates them, and
returns the largest channel's prediction; `combine` merges that prediction with the reactive
recommendation; `after_decision` times the start-up of any scale-up the decision made.

Invariants:
- Only data complete for the pods that serve teaches anything: every ready pod scraped, none failed
  (pods still starting have no metrics yet and do not make a window incomplete here, unlike for the
  reactive rules, which must not shrink a pool while they start).
- `combine` never lets anticipation shrink a pool the reactive rules hold (latency near the SLO,
  incomplete data), and never lowers a reactive scale-up; it may shrink a pool whose utilization
  allows it down to the prediction (which includes the forecast, headroom and learned capacity).
"""

from __future__ import annotations

from .capacity import Load
from .forecast import Channel, PoolForecast, Prediction, note_scale_up, observe_startup, predict, update
from .policy_types import DECODE, PREFILL, UNIFIED, AutoscaleConfig, PoolSnapshot, PoolState

_EPS = 1e-9


def queue_utilization(depth: float) -> float:
    """Requests in flight per replica -> utilization, inverting L = rho / (1 - rho) (M/M/1).

    Queue depth is not proportional to load (it explodes near saturation); utilization is, so
    ratios of utilizations give replica counts that neither overshoot on the way down nor
    compound a transient backlog on the way up (the ratio is bounded by (1 + target) / target).
    """
    return depth / (1.0 + depth)


def loads(name: str, config: AutoscaleConfig, snap: PoolSnapshot) -> dict[str, Load]:
    """The pool's channel measurements (empty when the snapshot has no window or no measured pod).

    Demand is throughput (tokens/s served), not backlog: a backlog is the reactive rules' to clear,
    and the capacity models learn only from unsaturated points. Latency limits are the SLO times
    `down_latency_headroom`, the level below which the reactive rules allow a pool to shrink, so the
    planned operating point and the reactive rules agree.
    """
    measured = snap.num_pods_scraped
    if measured <= 0 or snap.window_s <= 0 or snap.num_requests is None:
        return {}
    out: dict[str, Load] = {}
    waiting = snap.num_waiting or 0.0
    if name in (PREFILL, UNIFIED):
        rate = snap.prompt_tokens_per_s if snap.prompt_tokens_per_s is not None else snap.num_requests / snap.window_s
        queued = waiting + ((snap.num_running or 0.0) if name == PREFILL else 0.0)
        rho = queue_utilization(queued / measured) if snap.num_waiting is not None else None
        target = queue_utilization(config.queue_depth_target)
        ttft_limit = config.ttft_p95_s * config.down_latency_headroom if config.ttft_p95_s else None
        out["prefill"] = Load("queue", rate, rate / measured, rho, target, snap.ttft_p95_s, ttft_limit)
    if name in (DECODE, UNIFIED) and snap.num_running is not None and snap.generation_tokens_per_s is not None:
        rate = snap.generation_tokens_per_s
        saturated = waiting > 0 if name == DECODE else waiting / measured > config.queue_depth_target
        out["decode"] = Load(
            "batch",
            rate,
            rate / measured,
            snap.kv_cache_usage,
            config.kv_cache_target,
            snap.itl_p95_s,
            config.itl_p95_s * config.down_latency_headroom if config.itl_p95_s else None,
            snap.num_running / measured,
            saturated,
        )
    return out


def anticipate(
    name: str,
    config: AutoscaleConfig,
    snap: PoolSnapshot,
    state: PoolState,
    is_complete: bool,
    previous: PoolForecast | None,
    now: float,
) -> tuple[PoolForecast, Prediction | None]:
    """Update the pool's channels with this decision's measurement; the binding channel's prediction."""
    previous = previous or PoolForecast()
    startup = observe_startup(previous.startup, state.num_ready, state.replicas, state.num_unschedulable, now)
    interval = now - previous.last_t if previous.last_t is not None else 0.0
    lookahead = startup.lookahead_s(config.forecast, now) + interval + snap.window_s / 2
    channels = dict(previous.channels)
    best: Prediction | None = None
    # Pods still starting are not scraped yet: what the scraped (ready) pods report is complete for them.
    scraped_all = state.num_ready is not None and snap.num_pods_failed == 0 and snap.num_pods_scraped >= state.num_ready
    for key, load in (loads(name, config, snap) if is_complete or scraped_all else {}).items():
        channels[key] = update(channels.get(key, Channel()), load, lookahead, config.forecast, now)
        prediction = predict(channels[key], load, lookahead, config.forecast, key)
        if prediction.replicas is not None and (best is None or prediction.replicas > (best.replicas or 0)):
            best = prediction
    return PoolForecast(channels, startup, now), best


def combine(
    reactive: int, may_shrink: bool, current: int, prediction: Prediction | None, config: AutoscaleConfig
) -> int:
    """The raw recommendation: reactive and anticipated (see the module docstring's invariants)."""
    if not config.is_predictive or prediction is None or prediction.replicas is None:
        return reactive
    predicted = prediction.replicas
    if reactive > current or not may_shrink:  # up, or held (then reactive == current)
        return max(reactive, predicted)
    if current * (1 - config.tolerance) - _EPS <= predicted < current:
        return current  # within the anti-flap band: hold
    return predicted


def after_decision(forecast: PoolForecast, state: PoolState, applied: int) -> PoolForecast:
    """Start timing a scale-up that needs more ready replicas than the pool has."""
    if forecast.last_t is None:
        return forecast
    startup = note_scale_up(forecast.startup, state.num_ready, applied, forecast.last_t)
    return PoolForecast(forecast.channels, startup, forecast.last_t)


def describe(prediction: Prediction) -> str:
    def fmt(x: float | None) -> str:
        return f"{x:.3g}" if x is not None else "?"

    return (
        f"{prediction.channel} forecast {fmt(prediction.forecast)} tok/s in {prediction.lookahead_s:.0f}s, headroom"
        f" {prediction.headroom:.2f}, capacity/replica {fmt(prediction.capacity)} (limit"
        f" {fmt(prediction.capacity_limit)}) -> {prediction.replicas}"
    )
