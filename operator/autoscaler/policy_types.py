"""The autoscaling policy's inputs and outputs: plain frozen dataclasses, no pydantic, no I/O.

Role: the contract between the policy (`policy.decide`), the collector (which fills
`PoolSnapshot`s), the operator (which maps the parsed InferenceService spec to `AutoscaleConfig`
via `config.config_from_view` and observed workloads to `PoolState`), and the simulator
(`bench/autoscale_sim.py`), which drives the same policy without Kubernetes. Defaults that
the API also has are read from the API's pydantic defaults (no copy); the rest are tuning
knobs the API does not expose.

Invariants:
- Pool names are "unified", or "prefill" and "decode" (disaggregated).
- Latencies are seconds; fractions are 0..1; every count is per pool, not per pod, unless
  the field name says `per_replica`.
- `History` is immutable: `decide` returns the next one inside its `Decision`; the caller
  stores it and passes it back next time (that is all the state the policy has).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from tidepool.operator.api.spec import POOL_DECODE, POOL_PREFILL, POOL_UNIFIED, AutoscalingSpec

from .forecast import ForecastConfig, PoolForecast, Prediction

UNIFIED, PREFILL, DECODE = POOL_UNIFIED, POOL_PREFILL, POOL_DECODE
SleepChange = Literal["sleep", "wake"]
# The API's defaults: what an InferenceService that sets none of autoscaling.* gets. AutoscaleConfig's
# defaults are these, so the simulator and the operator agree without a copy.
_API = AutoscalingSpec()


@dataclass(frozen=True, slots=True)
class PoolBounds:
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    pools: Mapping[str, PoolBounds]  # "unified" or "prefill" + "decode"
    is_advisory: bool = False  # decide and report, never change replicas
    ttft_p95_s: float | None = None  # slo.ttftP95Ms / 1000
    itl_p95_s: float | None = None  # slo.itlP95Ms / 1000
    kv_cache_target: float = _API.kv_cache_target  # target mean vllm:kv_cache_usage_perc per replica
    # target waiting requests per replica (prefill pods: waiting + in prefill)
    queue_depth_target: float = float(_API.queue_depth_target)
    scale_to_zero: bool = _API.scale_to_zero.enabled
    idle_seconds: float = float(_API.scale_to_zero.idle_seconds)  # no request for this long -> zero replicas
    # autoscaling.idle sleep: idle pools keep their replicas and their engines sleep (idle.py) instead of going to 0
    sleep_when_idle: bool = _API.idle == "sleep"
    # scale-up stabilization window (min of recommendations within it)
    up_seconds: float = float(_API.stabilization.up_seconds)
    # scale-down stabilization window (max of recommendations within it)
    down_seconds: float = float(_API.stabilization.down_seconds)
    max_step_percent: float = float(_API.max_step_percent)  # one decision changes a pool by at most this %
    min_step_replicas: int = 4  # ... but scale-up may always add this many (small pools grow fast)
    tolerance: float = 0.1  # |load ratio - 1| within this: no change (anti-flap band)
    # Scale down only while every latency p95 is below this fraction of its SLO: latency is not
    # proportional to load, so a pool near its SLO must not shrink even if utilization says it could.
    down_latency_headroom: float = 0.8
    # prefill:decode replica ratio bounds (autoscaling.prefillDecodeRatio {min, max}).
    pd_ratio_min: float = _API.prefill_decode_ratio.min
    pd_ratio_max: float = _API.prefill_decode_ratio.max
    # Anticipation (forecast.py): replicas for the demand forecast one pod start-up ahead, with headroom from
    # observed forecast errors and per-replica capacity learned from the live metrics. False: reactive only.
    is_predictive: bool = True
    forecast: ForecastConfig = field(default_factory=ForecastConfig)


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """One pool's metrics over the window (see window.PoolWindow.snapshot); None = unknown."""

    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None
    num_requests: float | None = None  # requests that got their first token within the window
    kv_cache_usage: float | None = None  # mean over scraped pods, latest scrape
    num_waiting: float | None = None  # sum over scraped pods
    num_running: float | None = None  # sum over scraped pods
    preemptions_per_s: float | None = None
    prompt_tokens_per_s: float | None = None  # prompt tokens of requests that got a first token, per second
    generation_tokens_per_s: float | None = None  # tokens generated per second
    held_requests: float = 0.0  # router: requests held while the pool has no ready replica
    num_pods_scraped: int = 0
    num_pods_failed: int = 0
    window_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolState:
    """What the cluster has for a pool right now."""

    replicas: int  # the workload's spec.replicas
    num_unschedulable: int = 0  # pods Pending with PodScheduled=False/Unschedulable
    unschedulable_message: str = ""  # the scheduler's message, e.g. "0/2 nodes: Insufficient nvidia.com/gpu"
    num_ready: int | None = None  # replicas passing readiness (None: unknown); start-up time is learned from it


@dataclass(frozen=True, slots=True)
class History:
    recommendations: tuple[tuple[float, Mapping[str, int]], ...] = ()  # (time, raw recommendation per pool)
    last_scale_time: float | None = None
    last_active_time: float | None = None  # last time any pool saw a request (idle -> zero)
    asleep_since: float | None = None  # autoscaling.idle sleep: when the pools were put to sleep (None: awake)
    # Anticipation's learned state per pool (forecast.py); in memory only: an operator restart relearns it.
    forecasts: Mapping[str, PoolForecast] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PoolDecision:
    current: int
    desired: int
    recommendation: int  # before stabilization, step bounds, [min, max], capacity and ratio guards
    load_ratio: float | None  # the binding signal over its target (None: no usable data)
    signal: str  # which signal set the load ratio, e.g. "ttft_p95 0.62s / slo 0.50s"
    is_limited: bool = False
    limited_reason: str = ""
    has_complete_data: bool = False
    prediction: Prediction | None = None  # what anticipation asked for (None: not predictive or nothing learned)


@dataclass(frozen=True, slots=True)
class Decision:
    pools: Mapping[str, PoolDecision]
    replicas: Mapping[str, int]  # what to apply: desired (active) or current (advisory)
    is_advisory: bool
    reason: str  # human-readable, one clause per pool
    history: History = field(default_factory=History)
    is_asleep: bool = False  # autoscaling.idle sleep: the engines should sleep now (never in advisory mode)
    sleep_change: SleepChange | None = None  # this decision puts the pools to sleep or wakes them (idle.py)
    sleep_reason: str = ""  # why it sleeps or wakes, or why the pools stay asleep (idle.py; "" otherwise)

    @property
    def desired(self) -> dict[str, int]:
        return {name: pool.desired for name, pool in self.pools.items()}

    @property
    def is_scaling(self) -> bool:
        return any(pool.desired != pool.current for pool in self.pools.values())

    @property
    def is_limited(self) -> bool:
        return any(pool.is_limited for pool in self.pools.values())

    @property
    def limited_reason(self) -> str:
        return "; ".join(f"{name}: {p.limited_reason}" for name, p in self.pools.items() if p.is_limited)
