"""Operator scale benchmark: N InferenceServices on M KWOK GPU nodes: time to Ready, memory, steady-state cost.

Starts a throw-away control plane (e2e/controlplane) with M fake 8-GPU nodes, installs the CRD and
the chart's RBAC, runs `tidepool operator` with its production defaults as the chart's ServiceAccount
(token kubeconfig, like the control-plane tests; leader election on), creates N one-GPU unified
InferenceServices (1 engine + 1 router pod each) as fast as the API server takes them, and records
every `--poll` seconds (from two watches) how many engine Deployments exist, how many have their pods ready and how many
services are Ready at their generation, until all are Ready. Then the steady state: `--settle`
seconds after all Ready, the API server's own `apiserver_request_total` over `--window` seconds with
the operator running, minus the same window with it stopped, per service per minute (and the count
APF attributes to ServiceAccount clients, i.e. the operator, in the running window). Reports the
operator's peak RSS (VmHWM) and CPU seconds, the machine's load, and writes
bench/results/operator_scale_n<N>_m<M>.json and a PNG of the counts over time.

    source scripts/env.sh
    flock /tmp/tp/bench.lock nice -n 19 python bench/operator_scale.py --services 1000 --nodes 1000

The cluster's own controllers get client limits that do not bind (the benchmark measures the
operator, not kube-controller-manager's default 20 requests/s, which alone would take ~200 s to
create the 2N ReplicaSets and pods), kwok renews node leases every ~150 s (--node-lease-duration-seconds=600), and
nodes are not declared dead for an hour (on a busy machine kwok renews 1,000 leases late, and a node
marked NotReady turns its KWOK pods Ready=False for good).
Every component (etcd, apiserver, controller-manager, scheduler, kwok, operator, this poller) shares
the machine's cores; the numbers are wall-clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "e2e" / "controlplane"), str(REPO / "tests" / "controlplane")]

from operator_kit import (  # noqa: E402
    OperatorProcess,
    apiserver_counters,
    counter_delta,
    install_crd,
    is_ready,
    operator_identity,
    requests_by_kind,
    restricted_namespace,
)

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


def service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
            "resources": {"gpusPerReplica": 1, "cpu": "1", "memory": "4Gi"},
            "mode": "unified",
            "pools": {"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2}},
            "router": {"replicas": 1},
        },
    }


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
    original = devcluster.DevCluster._spawn

    def spawn(self: devcluster.DevCluster, name: str, args: list[str]) -> None:
        original(self, name, [*args, *COMPONENT_FLAGS.get(name, [])])

    devcluster.DevCluster._spawn = spawn  # type: ignore[method-assign]


async def create_all(kubeconfig: Path, num: int, floor: bool, concurrency: int = 16) -> float:
    """POST N InferenceServices with bounded concurrency; returns seconds taken. With `floor`, apply each
    service's children instead (the operator's own builders and two-phase apply, no operator running)."""
    t0 = time.monotonic()
    sem = asyncio.Semaphore(concurrency)
    async with KubeClient(load_credentials(str(kubeconfig)), max_connections=concurrency) as api:

        async def one(i: int) -> None:
            async with sem:
                if floor:
                    body = service(f"s{i:04d}")
                    children = desired_state(body["metadata"]["name"], NAMESPACE, ServiceView.from_body(body)).children
                    for obj in children:
                        obj["metadata"]["namespace"] = NAMESPACE
                    _, error = await apply_all(api, children)
                    if error:
                        raise RuntimeError(error)
                    return
                await api.request(
                    "POST",
                    f"/apis/tidepool.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices",
                    service(f"s{i:04d}"),
                )

        await asyncio.gather(*(one(i) for i in range(num)))
    return time.monotonic() - t0


class Progress:
    """Counts from two watches (InferenceServices; engine Deployments): engine Deployments created, those with
    every replica ready, services Ready at their generation. A watch costs the API server one event per
    change; polling full lists of 1,000 services and 2,000 Deployments every few seconds would cost it
    more than the operator does."""

    def __init__(self, api: KubeClient, floor: bool = False) -> None:
        self.api, self.floor = api, floor
        self.ready: dict[str, bool] = {}
        self.engines: dict[str, bool] = {}  # engine Deployment -> every replica ready
        self.routers: dict[str, bool] = {}  # router Deployment -> every replica ready (floor mode's "ready")
        self.synced = 0

    def counts(self) -> dict[str, int]:
        if self.floor:  # no operator, no status: a service is up when its engine and router pods are
            ready = sum(ok and self.routers.get(name.removesuffix("-unified") + "-router", False)
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
    kubeconfig: Path, num: int, timeout_s: float, poll_s: float, started: asyncio.Event, floor: bool
) -> list:
    """Sample the counts every poll_s seconds from the first create until all are Ready (or timeout)."""
    timeline: list[dict[str, Any]] = []
    async with KubeClient(load_credentials(str(kubeconfig))) as api:
        progress = Progress(api, floor)
        tasks = [asyncio.create_task(progress.follow(k)) for k in ("InferenceService", "Deployment")]
        while progress.synced < 2:
            await asyncio.sleep(0.1)
        started.set()
        t0 = time.monotonic()
        with tqdm(total=num, desc="Ready", unit="svc") as bar:
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
    kubeconfig: Path, num: int, timeout_s: float, poll_s: float, floor: bool
) -> tuple[float, list]:
    started = asyncio.Event()
    watcher = asyncio.create_task(watch_ready(kubeconfig, num, timeout_s, poll_s, started, floor))
    await started.wait()
    create_s = await create_all(kubeconfig, num, floor)
    return create_s, await watcher


def steady_state(
    cluster, op: OperatorProcess, stats: ProcStats, num: int, settle_s: float, window_s: float
) -> dict[str, Any]:
    """API requests per service per minute attributable to the operator (running window minus stopped)."""
    print(f"steady state: settling {settle_s:.0f}s, then two {window_s:.0f}s windows", file=sys.stderr)
    time.sleep(settle_s)
    cpu0 = stats.cpu_s()
    a0 = apiserver_counters(cluster)
    time.sleep(window_s)
    a1 = apiserver_counters(cluster)
    cpu_percent = round(100 * (stats.cpu_s() - cpu0) / window_s, 2)
    rss_peak = round(stats.rss_mb("VmHWM"), 1)
    op.stop()  # releases the Lease; nothing else changes in the cluster
    b0 = apiserver_counters(cluster)
    time.sleep(window_s)
    b1 = apiserver_counters(cluster)
    running = counter_delta(a0, a1, "apiserver_request_total")
    stopped = counter_delta(b0, b1, "apiserver_request_total")
    by_sa = counter_delta(a0, a1, "apiserver_flowcontrol_dispatched_requests_total", flow_schema="service-accounts")
    minutes = window_s / 60
    return {
        "settle_s": settle_s,
        "window_s": window_s,
        "requests_running": running,
        "requests_stopped": stopped,
        "operator_requests_per_service_per_minute": round((running - stopped) / num / minutes, 4),
        "apf_service_account_requests": by_sa,
        "apf_service_account_requests_per_service_per_minute": round(by_sa / num / minutes, 4),
        "operator_cpu_percent_in_window": cpu_percent,
        "operator_rss_peak_mb": rss_peak,
        "running_by_kind": dict(list(requests_by_kind(a0, a1).items())[:15]),
        "stopped_by_kind": dict(list(requests_by_kind(b0, b1).items())[:15]),
    }


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


def plot(timeline: list[dict[str, Any]], num: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p["t"] for p in timeline]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("engines", "engine Deployments created"), ("engines_ready", "engine pods ready"),
                       ("ready", "InferenceServices Ready")):  # fmt: skip
        ax.plot(t, [p[key] for p in timeline], label=label)
    ax.axhline(num, color="grey", linewidth=0.5)
    ax.set_xlabel("seconds since the first create")
    ax.set_ylabel("count")
    ax.set_title(f"{num} InferenceServices on KWOK nodes (shared 2-core machine)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    patch_component_flags()
    num = args.services
    state = Path(tempfile.mkdtemp(prefix="tidepool-opscale-"))
    t_cluster = time.monotonic()
    timeout = max(120, args.nodes)
    cluster = devcluster.DevCluster(num_nodes=args.nodes, state_dir=state / "cluster", timeout_s=timeout)
    cluster.start()
    result: dict[str, Any] = {"services": num, "nodes": args.nodes, "component_flags": COMPONENT_FLAGS}
    op: OperatorProcess | None = None
    try:
        result["cluster_start_s"] = round(time.monotonic() - t_cluster, 1)
        install_crd(cluster)
        cluster.kubectl("create", "namespace", NAMESPACE)
        restricted_namespace(cluster, NAMESPACE)
        stats: ProcStats | None = None
        if not args.floor:
            identity = operator_identity(cluster, state)
            op = OperatorProcess(identity.kubeconfig, [NAMESPACE], state / "operator.log")
            op.start()
            assert op.proc is not None
            stats = ProcStats(op.proc.pid)
            time.sleep(5)  # operator up, leader, caches synced before the clock starts
        cpu0, load0 = stats.cpu_s() if stats else 0.0, os.getloadavg()
        components = {name: ProcStats(pid) for name, pid in cluster.pids.items()}
        component_cpu0 = {name: c.cpu_s() for name, c in components.items()}
        result["operator_rss_idle_mb"] = round(stats.rss_mb(), 1) if stats else None
        requests0 = apiserver_counters(cluster)
        create_s, timeline = asyncio.run(create_and_watch(cluster.kubeconfig, num, args.timeout, args.poll, args.floor))
        result["create_all_s"] = round(create_s, 2)
        elapsed = timeline[-1]["t"]
        ready = timeline[-1]["ready"]
        phases = {}
        for key in ("engines", "engines_ready", "ready"):
            phases[f"all_{key}_s"] = next((p["t"] for p in timeline if p[key] >= num), None)
        result.update(
            phases=phases,
            all_ready=ready == num,
            num_ready=ready,
            time_to_all_ready_s=elapsed if ready == num else None,
            operator_cpu_s_to_ready=round(stats.cpu_s() - cpu0, 1) if stats else None,
            # Where the machine's time went meanwhile (each component's utime+stime).
            component_cpu_s_to_ready={n: round(c.cpu_s() - component_cpu0[n], 1) for n, c in components.items()},
            operator_rss_peak_mb_to_ready=round(stats.rss_mb("VmHWM"), 1) if stats else None,
            load_average_before=[round(x, 2) for x in load0],
            load_average_at_ready=[round(x, 2) for x in os.getloadavg()],
            timeline=timeline,
            **requests_to_ready(requests0, apiserver_counters(cluster), num),
        )
        if op is not None and stats is not None:
            if ready == num and args.window > 0:
                result["steady_state"] = steady_state(cluster, op, stats, num, args.settle, args.window)
            else:
                result["operator_rss_peak_mb"] = round(stats.rss_mb("VmHWM"), 1)
            op.stop()
            log = op.log_text()
            errors = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
            result["operator_errors_logged"] = len(errors)
            result["operator_error_samples"] = errors[:5]
            result["operator_forbidden"] = len(op.forbidden_lines())
        if args.keep_state:
            print(f"state (logs, kubeconfigs) kept in {state}", file=sys.stderr)
    finally:
        if op is not None:
            op.stop()
        cluster.stop()
        if not args.keep_state:
            shutil.rmtree(state, ignore_errors=True)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "shared": True}
    return result


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup (cluster, operator) on kill
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=100, help="InferenceServices to create (N)")
    parser.add_argument("--nodes", type=int, default=100, help="KWOK GPU nodes with 8 GPUs each (M)")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up waiting for Ready after this")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between samples of the counts")
    parser.add_argument("--settle", type=float, default=300.0, help="steady state: wait this long after all Ready")
    parser.add_argument("--window", type=float, default=120.0, help="steady state: each measuring window (0: skip)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--keep-state", action="store_true", help="keep the cluster's and operator's logs")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="no operator: apply every service's children directly (the cluster's own floor, for comparison)",
    )
    args = parser.parse_args(argv)
    if args.services * 1 > args.nodes * devcluster.GPUS_PER_NODE:
        parser.error(f"{args.services} one-GPU services do not fit on {args.nodes} nodes of {devcluster.GPUS_PER_NODE}")
    result = run(args)
    result["floor"] = args.floor
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"operator_scale_n{args.services}_m{args.nodes}{'_floor' if args.floor else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result["timeline"], args.services, stem.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "timeline"}, indent=2))
    print(f"wrote {stem}.json and {stem}.png")
    return 0 if result["all_ready"] else 1


if __name__ == "__main__":
    sys.exit(main())
