"""`tidepool operator`: run the InferenceService controller (kopf, standalone, no peering).

Watches the given namespaces (`-n/--namespace`, repeatable) or the whole cluster (default), with
credentials from `--kubeconfig` / $KUBECONFIG, else the pod's ServiceAccount (the chart's RBAC; no
admin rights needed). Serves kopf's liveness probe on `--liveness` (default http://0.0.0.0:8080/healthz).
SIGTERM/SIGINT stop it cleanly; a crash or SIGKILL loses nothing (all state is in the cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

logger = logging.getLogger("tidepool.operator")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidepool operator", description=__doc__.split("\n\n")[0])
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file; default $KUBECONFIG or in-cluster")
    parser.add_argument("--context", default=None, help="kubeconfig context; default its current-context")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL")
    parser.add_argument(
        "--resync-seconds", type=float, default=60.0, help="re-reconcile every object this often (reverts hand edits)"
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; sizes multi-node replicas")
    parser.add_argument("--router-image", default=None, help="router image; default: each service's engine image")
    parser.add_argument(
        "--hf-download-image", default=None, help="image with `hf` for hf:// models; default engine image"
    )
    parser.add_argument(
        "--s3-download-image", default="amazon/aws-cli:2.22.35", help="image with `aws` for s3:// models"
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, value in (("resync-seconds", args.resync_seconds), ("gpus-per-node", args.gpus_per_node)):
        if value <= 0:
            print(f"tidepool operator: error: --{flag} must be > 0", file=sys.stderr)
            return 2
    import kopf

    # kopf's formatter prefixes object messages with [namespace/name]; our level on top of it. It replaces
    # the plain handler `tidepool --log-level` installed, so every line is printed once.
    logging.getLogger().handlers.clear()
    kopf.configure(log_format=kopf.LogFormat.FULL, log_prefix=True, debug=args.log_level == "DEBUG")
    logging.getLogger().setLevel(args.log_level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

    from tidepool.operator.autoscaler import handlers as autoscaler
    from tidepool.operator.handlers import OperatorOptions, register
    from tidepool.operator.k8s import load_credentials

    try:
        creds = load_credentials(args.kubeconfig, args.context)
    except (RuntimeError, OSError, KeyError, StopIteration) as exc:
        print(f"tidepool operator: error: cannot load credentials: {exc}", file=sys.stderr)
        return 2
    options = OperatorOptions(
        resync_seconds=args.resync_seconds,
        gpus_per_node=args.gpus_per_node,
        router_image=args.router_image,
        hf_download_image=args.hf_download_image,
        s3_download_image=args.s3_download_image,
    )
    registry = kopf.OperatorRegistry()
    register(registry, creds, options)
    autoscaler.register(registry)  # the autoscaler timer (operator/autoscaler/handlers.py)
    scope = f"namespaces {', '.join(args.namespace)}" if args.namespace else "all namespaces"
    logger.info("tidepool operator starting: %s, API server %s, liveness %s", scope, creds.server, args.liveness)
    asyncio.run(
        kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness,
            memo=kopf.Memo(),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
