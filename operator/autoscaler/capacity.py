"""Per-replica capacity learned from the metrics the autoscaler already scrapes (pure, no clock, no I/O).

Two models, one per kind of pool work; both give the demand one replica serves at the utilization
target (`at_target`) and at the limit where service breaks (`at_limit`), in the demand's own units:

- **queue** (prefill: demand = prompt tokens/s, or requests/s when the engines do not count prompt
  tokens). A replica is a server of rate mu: utilization rho = demand per replica / mu, so each
  measurement with an informative rho (`RHO_RANGE`) is a sample mu = demand per replica / rho.
  TTFT follows M/M/1, TTFT = s / (1 - rho), so s = TTFT x (1 - rho) is learned too. Target: rho at
  the queue-depth target; limit: the rho at which TTFT reaches its SLO, 1 - s / SLO.
- **batch** (decode: demand = generated tokens/s). A replica runs a batch of b sequences per step,
  step(b) = a + c x b (the ITL p95 against running sequences per replica, a least-squares line with
  exponential forgetting), so it serves b / step(b) tokens/s; the KV cache bounds b:
  b_full = running per replica / KV usage is learned, and so is the efficiency: tokens/s measured
  over b / step(b) (a replica also prefills, and its gauges are sampled, not averaged). Target: b at
  `kvCacheTarget`; limit: the smaller of b at `KV_LIMIT` and the b whose step reaches the ITL SLO.
  Until the batches seen vary
  (no line yet) the step is taken as proportional to b through the last point (pessimistic: no
  batching gain is assumed before it is measured).

Invariants: learning only from complete data and unsaturated points (KV below `KV_SATURATED`, no
queue ahead of decode); every estimate is smoothed over `memory_s` (exponential forgetting in time,
so the learning rate does not depend on the decision interval); at_target <= at_limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RHO_RANGE = (0.1, 0.9)  # prefill utilizations that say something about mu (not idle, not saturated)
KV_RANGE = (0.2, 0.9)  # KV usages that say something about b_full, the step line, efficiency (busy, not full)
KV_LIMIT = 0.95  # KV-cache usage near which an engine starts preempting: the decode limit
MIN_SAMPLES = 4  # a model learned from fewer measurements predicts nothing yet


@dataclass(frozen=True, slots=True)
class Load:
    """One pool channel's measurement at a decision (complete data only)."""

    kind: str  # "queue" or "batch"
    demand: float  # the channel's total demand now (tokens/s)
    per_replica: float  # demand per measured replica
    utilization: float | None  # queue: rho; batch: KV usage (fractions; None: not reported)
    target: float  # the same quantity at the admin's target (rho at queueDepthTarget, or kvCacheTarget)
    latency_s: float | None = None  # queue: TTFT p95; batch: ITL p95
    latency_slo_s: float | None = None
    batch: float | None = None  # batch: running sequences per replica
    is_saturated: bool = False  # a queue ahead of the work: the point says nothing about capacity


@dataclass(frozen=True, slots=True)
class Model:
    """The learned state of one channel's capacity model."""

    samples: int = 0
    unit: float | None = None  # queue: mu; batch: b_full (sequences at full KV)
    latency: float | None = None  # queue: s (TTFT at zero load)
    fit: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)  # batch: w, x, y, xx, xy
    last: tuple[float, float] | None = None  # batch: the last (b, step) point
    efficiency: float = 1.0  # batch: tokens/s served / (b / step(b)): time not spent decoding (prefill, gaps)


def learn(model: Model, load: Load, dt: float, memory_s: float) -> Model:
    """The model after one measurement `dt` seconds after the previous one."""
    u = load.utilization
    if u is None or load.is_saturated or load.per_replica <= 0:
        return model
    keep = math.exp(-max(dt, 0.0) / memory_s) if model.samples else 0.0
    if load.kind == "queue":
        if not RHO_RANGE[0] <= u <= RHO_RANGE[1]:
            return model
        unit = _smooth(model.unit, load.per_replica / u, keep)
        latency = model.latency
        if load.latency_s is not None:
            latency = _smooth(latency, load.latency_s * (1 - u), keep)
        return Model(model.samples + 1, unit, latency, model.fit, model.last, model.efficiency)
    b = load.batch
    if b is None or b <= 0 or not KV_RANGE[0] <= u <= KV_RANGE[1]:
        return model
    unit = _smooth(model.unit, b / u, keep)
    fit, last = model.fit, model.last
    if load.latency_s is not None:
        y = load.latency_s
        w0, x0, y0, xx0, xy0 = fit
        fit = (keep * w0 + 1, keep * x0 + b, keep * y0 + y, keep * xx0 + b * b, keep * xy0 + b * y)
        last = (b, y)
    learned = Model(model.samples + 1, unit, model.latency, fit, last, model.efficiency)
    line = step_line(learned)
    if line is not None and line[0] + line[1] * b > 0:
        ideal = b / (line[0] + line[1] * b)
        efficiency = _smooth(model.efficiency if model.samples else None, load.per_replica / ideal, keep)
        learned = Model(learned.samples, unit, model.latency, fit, last, min(efficiency, 1.0))
    return learned


def _smooth(old: float | None, sample: float, keep: float) -> float:
    """Exponential smoothing in log space (capacities are positive and err by factors)."""
    if old is None or old <= 0 or sample <= 0:
        return sample
    return math.exp(keep * math.log(old) + (1 - keep) * math.log(sample))


def step_line(model: Model) -> tuple[float, float] | None:
    """(a, c) of step(b) = a + c x b: the fitted line, or through the origin and the last point while the
    batches seen do not vary; None before any point."""
    w, x, y, xx, xy = model.fit
    if w > 0:
        var = xx / w - (x / w) ** 2
        if var > 1e-6 * max(1.0, (x / w) ** 2):
            c = (xy / w - x * y / w**2) / var
            a = y / w - c * x / w
            if c >= 0 and a > 0:
                return a, c
            if c < 0:  # step does not grow with the batch (memory-bound): a flat line at the mean
                return y / w, 0.0
    if model.last is None or model.last[0] <= 0:
        return None
    b, step = model.last
    return 0.0, step / b


def capacities(model: Model, load: Load) -> tuple[float, float] | None:
    """(at_target, at_limit) demand per replica, or None while the model is not learned."""
    if model.samples < MIN_SAMPLES or model.unit is None:
        return None
    if load.kind == "queue":
        mu = model.unit
        rho_limit = 1.0
        if model.latency is not None and load.latency_slo_s:
            rho_limit = min(max(1 - model.latency / load.latency_slo_s, 0.0), 1.0)
        at_limit = mu * rho_limit
        return min(mu * load.target, at_limit), at_limit
    line = step_line(model)
    if line is None:
        return None
    a, c = line
    b_limit = KV_LIMIT * model.unit
    if load.latency_slo_s and c > 0:
        b_limit = min(b_limit, max((load.latency_slo_s - a) / c, 0.0))
    b_target = min(load.target * model.unit, b_limit)

    def served(b: float) -> float:
        step = a + c * b
        return model.efficiency * b / step if step > 0 else 0.0

    return served(b_target), served(b_limit)
