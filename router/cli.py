"""`tidepool router`: the command line of the data-plane router.

Unified pool: `--unified-url URL` (repeatable) or `--discovery kubernetes --namespace NS
--unified-service NAME`. Disaggregated: `--prefill-url URL --decode-url URL,kv=HOST:PORT`
or `--prefill-service NAME --decode-service NAME`. Bad flags exit 2 with a message naming
the flag.

API keys: `--api-key` / `--api-key-file` / $TIDEPOOL_API_KEY, the flags of `tidepool serve` (from the
serve-flag table's AUTH_FLAGS, read by tidepool.common.api_key).

SIGTERM/SIGINT drain (tidepool.common.graceful): `/ready` 503, new requests 503 `draining`, in-flight
ones get `--drain-timeout` seconds (the serve flag's default), then the process exits 0; a second
signal stops waiting (uvicorn then gives what is left its short graceful-shutdown time).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from tidepool.common.api_key import ApiKeys
from tidepool.contract import serve_flags

from .app import RouterConfig, build_app, drain
from .discovery import SA_DIR, KubernetesConfig, KubernetesDiscovery, StaticDiscovery, parse_static_url
from .policy import POLICIES, HotThresholds
from .pool import Endpoint
from .proxy import ProxySettings

# uvicorn's own wait for connections once the drain is over: after a full drain only idle keep-alive
# connections are left; after a second signal, what is still streaming is cut after this long.
_GRACEFUL_SHUTDOWN_S = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidepool router", description="OpenAI-compatible router for engine pools")
    disc = parser.add_argument_group("discovery")
    disc.add_argument("--discovery", choices=["static", "kubernetes"], default="static")
    disc.add_argument("--unified-url", action="append", default=[], help="a unified replica's base URL (repeatable)")
    disc.add_argument("--prefill-url", action="append", default=[], help="a prefill replica's base URL (repeatable)")
    disc.add_argument(
        "--decode-url",
        action="append",
        default=[],
        help="a decode replica: URL,kv=HOST:PORT (its KV-transfer listener; repeatable)",
    )
    disc.add_argument("--namespace", default=None, help="Kubernetes namespace of the pool Services")
    disc.add_argument("--unified-service", default=None, help="Service of the unified pool")
    disc.add_argument("--prefill-service", default=None, help="Service of the prefill pool")
    disc.add_argument("--decode-service", default=None, help="Service of the decode pool (with a port named 'kv')")
    disc.add_argument("--service-port-name", default="http", help="the Service port the engines serve HTTP on")
    disc.add_argument("--discovery-interval", type=float, default=2.0, help="seconds between EndpointSlice lists")
    disc.add_argument("--kube-api-server", default=None, help="default: the in-cluster API server")
    disc.add_argument("--kube-token-file", type=Path, default=SA_DIR / "token")
    disc.add_argument("--kube-ca-file", type=Path, default=SA_DIR / "ca.crt")
    pol = parser.add_argument_group("routing")
    pol.add_argument("--policy", choices=POLICIES, default="prefix-aware")
    pol.add_argument("--prefix-block-chars", type=int, default=64, help="characters per hashed prompt block")
    pol.add_argument("--prefix-max-blocks", type=int, default=4, help="leading blocks in the prefix key")
    pol.add_argument("--virtual-nodes", type=int, default=160, help="hash-ring points per replica")
    pol.add_argument("--hot-max-waiting", type=int, default=4, help="prefix target with more queued is hot")
    pol.add_argument("--hot-load-ratio", type=float, default=2.0, help="hot if load > ratio * least load + slack")
    pol.add_argument("--hot-load-slack", type=int, default=4)
    rel = parser.add_argument_group("reliability")
    rel.add_argument("--hold-timeout", type=float, default=30.0, help="seconds to hold requests at zero replicas")
    rel.add_argument("--max-retries", type=int, default=2, help="retries on another replica before any byte streamed")
    rel.add_argument("--health-interval", type=float, default=1.0, help="seconds between /ready + /metrics probes")
    rel.add_argument("--max-failures", type=int, default=3, help="consecutive failures that eject a replica")
    rel.add_argument("--eject-seconds", type=float, default=5.0, help="minimum time an ejected replica stays out")
    rel.add_argument("--connect-timeout", type=float, default=5.0)
    rel.add_argument("--read-timeout", type=float, default=600.0, help="seconds without a byte from a replica")
    srv = parser.add_argument_group("server")
    srv.add_argument("--host", default="0.0.0.0")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--access-log", action="store_true")
    drain_flag = serve_flags.FLAGS["drain-timeout"]
    srv.add_argument(drain_flag.option, type=float, default=drain_flag.default, help=drain_flag.help)
    serve_flags.add_to_parser(parser, serve_flags.AUTH_FLAGS)
    return parser


def build_config(args: argparse.Namespace) -> RouterConfig:
    """RouterConfig from parsed flags; ValueError naming the flag on bad input."""
    for flag, value in (
        ("--hold-timeout", args.hold_timeout),
        ("--max-retries", args.max_retries),
        ("--eject-seconds", args.eject_seconds),
        ("--hot-max-waiting", args.hot_max_waiting),
        ("--hot-load-ratio", args.hot_load_ratio),
        ("--hot-load-slack", args.hot_load_slack),
        ("--drain-timeout", args.drain_timeout),
    ):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    for flag, value in (
        ("--health-interval", args.health_interval),
        ("--max-failures", args.max_failures),
        ("--prefix-block-chars", args.prefix_block_chars),
        ("--virtual-nodes", args.virtual_nodes),
        ("--prefix-max-blocks", args.prefix_max_blocks),
        ("--discovery-interval", args.discovery_interval),
        ("--connect-timeout", args.connect_timeout),
        ("--read-timeout", args.read_timeout),
    ):
        if value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    discovery: StaticDiscovery | KubernetesDiscovery
    if args.discovery == "static":
        if args.namespace or args.unified_service or args.prefill_service or args.decode_service:
            raise ValueError("--namespace/--*-service need --discovery kubernetes")
        members: dict[str, list[Endpoint]] = {}
        if args.unified_url:
            members["unified"] = [parse_static_url(u, "--unified-url") for u in args.unified_url]
        if args.prefill_url or args.decode_url:
            members["prefill"] = [parse_static_url(u, "--prefill-url") for u in args.prefill_url]
            members["decode"] = [parse_static_url(u, "--decode-url", needs_kv=True) for u in args.decode_url]
        pool_names = _pool_names(bool(args.unified_url), bool(args.prefill_url), bool(args.decode_url), "url")
        discovery = StaticDiscovery(members)
    else:
        if args.unified_url or args.prefill_url or args.decode_url:
            raise ValueError("--*-url flags are for --discovery static; give --*-service names instead")
        if not args.namespace:
            raise ValueError("--discovery kubernetes needs --namespace")
        services = {
            name: svc
            for name, svc in (
                ("unified", args.unified_service),
                ("prefill", args.prefill_service),
                ("decode", args.decode_service),
            )
            if svc
        }
        pool_names = _pool_names("unified" in services, "prefill" in services, "decode" in services, "service")
        discovery = KubernetesDiscovery(
            KubernetesConfig(
                args.namespace,
                services,
                args.kube_api_server,
                args.kube_token_file,
                args.kube_ca_file,
                args.service_port_name,
                args.discovery_interval,
            )
        )
    thresholds = HotThresholds(args.hot_max_waiting, args.hot_load_ratio, args.hot_load_slack)
    proxy = ProxySettings(args.hold_timeout, args.max_retries, args.prefix_block_chars, args.prefix_max_blocks)
    return RouterConfig(
        discovery,
        pool_names,
        args.policy,
        thresholds,
        args.virtual_nodes,
        proxy,
        health_interval_s=args.health_interval,
        max_failures=args.max_failures,
        eject_s=args.eject_seconds,
        connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout,
        api_keys=ApiKeys.from_flags(args.api_key, args.api_key_file),  # ApiKeyError is a ValueError naming the flag
        drain_timeout_s=args.drain_timeout,
    )


def _pool_names(has_unified: bool, has_prefill: bool, has_decode: bool, kind: str) -> tuple[str, ...]:
    if has_unified and not (has_prefill or has_decode):
        return ("unified",)
    if has_prefill and has_decode and not has_unified:
        return ("prefill", "decode")
    raise ValueError(
        f"give either --unified-{kind} (a unified pool) or both --prefill-{kind} and --decode-{kind} "
        "(disaggregated), not a mix"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
    except ValueError as err:
        print(f"tidepool router: error: {err}", file=sys.stderr)
        return 2
    import uvicorn

    from tidepool.common.graceful import DrainingServer
    from tidepool.common.tcp_tuning import http_protocol

    app = build_app(config)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=args.access_log,
        http=http_protocol(),
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=5,
    )
    server = DrainingServer(uv_config, lambda: drain(app), app.state.router.drain.hurry)
    server.run()  # a port that cannot be bound: uvicorn logs it and exits 1
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
