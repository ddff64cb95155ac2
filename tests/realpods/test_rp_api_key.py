"""API keys on real pods (`spec.auth.apiKeySecretRef`): the router and every engine refuse a request without a listed
key with OpenAI's 401, and serve it with one.

One service whose Secret holds a key; the operator mounts it into the engine and router pods and passes
`--api-key-file`. Requests go from the host (admitted by the NetworkPolicies through the collector's address
block, rp_support.Operator) both through the router's Service and straight to an engine pod's IP, so neither
path leans on the other's check. /metrics stays open (scrapers carry no key). The expected 401 bodies come from
tidepool.common.api_key, the one place that writes them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from rp_support import (
    Operator,
    apply,
    cpu_service,
    engine_pods,
    install_crd,
    operator_identity,
    service_url,
    wait_ready,
)

from controlplane_fixture import dev_namespace
from tidepool.common.api_key import unauthorized_body

pytestmark = [pytest.mark.realpods, pytest.mark.timeout(900)]

NAME = "keyed"
SECRET, SECRET_KEY = "keyed-api-keys", "api-key"
KEY = f"tp-{uuid.uuid4().hex}"
ENGINE_PORT = 8000  # operator/builders/common.py


@dataclass
class Keyed:
    namespace: str
    router: str  # base URL of the router's Service
    engine: str  # base URL of one engine pod


@pytest.fixture(scope="module")
def keyed_service(real_cluster, rp_models, tmp_path_factory) -> Iterator[Keyed]:
    state = tmp_path_factory.mktemp("rp-api-key")
    with dev_namespace(real_cluster, f"rp-api-key-{uuid.uuid4().hex[:6]}", rp_models) as ns:
        install_crd(real_cluster)
        identity = operator_identity(real_cluster, state)
        op = Operator(identity.kubeconfig, [ns], state / "operator.log")
        try:
            real_cluster.kubectl("create", "secret", "generic", SECRET, "-n", ns, f"--from-literal={SECRET_KEY}={KEY}")
            obj = cpu_service(NAME, real_cluster.dev_image, auth={"apiKeySecretRef": {"name": SECRET}})
            out = apply(real_cluster, ns, obj)
            assert out.returncode == 0, out.stderr
            wait_ready(real_cluster, ns, NAME)
            engine_ip = engine_pods(real_cluster, ns, NAME)[0]["status"]["podIP"]
            yield Keyed(ns, service_url(real_cluster, ns, f"{NAME}-router"), f"http://{engine_ip}:{ENGINE_PORT}")
        finally:
            op.stop()
        forbidden = op.forbidden_lines()
        assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])


def complete(base_url: str, headers: dict[str, str]) -> httpx.Response:
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("target", ["router", "engine"])
def test_a_request_without_the_key_gets_openais_401(keyed_service, target):
    base = getattr(keyed_service, target)
    missing = complete(base, {})
    assert missing.status_code == 401, missing.text
    assert missing.json() == json.loads(unauthorized_body(False))
    wrong = complete(base, {"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 401, wrong.text
    assert wrong.json() == json.loads(unauthorized_body(True))


@pytest.mark.parametrize("target", ["router", "engine"])
def test_a_request_with_the_key_is_served(keyed_service, target):
    resp = complete(getattr(keyed_service, target), {"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


def test_metrics_stay_open_to_scrapers_without_a_key(keyed_service):
    resp = httpx.get(f"{keyed_service.engine}/metrics", timeout=30)
    assert resp.status_code == 200, resp.text
