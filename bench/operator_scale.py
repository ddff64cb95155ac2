"""Operator scale benchmark: N InferenceServices on M KWOK GPU nodes: time to Ready against the cluster's floor.

Starts a throw-away control plane (e2e/controlplane) with M fake 8-GPU nodes, installs the CRD and
the chart's RBAC, runs `tidepool operator` with its production defaults as the chart's ServiceAccount
(token kubeconfig, like the control-plane tests; leader election on), creates N one-GPU unified
InferenceServices (1 engine pod, and 1 router pod unless `--no-router`: `spec.router.enabled: false`)
as fast as the API server takes them, and records every `--poll` seconds (from two watches) how many
engine Deployments exist, how many have their pods ready and how many services are Ready at their
generation, until all are Ready. Then the steady state: `--settle` seconds after all Ready, the API
server's own `apiserver_request_total` over `--window` seconds with the operator running, minus the
same window with it stopped, per service per minute (and the count APF attributes to ServiceAccount
clients, i.e. the operator, in the running window). Reports the operator's peak RSS (VmHWM) and CPU
seconds, each component's CPU, the machine's load and busy CPU (other work on a shared machine shows as
busy time no component accounts for), and writes bench/results/operator_scale_n<N>_m<M>[_norouter].json
and a PNG of the counts over time.

The floor (`--floor`): no operator; the bench applies each service's children itself (the operator's own
builders and two-phase server-side apply, 16 services at a time, the operator's default workers) and a
service is up when its engine (and router) Deployments serve. `--compare` runs the floor and the operator
one after the other (`--order`), each on a fresh control plane, and reports the ratio; both JSONs say
which run they were compared with.

    source scripts/env.sh
    flock /tmp/tp/bench.lock python bench/operator_scale.py --services 1000 --nodes 1000 --compare
    flock /tmp/tp/bench.lock python bench/operator_scale.py --services 1000 --nodes 1000 \
        --compare --no-router

(Not under `nice -n 19` on a shared machine: the cluster would then run on whatever CPU others leave, and
the floor and the operator would each measure the others' load.)

`--profile-operator` runs the operator under cProfile (slower: for finding where its time goes, not for
the numbers) and writes the top functions next to the JSON.

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
import io
import json
import os
import platform
import pstats
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "e2e" / "controlplane"), str(REPO / "tests" / "controlplane")]

import operator_kit  # noqa: E402
from operator_kit import (  # noqa: E402
    OperatorProcess,
    apiserver_counters,
    counter_delta,
    install_crd,
    operator_identity,
    requests_by_kind,
    restricted_namespace,
)
from operator_scale_kit import (  # noqa: E402
    COMPONENT_FLAGS,
    NAMESPACE,
    ProcStats,
    create_and_watch,
    events_by_reason,
    patch_component_flags,
    plot,
    requests_to_ready,
)

import devcluster  # noqa: E402


def busy_cpu_s() -> float:
    """Seconds of CPU the whole machine spent busy (all processes, every core), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def steady_state(
    cluster, op: OperatorProcess, stats: ProcStats, num: int, settle_s: float, window_s: float
) -> dict[str, Any]:
    """API requests per service per minute attributable to the operator: the running window minus the stopped one,
    and what APF counts for ServiceAccount clients in the running window (the operator is the only one). At
    M=1,000 KWOK renews its node Leases in bursts of ~1,000 PUTs that land in one window or the other, which can
    swamp the difference (even make it negative); the APF count is the operator's own requests."""
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


def profiled_operator(state: Path, prof: Path) -> None:
    """Make OperatorProcess start `tidepool operator` under cProfile (written to `prof` when it stops)."""
    wrapper = state / "tidepool-profiled"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cProfile -o "{prof}" "{operator_kit.TIDEPOOL}" "$@"\n')
    wrapper.chmod(0o755)
    operator_kit.TIDEPOOL = wrapper


def profile_summary(prof: Path, out: Path, top: int = 45) -> None:
    buf = io.StringIO()
    stats = pstats.Stats(str(prof), stream=buf)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    out.write_text(buf.getvalue())


def run(args: argparse.Namespace, floor: bool) -> dict[str, Any]:
    """One run on a fresh control plane: the operator's, or the floor's (`floor`)."""
    patch_component_flags()
    num, router = args.services, not args.no_router
    state = Path(tempfile.mkdtemp(prefix="tidepool-opscale-"))
    prof = state / "operator.prof"
    if args.profile_operator and not floor:
        profiled_operator(state, prof)
    t_cluster = time.monotonic()
    cluster = devcluster.DevCluster(num_nodes=args.nodes, state_dir=state / "cluster", timeout_s=max(120, args.nodes))
    cluster.start()
    result: dict[str, Any] = {
        "services": num, "nodes": args.nodes, "router": router, "floor": floor,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "component_flags": COMPONENT_FLAGS,
    }  # fmt: skip
    op: OperatorProcess | None = None
    try:
        result["cluster_start_s"] = round(time.monotonic() - t_cluster, 1)
        install_crd(cluster)
        cluster.kubectl("create", "namespace", NAMESPACE)
        restricted_namespace(cluster, NAMESPACE)
        stats: ProcStats | None = None
        if not floor:
            identity = operator_identity(cluster, state)
            op = OperatorProcess(identity.kubeconfig, [NAMESPACE], state / "operator.log")
            op.start()
            assert op.proc is not None
            stats = ProcStats(op.proc.pid)
            time.sleep(5)  # operator up, leader, caches synced before the clock starts
        cpu0, load0 = stats.cpu_s() if stats else 0.0, os.getloadavg()
        components = {name: ProcStats(pid) for name, pid in cluster.pids.items()}
        component_cpu0 = {name: c.cpu_s() for name, c in components.items()}
        busy0, bench0 = busy_cpu_s(), sum(os.times()[:2])
        result["operator_rss_idle_mb"] = round(stats.rss_mb(), 1) if stats else None
        requests0 = apiserver_counters(cluster)
        create_s, timeline = asyncio.run(
            create_and_watch(cluster.kubeconfig, num, args.timeout, args.poll, floor, router)
        )
        busy, bench = busy_cpu_s() - busy0, sum(os.times()[:2]) - bench0
        result["create_all_s"] = round(create_s, 2)
        elapsed, ready = timeline[-1]["t"], timeline[-1]["ready"]
        phases = {}
        for key in ("engines", "engines_ready", "ready"):
            phases[f"all_{key}_s"] = next((p["t"] for p in timeline if p[key] >= num), None)
        component_cpu = {n: round(c.cpu_s() - component_cpu0[n], 1) for n, c in components.items()}
        operator_cpu = round(stats.cpu_s() - cpu0, 1) if stats else 0.0
        result.update(
            phases=phases,
            all_ready=ready == num,
            num_ready=ready,
            time_to_all_ready_s=elapsed if ready == num else None,
            operator_cpu_s_to_ready=operator_cpu if stats else None,
            # Where the machine's time went meanwhile (each component's utime+stime).
            component_cpu_s_to_ready=component_cpu,
            bench_cpu_s_to_ready=round(bench, 1),  # this process: the watches, and in floor mode the applies
            machine_busy_cpu_s_to_ready=round(busy, 1),
            # Busy CPU no part of this benchmark accounts for: other work on a shared machine.
            other_cpu_s_to_ready=round(busy - sum(component_cpu.values()) - operator_cpu - bench, 1),
            operator_rss_peak_mb_to_ready=round(stats.rss_mb("VmHWM"), 1) if stats else None,
            load_average_before=[round(x, 2) for x in load0],
            load_average_at_ready=[round(x, 2) for x in os.getloadavg()],
            timeline=timeline,
            **requests_to_ready(requests0, apiserver_counters(cluster), num),
        )
        result["events_by_reason"] = events_by_reason(cluster)
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
        if prof.exists():
            profile_summary(prof, args.out / f"{stem(args, floor).name}_profile.txt")
        if not args.keep_state:
            shutil.rmtree(state, ignore_errors=True)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "shared": True}
    return result


def stem(args: argparse.Namespace, floor: bool) -> Path:
    suffix = ("_norouter" if args.no_router else "") + ("_floor" if floor else "")
    return args.out / f"operator_scale_n{args.services}_m{args.nodes}{suffix}"


def write(args: argparse.Namespace, result: dict[str, Any], floor_timeline: list | None = None) -> Path:
    path = stem(args, result["floor"])
    path.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    what = "same children applied without an operator (floor)" if result["floor"] else "InferenceServices"
    routers = "with routers" if result["router"] else "no routers"
    title = f"{args.services} {what}, {routers}, on {args.nodes} KWOK nodes (shared {os.cpu_count()}-core machine)"
    plot(result["timeline"], args.services, path.with_suffix(".png"), title, floor_timeline)
    print(json.dumps({k: v for k, v in result.items() if k not in ("timeline", "component_flags")}, indent=2))
    print(f"wrote {path}.json and {path}.png")
    return path


def compare(args: argparse.Namespace) -> int:
    """The floor and the operator, one after the other on fresh control planes; the ratio in both JSONs."""
    order = [True, False] if args.order == "floor-first" else [False, True]
    results = {floor: run(args, floor) for floor in order}
    floor_s, operator_s = results[True]["time_to_all_ready_s"], results[False]["time_to_all_ready_s"]
    ratio = round(operator_s / floor_s, 3) if floor_s and operator_s else None
    for floor, result in results.items():
        other = stem(args, not floor).with_suffix(".json").name
        result["comparison"] = {"order": args.order, "floor_s": floor_s, "operator_s": operator_s,
                                "ratio": ratio, "compared_with": other}  # fmt: skip
    write(args, results[True])
    write(args, results[False], results[True]["timeline"])
    print(f"operator {operator_s} s / floor {floor_s} s = {ratio} ({args.order})")
    return 0 if results[True]["all_ready"] and results[False]["all_ready"] else 1


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
    parser.add_argument("--no-router", action="store_true", help="services with spec.router.enabled: false")
    parser.add_argument("--profile-operator", action="store_true", help="run the operator under cProfile")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--floor",
        action="store_true",
        help="no operator: apply every service's children directly (the cluster's own floor, for comparison)",
    )
    mode.add_argument("--compare", action="store_true", help="the floor, then the operator (or --order), and the ratio")
    parser.add_argument("--order", choices=("floor-first", "operator-first"), default="floor-first")
    args = parser.parse_args(argv)
    if args.services * 1 > args.nodes * devcluster.GPUS_PER_NODE:
        parser.error(f"{args.services} one-GPU services do not fit on {args.nodes} nodes of {devcluster.GPUS_PER_NODE}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        return compare(args)
    result = run(args, args.floor)
    write(args, result)
    return 0 if result["all_ready"] else 1


if __name__ == "__main__":
    sys.exit(main())
