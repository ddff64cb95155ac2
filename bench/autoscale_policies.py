"""The controllers the autoscaling simulator compares: Tidepool's policy, static peak, and the baselines.

Role: adapt the fleet's `PoolView`s (bench/autoscale_fleet.py) to each autoscaler's inputs.
- tidepool: `tidepool.operator.autoscaler.policy.decide`, the operator's code, called as the operator
  calls it: `decide(config, snapshots, states, history, now)`. The config is `AutoscaleConfig`'s
  (= the API's) defaults except the SLOs and the knobs the simulator exposes (kvCacheTarget,
  queueDepthTarget, stabilization down seconds, maxStepPercent), and `is_predictive` (False: the
  reactive-only ablation).
- static: both pools at the trace's peak provisioning, never changed.
- baselines, one autoscaler per pool on the metric as that pool's engines report it
  (prefill pods: running = requests in prefill; decode pods: running = decoding sequences):
    hpa-running   Kubernetes HPA on vllm:num_requests_running per pod
    hpa-kv        Kubernetes HPA on vllm:kv_cache_usage_perc per pod
    hpa-waiting   Kubernetes HPA on vllm:num_requests_waiting per pod (a KEDA ScaledObject on it drives an
                  HPA on an External metric instead: ceil(sum / target), without the missing-pod rules)
    kubeai        KubeAI's autoscaler on in-flight requests (running + waiting: what its proxy counts)
  (autoscale_k8s.py has the algorithms.) Loading pods are Running without metrics (the engine
  serves /metrics once the model is loaded): "missing" to the HPA; unschedulable pods are Pending.

Baseline targets come from a utilization level u, so one grid spans far fewer to far more
replicas than the policy whatever the trace: running u (prefill) and u x the KV-full batch
(decode); KV usage u x mean prompt / KV tokens (prefill) and u (decode); waiting u^2 / (1 - u) for
both (M/M/1 queue at utilization u); in-flight u / (1 - u) (prefill) and u x KV-full batch (decode);
plus, for both pools, waiting 100 and 1000 (to reach few replicas too) and KubeAI's default
targetRequests 100 and 1000.

Invariants: every controller returns a replica count for both pools, within [1, 1.2 x static peak].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from autoscale_fleet import POOLS, Params, Perf, PoolView
from autoscale_k8s import SYNC_PERIOD_S, Hpa, KubeAiAutoscaler

from tidepool.operator.autoscaler.policy import decide
from tidepool.operator.autoscaler.policy_types import AutoscaleConfig, History, PoolBounds, PoolSnapshot, PoolState

FAMILIES = ("hpa-running", "hpa-kv", "hpa-waiting", "kubeai")
LEVELS = (0.15, 0.3, 0.45, 0.6, 0.75, 0.9, 0.97)
# Targets beyond the levels, the same for both pools: waiting per replica stays near 0 until a pool
# saturates, then grows by thousands, so only large targets reach few replicas; KubeAI's default
# targetRequests is 100.
EXTRA_TARGETS = {
    "hpa-waiting": (("100", 100.0), ("1000", 1000.0)),
    "kubeai": (("default", 100.0), ("1000", 1000.0)),
}


def bounds_for(static: Mapping[str, int]) -> dict[str, PoolBounds]:
    """Every autoscaler gets the same bounds: 1 .. 1.2 x the static peak of each pool."""
    return {name: PoolBounds(1, math.ceil(1.2 * static[name])) for name in POOLS}


def family_targets(family: str, level: float, perf: Perf, prompt_mean: float, output_mean: float) -> dict[str, float]:
    """Per-pool metric targets of a baseline family at utilization level `level` (0 < level < 1)."""
    full_batch = perf.max_batch(prompt_mean + output_mean / 2)
    if family == "hpa-running":
        return {"prefill": level, "decode": level * full_batch}
    if family == "hpa-kv":
        return {"prefill": level * prompt_mean / perf.kv_tokens, "decode": level}
    if family == "hpa-waiting":
        depth = level * level / (1 - level)
        return {"prefill": depth, "decode": depth}
    if family == "kubeai":
        return {"prefill": level / (1 - level), "decode": level * full_batch}
    raise ValueError(f"unknown baseline family {family!r}")


@dataclass(frozen=True, slots=True)
class BaselineSpec:
    family: str
    label: str  # e.g. "u=0.45" or "default"
    targets: Mapping[str, float]

    @property
    def name(self) -> str:
        shown = ", ".join(f"{pool[0]} {self.targets[pool]:.3g}" for pool in POOLS)
        return f"{self.family} {self.label} ({shown})"


def baseline_grid(perf: Perf, prompt_mean: float, output_mean: float) -> list[BaselineSpec]:
    specs = [
        BaselineSpec(family, f"u={level:g}", family_targets(family, level, perf, prompt_mean, output_mean))
        for family in FAMILIES
        for level in LEVELS
    ]
    for family, extras in EXTRA_TARGETS.items():
        specs += [BaselineSpec(family, label, {pool: value for pool in POOLS}) for label, value in extras]
    return specs


class StaticController:
    name = "static"
    interval_s = 0.0

    def decide(self, now: float, views: Mapping[str, PoolView]) -> dict[str, int]:
        return {name: view.desired for name, view in views.items()}


class TidepoolController:
    def __init__(self, params: Params, static: Mapping[str, int], is_predictive: bool = True) -> None:
        self.name = "tidepool" if is_predictive else "tidepool-reactive"
        self.interval_s = params.interval_s
        self.config = AutoscaleConfig(
            pools=bounds_for(static),
            ttft_p95_s=params.slo_ttft,
            itl_p95_s=params.slo_itl,
            kv_cache_target=params.kv_target,
            queue_depth_target=params.queue_target,
            down_seconds=params.down_seconds,
            max_step_percent=params.max_step_percent,
            is_predictive=is_predictive,
        )
        self.history: History | None = None

    def decide(self, now: float, views: Mapping[str, PoolView]) -> dict[str, int]:
        pre, dec = views["prefill"], views["decode"]
        snaps = {
            "prefill": _snapshot(
                pre, ttft_p95_s=pre.latency_p95(), prompt_tokens_per_s=pre.prompt_tokens / pre.window_s
            ),
            "decode": _snapshot(
                dec, itl_p95_s=dec.latency_p95(), generation_tokens_per_s=dec.generation_tokens / dec.window_s
            ),
        }
        states = {
            name: PoolState(replicas=view.desired, num_unschedulable=view.unschedulable, num_ready=view.ready)
            for name, view in views.items()
        }
        decision = decide(self.config, snaps, states, self.history, now)
        self.history = decision.history
        return dict(decision.replicas)


def _snapshot(view: PoolView, **latency_and_tokens: float | None) -> PoolSnapshot:
    """What the operator's collector gives the policy for one pool: the gauges of its ready pods (none
    without one), the requests that got a first token in the window, plus the pool's own latency and
    token rate."""
    return PoolSnapshot(
        num_requests=view.first_tokens,
        kv_cache_usage=view.kv_usage,
        num_waiting=view.waiting if view.ready else None,
        num_running=view.running if view.ready else None,
        num_pods_scraped=view.ready,
        window_s=view.window_s,
        **latency_and_tokens,
    )


def _metric(family: str, view: PoolView) -> float:
    """The pool's per-pod value of the family's metric (every ready pod reports the same: balanced router)."""
    if family == "hpa-running":
        return view.running / view.ready
    if family == "hpa-waiting":
        return view.waiting / view.ready
    if family == "hpa-kv":
        return view.kv_usage or 0.0
    raise ValueError(family)


class HpaController:
    interval_s = SYNC_PERIOD_S

    def __init__(self, spec: BaselineSpec, static: Mapping[str, int]) -> None:
        self.name, self.family = spec.name, spec.family
        bounds = bounds_for(static)
        self.hpas = {
            name: Hpa(spec.targets[name], bounds[name].min_replicas, bounds[name].max_replicas) for name in POOLS
        }

    def decide(self, now: float, views: Mapping[str, PoolView]) -> dict[str, int]:
        out = {}
        for name, view in views.items():
            value = _metric(self.family, view) if view.ready else 0.0
            out[name] = self.hpas[name].sync(now, view.desired, view.ready, view.loading, view.unschedulable, value)
        return out


class KubeAiController:
    interval_s = 10.0

    def __init__(self, spec: BaselineSpec, static: Mapping[str, int]) -> None:
        self.name, self.family = spec.name, spec.family
        bounds = bounds_for(static)
        self.scalers = {
            name: KubeAiAutoscaler(spec.targets[name], bounds[name].min_replicas, bounds[name].max_replicas)
            for name in POOLS
        }

    def decide(self, now: float, views: Mapping[str, PoolView]) -> dict[str, int]:
        return {
            name: self.scalers[name].decide(view.desired, view.running + view.waiting, has_endpoints=view.ready > 0)
            for name, view in views.items()
        }


def baseline_controller(spec: BaselineSpec, static: Mapping[str, int]) -> HpaController | KubeAiController:
    return KubeAiController(spec, static) if spec.family == "kubeai" else HpaController(spec, static)
