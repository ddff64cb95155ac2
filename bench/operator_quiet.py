"""Quiet at scale: the Events and status writes of N autoscaled services in advisory mode over a steady window.

Issue 39's measurement ("over 10 minutes of steady state with 100 autoscaled services in advisory mode, the
operator creates <= 100 Events in total and writes status only on change, measured from the API server's
counters"). Starts a throw-away control plane (e2e/controlplane) with M KWOK nodes (operator_scale's component
flags: kwok renews node leases, nodes are not declared dead for an hour), installs the CRD and the chart's RBAC,
and runs `tidepool operator` as the chart's ServiceAccount with its production defaults, the autoscaler's 15 s
tick and 60 s metrics window included, reading a steady synthetic metrics feed in this process
(tests/controlplane/quiet_kit.SteadyFeed: KV usage 0.9 against a target of 0.5 on each service's one replica, so
every service is recommended 2 replicas that advisory mode never applies). Creates N such services, waits until
each is Ready, complete and told (its recommendation in status, its AdvisoryScale Event), lets `--settle-ticks`
autoscaler ticks pass (the operator's own decision counter), then counts over `--window` seconds, from
`apiserver_request_total`: Events created and patched (every component's: an upper bound on the operator's),
InferenceService status writes (the operator's only), and the ticks each service made meanwhile. Prints the
counts and writes bench/results/operator_quiet_n<N>.json.

    source scripts/env.sh
    flock /tmp/tp/bench.lock nice -n 19 python bench/operator_quiet.py --services 100 --window 600
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "bench"), str(REPO / "e2e" / "controlplane"), str(REPO / "tests" / "controlplane")]

from autoscale_feed import feed_server  # noqa: E402
from operator_kit import (  # noqa: E402
    OperatorProcess,
    apiserver_counters,
    condition,
    free_port,
    get_isvc,
    install_crd,
    is_ready,
    operator_identity,
    requests_by_kind,
    wait_until,
)
from operator_scale import ProcStats, patch_component_flags  # noqa: E402
from quiet_kit import (  # noqa: E402
    SteadyFeed,
    advisory_service,
    decisions,
    quiet_counts,
    service_events,
    wait_for_ticks,
)

import devcluster  # noqa: E402

NAMESPACE = "quiet"
PODS_PER_NODE = 110  # devcluster_components' node capacity


def advisory_events(cluster) -> Counter[str]:
    events = service_events(cluster, NAMESPACE)
    return Counter(e["involvedObject"]["name"] for e in events if e["reason"] == "AdvisoryScale")


def wait_steady(cluster, names: list[str], timeout_s: float) -> float:
    """Every service Ready and complete, recommending 2 replicas, its AdvisoryScale Event told; returns seconds."""
    t0 = time.monotonic()

    def steady() -> bool:
        objs = [get_isvc(cluster, NAMESPACE, n) for n in names]
        if not all(is_ready(o) and condition(o, "Progressing")["status"] == "False" for o in objs):
            return False
        desired = [((o["status"].get("autoscaling") or {}).get("pools") or {}).get("unified", {}) for o in objs]
        return all(d.get("desiredReplicas") == 2 for d in desired) and set(advisory_events(cluster)) >= set(names)

    wait_until(steady, timeout_s, f"{len(names)} services Ready, recommending 2 replicas, told", interval_s=5)
    return time.monotonic() - t0


def measure(cluster, op: OperatorProcess, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    keys = [(NAMESPACE, n) for n in names]
    tick_s = float(os.environ.get("TIDEPOOL_AUTOSCALE_INTERVAL", "15"))
    print(f"settling: {args.settle_ticks} ticks per service", file=sys.stderr)
    wait_for_ticks(op.metrics_port, keys, args.settle_ticks, timeout_s=args.settle_ticks * tick_s * 4 + 120)
    assert op.proc is not None
    stats = ProcStats(op.proc.pid)
    cpu0, ticks0, before = stats.cpu_s(), decisions(op.metrics_port), apiserver_counters(cluster)
    print(f"window: {args.window:.0f}s", file=sys.stderr)
    time.sleep(args.window)  # the measurement is a wall-clock window; the ticks in it are counted below
    after, ticks1 = apiserver_counters(cluster), decisions(op.metrics_port)
    made = [ticks1.get(k, 0.0) - ticks0.get(k, 0.0) for k in keys]
    counts = quiet_counts(before, after)
    per_service = advisory_events(cluster)
    return {
        "window_s": args.window,
        **counts,
        "events_per_service": round((counts["events_created"] + counts["events_patched"]) / len(names), 4),
        "ticks_per_service_min": min(made),
        "ticks_per_service_max": max(made),
        "advisory_event_objects": sum(per_service.values()),
        "services_with_more_than_one_advisory_event": sum(1 for v in per_service.values() if v > 1),
        "operator_cpu_percent_in_window": round(100 * (stats.cpu_s() - cpu0) / args.window, 2),
        "operator_rss_peak_mb": round(stats.rss_mb("VmHWM"), 1),
        "window_by_kind": dict(list(requests_by_kind(before, after).items())[:15]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    patch_component_flags()
    state = Path(tempfile.mkdtemp(prefix="tidepool-opquiet-"))
    nodes = args.nodes or max(2, -(-2 * args.services // (PODS_PER_NODE - 10)))  # an engine and a router each
    cluster = devcluster.DevCluster(num_nodes=nodes, state_dir=state / "cluster", timeout_s=max(120, nodes))
    cluster.start()
    result: dict[str, Any] = {"services": args.services, "nodes": nodes}
    op: OperatorProcess | None = None
    feed = SteadyFeed(cluster, NAMESPACE, list_s=10.0)
    try:
        install_crd(cluster)
        cluster.kubectl("create", "namespace", NAMESPACE)
        identity = operator_identity(cluster, state)
        feed.set("unified", kv=0.9, requests=5)
        with feed_server(feed) as url:
            os.environ["TIDEPOOL_METRICS_SOURCE_URL_TEMPLATE"] = url + "/{namespace}/{name}/{pool}"
            os.environ["TIDEPOOL_OPERATOR_METRICS_PORT"] = str(free_port())
            op = OperatorProcess(identity.kubeconfig, [NAMESPACE], state / "operator.log")
            op.start()
            names = [f"q{i:03d}" for i in range(args.services)]
            manifest = "---\n".join(yaml.safe_dump(advisory_service(n)) for n in names)
            cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=manifest, timeout=300)
            result["steady_after_s"] = round(wait_steady(cluster, names, args.timeout), 1)
            result.update(measure(cluster, op, names, args))
            op.stop()
        log = op.log_text()
        result["operator_errors_logged"] = sum(1 for line in log.splitlines() if " ERROR " in line)
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
    parser.add_argument("--services", type=int, default=100, help="advisory InferenceServices (N)")
    parser.add_argument("--nodes", type=int, default=0, help="KWOK nodes (0: enough for an engine and a router each)")
    parser.add_argument("--window", type=float, default=600.0, help="seconds of steady state counted")
    parser.add_argument("--settle-ticks", type=int, default=5, help="autoscaler ticks per service before the window")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up waiting for the steady state after this")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--keep-state", action="store_true", help="keep the cluster's and operator's logs")
    args = parser.parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"operator_quiet_n{args.services}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    is_quiet = result["status_writes"] == 0 and result["events_created"] + result["events_patched"] <= args.services
    return 0 if is_quiet else 1


if __name__ == "__main__":
    sys.exit(main())
