"""Operator scale benchmark: N InferenceServices on M KWOK GPU nodes, time until all are Ready.

Starts a throw-away control plane (e2e/controlplane) with M fake 8-GPU nodes, installs the CRD and
the chart's RBAC, runs `tidepool operator` as the chart's ServiceAccount (token kubeconfig, like the
control-plane tests), creates N one-GPU unified InferenceServices (1 engine + 1 router pod each) as
fast as the API server takes them, and polls until every one reports Ready at its generation.
Reports: time to all created, when every engine Deployment existed / had its pods ready / every
service was Ready (from the first create), the operator's peak RSS (VmHWM) and CPU seconds
(utime+stime from /proc), and the machine's load. Results go to bench/results/operator_scale_n<N>_m<M>.json.

    source scripts/env.sh && nice -n 19 python bench/operator_scale.py --services 100 --nodes 100

kwok here runs with --node-lease-duration-seconds=40 (added by this script): without it nothing
renews node leases, nodes turn NotReady ~50 s after start and every pod loses readiness for good.
The numbers are wall-clock on whatever machine runs it: every component (etcd, apiserver,
controller-manager, scheduler, kwok, operator, this poller) shares its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "e2e" / "controlplane"), str(REPO / "tests" / "controlplane")]

from test_cp_operator_support import (  # noqa: E402
    OperatorProcess,
    install_crd,
    is_ready,
    operator_identity,
    restricted_namespace,
)

import devcluster  # noqa: E402
from tidepool.operator.k8s import KubeClient, load_credentials  # noqa: E402

NAMESPACE = "bench"


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


def patch_kwok_leases() -> None:
    """Give kwok a node lease duration so it renews node leases (see the module docstring)."""
    original = devcluster.DevCluster._spawn

    def spawn(self: devcluster.DevCluster, name: str, args: list[str]) -> None:
        if name == "kwok":
            args = [*args, "--node-lease-duration-seconds=40"]
        original(self, name, args)

    devcluster.DevCluster._spawn = spawn  # type: ignore[method-assign]


async def create_all(kubeconfig: Path, num: int, concurrency: int = 16) -> float:
    """POST N InferenceServices with bounded concurrency; returns seconds taken."""
    t0 = time.monotonic()
    sem = asyncio.Semaphore(concurrency)
    async with KubeClient(load_credentials(str(kubeconfig)), max_connections=concurrency) as api:

        async def one(i: int) -> None:
            async with sem:
                await api.request(
                    "POST",
                    f"/apis/tidepool.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices",
                    service(f"s{i:04d}"),
                )

        await asyncio.gather(*(one(i) for i in range(num)))
    return time.monotonic() - t0


async def progress(kubeconfig: Path) -> dict[str, int]:
    """Counts per phase: engine Deployments created, Deployments with every replica ready, services Ready."""
    async with KubeClient(load_credentials(str(kubeconfig))) as api:
        services, deployments = await asyncio.gather(
            api.list("InferenceService", NAMESPACE), api.list("Deployment", NAMESPACE)
        )
    engines = [d for d in deployments if d["metadata"]["name"].endswith("-unified")]
    pods_ready = [d for d in engines if (d.get("status") or {}).get("readyReplicas", 0) >= d["spec"]["replicas"]]
    return {"engines": len(engines), "engines_ready": len(pods_ready), "ready": sum(map(is_ready, services))}


def run(num_services: int, num_nodes: int, timeout_s: float, resync_s: float, keep_state: bool) -> dict[str, Any]:
    patch_kwok_leases()
    state = Path(tempfile.mkdtemp(prefix="tidepool-opscale-"))
    t_cluster = time.monotonic()
    cluster = devcluster.DevCluster(num_nodes=num_nodes, state_dir=state / "cluster", timeout_s=max(120, num_nodes))
    cluster.start()
    result: dict[str, Any] = {"services": num_services, "nodes": num_nodes, "resync_seconds": resync_s}
    try:
        result["cluster_start_s"] = round(time.monotonic() - t_cluster, 1)
        install_crd(cluster)
        cluster.kubectl("create", "namespace", NAMESPACE)
        restricted_namespace(cluster, NAMESPACE)
        identity = operator_identity(cluster, state)
        op = OperatorProcess(identity.kubeconfig, [NAMESPACE], state / "operator.log", resync_seconds=resync_s)
        op.start()
        assert op.proc is not None
        stats = ProcStats(op.proc.pid)
        time.sleep(3)  # kopf up and watching before the clock starts
        cpu0, load0 = stats.cpu_s(), os.getloadavg()
        result["operator_rss_idle_mb"] = round(stats.rss_mb(), 1)
        t0 = time.monotonic()
        result["create_all_s"] = round(asyncio.run(create_all(cluster.kubeconfig, num_services)), 2)
        ready = 0
        phases: dict[str, float] = {}  # first time each count reached N, seconds from the first create
        with tqdm(total=num_services, desc="Ready", unit="svc") as bar:
            while time.monotonic() - t0 < timeout_s:
                counts = asyncio.run(progress(cluster.kubeconfig))
                now = round(time.monotonic() - t0, 1)
                for key, value in counts.items():
                    if value >= num_services:
                        phases.setdefault(f"all_{key}_s", now)
                ready = counts["ready"]
                bar.update(ready - bar.n)
                if ready == num_services:
                    break
                time.sleep(1.0)
        elapsed = time.monotonic() - t0
        result["phases"] = phases
        result.update(
            all_ready=ready == num_services,
            num_ready=ready,
            time_to_all_ready_s=round(elapsed, 1) if ready == num_services else None,
            waited_s=round(elapsed, 1),
            operator_cpu_s=round(stats.cpu_s() - cpu0, 1),
            operator_cpu_percent=round(100 * (stats.cpu_s() - cpu0) / elapsed, 1),
            operator_rss_peak_mb=round(stats.rss_mb("VmHWM"), 1),
            operator_rss_end_mb=round(stats.rss_mb(), 1),
            load_average_before=[round(x, 2) for x in load0],
            load_average_after=[round(x, 2) for x in os.getloadavg()],
        )
        op.stop()
        log = op.log_text()
        # kopf logs every TemporaryError ("not ready yet" while pods start) at ERROR; count the others.
        errors = [line for line in log.splitlines() if " ERROR " in line and "not ready yet" not in line]
        result["operator_errors_logged"] = len(errors)
        result["operator_error_samples"] = errors[:5]
        result["operator_forbidden"] = len(op.forbidden_lines())
    finally:
        cluster.stop()
        if keep_state:
            print(f"state (logs, kubeconfigs) kept in {state}", file=sys.stderr)
        else:
            shutil.rmtree(state, ignore_errors=True)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "shared": True}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=100, help="InferenceServices to create (N)")
    parser.add_argument("--nodes", type=int, default=100, help="KWOK GPU nodes with 8 GPUs each (M)")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up waiting for Ready after this")
    parser.add_argument("--resync-seconds", type=float, default=60.0, help="the operator's resync timer")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--keep-state", action="store_true", help="keep the cluster's and operator's logs")
    args = parser.parse_args(argv)
    if args.services * 1 > args.nodes * devcluster.GPUS_PER_NODE:
        parser.error(f"{args.services} one-GPU services do not fit on {args.nodes} nodes of {devcluster.GPUS_PER_NODE}")
    result = run(args.services, args.nodes, args.timeout, args.resync_seconds, args.keep_state)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"operator_scale_n{args.services}_m{args.nodes}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0 if result["all_ready"] else 1


if __name__ == "__main__":
    sys.exit(main())
