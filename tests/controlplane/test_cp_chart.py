"""The Helm chart against a real API server: its manifests are accepted, its RBAC grants exactly what it says.

`helm template` output goes through server-side dry-run (schema, admission); the operator pod
passes Pod Security "restricted" enforcement; the chart's ServiceAccount is checked with
`kubectl auth can-i` for what it must and must not do. The samples validate against the CRD.
Cluster-scoped objects get a per-test release name and are deleted afterwards.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from controlplane_fixture import wait_for
from tidepool.operator.api import CRD_NAME

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tidepool"


def _render(control_plane, release: str, namespace: str, *sets: str) -> str:
    args = [str(control_plane.bin_dir / "helm"), "template", release, str(CHART), "--namespace", namespace]
    for item in sets:
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _install_crd(control_plane) -> None:
    crd = CHART / "crds" / "tidepool.dev_inferenceservices.yaml"
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    control_plane.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")


@pytest.fixture
def release(control_plane, cp_namespace) -> Iterator[tuple[str, str]]:
    """(release name, its namespace); the release's cluster-scoped RBAC is removed afterwards."""
    name = f"tp{uuid.uuid4().hex[:6]}"
    try:
        yield name, cp_namespace
    finally:
        for kind in ("clusterrolebinding", "clusterrole"):
            control_plane.kubectl("delete", kind, f"{name}-tidepool", "--ignore-not-found", check=False)
        for role in ("router", "edit", "view"):  # the routers' and the tenants' ClusterRoles
            control_plane.kubectl("delete", "clusterrole", f"{name}-tidepool-{role}", "--ignore-not-found", check=False)


def test_rendered_chart_passes_server_side_dry_run(control_plane, release):
    name, namespace = release
    _install_crd(control_plane)
    for sets in ((), ("watchNamespaces={" + namespace + "}",)):
        manifest = _render(control_plane, name, namespace, *sets)
        out = control_plane.kubectl(
            "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=manifest, check=False
        )
        assert out.returncode == 0, out.stderr
        assert "deployment.apps/" in out.stdout and "clusterrole.rbac.authorization.k8s.io/" in out.stdout, out.stdout


def test_operator_pod_is_admitted_under_pod_security_restricted(control_plane, release):
    name, namespace = release
    control_plane.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted", "--overwrite"
    )
    docs = [d for d in yaml.safe_load_all(_render(control_plane, name, namespace)) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "operator-pod", "labels": deployment["spec"]["template"]["metadata"]["labels"]},
        "spec": {**deployment["spec"]["template"]["spec"], "serviceAccountName": "default"},
    }
    out = control_plane.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(pod), check=False
    )
    assert out.returncode == 0, out.stderr
    # A pod that breaks the profile is refused in the same namespace, so the check has teeth.
    pod["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    out = control_plane.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(pod), check=False
    )
    assert out.returncode != 0 and "violates PodSecurity" in out.stderr, out.stderr


def _can_i(control_plane, subject: str, verb: str, resource: str, namespace: str | None) -> bool:
    """Ask the API server's authorizer (a SubjectAccessReview, what `kubectl auth can-i --as` does)."""
    resource, _, sub = resource.partition("/")
    plural, _, group = resource.partition(".")
    attrs = {"verb": verb, "resource": plural, "group": group, "subresource": sub, "namespace": namespace or ""}
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview"}
    review["spec"] = {"user": subject, "groups": ["system:serviceaccounts"], "resourceAttributes": attrs}
    api = client.AuthorizationV1Api(control_plane.api_client())
    return bool(api.create_subject_access_review(review).status.allowed)


def _wait_for_binding(control_plane, subject: str, namespace: str) -> None:
    # A new binding reaches the authorizer's cache a moment after it is created.
    wait_for(lambda: _can_i(control_plane, subject, "create", "deployments.apps", namespace), 30, what=subject)


def test_service_account_can_do_exactly_what_the_operator_needs(control_plane, release):
    name, namespace = release
    other = f"other-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", other)
    try:
        control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=_render(control_plane, name, namespace))
        subject = f"system:serviceaccount:{namespace}:{name}-tidepool"
        _wait_for_binding(control_plane, subject, other)
        allowed: list[tuple[str, str, str | None]] = [
            ("watch", "inferenceservices.tidepool.dev", None),
            ("patch", "inferenceservices.tidepool.dev", other),
            ("patch", "inferenceservices.tidepool.dev/status", other),
            ("create", "deployments.apps", other),
            ("patch", "statefulsets.apps", other),
            ("delete", "services", other),
            ("create", "poddisruptionbudgets.policy", other),
            ("create", "rolebindings.rbac.authorization.k8s.io", other),
            ("list", "pods", other),
            ("delete", "roles.rbac.authorization.k8s.io", other),  # an older operator's router Role, pruned
            ("create", "events", other),
            ("create", "secrets", other),  # a multi-node pool's control key, created once
            ("get", "secrets", other),  # spec.auth's Secret, read by name
        ]
        denied: list[tuple[str, str, str | None]] = [
            ("list", "secrets", other),
            ("watch", "secrets", other),
            ("update", "secrets", other),
            ("list", "nodes", None),
            ("list", "customresourcedefinitions.apiextensions.k8s.io", None),
            ("list", "namespaces", None),
            ("create", "clusterroles.rbac.authorization.k8s.io", None),
            ("escalate", "roles.rbac.authorization.k8s.io", other),
            ("create", "roles.rbac.authorization.k8s.io", other),  # routers bind the chart's ClusterRole instead
            ("bind", "clusterroles.rbac.authorization.k8s.io", other),  # only the router's, by name
            ("list", "endpointslices.discovery.k8s.io", other),  # the routers' to read, never the operator's
            ("impersonate", "serviceaccounts", other),
            ("delete", "pods", other),
            ("create", "pods/exec", other),
            ("delete", "namespaces", None),
            ("update", "inferenceservices.tidepool.dev/scale", other),
        ]
        results: dict[str, Any] = {}
        for verb, resource, ns in allowed:
            results[f"{verb} {resource} in {ns}"] = _can_i(control_plane, subject, verb, resource, ns)
        for verb, resource, ns in denied:
            results[f"NOT {verb} {resource} in {ns}"] = not _can_i(control_plane, subject, verb, resource, ns)
        assert all(results.values()), {k: v for k, v in results.items() if not v}
    finally:
        control_plane.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_watch_namespaces_limits_writes_to_those_namespaces(control_plane, release):
    name, namespace = release
    other = f"other-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", other)
    try:
        manifest = _render(control_plane, name, namespace, "watchNamespaces={" + namespace + "}")
        control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=manifest)
        subject = f"system:serviceaccount:{namespace}:{name}-tidepool"
        _wait_for_binding(control_plane, subject, namespace)
        assert not _can_i(control_plane, subject, "create", "deployments.apps", other)
        assert not _can_i(control_plane, subject, "list", "inferenceservices.tidepool.dev", other)
        assert not _can_i(control_plane, subject, "watch", "inferenceservices.tidepool.dev", None)
    finally:
        control_plane.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_samples_validate_against_the_crd(control_plane, cp_namespace):
    _install_crd(control_plane)
    for sample in sorted((REPO / "examples").glob("inferenceservice-*.yaml")):
        out = control_plane.kubectl("apply", "--dry-run=server", "-n", cp_namespace, "-f", str(sample), check=False)
        assert out.returncode == 0, f"{sample.name}: {out.stderr}"
        assert "(server dry run)" in out.stdout
