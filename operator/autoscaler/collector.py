"""Collection: scrape engine pods' `/metrics` (and routers' held requests) into per-pool windows.

Role: once per interval, for each pool of an InferenceService, a `MetricsSource` returns the
`/metrics` bodies of the pool's ready pods (and of its routers); `Collector` parses them into a
`window.Scrape` and appends it to that pool's `PoolWindow` (the windows live in the service's state).
Partial data is normal: a pod that times out or answers garbage counts in `num_pods_failed`, which
the policy reads as "incomplete: never scale down".

Sources (pluggable, so tests feed synthetic metrics; KWOK pods have no real IPs):
- `PodsSource`: the IPs of the pool's ready pods from the operator's pod cache (fed by its watch,
  so scraping costs the API server nothing), scraped over HTTP with httpx and a timeout.
- `PrometheusSource`: a Prometheus server's `/federate` (operator env TIDEPOOL_PROMETHEUS_URL),
  series split into pods by their `pod` label.
- `UrlTemplateSource`: one URL per pool from a template (operator flag
  `--metrics-source-url-template`, e.g. `http://feed:9000/{namespace}/{name}/{pool}`) whose body
  is the concatenated text of all the pool's pods, one block per pod, each block starting with
  the comment line `# pod: <pod-name>`; a feed for tests and for Prometheus-federation setups.

Invariants: no decisions here; times are the caller's (monotonic) clock; the router body's
`tidepool_router_held_requests{pool}` goes to the matching pool's scrape.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from tidepool.operator.builders.common import ENGINE_PORT, ROUTER_POOL, ROUTER_PORT
from tidepool.operator.cache import PodInfo

from .metrics import MetricsParseError, PodMetrics, held_requests_by_pool, pod_metrics_from_text
from .policy_types import PoolSnapshot
from .window import PoolWindow, Scrape

_POD_LABEL = re.compile(r'[{,]pod="([^"]+)"')


@dataclass(slots=True)
class PoolBodies:
    """Raw `/metrics` bodies of one pool: answered pods, failed pods, router bodies."""

    bodies: dict[str, str] = field(default_factory=dict)  # pod name -> body
    num_failed: int = 0
    router_bodies: list[str] = field(default_factory=list)


class MetricsSource(Protocol):
    async def fetch(self, namespace: str, name: str, pools: tuple[str, ...]) -> dict[str, PoolBodies]: ...


def split_pod_blocks(text: str) -> dict[str, str]:
    """A feed body -> {pod name: its block}; text before the first `# pod:` line is ignored."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("# pod:"):
            current = blocks.setdefault(line.removeprefix("# pod:").strip(), [])
        elif current is not None:
            current.append(line)
    return {pod: "\n".join(lines) for pod, lines in blocks.items()}


class UrlTemplateSource:
    """One HTTP body per pool from a URL template with {namespace}, {name} and {pool}."""

    def __init__(self, template: str, client: httpx.AsyncClient, timeout_s: float = 2.0) -> None:
        self.template, self.client, self.timeout_s = template, client, timeout_s

    async def fetch(self, namespace: str, name: str, pools: tuple[str, ...]) -> dict[str, PoolBodies]:
        async def one(pool: str) -> PoolBodies:
            url = self.template.format(namespace=namespace, name=name, pool=pool)
            try:
                response = await self.client.get(url, timeout=self.timeout_s)
                response.raise_for_status()
            except httpx.HTTPError:
                return PoolBodies(num_failed=1)
            blocks = split_pod_blocks(response.text)
            router = [b for pod, b in blocks.items() if pod.startswith("router")]
            return PoolBodies({p: b for p, b in blocks.items() if not p.startswith("router")}, 0, router)

        results = await asyncio.gather(*(one(pool) for pool in pools))
        return dict(zip(pools, results, strict=True))


class PrometheusSource:
    """Series from a Prometheus server's `/federate` endpoint, split into per-pod bodies by `pod` label.

    Prometheus (e.g. via the chart's ServiceMonitor) labels every scraped series with `namespace`
    and `pod`; engine pods of a pool are named `<service>-<pool>-...`, routers `<service>-router-...`.
    Pods Prometheus does not report simply count as not scraped (so the policy sees incomplete data).
    """

    def __init__(self, base_url: str, client: httpx.AsyncClient, timeout_s: float = 5.0) -> None:
        self.base_url, self.client, self.timeout_s = base_url.rstrip("/"), client, timeout_s

    async def fetch(self, namespace: str, name: str, pools: tuple[str, ...]) -> dict[str, PoolBodies]:
        # Kubernetes names are [a-z0-9.-]: only "." is special in the regex; PromQL strings need its "\\" doubled.
        pod_re = name.replace(".", "\\\\.")
        selector = f'{{namespace="{namespace}",pod=~"{pod_re}-.+",__name__=~"vllm:.+|tidepool_router_.+"}}'
        try:
            response = await self.client.get(
                f"{self.base_url}/federate", params={"match[]": selector}, timeout=self.timeout_s
            )
            response.raise_for_status()
        except httpx.HTTPError:
            return {pool: PoolBodies(num_failed=1) for pool in pools}
        by_pod: dict[str, list[str]] = {}
        for line in response.text.splitlines():
            match = _POD_LABEL.search(line) if line and not line.startswith("#") else None
            if match:
                by_pod.setdefault(match.group(1), []).append(line)
        routers = ["\n".join(lines) for pod, lines in by_pod.items() if pod.startswith(f"{name}-router-")]
        return {
            pool: PoolBodies(
                {pod: "\n".join(lines) for pod, lines in by_pod.items() if pod.startswith(f"{name}-{pool}-")},
                0,
                routers,
            )
            for pool in pools
        }


class PodsSource:
    """Ready pods' IPs from the operator's pod cache (no API request), scraped over httpx.

    Only rank 0 of a multi-node replica serves HTTP, so only it is scraped; the router's pods
    (pool "router") give the held requests."""

    def __init__(
        self,
        pods_of: Callable[[str, str], Sequence[PodInfo]],
        client: httpx.AsyncClient,
        timeout_s: float = 2.0,
        port_of: Callable[[PodInfo], int] | None = None,
    ) -> None:
        self.pods_of, self.client, self.timeout_s = pods_of, client, timeout_s
        self.port_of = port_of or (lambda pod: ROUTER_PORT if pod.pool == ROUTER_POOL else ENGINE_PORT)

    def _ready(self, namespace: str, name: str, pool: str) -> list[tuple[str, str, int]]:
        return [
            (p.name, p.ip, self.port_of(p))
            for p in self.pods_of(namespace, name)
            if p.pool == pool and p.is_ready and p.ip and p.rank == 0
        ]

    async def _get(self, ip: str, port: int) -> str | None:
        host = f"[{ip}]" if ":" in ip else ip
        try:
            response = await self.client.get(f"http://{host}:{port}/metrics", timeout=self.timeout_s)
            response.raise_for_status()
            return response.text
        except httpx.HTTPError:
            return None

    async def fetch(self, namespace: str, name: str, pools: tuple[str, ...]) -> dict[str, PoolBodies]:
        routers = self._ready(namespace, name, ROUTER_POOL)
        router_bodies = [b for b in await asyncio.gather(*(self._get(ip, port) for _, ip, port in routers)) if b]
        out = {}
        for pool in pools:
            pods = self._ready(namespace, name, pool)
            bodies = await asyncio.gather(*(self._get(ip, port) for _, ip, port in pods))
            answered = {pod: body for (pod, _, _), body in zip(pods, bodies, strict=True) if body is not None}
            out[pool] = PoolBodies(answered, len(pods) - len(answered), router_bodies)
        return out


class Collector:
    """Fills the windows of an InferenceService's pools from one `MetricsSource`. The windows are the service's
    own (its `AutoscaleState` holds them), so they go when the service does."""

    def __init__(self, source: MetricsSource, window_s: float = 60.0) -> None:
        self.source, self.window_s = source, window_s

    async def collect(
        self, windows: dict[str, PoolWindow], namespace: str, name: str, pools: tuple[str, ...], now: float
    ) -> None:
        fetched = await self.source.fetch(namespace, name, pools)
        for pool in pools:
            got = fetched.get(pool) or PoolBodies()
            windows.setdefault(pool, PoolWindow(self.window_s)).add(to_scrape(pool, got, now))


def snapshots(windows: Mapping[str, PoolWindow], pools: tuple[str, ...]) -> dict[str, PoolSnapshot]:
    """The snapshot of each pool that has a window."""
    return {pool: w.snapshot() for pool in pools if (w := windows.get(pool)) is not None}


def to_scrape(pool: str, got: PoolBodies, now: float) -> Scrape:
    pods: dict[str, PodMetrics] = {}
    failed = got.num_failed
    for pod, body in got.bodies.items():
        try:
            pods[pod] = pod_metrics_from_text(body)
        except MetricsParseError:
            failed += 1
    held = 0.0
    for body in got.router_bodies:
        try:
            held += held_requests_by_pool(body).get(pool, 0.0)
        except MetricsParseError:
            continue
    return Scrape(now, pods, failed, held)
