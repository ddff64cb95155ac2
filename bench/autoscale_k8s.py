"""Baseline autoscalers as their projects implement them: the Kubernetes HPA and KubeAI's autoscaler.

Role: pure decision logic (no Kubernetes, no clock: `now` is an argument) that
bench/autoscale_policies.py drives per pool in the simulator, and tests/test_autoscale_sim.py
checks against the Kubernetes rules. Written from the documented algorithms and the projects'
source as facts (not copied):

Kubernetes HPA, autoscaling/v2, a Pods metric with an AverageValue target
(kubernetes/kubernetes pkg/controller/podautoscaler: replica_calculator.go calcPlainMetricReplicas,
groupPods; horizontal.go stabilizeRecommendationWithBehaviors, convertDesiredReplicasWithBehaviorRate,
calculateScaleUpLimitWithScalingRules / calculateScaleDownLimitWithBehaviors, storeScaleEvent;
https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/#algorithm-details):
- Every sync period (15 s). Values are milli-units (Quantity.MilliValue rounds up); the usage is
  the integer mean of the pods' values; ratio = usage / target.
- Pods: Pending -> "unready" (dropped); Running without a metric -> "missing"; the others count
  ("ready"; readiness itself only matters for CPU). No metrics at all -> error: no scaling, and
  no recommendation is recorded.
- No missing pods and no (unready and ratio > 1): 1 - 0.1 <= ratio <= 1 + 0.1 (tolerance) -> current,
  else ceil(ratio x ready). Otherwise missing pods count as the target on a scale-down and 0 on a
  scale-up, unready pods as 0 on a scale-up; the ratio is recomputed; within tolerance or a flipped
  direction -> current; else ceil(new ratio x counted pods), unless that moves the other way.
- current > maxReplicas -> max; current < minReplicas -> min (before any metric).
- Stabilization: up = min of the recommendations newer than the up window (default 0 s), down =
  max of those newer than the down window (default 300 s); current is clamped into [up, down].
  Every computed recommendation is recorded.
- Rate: the period-start replicas of a policy = current - replicas added + replicas removed by the
  scale events within its period. Defaults: up max(Percent 100, Pods 4) per 15 s (selectPolicy
  Max); down Percent 100 per 15 s. A scale records its change as an event.

KubeAI (substratusai/kubeai: docs/how-to/configure-autoscaling.md and docs/concepts/autoscaling.md,
"based on the average active number of requests"; internal/modelautoscaler/autoscaler.go,
internal/movingaverage/simple.go, internal/modelscaler/scaler.go, api Model types):
- Every `interval` (default 10 s) the active (in-flight) requests summed over the proxies enter a
  simple moving average over `timeWindow` (default 10 min: ceil(600 / 10) = 60 samples);
  desired = ceil(average / targetRequests) (default 100), bounded by [min, max].
- A scale-down is applied only after ceil(scaleDownDelaySeconds (default 30) / interval) consecutive
  decisions wanted one (the count is not reset by the scale-down itself, only by a non-down
  decision); a scale-up applies at once. No ready endpoint -> skipped.

Invariants: every decision is within [min, max]; state is only what the controllers keep.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

SYNC_PERIOD_S = 15.0
TOLERANCE = 0.1


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    kind: str  # "Pods" or "Percent"
    value: int
    period_s: float


@dataclass(frozen=True, slots=True)
class ScalingRules:
    stabilization_s: float
    policies: tuple[ScalingPolicy, ...]
    select: str = "Max"  # Max, Min or Disabled


DEFAULT_UP = ScalingRules(0.0, (ScalingPolicy("Percent", 100, 15.0), ScalingPolicy("Pods", 4, 15.0)))
DEFAULT_DOWN = ScalingRules(300.0, (ScalingPolicy("Percent", 100, 15.0),))


def milli(value: float) -> int:
    """Quantity.MilliValue(): the value in thousandths, rounded up."""
    return math.ceil(round(value * 1000, 6))


def _within(ratio: float, tolerance: float) -> bool:
    """The tolerance band, bounds included (Tolerances.isWithin): 1.1 x target does not scale at 0.1."""
    return 1.0 - tolerance <= ratio <= 1.0 + tolerance


def pods_metric_replicas(
    current: int, ready: int, missing: int, unready: int, value_milli: int, target_milli: int, tolerance: float
) -> int | None:
    """The replica calculator for a Pods metric; every ready pod reports `value_milli`. None: no metrics."""
    if ready == 0:
        return None
    ratio = value_milli / target_milli  # usage = integer mean of equal values = the value
    scale_up_with_unready = unready > 0 and ratio > 1.0
    if not scale_up_with_unready and missing == 0:
        if _within(ratio, tolerance):
            return current
        return math.ceil(ratio * ready)
    total = value_milli * ready
    counted = ready
    if missing > 0:
        if ratio < 1.0:
            total += target_milli * missing
            counted += missing
        elif ratio > 1.0:
            counted += missing
    if scale_up_with_unready:
        counted += unready
    new_ratio = (total // counted) / target_milli
    if _within(new_ratio, tolerance) or (ratio < 1.0 < new_ratio) or (new_ratio < 1.0 < ratio):
        return current
    replicas = math.ceil(new_ratio * counted)
    if (new_ratio < 1.0 and replicas > current) or (new_ratio > 1.0 and replicas < current):
        return current
    return replicas


class Hpa:
    """One HorizontalPodAutoscaler on one Pods metric (AverageValue target) of one workload."""

    def __init__(
        self,
        target: float,
        min_replicas: int,
        max_replicas: int,
        up: ScalingRules = DEFAULT_UP,
        down: ScalingRules = DEFAULT_DOWN,
        tolerance: float = TOLERANCE,
    ) -> None:
        self.target_milli = max(milli(target), 1)
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.up, self.down, self.tolerance = up, down, tolerance
        self.recommendations: list[tuple[float, int]] = []
        self.up_events: list[tuple[float, int]] = []
        self.down_events: list[tuple[float, int]] = []

    def sync(self, now: float, current: int, ready: int, missing: int, unready: int, value: float) -> int:
        """One sync: the replicas the HPA sets (`current` when it does not scale)."""
        if current > self.max_replicas:
            desired = self.max_replicas
        elif current < self.min_replicas:
            desired = self.min_replicas
        elif current == 0:
            return 0  # scaling disabled
        else:
            computed = pods_metric_replicas(
                current, ready, missing, unready, milli(value), self.target_milli, self.tolerance
            )
            if computed is None:
                return current  # FailedGetPodsMetric: no rescale, nothing recorded
            desired = self._normalize(now, current, computed)
        if desired != current:
            events = self.up_events if desired > current else self.down_events
            events.append((now, abs(desired - current)))
        return desired

    def _normalize(self, now: float, current: int, desired: int) -> int:
        up_cut, down_cut = now - self.up.stabilization_s, now - self.down.stabilization_s
        up_rec = min([r for t, r in self.recommendations if t > up_cut], default=desired)
        down_rec = max([r for t, r in self.recommendations if t > down_cut], default=desired)
        up_rec, down_rec = min(up_rec, desired), max(down_rec, desired)
        horizon = now - max(self.up.stabilization_s, self.down.stabilization_s)
        self.recommendations = [(t, r) for t, r in self.recommendations if t >= horizon]
        self.recommendations.append((now, desired))
        value = min(max(current, up_rec), down_rec)
        if value > current:
            limit = max(self._limit(now, current, self.up, up=True), current)
            return min(value, limit, self.max_replicas)
        if value < current:
            limit = min(self._limit(now, current, self.down, up=False), current)
            return max(value, limit, self.min_replicas)
        return value

    def _limit(self, now: float, current: int, rules: ScalingRules, up: bool) -> int:
        if rules.select == "Disabled":
            return current
        proposals = []
        for policy in rules.policies:
            cut = now - policy.period_s
            added = sum(c for t, c in self.up_events if t > cut)
            removed = sum(c for t, c in self.down_events if t > cut)
            start = current - added + removed
            if policy.kind == "Pods":
                proposals.append(start + policy.value if up else start - policy.value)
            elif up:
                proposals.append(math.ceil(start * (1 + policy.value / 100)))
            else:
                proposals.append(int(start * (1 - policy.value / 100)))
        longest = max(p.period_s for p in (*self.up.policies, *self.down.policies))
        self.up_events = [(t, c) for t, c in self.up_events if t > now - longest]
        self.down_events = [(t, c) for t, c in self.down_events if t > now - longest]
        # selectPolicy Max = the largest change: the highest limit up, the lowest limit down.
        largest = (rules.select == "Max") == up
        return max(proposals) if largest else min(proposals)


class KubeAiAutoscaler:
    """KubeAI's autoscaler for one workload: moving average of in-flight requests / targetRequests."""

    def __init__(
        self,
        target_requests: float,
        min_replicas: int,
        max_replicas: int,
        interval_s: float = 10.0,
        time_window_s: float = 600.0,
        scale_down_delay_s: float = 30.0,
    ) -> None:
        self.target, self.min_replicas, self.max_replicas = target_requests, min_replicas, max_replicas
        self.interval_s = interval_s
        self.samples: deque[float] = deque(maxlen=math.ceil(time_window_s / interval_s))
        self.required_downs = math.ceil(scale_down_delay_s / interval_s)
        self.consecutive_downs = 0

    def decide(self, current: int, in_flight: float, has_endpoints: bool = True) -> int:
        if not has_endpoints:
            return current
        if not self.samples:
            # KubeAI seeds its window with zeros at process start; the simulator starts at a served
            # load, so the window is seeded as if the autoscaler had run at this load before (warm).
            self.samples.extend([in_flight] * (self.samples.maxlen or 1))
        self.samples.append(in_flight)
        average = sum(self.samples) / len(self.samples)
        replicas = min(max(math.ceil(average / self.target), self.min_replicas), self.max_replicas)
        if current > replicas:
            if self.consecutive_downs < self.required_downs:
                self.consecutive_downs += 1
                return current
        else:
            self.consecutive_downs = 0
        return replicas
