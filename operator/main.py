"""`tidepool operator`: run the InferenceService controller (kopf process, watch-driven controller).

Watches the given namespaces (`-n/--namespace`, repeatable) or the whole cluster (default), with
credentials from `--kubeconfig` / $KUBECONFIG, else the pod's ServiceAccount (the chart's RBAC; no
admin rights needed). Serves kopf's liveness probe on `--liveness` (default http://0.0.0.0:8080/healthz).
With leader election (the default) several replicas may run: one reconciles, the others wait on
the Lease `--leader-election-id` in `--leader-election-namespace` (default: the pod's namespace).
SIGTERM/SIGINT stop it cleanly and release the Lease; a crash or SIGKILL loses nothing (all state,
the autoscaler's included, is in the cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

logger = logging.getLogger("tidepool.operator")


def _add_election_args(parser: argparse.ArgumentParser, lease: dict[str, Any]) -> None:
    election = parser.add_argument_group("leader election (several replicas, one reconciles)")
    election.add_argument(
        "--leader-elect", action=argparse.BooleanOptionalAction, default=True, help="hold a Lease before reconciling"
    )
    election.add_argument("--leader-election-id", default="tidepool-operator", help="name of the Lease")
    election.add_argument(
        "--leader-election-namespace", default=None, help="namespace of the Lease; default the pod's own"
    )
    election.add_argument(
        "--lease-duration-seconds", type=float, default=lease["lease_duration_s"], help="a dead leader's Lease expiry"
    )
    election.add_argument(
        "--renew-deadline-seconds", type=float, default=lease["renew_deadline_s"], help="a leader unable to renew quits"
    )
    election.add_argument(
        "--retry-period-seconds", type=float, default=lease["retry_period_s"], help="renew / poll interval"
    )


def build_parser() -> argparse.ArgumentParser:
    # The defaults are the options' own (one source); importing them loads kopf, which `main` needs anyway.
    from tidepool.operator.collector_flags import add_collector_args
    from tidepool.operator.handlers import OperatorOptions
    from tidepool.operator.leader import LeaseConfig

    defaults = OperatorOptions()
    lease = {f.name: f.default for f in fields(LeaseConfig)}
    parser = argparse.ArgumentParser(prog="tidepool operator", description=__doc__.split("\n\n")[0])
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file; default $KUBECONFIG or in-cluster")
    parser.add_argument("--context", default=None, help="kubeconfig context; default its current-context")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL")
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=defaults.resync_seconds,
        help="compare every object with its spec this often (+-10%%), a safety net: watches drive reconciles",
    )
    parser.add_argument(
        "--feature-recheck-seconds",
        type=float,
        default=defaults.feature_recheck_seconds,
        help="look up optional CRDs (LeaderWorkerSet, ServiceMonitor, InferencePool) again this often",
    )
    parser.add_argument(
        "--workers", type=int, default=defaults.workers, help="InferenceServices reconciled concurrently"
    )
    parser.add_argument(
        "--max-concurrent-rollouts",
        type=int,
        default=defaults.max_concurrent_rollouts,
        help="services that replace pods at once (a spec change or new operator defaults); the rest wait, "
        "Progressing reason RolloutQueued; 0: no limit",
    )
    parser.add_argument(
        "--kube-api-qps", type=float, default=defaults.kube_api_qps, help="API requests per second (token bucket)"
    )
    parser.add_argument(
        "--kube-api-burst", type=int, default=defaults.kube_api_burst, help="API requests allowed in a burst"
    )
    _add_election_args(parser, lease)
    parser.add_argument(
        "--gpus-per-node", type=int, default=defaults.gpus_per_node, help="GPUs per node; sizes multi-node replicas"
    )
    parser.add_argument(
        "--engine-image",
        default=None,
        help="engine image of services that set no spec.engine.image (the chart's engineImage); default: the API's",
    )
    parser.add_argument("--router-image", default=None, help="router image; default: each service's engine image")
    parser.add_argument(
        "--router-cluster-role",
        default=defaults.router_cluster_role,
        help="ClusterRole (endpointslices get/list/watch) each router's RoleBinding names; the operator needs `bind` "
        "on it (the chart's <fullname>-router)",
    )
    parser.add_argument(
        "--hf-download-image", default=None, help="image with `tidepool download` (hf:// models); default: engine image"
    )
    parser.add_argument(
        "--s3-download-image", default=defaults.s3_download_image, help="image with `aws` for s3:// models"
    )
    parser.add_argument(
        "--resolve-revisions",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin a floating hf:// spec.model.revision to its commit once per spec, before any pod starts (needs "
        "the operator to reach the Hub or the Secret's HF_ENDPOINT); --no-resolve-revisions: each pod resolves it",
    )
    add_collector_args(parser)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def _invalid_number(args: argparse.Namespace) -> str | None:
    """What is wrong with the numeric flags (and the other checked ones), if anything."""
    positive = (
        ("resync-seconds", args.resync_seconds),
        ("feature-recheck-seconds", args.feature_recheck_seconds),
        ("gpus-per-node", args.gpus_per_node),
        ("workers", args.workers),
        ("kube-api-burst", args.kube_api_burst),
    )
    for flag, value in positive:
        if value <= 0:
            return f"--{flag} must be > 0"
    if args.max_concurrent_rollouts < 0:
        return "--max-concurrent-rollouts must be >= 0 (0: no limit)"
    if not args.router_cluster_role or "/" in args.router_cluster_role:
        return f"--router-cluster-role must name a ClusterRole, got {args.router_cluster_role!r}"
    from tidepool.operator.collector_flags import collector_from_args

    try:
        collector_from_args(args)
    except ValueError as exc:
        return str(exc)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (error := _invalid_number(args)) is not None:
        print(f"tidepool operator: error: {error}", file=sys.stderr)
        return 2
    import kopf

    # kopf's formatter prefixes object messages with [namespace/name]; our level on top of it. It replaces
    # the plain handler `tidepool --log-level` installed, so every line is printed once.
    logging.getLogger().handlers.clear()
    kopf.configure(log_format=kopf.LogFormat.FULL, log_prefix=True, debug=args.log_level == "DEBUG")
    logging.getLogger().setLevel(args.log_level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)

    from tidepool.operator.collector_flags import collector_from_args
    from tidepool.operator.handlers import OperatorOptions, identity, lease_namespace, register
    from tidepool.operator.k8s import load_credentials
    from tidepool.operator.leader import LeaseConfig

    try:
        creds = load_credentials(args.kubeconfig, args.context)
    except (RuntimeError, OSError, KeyError, StopIteration) as exc:
        print(f"tidepool operator: error: cannot load credentials: {exc}", file=sys.stderr)
        return 2
    lease = None
    if args.leader_elect:
        try:
            lease = LeaseConfig(
                namespace=lease_namespace(creds, args.leader_election_namespace),
                name=args.leader_election_id,
                identity=identity(),
                lease_duration_s=args.lease_duration_seconds,
                renew_deadline_s=args.renew_deadline_seconds,
                retry_period_s=args.retry_period_seconds,
            )
        except ValueError as exc:
            print(f"tidepool operator: error: {exc}", file=sys.stderr)
            return 2
    options = OperatorOptions(
        namespaces=args.namespace,
        resync_seconds=args.resync_seconds,
        feature_recheck_seconds=args.feature_recheck_seconds,
        workers=args.workers,
        max_concurrent_rollouts=args.max_concurrent_rollouts,
        kube_api_qps=args.kube_api_qps,
        kube_api_burst=args.kube_api_burst,
        lease=lease,
        gpus_per_node=args.gpus_per_node,
        engine_image=args.engine_image,
        router_image=args.router_image,
        router_cluster_role=args.router_cluster_role,
        hf_download_image=args.hf_download_image,
        s3_download_image=args.s3_download_image,
        metrics_port=int(os.environ.get("TIDEPOOL_OPERATOR_METRICS_PORT", "9090")),
        resolve_revisions=args.resolve_revisions,
        collector=collector_from_args(args),
    )
    registry = kopf.OperatorRegistry()
    register(registry, creds, options)
    scope = f"namespaces {', '.join(args.namespace)}" if args.namespace else "all namespaces"
    election = f"lease {lease.namespace}/{lease.name} as {lease.identity}" if lease else "no leader election"
    logger.info("tidepool operator starting: %s, API server %s, %s", scope, creds.server, election)
    asyncio.run(
        kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=True,  # kopf itself watches nothing; the controller watches the namespaces above
            liveness_endpoint=args.liveness,
            memo=kopf.Memo(),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
