"""Replica health: probe `/ready`, scrape the load gauges from `/metrics`, every `interval_s`.

A probe is: GET `/ready` (200 → ready; any other status → unready, e.g. loading or
draining) then, when ready, GET `/metrics` for `vllm:num_requests_waiting`,
`vllm:num_requests_running` and `vllm:kv_cache_usage_perc` (summed over label sets; a
replica serves one model), then GET `/v1/models` for the adapters it holds (LoRA affinity, see
`lora`; an answer that is not a model list leaves them unknown). A replica whose metrics say its engine
sleeps (`vllm:engine_sleep_state`, tidepool.contract.sleep: the operator put an idle pool to sleep, and its
`/ready` stays 200) is unready to the router, like one at zero: its requests are held, which the operator
sees (`tidepool_router_held_requests`) and answers by waking the pool; the next probe then makes it ready.
A transport error is a failure (a refused connection ejects the replica at once, see
`Pool.record_failure`). New replicas are probed as soon as discovery reports them (`probe_now`), so a
request held at zero is released without waiting a period.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable

import httpx

from tidepool.contract.metrics_names import KV_CACHE_USAGE_PERC, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from tidepool.contract.sleep import AWAKE, ENGINE_SLEEP_STATE_METRIC, SLEEP_STATE_LABEL

from .lora import ReplicaModels, parse_models
from .pool import Pool, Replica

logger = logging.getLogger(__name__)
_SLEEP_STATE_RE = re.compile(SLEEP_STATE_LABEL + r'="([^"]*)"')


def parse_gauges(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum each named sample over its label sets in Prometheus text format; names absent are 0."""
    wanted = set(names)
    totals = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for sep in ("{", " "):
            index = line.find(sep)
            if index != -1:
                name_end = min(name_end, index)
        name = line[:name_end]
        if name not in wanted:
            continue
        value = line.rsplit("}", 1)[-1].split()
        try:
            totals[name] += float(value[0])
        except (IndexError, ValueError):
            logger.debug("unparsable metrics line: %r", line)
    return totals


def is_asleep(text: str) -> bool:
    """Whether an engine's metrics say it sleeps: a `vllm:engine_sleep_state` sample whose `sleep_state` is not
    `awake` at 1 (an engine without sleep mode exports none: awake)."""
    for line in text.splitlines():
        if not line.startswith(ENGINE_SLEEP_STATE_METRIC + "{"):
            continue
        labels, _, value = line.partition("}")
        match = _SLEEP_STATE_RE.search(labels)
        try:
            if match and match.group(1) != AWAKE and float(value.split()[0]) == 1.0:
                return True
        except (IndexError, ValueError):
            logger.debug("unparsable metrics line: %r", line)
    return False


class HealthChecker:
    def __init__(
        self, pools: Iterable[Pool], client: httpx.AsyncClient, interval_s: float = 1.0, timeout_s: float = 2.0
    ) -> None:
        self.pools = list(pools)
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def run(self) -> None:
        while True:
            await asyncio.gather(*(self.probe_now(pool) for pool in self.pools))
            await asyncio.sleep(self.interval_s)

    async def probe_now(self, pool: Pool, replicas: Iterable[Replica] | None = None) -> None:
        targets = list(pool.replicas.values()) if replicas is None else list(replicas)
        await asyncio.gather(*(self._probe(pool, r) for r in targets))

    async def _probe(self, pool: Pool, replica: Replica) -> None:
        url = replica.url
        try:
            ready = await self.client.get(f"{url}/ready", timeout=self.timeout_s)
            if ready.status_code != 200:
                pool.mark_unready(url, f"/ready answered {ready.status_code}")
                return
            metrics = await self.client.get(f"{url}/metrics", timeout=self.timeout_s)
            models = await self.client.get(f"{url}/v1/models", timeout=self.timeout_s)
        except httpx.ConnectError as err:
            pool.record_failure(url, f"probe: {err!r}", is_fatal=True)
            return
        except httpx.HTTPError as err:
            pool.record_failure(url, f"probe: {err!r}")
            return
        if is_asleep(metrics.text):
            pool.mark_unready(url, "engine asleep (sleep mode)")
            return
        pool.set_models(url, _models_of(models))
        gauges = parse_gauges(metrics.text, (NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING, KV_CACHE_USAGE_PERC))
        pool.mark_ready(
            url, int(gauges[NUM_REQUESTS_WAITING]), int(gauges[NUM_REQUESTS_RUNNING]), gauges[KV_CACHE_USAGE_PERC]
        )


def _models_of(response: httpx.Response) -> ReplicaModels | None:
    if response.status_code != 200:
        return None
    try:
        return parse_models(response.json())
    except ValueError:
        return None
