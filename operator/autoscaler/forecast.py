"""Anticipation for the autoscaling policy: demand forecast, burst headroom, start-up time.

Pure: no clock (`now` is an argument), no I/O; every state is an immutable value that `update`
returns anew and the policy keeps in its `History`.

A pool has up to two demand *channels* (anticipate.py builds them from its snapshot): "prefill"
(prompt tokens/s, a queue) and "decode" (generated tokens/s, a batch); capacity.py learns what one
replica serves of each. Per channel, every decision with complete data:
1. **Forecast** (Holt's linear smoothing, time-aware: level time constant `level_s`, trend
   `trend_s`): demand `lookahead` seconds ahead, never below the demand measured now (shrinking
   needs no anticipation: removing a pod is instant).
2. **Headroom** from burst statistics, not a constant: each forecast is checked `lookahead` later
   against the largest demand seen in between; the ratio (actual max / forecast) is an error
   sample, kept as the largest per `headroom_block_s` block (memory bounded by window / block per
   channel, whatever the decision interval), and headroom is the `headroom_quantile` of those
   blocks over the last `headroom_window_s`, between 1 and `MAX_HEADROOM`.
3. Replicas = ceil(forecast x max(headroom / capacity at the limit, 1 / capacity at the target)):
   the target's slack (limit / target) absorbs bursts up to that size; headroom beyond it buys
   replicas. No capacity learned yet -> no prediction (the policy stays reactive).

The lookahead is the pool's start-up time, learned from `PoolState.num_ready` (from a scale-up
until that many replicas are ready; a slower sample wins at once, a faster one is averaged in;
while pods have been starting for longer than learned, the elapsed time counts), plus the interval
between decisions and half the metrics window (the lag of the measurement itself).

Invariants (tests/autoscaler/test_autoscale_forecast.py, with fake clocks): a step change is
followed, and its forecast errors raise headroom, which ages out; a ramp is forecast ahead of itself;
a slower pod start lengthens the lookahead at once; capacity converges to the true per-replica
capacity from any start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .capacity import Load, Model, capacities, learn

MAX_HEADROOM = 4.0
MIN_ERROR_BLOCKS = 2  # fewer blocks of error samples than this: headroom 1 (the reactive rules still act)
MAX_LOOKAHEAD_S = 1800.0


@dataclass(frozen=True, slots=True)
class ForecastConfig:
    level_s: float = 30.0  # Holt level time constant
    trend_s: float = 300.0  # Holt trend time constant
    memory_s: float = 1800.0  # capacity models forget with this time constant
    headroom_quantile: float = 1.0  # the largest error in the window: bursts rarely repeat often enough for less
    headroom_window_s: float = 8 * 3600.0
    headroom_block_s: float = 300.0  # error samples are kept as the largest per block (bounded memory per service)
    default_startup_s: float = 120.0  # a pool's start-up time before any was measured


@dataclass(frozen=True, slots=True)
class Channel:
    """One demand channel's learned state (see the module docstring)."""

    t: float | None = None  # time of the last update
    level: float = 0.0
    trend: float = 0.0  # demand units per second
    pending: tuple[tuple[float, float, float], ...] = ()  # (due time, forecast, max demand since) per forecast
    errors: tuple[tuple[float, float], ...] = ()  # (block start, largest actual max / forecast in it), oldest first
    model: Model = field(default_factory=Model)

    def forecast(self, horizon_s: float) -> float:
        return max(self.level + self.trend * horizon_s, 0.0)

    def headroom(self, config: ForecastConfig) -> float:
        if len(self.errors) < MIN_ERROR_BLOCKS:
            return 1.0
        ratios = sorted(r for _, r in self.errors)
        index = min(math.ceil(config.headroom_quantile * len(ratios)) - 1, len(ratios) - 1)
        return min(max(ratios[max(index, 0)], 1.0), MAX_HEADROOM)


@dataclass(frozen=True, slots=True)
class Startup:
    """A pool's start-up time: the learned value and the scale-ups still waiting for readiness."""

    learned_s: float | None = None
    waiting: tuple[tuple[float, int], ...] = ()  # (time of the scale-up, ready replicas it needs)

    def lookahead_s(self, config: ForecastConfig, now: float) -> float:
        base = self.learned_s if self.learned_s is not None else config.default_startup_s
        oldest = min((t for t, _ in self.waiting), default=now)
        return min(max(base, now - oldest), MAX_LOOKAHEAD_S)


@dataclass(frozen=True, slots=True)
class Prediction:
    replicas: int | None  # None: nothing learned yet
    forecast: float  # demand expected `lookahead_s` ahead
    headroom: float
    capacity: float | None  # demand per replica at the utilization target
    lookahead_s: float
    capacity_limit: float | None = None  # demand per replica at the limit (utilization or latency SLO)
    channel: str = ""


@dataclass(frozen=True, slots=True)
class PoolForecast:
    """Everything anticipation keeps for one pool across decisions."""

    channels: dict[str, Channel] = field(default_factory=dict)
    startup: Startup = field(default_factory=Startup)
    last_t: float | None = None


def observe_startup(startup: Startup, ready: int | None, replicas: int, unschedulable: int, now: float) -> Startup:
    """Resolve scale-ups whose replicas are ready (a start-up sample each); forget cancelled ones.
    Unschedulable pods are not starting: a scale-up is done when the schedulable part of it is ready."""
    if ready is None:
        return startup
    learned, waiting = startup.learned_s, []
    for t0, need in startup.waiting:
        if need > replicas:  # scaled down since: this start will not complete as asked
            continue
        if ready + unschedulable >= need:
            sample = now - t0
            learned = sample if learned is None or sample > learned else 0.7 * learned + 0.3 * sample
        else:
            waiting.append((t0, need))
    return Startup(learned, tuple(waiting))


def note_scale_up(startup: Startup, ready: int | None, desired: int, now: float) -> Startup:
    """Remember a decision that needs more ready replicas than there are (its start-up will be timed)."""
    if ready is None or desired <= ready or any(need >= desired for _, need in startup.waiting):
        return startup
    return replace(startup, waiting=(*startup.waiting, (now, desired)))


def update(channel: Channel, load: Load, lookahead_s: float, config: ForecastConfig, now: float) -> Channel:
    """The channel after one complete measurement: forecast, error samples, capacity model."""
    x = max(load.demand, 0.0)
    dt = max(now - channel.t, 1e-6) if channel.t is not None else 0.0
    if channel.t is None:
        level, trend = x, 0.0
    else:
        predicted = channel.level + channel.trend * dt
        level = predicted + (1 - math.exp(-dt / config.level_s)) * (x - predicted)
        trend = channel.trend + (1 - math.exp(-dt / config.trend_s)) * ((level - channel.level) / dt - channel.trend)
    forecast = max(level + trend * lookahead_s, x)

    errors = list(channel.errors)
    pending = []
    block = math.floor(now / config.headroom_block_s) * config.headroom_block_s
    for due, made, peak in channel.pending:
        peak = max(peak, x)
        if now >= due:
            if made > 0:
                if errors and errors[-1][0] == block:
                    errors[-1] = (block, max(errors[-1][1], peak / made))
                else:
                    errors.append((block, peak / made))
        else:
            pending.append((due, made, peak))
    pending.append((now + lookahead_s, forecast, 0.0))
    cutoff = now - config.headroom_window_s
    errors = [(t, r) for t, r in errors if t + config.headroom_block_s > cutoff]
    model = learn(channel.model, load, dt, config.memory_s)
    return Channel(now, level, trend, tuple(pending), tuple(errors), model)


def predict(channel: Channel, load: Load, lookahead_s: float, config: ForecastConfig, name: str = "") -> Prediction:
    """Replicas for the forecast: at least its demand at the target capacity, and its demand times the
    burst headroom at the limit capacity (the target's own slack absorbs bursts up to limit / target)."""
    forecast = max(channel.forecast(lookahead_s), load.demand)
    headroom = channel.headroom(config)
    learned = capacities(channel.model, load)
    if learned is None or min(learned) <= 0:
        return Prediction(None, forecast, headroom, None, lookahead_s, None, name)
    at_target, at_limit = learned
    replicas = math.ceil(forecast * max(headroom / at_limit, 1 / at_target) - 1e-9)
    return Prediction(replicas, forecast, headroom, at_target, lookahead_s, at_limit, name)
