"""The router's own Prometheus metrics (names in `metrics_names`), in a registry per app.

Gauges that describe the pools (held requests, replicas per state) are read from the pools
at scrape time by a custom collector, so they can never drift from the state they report.
Every pool's held gauge is exported even at 0, so the autoscaler sees the series exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tidepool.contract.router_metrics_names import (
    CODE_LABEL,
    HELD_REQUESTS,
    LORA_AFFINITY_HITS,
    LORA_AFFINITY_MISSES,
    POOL_LABEL,
    PREFIX_FALLBACKS,
    REPLICA_LABEL,
    REPLICAS,
    REQUEST_DURATION_SECONDS,
    REQUESTS,
    RETRIES,
    STATE_LABEL,
)

from .pool import Pool, ReplicaState

_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _PoolCollector(Collector):
    def __init__(self, pools: Iterable[Pool]) -> None:
        self.pools = list(pools)

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            HELD_REQUESTS, "Requests held while their pool has no ready replica", labels=[POOL_LABEL]
        )
        replicas = GaugeMetricFamily(REPLICAS, "Known replicas by state", labels=[POOL_LABEL, STATE_LABEL])
        for pool in self.pools:
            held.add_metric([pool.name], pool.num_held)
            counts = pool.count_by_state()
            for state in ReplicaState:
                replicas.add_metric([pool.name, state.value], counts[state])
        yield held
        yield replicas


class RouterMetrics:
    def __init__(self, pools: Iterable[Pool]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(pools))
        self.requests = Counter(
            REQUESTS, "Client requests answered", [POOL_LABEL, REPLICA_LABEL, CODE_LABEL], registry=self.registry
        )
        self.retries = Counter(RETRIES, "Attempts repeated on another replica", [POOL_LABEL], registry=self.registry)
        self.prefix_fallbacks = Counter(
            PREFIX_FALLBACKS,
            "Prefix-aware choices overridden because the target was hot",
            [POOL_LABEL],
            registry=self.registry,
        )
        self.lora_affinity_hits = Counter(
            LORA_AFFINITY_HITS,
            "Adapter requests sent to a replica holding the adapter",
            [POOL_LABEL],
            registry=self.registry,
        )
        self.lora_affinity_misses = Counter(
            LORA_AFFINITY_MISSES,
            "Adapter requests sent by load because no ready replica held the adapter",
            [POOL_LABEL],
            registry=self.registry,
        )
        self.duration = Histogram(
            REQUEST_DURATION_SECONDS,
            "Client request duration, arrival to last byte",
            [POOL_LABEL],
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )

    def observe(self, pool: str, replica: str, code: str, seconds: float) -> None:
        self.requests.labels(pool, replica, code).inc()
        self.duration.labels(pool).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
