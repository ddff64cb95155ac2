"""The fleet the autoscaling simulator drives: replica performance, static sizing, pods, and what controllers see.

Role: shared by bench/autoscale_fluid.py (the per-tick model), bench/autoscale_policies.py (the
controllers) and bench/autoscale_sim.py. A pool is a count of identical replicas (the router
balances them), so pods are counts, not objects.

Per-replica performance is calibrated from our own measurements on the 2-core dev machine
(smollm-135m, float32; bench/README.md and bench/results/*.json): prefill 279 tok/s (1,932-token
prompt in 6.92 s, prefix_cache_off.json median TTFT); decode step 108.7 ms at batch 1
(offline_throughput json `bs1_step_s`) and ~350 ms at ~16 sequences (serve_smollm_135m_load: TPOT
mean 348 ms), i.e. step(b) = 93 ms + 16.1 ms x b; KV capacity 2 GiB / 46,080 B per token
(30 layers x 3 KV heads x 64 x 2 x fp32) = 46,603 tokens. A GPU-class replica applies two
documented factors: `speedup` (default 12) on prefill throughput and the fixed part of a decode
step (weight reads: memory-bound on a GPU), and `batch_speedup` (default 100) on the per-sequence
part (compute: the CPU is compute-bound at batch, a GPU is not; its FLOP/byte ratio is ~50x the
CPU's): prefill 3,350 tok/s, step(b) = 7.7 ms + 0.16 ms x b, same KV tokens (KV binds before ITL).

Static peak provisioning: both pools sized for the trace's peak demand x `static_headroom` at the
per-replica targets the policy uses (prefill: queueDepthTarget in flight per replica, i.e.
utilization q / (1 + q); decode: kvCacheTarget of the KV cache at the demand's mean context).

Invariants: after `actuate`, every pool has ready + loading + unschedulable == desired, all >= 0,
and the scheduled pods of all pools fit the GPU budget; a `PoolView` holds only what an engine's
/metrics, the router or the Kubernetes API would show.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from autoscale_traces import Trace

CPU_PREFILL_TPS = 1932 / 6.919
CPU_STEP_BS1_S = 0.1087
CPU_STEP_PER_SEQ_S = (0.348 - 0.1087) / 15
KV_CAPACITY_TOKENS = 2 * 1024**3 // 46_080
MAX_BATCH = 256  # sequences one decode replica runs at most
POOLS = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Perf:
    prefill_tps: float
    step0_s: float
    step_per_seq_s: float
    kv_tokens: float

    @staticmethod
    def calibrated(speedup: float = 12.0, batch_speedup: float = 100.0) -> Perf:
        fixed = CPU_STEP_BS1_S - CPU_STEP_PER_SEQ_S
        return Perf(CPU_PREFILL_TPS * speedup, fixed / speedup, CPU_STEP_PER_SEQ_S / batch_speedup, KV_CAPACITY_TOKENS)

    def step(self, batch: float) -> float:
        return self.step0_s + self.step_per_seq_s * batch

    def max_batch(self, context: float) -> float:
        return min(self.kv_tokens / context, MAX_BATCH)


@dataclass(frozen=True, slots=True)
class Params:
    dt: float = 2.0
    gpus: int = 1000
    pod_start_s: float = 90.0
    slo_ttft: float = 1.0
    slo_itl: float = 0.06
    kv_target: float = 0.6  # the policy's kvCacheTarget, and static sizing's decode occupancy
    queue_target: float = 1.0  # the policy's queueDepthTarget, and static sizing's prefill in-flight
    down_seconds: float = 300.0
    max_step_percent: float = 100.0
    window_s: float = 60.0  # metrics window of the latency percentiles
    interval_s: float = 15.0  # Tidepool's decision interval (the baselines have their own periods)
    static_headroom: float = 1.15  # static = peak demand x this


def replicas_needed(
    perf: Perf, params: Params, rate: np.ndarray, prompt: np.ndarray, output: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Fractional replicas per pool serving `rate` req/s at the per-replica targets the policy uses."""
    rho = params.queue_target / (1 + params.queue_target)  # in-flight per replica = rho / (1 - rho)
    batch = params.kv_target * perf.kv_tokens / (prompt + output / 2)
    per_replica = batch / perf.step(batch) / output
    return rate * prompt / (perf.prefill_tps * rho), rate / per_replica


def fit_scale(perf: Perf, params: Params, trace: Trace, fill: float = 0.97) -> float:
    """Rate multiplier after which static peak provisioning of `trace` uses `fill` of the GPU budget."""
    prefill, decode = replicas_needed(perf, params, trace.rate, trace.prompt_mean, trace.output_mean)
    return fill * params.gpus / (params.static_headroom * (prefill.max() + decode.max()))


def static_replicas(perf: Perf, params: Params, trace: Trace, until_s: float | None = None) -> dict[str, int]:
    """Replicas for the trace's peak demand x headroom (`until_s`: the peak before then, no headroom)."""
    end = trace.ticks if until_s is None else max(int(until_s / trace.dt), 1)
    prefill, decode = replicas_needed(perf, params, trace.rate[:end], trace.prompt_mean[:end], trace.output_mean[:end])
    headroom = params.static_headroom if until_s is None else 1.0
    return {"prefill": math.ceil(prefill.max() * headroom), "decode": math.ceil(decode.max() * headroom)}


def weighted_p95(window: deque[tuple[float, float, float]]) -> float | None:
    total = sum(w for _, _, w in window)
    if total <= 0:
        return None
    cum = 0.0
    for _, value, weight in sorted(window, key=lambda e: e[1]):
        cum += weight
        if cum >= 0.95 * total:
            return value
    return None


@dataclass(slots=True)
class PoolView:
    """What a controller can observe of one pool at a decision: pod counts and the engines' gauges."""

    desired: int  # the workload's spec.replicas
    ready: int  # serving, scraped
    loading: int  # scheduled, starting (container up, engine loading: no metrics yet)
    unschedulable: int  # Pending: over the GPU budget
    running: float  # vllm:num_requests_running, sum over ready pods
    waiting: float  # vllm:num_requests_waiting, sum over ready pods
    kv_usage: float | None  # vllm:kv_cache_usage_perc, mean over ready pods
    first_tokens: float  # requests that got their first token within the window
    window_s: float
    latency: deque[tuple[float, float, float]] = field(repr=False)  # (time, seconds, weight) within the window
    prompt_tokens: float = 0.0  # vllm:prompt_tokens_total increase over the window (prefill: requests prefilled)
    generation_tokens: float = 0.0  # vllm:generation_tokens_total increase over the window

    def latency_p95(self) -> float | None:
        return weighted_p95(self.latency)


class Controller(Protocol):
    name: str
    interval_s: float  # 0: never decides (static)

    def decide(self, now: float, views: Mapping[str, PoolView]) -> dict[str, int]: ...


@dataclass(slots=True)
class Pool:
    desired: int
    ready: int
    loading: deque[list[float]] = field(default_factory=deque)  # [ready time, count], oldest first
    n_loading: int = 0
    unschedulable: int = 0

    @property
    def scheduled(self) -> int:
        return self.ready + self.n_loading


def actuate(pools: dict[str, Pool], target: Mapping[str, int], now: float, params: Params) -> None:
    """Apply desired replicas: loading pods go first on a scale-down; pods over the GPU budget stay Pending."""
    for name, pool in pools.items():
        pool.desired = target[name]
        excess = pool.scheduled - pool.desired
        while excess > 0 and pool.loading:  # the most recently started first
            take = min(excess, int(pool.loading[-1][1]))
            pool.loading[-1][1] -= take
            pool.n_loading -= take
            excess -= take
            if pool.loading[-1][1] <= 0:
                pool.loading.pop()
        pool.ready -= max(excess, 0)
    free = params.gpus - sum(p.scheduled for p in pools.values())
    for pool in pools.values():
        want = pool.desired - pool.scheduled
        start = max(min(want, free), 0)
        if start:
            pool.loading.append([now + params.pod_start_s, start])
            pool.n_loading += start
        free -= start
        pool.unschedulable = want - start
