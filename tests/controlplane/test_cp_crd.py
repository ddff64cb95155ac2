"""The generated InferenceService CRD on a real API server: installs, accepts the samples, refuses bad objects.

Every invalid case of tests/operator/test_api_cases.py is sent to the API server, which must
refuse it itself (422) with the case's message, so users see what to fix at `kubectl apply`.
Also: the server's defaults equal the models' defaults, the printer columns, and the status and
scale subresources. The CRD is applied server-side and left installed (other control-plane tests
of the same session use it).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from api_cases_resources import layered
from devcluster_addons import install_crds
from hypothesis import HealthCheck, given, settings
from kubernetes import client
from kubernetes.client.rest import ApiException

from controlplane_fixture import wait_for
from tidepool.operator.api import (
    CRD_NAME,
    GROUP,
    PLURAL,
    VERSION,
    InferenceService,
    InferenceServiceStatus,
    status_patch,
    validate_spec,
)
from tidepool.operator.builders import ClusterFeatures, ServiceView
from tidepool.operator.reconcile import desire

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / f"{GROUP}_{PLURAL}.yaml"


def _load_cases():
    name = "tidepool_test_api_cases"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "operator" / "test_api_cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


cases = _load_cases()


def install_crd(control_plane) -> None:
    """Apply the generated CRD (idempotent) and wait until it is Established."""
    install_crds(control_plane, [CRD_FILE])


@pytest.fixture(scope="module")
def crd_namespace(control_plane) -> Iterator[str]:
    install_crd(control_plane)
    name = f"crd-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", name)
    custom = client.CustomObjectsApi(control_plane.api_client())
    # Discovery can lag Established for a moment: wait until the resource is served.
    wait_for(lambda: _status(lambda: custom.list_namespaced_custom_object(GROUP, VERSION, name, PLURAL))[0] == 200, 30)
    try:
        yield name
    finally:
        control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _status(call) -> tuple[int, str]:
    try:
        call()
    except ApiException as exc:
        return exc.status, exc.body or ""
    return 200, ""


def _create(control_plane, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    custom = client.CustomObjectsApi(control_plane.api_client())
    return custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def test_crd_is_established_with_names_and_subresources(control_plane, crd_namespace):
    crd = client.ApiextensionsV1Api(control_plane.api_client()).read_custom_resource_definition(CRD_NAME)
    conditions = {c.type: c.status for c in crd.status.conditions}
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True", conditions
    assert crd.status.accepted_names.short_names == ["tpisvc"]
    resources = control_plane.kubectl("api-resources", f"--api-group={GROUP}", "-o", "wide").stdout
    assert "tpisvc" in resources and "inferenceservices" in resources, resources
    # The category makes `kubectl get tidepool` list them.
    assert control_plane.kubectl("get", "tidepool", "-n", crd_namespace).returncode == 0


def _normalized(spec: dict[str, Any]) -> dict[str, Any]:
    """The stored spec as the models read it (quantities written as ints become strings)."""
    return InferenceService.from_body({"spec": spec})[0].to_wire()


@pytest.mark.parametrize("name", ["unified", "disaggregated"])
def test_sample_is_accepted_and_server_defaults_match_the_models(control_plane, crd_namespace, name):
    body = cases.sample(name)
    stored = _create(control_plane, crd_namespace, body)
    spec, _ = InferenceService.from_body(body)
    assert validate_spec(spec, body["metadata"]["name"]) == []
    # Every default the API server filled in is the one pydantic fills in, and nothing else appeared.
    raw_stored = json.loads(json.dumps(stored["spec"]))
    assert _normalized(raw_stored) == spec.to_wire()
    assert set(raw_stored) == set(spec.to_wire()), set(raw_stored) ^ set(spec.to_wire())


def test_minimal_object_gets_every_default(control_plane, crd_namespace):
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": "minimal"},
        "spec": {"model": {"uri": "pvc://models/tiny"}},
    }
    stored = _create(control_plane, crd_namespace, body)["spec"]
    assert stored == InferenceService.from_body(body)[0].to_wire()
    assert stored["pools"] == {"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4}}


@pytest.mark.parametrize("case", [*cases.INVALID_CASES, cases.NAME_CASE], ids=lambda c: c.id)
def test_api_server_refuses_invalid_object_saying_what_to_fix(control_plane, crd_namespace, case):
    status, body = _status(lambda: _create(control_plane, crd_namespace, case.body()))
    assert status == 422, f"{case.id}: expected 422, got {status}: {body[:500]}"
    message = json.loads(body)["message"]
    assert case.message in message, message


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(body=layered())
def test_the_api_server_refuses_a_request_above_its_limit_exactly_when_the_python_mirror_does(
    control_plane, crd_namespace, body
):
    """The CEL of api/resource_rules.py (generated, ~3.7 kB per pool) against its Python mirror, on layered
    requests and limits: the API server (a dry-run create) accepts exactly what `validate_spec` accepts."""
    custom = client.CustomObjectsApi(control_plane.api_client())
    create = lambda: custom.create_namespaced_custom_object(  # noqa: E731
        GROUP, VERSION, crd_namespace, PLURAL, body, dry_run="All"
    )
    status, answer = _status(create)
    refused = [m for m in validate_spec(InferenceService.from_body(body)[0]) if "above its limit" in m]
    assert (status == 422) == bool(refused), (status, answer[:800], refused)
    for message in refused:
        assert message in json.loads(answer)["message"]


def test_printer_columns_show_status(control_plane, crd_namespace):
    custom = client.CustomObjectsApi(control_plane.api_client())
    body = cases.sample("unified")
    body["metadata"]["name"] = "columns"
    _create(control_plane, crd_namespace, body)
    status = InferenceServiceStatus(
        observed_generation=1,
        replicas=2,
        selector="app.kubernetes.io/instance=columns,tidepool.dev/pool=unified",
        url="http://columns.default.svc:8080",
    )
    status.set_condition("Ready", "True", "AllPoolsReady", "2/2 replicas ready", observed_generation=1)
    status.set_condition("Progressing", "False", "RolloutComplete", "", observed_generation=1)
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, crd_namespace, PLURAL, "columns", {"status": status_patch(status)}
    )
    out = control_plane.kubectl("get", "inferenceservices", "-n", crd_namespace, "columns").stdout.splitlines()
    assert out[0].split() == ["NAME", "MODE", "READY", "REPLICAS", "URL", "AGE"], out
    row = out[1].split()
    assert row[:5] == ["columns", "unified", "True", "2", "http://columns.default.svc:8080"], out
    wide = control_plane.kubectl("get", "tpisvc", "-n", crd_namespace, "columns", "-o", "wide").stdout
    assert "AllPoolsReady" in wide, wide
    # The written status reads back through the model unchanged.
    stored = custom.get_namespaced_custom_object(GROUP, VERSION, crd_namespace, PLURAL, "columns")
    assert InferenceService.from_body(stored)[1] == status


def test_scale_subresource_drives_spec_replicas(control_plane, crd_namespace):
    custom = client.CustomObjectsApi(control_plane.api_client())
    body = cases.sample("disaggregated")
    body["metadata"]["name"] = "scaled"
    _create(control_plane, crd_namespace, body)
    status = InferenceServiceStatus(replicas=2, selector="tidepool.dev/pool=decode")
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, crd_namespace, PLURAL, "scaled", {"status": status_patch(status)}
    )
    control_plane.kubectl("scale", "-n", crd_namespace, "inferenceservice/scaled", "--replicas=3")
    stored = custom.get_namespaced_custom_object(GROUP, VERSION, crd_namespace, PLURAL, "scaled")
    spec, _ = InferenceService.from_body(stored)
    assert spec.replicas == 3 and spec.pool_replicas("decode") == 3 and spec.pool_replicas("prefill") == 1
    scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, crd_namespace, PLURAL, "scaled")
    assert scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 2, "selector": "tidepool.dev/pool=decode"}
    # Scaling past the decode pool's maxReplicas is refused by the same CEL rule.
    refused = control_plane.kubectl(
        "scale", "-n", crd_namespace, "inferenceservice/scaled", "--replicas=9", check=False
    )
    assert refused.returncode != 0
    assert "spec.replicas must lie within minReplicas..maxReplicas" in refused.stderr, refused.stderr


@pytest.mark.parametrize(("name", "edit"), cases.VALID_EDITS, ids=[e[0] for e in cases.VALID_EDITS])
def test_accepted_pod_edge_cases_give_pods_the_api_server_accepts(control_plane, crd_namespace, name, edit):
    """What the CRD accepts in spec.pod, the API server accepts in the children built from it (a dry-run apply of
    each): an InferenceService must never pass admission only to have every pod template refused later."""
    body = cases.sample("unified")
    body["metadata"]["name"] = f"edge-{name}"
    edit(body)
    stored = _create(control_plane, crd_namespace, body)
    children = desire(ServiceView.from_body(stored), stored["metadata"], ClusterFeatures(), None).children
    assert children
    for child in children:
        out = control_plane.kubectl(
            "apply", "--server-side", "--dry-run=server", "--field-manager=test", "-f", "-",
            input=yaml.safe_dump(child), check=False,
        )  # fmt: skip
        assert out.returncode == 0, f"{child['kind']}/{child['metadata']['name']}: {out.stderr}"
