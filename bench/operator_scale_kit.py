"""Parts of `bench/operator_scale.py`: the services, the cluster's flags, creating them, following them to Ready.

`service(name, router)` is the one spec every run creates (with a router Deployment, or
`spec.router.enabled: false`); `create_all` POSTs the InferenceServices, or in floor mode applies the
children the operator's own builders derive from that same spec (its two-phase apply, 16 services at a
time, no operator); `watch_ready` samples from two watches how many engine Deployments exist, how many
serve and how many services are Ready (floor mode: engine and, if the spec has one, router Deployments
serving). `requests_to_ready` and `events_by_reason` say where the API server's work came from;
`plot` draws a timeline. No module-level state besides the constant flags.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "e2e" / "controlplane"), str(REPO / "tests" / "controlplane")]

from operator_kit import is_ready, requests_by_kind  # noqa: E402

import devcluster  # noqa: E402
from tidepool.operator.builders import ServiceView, desired_state  # noqa: E402
from tidepool.operator.k8s import KubeClient, load_credentials  # noqa: E402
from tidepool.operator.reconcile import apply_all  # noqa: E402

NAMESPACE = "bench"
COMPONENT_FLAGS = {
    # kwok renews node leases (without a duration it renews none and nodes go NotReady); 1,000 nodes at
    # the kubelet's 40 s would be ~100 lease writes a second of background load on a 2-core machine.
    "kwok": ["--node-lease-duration-seconds=600"],
    "kube-controller-manager": [
        "--kube-api-qps=1000",
        "--kube-api-burst=2000",
        "--concurrent-deployment-syncs=25",
        "--concurrent-replicaset-syncs=25",
        # kwok renews 1,000 node leases; on a starved machine it falls behind, the node lifecycle controller
        # marks nodes NotReady and sets every pod's Ready=False for good (KWOK only readies Pending pods).
        "--node-monitor-grace-period=1h",
    ],
    "kube-scheduler": ["--kube-api-qps=1000", "--kube-api-burst=2000"],
}
APPLY_CONCURRENCY = 16  # floor mode: services applied at once (the operator's default workers)


def service(name: str, router: bool = True) -> dict[str, Any]:
    """One one-GPU unified InferenceService: 1 engine pod, and 1 router pod unless `router` is False."""
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
            "resources": {"gpusPerReplica": 1, "cpu": "1", "memory": "4Gi"},
            "mode": "unified",
            "pools": {"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2}},
            "router": {"replicas": 1} if router else {"enabled": False},
        },
    }


def children_of(name: str, router: bool) -> list[dict[str, Any]]:
    """What the operator's builders derive from `service(name, router)`: what floor mode applies."""
    body = service(name, router)
    children = desired_state(name, NAMESPACE, ServiceView.from_body(body)).children
    for obj in children:
        obj["metadata"]["namespace"] = NAMESPACE
    return children


class ProcStats:
    """CPU seconds and peak RSS of one process, from /proc (Linux)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.ticks = os.sysconf("SC_CLK_TCK")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.ticks  # utime + stime

    def rss_mb(self, key: str = "VmRSS") -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
        return 0.0


def patch_component_flags() -> None:
    """Every DevCluster started after this passes COMPONENT_FLAGS to its components (idempotent)."""
    if getattr(devcluster.DevCluster, "_bench_flags", False):
        return
    original = devcluster.DevCluster._spawn

    def spawn(self: devcluster.DevCluster, name: str, args: list[str]) -> None:
        original(self, name, [*args, *COMPONENT_FLAGS.get(name, [])])

    devcluster.DevCluster._spawn = spawn  # type: ignore[method-assign]
    devcluster.DevCluster._bench_flags = True  # type: ignore[attr-defined]


async def create_all(kubeconfig: Path, num: int, floor: bool, router: bool) -> float:
    """POST N InferenceServices with bounded concurrency; returns seconds taken. With `floor`, apply each
    service's children instead (the operator's own builders and two-phase apply, no operator running)."""
    t0 = time.monotonic()
    sem = asyncio.Semaphore(APPLY_CONCURRENCY)
    async with KubeClient(load_credentials(str(kubeconfig)), max_connections=APPLY_CONCURRENCY) as api:

        async def one(i: int) -> None:
            name = f"s{i:04d}"
            async with sem:
                if floor:
                    _, error = await apply_all(api, children_of(name, router))
                    if error:
                        raise RuntimeError(error)
                    return
                path = f"/apis/tidepool.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices"
                await api.request("POST", path, service(name, router))

        await asyncio.gather(*(one(i) for i in range(num)))
    return time.monotonic() - t0


class Progress:
    """Counts from two watches (InferenceServices; Deployments): engine Deployments created, those with every
    replica ready, services Ready at their generation. A watch costs the API server one event per change;
    polling full lists of 1,000 services and 2,000 Deployments every few seconds would cost it more than
    the operator does."""

    def __init__(self, api: KubeClient, floor: bool = False, router: bool = True) -> None:
        self.api, self.floor, self.router = api, floor, router
        self.ready: dict[str, bool] = {}
        self.engines: dict[str, bool] = {}  # engine Deployment -> every replica ready
        self.routers: dict[str, bool] = {}  # router Deployment -> every replica ready (floor mode's "ready")
        self.synced = 0

    def counts(self) -> dict[str, int]:
        if self.floor:  # no operator, no status: a service is up when its engine (and router) pods are
            ready = sum(ok and (not self.router or self.routers.get(name.removesuffix("-unified") + "-router", False))
                        for name, ok in self.engines.items())  # fmt: skip
        else:
            ready = sum(self.ready.values())
        return {"engines": len(self.engines), "engines_ready": sum(self.engines.values()), "ready": ready}

    def _update(self, kind: str, event_type: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if kind == "InferenceService":
            self.ready[name] = event_type != "DELETED" and is_ready(obj)
        elif name.endswith(("-unified", "-router")):
            status = obj.get("status") or {}
            up = int(status.get("readyReplicas", 0)) >= int(obj["spec"].get("replicas", 1))
            (self.engines if name.endswith("-unified") else self.routers)[name] = up

    async def follow(self, kind: str) -> None:
        items, rv, _ = await self.api.list_page(kind, NAMESPACE, None)
        for item in items:
            self._update(kind, "ADDED", item)
        self.synced += 1
        while True:
            try:
                async for event in self.api.watch(kind, NAMESPACE, None, rv, 300):
                    obj = event.get("object") or {}
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self._update(kind, event["type"], obj)
            except Exception as exc:  # a dropped watch: resume from the last version seen
                print(f"progress watch on {kind} restarted: {exc!r}", file=sys.stderr)
                await asyncio.sleep(1)


async def watch_ready(
    kubeconfig: Path, num: int, timeout_s: float, poll_s: float, started: asyncio.Event, floor: bool, router: bool
) -> list[dict[str, Any]]:
    """Sample the counts every poll_s seconds from the first create until all are Ready (or timeout)."""
    timeline: list[dict[str, Any]] = []
    async with KubeClient(load_credentials(str(kubeconfig))) as api:
        progress = Progress(api, floor, router)
        tasks = [asyncio.create_task(progress.follow(k)) for k in ("InferenceService", "Deployment")]
        while progress.synced < 2:
            await asyncio.sleep(0.1)
        started.set()
        t0 = time.monotonic()
        with tqdm(total=num, desc="floor" if floor else "Ready", unit="svc") as bar:
            while time.monotonic() - t0 < timeout_s:
                counts = progress.counts()
                timeline.append({"t": round(time.monotonic() - t0, 1), **counts})
                bar.update(counts["ready"] - bar.n)
                if counts["ready"] == num:
                    break
                await asyncio.sleep(poll_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return timeline


async def create_and_watch(
    kubeconfig: Path, num: int, timeout_s: float, poll_s: float, floor: bool, router: bool
) -> tuple[float, list[dict[str, Any]]]:
    started = asyncio.Event()
    watcher = asyncio.create_task(watch_ready(kubeconfig, num, timeout_s, poll_s, started, floor, router))
    await started.wait()
    create_s = await create_all(kubeconfig, num, floor, router)
    return create_s, await watcher


def requests_to_ready(before: dict, after: dict, num: int) -> dict[str, Any]:
    """Where the API server's requests came from while the services came up: per 'VERB resource' and per
    APF flow schema (which client: the operator is a ServiceAccount, the controllers are system users)."""
    by_client: dict[str, float] = {}
    for labels, value in after["apiserver_flowcontrol_dispatched_requests_total"].items():
        schema = dict(labels).get("flow_schema", "?")
        delta = value - before["apiserver_flowcontrol_dispatched_requests_total"].get(labels, 0.0)
        by_client[schema] = by_client.get(schema, 0.0) + delta
    by_kind = requests_by_kind(before, after)
    return {
        "requests_to_ready_total": sum(by_kind.values()),
        "requests_to_ready_per_service": round(sum(by_kind.values()) / num, 1),
        "requests_to_ready_by_kind": {k: v for k, v in list(by_kind.items())[:40]},
        "requests_to_ready_by_flow_schema": dict(sorted(by_client.items(), key=lambda kv: -kv[1])),
    }


def events_by_reason(cluster) -> dict[str, int]:
    """Events in the bench namespace by 'source reason' (who posted the API server's `POST events`)."""
    out = cluster.kubectl(
        "get", "events", "-n", NAMESPACE, "-o",
        "jsonpath={range .items[*]}{.source.component}{.reportingComponent} {.reason}{\"\\n\"}{end}",
        timeout=120,
    ).stdout  # fmt: skip
    counts = Counter(line for line in out.splitlines() if line.strip())
    return dict(counts.most_common(20))


def plot(timeline: list[dict[str, Any]], num: int, path: Path, title: str, floor: list[dict[str, Any]] | None) -> None:
    """The counts over time; with `floor`, the floor run's count of services up drawn dashed for comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p["t"] for p in timeline]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("engines", "engine Deployments created"), ("engines_ready", "engine pods ready"),
                       ("ready", "InferenceServices Ready")):  # fmt: skip
        ax.plot(t, [p[key] for p in timeline], label=label)
    if floor:
        ax.plot([p["t"] for p in floor], [p["ready"] for p in floor], "k--", label="floor: same children, no operator")
    ax.axhline(num, color="grey", linewidth=0.5)
    ax.set_xlabel("seconds since the first create")
    ax.set_ylabel("count")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
