"""Helpers for the autoscaler tests: Prometheus text for synthetic engine pods, policy inputs.

`engine_metrics_text` renders exactly what an engine pod exposes (prometheus_client with the
engine's own bucket layouts), so the parser is tested against the real exposition format.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tidepool.contract import metrics_names as names
from tidepool.engine.server.metrics import ITL_BUCKETS, TTFT_BUCKETS
from tidepool.operator.autoscaler.policy_types import AutoscaleConfig, PoolBounds, PoolSnapshot, PoolState


def engine_metrics_text(
    ttft: Iterable[float] = (),
    itl: Iterable[float] = (),
    *,
    kv: float = 0.0,
    waiting: int = 0,
    running: int = 0,
    preemptions: int = 0,
    prompt_tokens: int = 0,
    generation_tokens: int = 0,
    model_names: tuple[str, ...] = ("m",),
) -> str:
    """One pod's /metrics body; observations are split round-robin over `model_names`."""
    registry = CollectorRegistry()
    label = [names.MODEL_NAME_LABEL]
    ttft_h = Histogram(names.TIME_TO_FIRST_TOKEN_SECONDS, "ttft", label, buckets=TTFT_BUCKETS, registry=registry)
    itl_h = Histogram(names.INTER_TOKEN_LATENCY_SECONDS, "itl", label, buckets=ITL_BUCKETS, registry=registry)
    kv_g = Gauge(names.KV_CACHE_USAGE_PERC, "kv", label, registry=registry)
    wait_g = Gauge(names.NUM_REQUESTS_WAITING, "w", label, registry=registry)
    run_g = Gauge(names.NUM_REQUESTS_RUNNING, "r", label, registry=registry)
    pre_c = Counter(names.NUM_PREEMPTIONS, "p", label, registry=registry)
    prompt_c = Counter(names.PROMPT_TOKENS, "pt", label, registry=registry)
    gen_c = Counter(names.GENERATION_TOKENS, "gt", label, registry=registry)
    for i, value in enumerate(ttft):
        ttft_h.labels(model_names[i % len(model_names)]).observe(value)
    for i, value in enumerate(itl):
        itl_h.labels(model_names[i % len(model_names)]).observe(value)
    for model in model_names:
        ttft_h.labels(model)
        itl_h.labels(model)
        kv_g.labels(model).set(kv)
    wait_g.labels(model_names[0]).set(waiting)
    run_g.labels(model_names[0]).set(running)
    pre_c.labels(model_names[0]).inc(preemptions)
    prompt_c.labels(model_names[0]).inc(prompt_tokens)
    gen_c.labels(model_names[0]).inc(generation_tokens)
    return generate_latest(registry).decode()


def unified_config(**overrides) -> AutoscaleConfig:
    values = dict(
        pools={"unified": PoolBounds(1, 20)},
        ttft_p95_s=0.5,
        itl_p95_s=0.05,
        kv_cache_target=0.75,
        queue_depth_target=4.0,
        down_seconds=0.0,
    )
    values.update(overrides)
    return AutoscaleConfig(**values)


def pd_config(**overrides) -> AutoscaleConfig:
    values = dict(
        pools={"prefill": PoolBounds(1, 40), "decode": PoolBounds(1, 40)},
        ttft_p95_s=0.5,
        itl_p95_s=0.05,
        down_seconds=0.0,
    )
    values.update(overrides)
    return AutoscaleConfig(**values)


def snap(pods: int, **fields) -> PoolSnapshot:
    """A complete snapshot of `pods` measured pods with some traffic; `fields` override."""
    values = dict(
        ttft_p95_s=0.2,
        itl_p95_s=0.02,
        num_requests=100.0,
        kv_cache_usage=0.7,
        num_waiting=0.0,
        num_running=8.0 * pods,
        preemptions_per_s=0.0,
        num_pods_scraped=pods,
        window_s=60.0,
    )
    values.update(fields)
    return PoolSnapshot(**values)


def state(replicas: int, unschedulable: int = 0) -> PoolState:
    return PoolState(replicas=replicas, num_unschedulable=unschedulable, unschedulable_message="Insufficient gpu")
