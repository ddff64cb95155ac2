"""RBAC, CRD CEL validation and Pod Security admission, enforced by the real apiserver."""

from __future__ import annotations

import json
import uuid

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from controlplane_fixture import wait_for

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(240)]


def _status_of(call) -> tuple[int, str]:
    try:
        call()
    except ApiException as exc:
        return exc.status, exc.body or ""
    return 200, ""


def test_rbac_narrow_role_forbids_what_it_does_not_grant(control_plane, cp_namespace):
    admin = control_plane.api_client()
    core, rbac = client.CoreV1Api(admin), client.RbacAuthorizationV1Api(admin)
    core.create_namespaced_service_account(cp_namespace, {"metadata": {"name": "narrow"}})
    rbac.create_namespaced_role(
        cp_namespace,
        {
            "metadata": {"name": "configmap-reader"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        cp_namespace,
        {
            "metadata": {"name": "narrow-reads-configmaps"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmap-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "narrow", "namespace": cp_namespace}],
        },
    )
    token = core.create_namespaced_service_account_token(
        "narrow", cp_namespace, {"spec": {"expirationSeconds": 600}}
    ).status.token

    conf = client.Configuration()
    conf.host = admin.configuration.host
    conf.ssl_ca_cert = admin.configuration.ssl_ca_cert
    conf.api_key = {"authorization": f"Bearer {token}"}
    narrow = client.CoreV1Api(client.ApiClient(conf))

    # Granted (the RoleBinding may take a moment to reach the authorizer's cache).
    wait_for(
        lambda: _status_of(lambda: narrow.list_namespaced_config_map(cp_namespace))[0] == 200,
        30,
        what="the narrow SA to list configmaps",
    )
    denied = {
        "list secrets": lambda: narrow.list_namespaced_secret(cp_namespace),
        "create configmap": lambda: narrow.create_namespaced_config_map(cp_namespace, {"metadata": {"name": "nope"}}),
        "list pods": lambda: narrow.list_namespaced_pod(cp_namespace),
        "list configmaps in kube-system": lambda: narrow.list_namespaced_config_map("kube-system"),
        "list nodes": lambda: narrow.list_node(),
    }
    for what, call in denied.items():
        status, body = _status_of(call)
        assert status == 403, f"{what}: expected 403, got {status}"
        assert f"system:serviceaccount:{cp_namespace}:narrow" in body, body


def test_crd_cel_rule_rejects_invalid_object_with_its_message(control_plane, cp_namespace):
    api = control_plane.api_client()
    ext, custom = client.ApiextensionsV1Api(api), client.CustomObjectsApi(api)
    group = f"t{uuid.uuid4().hex[:8]}.tidepool.example.com"
    message = "minReplicas must not exceed maxReplicas"
    spec_schema = {
        "type": "object",
        "properties": {"minReplicas": {"type": "integer"}, "maxReplicas": {"type": "integer"}},
        "x-kubernetes-validations": [{"rule": "self.minReplicas <= self.maxReplicas", "message": message}],
    }
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": spec_schema}}},
                }
            ],
        },
    }
    ext.create_custom_resource_definition(crd)
    try:
        wait_for(
            lambda: any(
                c.type == "Established" and c.status == "True"
                for c in ext.read_custom_resource_definition(f"widgets.{group}").status.conditions or []
            ),
            30,
            what="CRD Established",
        )

        def create(name: str, lo: int, hi: int):
            body = {
                "apiVersion": f"{group}/v1",
                "kind": "Widget",
                "metadata": {"name": name},
                "spec": {"minReplicas": lo, "maxReplicas": hi},
            }
            return lambda: custom.create_namespaced_custom_object(group, "v1", cp_namespace, "widgets", body)

        # The discovery/REST mapping can lag Established by a moment: retry on 404.
        wait_for(lambda: _status_of(create("ok", 1, 3))[0] in (200, 409), 30, what="a valid Widget to be accepted")
        status, body = _status_of(create("bad", 5, 2))
        assert status == 422, body
        assert message in json.loads(body)["message"]
    finally:
        ext.delete_custom_resource_definition(f"widgets.{group}")


def test_restricted_namespace_rejects_privileged_pod(control_plane, cp_namespace):
    core = client.CoreV1Api(control_plane.api_client())
    core.patch_namespace(
        cp_namespace,
        {
            "metadata": {
                "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/enforce-version": "latest",
                }
            }
        },
    )

    def pod(name: str, security_context: dict, pod_security: dict | None = None) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "securityContext": pod_security or {},
                "containers": [
                    {"name": "main", "image": "registry.k8s.io/pause:3.10", "securityContext": security_context}
                ],
            },
        }

    status, body = _status_of(lambda: core.create_namespaced_pod(cp_namespace, pod("privileged", {"privileged": True})))
    assert status == 403, body
    message = json.loads(body)["message"]
    assert 'violates PodSecurity "restricted:latest"' in message
    assert "securityContext.privileged=true" in message

    # A pod meeting the restricted profile is admitted in the same namespace.
    compliant = pod(
        "restricted-ok",
        {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": 65532,
        },
        {"seccompProfile": {"type": "RuntimeDefault"}},
    )
    assert core.create_namespaced_pod(cp_namespace, compliant).metadata.name == "restricted-ok"
