"""Helpers for measuring how quiet the operator is at scale (no tests here): test_cp_operator_quiet.py runs the
CI-sized measurement, bench/operator_quiet.py the issue's full one (100 services, 10 minutes).

- `advisory_service(name)`: a CPU-only unified InferenceService autoscaled in advisory mode whose steady load
  (KV usage 0.9 against a target of 0.5 on its one replica) makes the autoscaler recommend 2 replicas that nothing
  applies: the case that used to post an AdvisoryScale Event every tick and refresh status every 60 s.
- `SteadyFeed`: autoscale_feed.Feed with the same blocks, but the Ready pods come from one namespace-wide LIST at
  most every `list_s` seconds instead of one LIST per scrape (100 services ticking would otherwise cost the API
  server, and a 2-core machine, a LIST per service per tick from the test itself).
- `decisions(port)`: the operator's own count of autoscaler decisions per service (its /metrics), i.e. ticks;
  `wait_for_ticks` waits until every service made `num_ticks` more, so a window is a number of ticks, not a
  wall-clock time hoping the machine kept up.
- `quiet_counts(before, after)`: from two `apiserver_counters` snapshots, the Event writes (POST, PATCH) and the
  InferenceService status writes (PATCH, PUT, APPLY on inferenceservices/status) the API server counted.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

from autoscale_feed import Feed, histogram
from operator_kit import counter_delta
from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, str]
STATUS_WRITE_VERBS = ("PATCH", "PUT", "APPLY")


def advisory_service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
            "resources": {"gpusPerReplica": 0, "cpu": "100m", "memory": "256Mi"},
            "mode": "unified",
            "pools": {"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4}},
            "router": {"replicas": 1},
            # Production defaults everywhere else (stabilization windows, step, tolerance).
            "autoscaling": {"enabled": True, "mode": "advisory", "kvCacheTarget": 0.5},
        },
    }


class SteadyFeed(Feed):
    """Feed's per-pod blocks, the Ready pods listed once per `list_s` for the whole namespace."""

    def __init__(self, cluster, namespace: str, list_s: float = 5.0) -> None:
        super().__init__(cluster)
        self.namespace, self.list_s = namespace, list_s
        self._ready: dict[Key, list[str]] = {}
        self._listed_at = float("-inf")
        self._list_lock = threading.Lock()

    def ready_pods(self, name: str, pool: str) -> list[str]:
        """The pool's Ready pods as of the last LIST. One thread refreshes a stale list while the others answer
        from it (a scrape waiting on a LIST of hundreds of pods would miss the operator's 2 s scrape timeout)."""
        is_first = self._listed_at == float("-inf")
        if time.monotonic() - self._listed_at > self.list_s and self._list_lock.acquire(blocking=is_first):
            try:
                if time.monotonic() - self._listed_at > self.list_s:
                    self._ready, self._listed_at = self._list(), time.monotonic()
            finally:
                self._list_lock.release()
        return sorted(self._ready.get((name, pool), []))

    def _list(self) -> dict[Key, list[str]]:
        raw = self.core.list_namespaced_pod(
            self.namespace,
            label_selector="tidepool.dev/inferenceservice",
            _request_timeout=(5, 30),
            _preload_content=False,  # plain JSON: the client's models are slow to build for hundreds of pods
        )
        ready: dict[Key, list[str]] = {}
        for pod in json.loads(raw.data)["items"]:
            labels = pod["metadata"].get("labels") or {}
            status = pod.get("status") or {}
            is_ready = status.get("phase") == "Running" and any(
                c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
            )
            if is_ready and "tidepool.dev/pool" in labels:
                key = (labels["tidepool.dev/inferenceservice"], labels["tidepool.dev/pool"])
                ready.setdefault(key, []).append(pod["metadata"]["name"])
        return ready

    def body(self, namespace: str, name: str, pool: str) -> str:
        pods = self.ready_pods(name, pool)
        blocks = []
        with self.lock:
            load = self.load.get(pool, {"kv": 0.0, "requests": 0, "ttft": 0.1})
            for pod in pods:
                self.counts[pod] = self.counts.get(pod, 0) + int(load["requests"])
                lines = [
                    f"# pod: {pod}",
                    f'vllm:kv_cache_usage_perc{{model_name="m"}} {load["kv"]}',
                    'vllm:num_requests_waiting{model_name="m"} 0',
                    f'vllm:num_requests_running{{model_name="m"}} {1 if load["requests"] else 0}',
                    *histogram("vllm:time_to_first_token_seconds", self.counts[pod], load["ttft"]),
                ]
                blocks.append("\n".join(lines))
            blocks.append(f'# pod: router-0\ntidepool_router_held_requests{{pool="{pool}"}} {self.held.get(pool, 0)}')
        return "\n".join(blocks) + "\n"


def decisions(metrics_port: int) -> dict[Key, float]:
    """Autoscaler decisions (ticks) per service so far, from the operator's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "tidepool_autoscaler_decisions":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = (sample.labels["namespace"], sample.labels["name"])
                out[key] = out.get(key, 0.0) + sample.value
    return out


def wait_for_ticks(
    metrics_port: int, keys: list[Key], num_ticks: int, timeout_s: float, since: dict[Key, float] | None = None
) -> dict[Key, float]:
    """Wait until every service in `keys` made `num_ticks` decisions after `since` (default: now); returns the
    counts then. Raises AssertionError naming the slowest service on timeout."""
    start = since if since is not None else decisions(metrics_port)
    deadline = time.monotonic() + timeout_s
    while True:
        now = decisions(metrics_port)
        behind = {k: now.get(k, 0.0) - start.get(k, 0.0) for k in keys}
        if min(behind.values()) >= num_ticks:
            return now
        if time.monotonic() > deadline:
            slowest = min(behind, key=behind.__getitem__)
            raise AssertionError(f"{slowest} made {behind[slowest]:.0f} of {num_ticks} ticks in {timeout_s}s")
        time.sleep(1.0)


def quiet_counts(before: dict, after: dict) -> dict[str, float]:
    """Event writes and InferenceService status writes the API server counted between two snapshots. Event
    writes include every component's (the cluster's own controllers post Events too): an upper bound on the
    operator's. Status writes of InferenceServices come from the operator only."""
    total = "apiserver_request_total"
    created = counter_delta(before, after, total, resource="events", verb="POST")
    patched = counter_delta(before, after, total, resource="events", verb="PATCH")
    status = sum(
        counter_delta(before, after, total, resource="inferenceservices", subresource="status", verb=verb)
        for verb in STATUS_WRITE_VERBS
    )
    writes = sum(
        counter_delta(before, after, total, resource="inferenceservices", verb=verb)
        for verb in (*STATUS_WRITE_VERBS, "POST", "DELETE")
    )
    return {"events_created": created, "events_patched": patched, "status_writes": status, "service_writes": writes}


def service_events(cluster, namespace: str) -> list[dict[str, Any]]:
    """The Events about InferenceServices in `namespace`."""
    out = cluster.kubectl(
        "get", "events", "-n", namespace, "-o", "json", "--field-selector", "involvedObject.kind=InferenceService"
    )
    return json.loads(out.stdout)["items"]
