"""A service that scales to zero gets a router that holds requests long enough for a pod to start (issue #43).

Found by tests/realpods/test_rp_scale_from_zero.py: with the router's 30 s default, a request arriving at zero
waited for an autoscaler tick (15 s) and a pod start (45 s after arrival on the dev machine) and got 503. With
scaleToZero the router runs with `--hold-timeout` SCALE_FROM_ZERO_HOLD_S, which its own parser takes as the
proxy's hold; other services keep the router's default (and their templates unchanged).
"""

from __future__ import annotations

from typing import Any

from test_builders import UNIFIED, build, pod_specs, spec

from tidepool.operator.builders.network import SCALE_FROM_ZERO_HOLD_S
from tidepool.router.cli import build_config, build_parser

TO_ZERO = {"enabled": True, "scaleToZero": {"enabled": True, "idleSeconds": 60}}
POOLS_FROM_ZERO = {"unified": {"replicas": 1, "minReplicas": 0, "maxReplicas": 2}}


def _router_args(s: dict[str, Any]) -> list[str]:
    (router,) = [c for t in pod_specs(build(s)) for c in t["spec"]["containers"] if c["name"] == "router"]
    return router["args"]


def test_a_service_that_scales_to_zero_holds_requests_through_a_pod_start() -> None:
    args = _router_args(spec(UNIFIED, autoscaling=TO_ZERO, pools=POOLS_FROM_ZERO))
    assert args[args.index("--hold-timeout") + 1] == str(SCALE_FROM_ZERO_HOLD_S)
    parsed = build_parser().parse_args([*args, "--kube-api-server", "https://127.0.0.1:6443"])  # not in a pod
    assert build_config(parsed).proxy.hold_timeout_s == SCALE_FROM_ZERO_HOLD_S


def test_other_services_keep_the_router_default() -> None:
    assert "--hold-timeout" not in _router_args(spec(UNIFIED))
    assert "--hold-timeout" not in _router_args(spec(UNIFIED, autoscaling={"enabled": True}))
