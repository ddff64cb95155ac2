"""Kubernetes discovery against a real API server: EndpointSlices read with a service-account token under RBAC.

The pool Service has no selector, so the test writes its EndpointSlice itself (pointing at a
fake engine on loopback), the way the endpoint-slice controller would for engine pods.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_helpers import Servers, replica_states, wait_for

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

NAMESPACE = "router-discovery"
ROLE_RULES = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]


def apply(control_plane: Any, *objects: dict[str, Any]) -> None:
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    out = control_plane.kubectl("apply", "-f", "-", input=body, check=False)
    assert out.returncode == 0, out.stderr


def host_address() -> str:
    """This machine's non-loopback IPv4 address (EndpointSlices refuse loopback ones); skip without one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))  # UDP: no packet is sent; only picks the outgoing address
            address = sock.getsockname()[0]
    except OSError:
        address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("no non-loopback IPv4 address here: EndpointSlices refuse loopback addresses")
    return address


def endpoint_slice(address: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "engines-1", "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": "engines",
                                "endpointslice.kubernetes.io/managed-by": "tidepool-tests"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
    }  # fmt: skip


def test_router_follows_the_pool_services_endpointslices(control_plane: Any, servers: Servers, tmp_path: Path) -> None:
    meta = {"namespace": NAMESPACE}
    apply(control_plane, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    apply(
        control_plane,
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "router", **meta}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody", **meta}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "router", **meta},
         "rules": ROLE_RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "router", **meta},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "router"},
         "subjects": [{"kind": "ServiceAccount", "name": "router", "namespace": NAMESPACE}]},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "engines", **meta},
         "spec": {"ports": [{"name": "http", "port": 8000}]}},
    )  # fmt: skip
    address = host_address()
    _, engine = servers.engine("a", host=address)
    apply(control_plane, endpoint_slice(address, engine.port))
    ca = control_plane.state_dir / "pki" / "ca.crt"
    tokens = {}
    for account in ("router", "nobody"):
        tokens[account] = tmp_path / account
        tokens[account].write_text(control_plane.kubectl("create", "token", account, "-n", NAMESPACE).stdout.strip())

    def router(account: str, wait_ready: int) -> str:
        return servers.router(
            "--discovery", "kubernetes", "--namespace", NAMESPACE, "--unified-service", "engines",
            "--kube-api-server", control_plane.server, "--kube-token-file", str(tokens[account]),
            "--kube-ca-file", str(ca), "--discovery-interval", "0.2", "--hold-timeout", "1", wait_ready=wait_ready,
        ).url  # fmt: skip

    url = router("router", wait_ready=1)
    out = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert out.status_code == 200 and out.headers["x-tidepool-replica"] == f"{address}:{engine.port}"

    control_plane.kubectl("delete", "endpointslice", "engines-1", "-n", NAMESPACE)
    wait_for(lambda: replica_states(url) == {}, what="the replica to leave with its EndpointSlice")
    out = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert out.status_code == 503 and out.json()["error"]["code"] == "no_ready_replica"

    apply(control_plane, endpoint_slice(address, engine.port))
    wait_for(lambda: replica_states(url) == {engine.url: "ready"}, what="the replica to come back")

    # Without the Role, listing is forbidden: the router keeps an empty pool and stays healthy.
    forbidden = router("nobody", wait_ready=0)
    time.sleep(1.0)
    assert replica_states(forbidden) == {}
    assert httpx.get(f"{forbidden}/health").json() == {"status": "ok"}
