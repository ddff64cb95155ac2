"""Pod overrides on the real control plane: the operator (as the chart's ServiceAccount) renders spec.pod,
pools.<name>.pod and router.* into pods that a namespace enforcing Pod Security "restricted" admits and
KWOK runs; overrides Pod Security forbids (a hostPath volume, host namespaces) or that would take over the
operator's own env, volumes or mount paths are refused by the API server itself, with the message that says
what to fix (the CRD's CEL, the same text `validate_spec` gives)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml
from kubernetes import client
from operator_kit import (
    bind_claims,
    children,
    claims_in,
    custom_api,
    get_isvc,
    is_ready,
    load_example,
    pod_is_ready,
    pods,
    restricted_namespace,
    wait_until,
)

from controlplane_fixture import load_devcluster
from tidepool.operator.api import GROUP, PLURAL, VERSION, InferenceServiceSpec, validate_spec
from tidepool.operator.builders import ServiceView, desired_state
from tidepool.operator.builders.common import container_security_context, pod_security_context
from tidepool.operator.reconcile import contains

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

RUNTIME_CLASS = "tidepool-test-overrides"
POD = {
    "env": [
        {"name": "HTTPS_PROXY", "value": "http://proxy.example:3128"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ],
    "envFrom": [{"configMapRef": {"name": "engine-env"}}],
    "volumes": [
        {"name": "certs", "secret": {"secretName": "ca"}},
        {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
        {
            "name": "identity",
            "projected": {
                "sources": [
                    {"serviceAccountToken": {"path": "token", "audience": "s3", "expirationSeconds": 3600}},
                    {"configMap": {"name": "engine-env"}},
                ]
            },
        },
    ],
    "volumeMounts": [
        {"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True},
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "identity", "mountPath": "/var/run/identity", "readOnly": True},
    ],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "type", "operator": "In", "values": ["kwok"]}]}]
            }
        }
    },
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    ],
    "runtimeClassName": RUNTIME_CLASS,
    "imagePullSecrets": [{"name": "regcred"}],
    "resources": {"requests": {"ephemeral-storage": "10Gi"}, "limits": {"ephemeral-storage": "20Gi"}},
}
POOL_POD = {
    "env": [{"name": "HTTPS_PROXY", "value": "http://pool-proxy.example:3128"}],
    "nodeSelector": {"type": "kwok"},
}
ROUTER = {
    "nodeSelector": {"type": "kwok"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "resources": {"requests": {"cpu": "100m"}, "limits": {"memory": "512Mi"}},
}


def _objects(namespace: str) -> list[dict[str, Any]]:
    """What the overrides name: a RuntimeClass (admission refuses pods naming a missing one), Secrets, a ConfigMap."""
    meta = {"namespace": namespace}
    return [
        {
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": {"name": RUNTIME_CLASS},
            "handler": "nvidia",
        },
        {"apiVersion": "v1", "kind": "Secret", "metadata": {**meta, "name": "hf"}, "stringData": {"token": "hf_x"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {**meta, "name": "ca"}, "stringData": {"ca.crt": "x"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": "engine-env"}, "data": {"LOG": "1"}},
    ]


def _isvc(name: str) -> dict[str, Any]:
    obj = load_example("inferenceservice-unified.yaml")
    obj["metadata"]["name"] = name
    obj["spec"]["pod"] = copy.deepcopy(POD)
    obj["spec"]["pools"]["unified"]["pod"] = copy.deepcopy(POOL_POD)
    obj["spec"]["router"].update(copy.deepcopy(ROUTER))
    obj["spec"]["autoscaling"]["enabled"] = False
    return obj


def test_overrides_land_in_pods_admitted_by_a_restricted_namespace(control_plane, cp_namespace, operator):
    ns = cp_namespace
    for doc in _objects(ns):
        control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    obj = _isvc("overrides")
    assert validate_spec(InferenceServiceSpec.model_validate(obj["spec"]), "overrides") == []
    bind_claims(control_plane, ns, claims_in(obj["spec"]))
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))
    wait_until(lambda: is_ready(get_isvc(control_plane, ns, "overrides")), 180, "overrides Ready")

    # What the operator applied reads back equal to what the builders render: no write on every reconcile.
    desired = {
        (c["kind"], c["metadata"]["name"]): c
        for c in desired_state("overrides", ns, ServiceView.from_spec(obj["spec"])).children
    }
    found = children(control_plane, ns, "overrides")
    for key in (("Deployment", "overrides-unified"), ("Deployment", "overrides-router")):
        assert contains(found[key], desired[key]), key

    engines = pods(control_plane, ns, "tidepool.dev/inferenceservice=overrides,tidepool.dev/pool=unified")
    assert engines and all(pod_is_ready(p) for p in engines)
    for pod in engines:
        spec, engine = pod["spec"], pod["spec"]["containers"][0]
        env = {e["name"]: e for e in engine["env"]}
        assert env["HTTPS_PROXY"]["value"] == "http://pool-proxy.example:3128"  # the pool's entry replaced it
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
        assert env["HOME"]["value"] == "/tmp"
        assert engine["envFrom"] == [{"configMapRef": {"name": "engine-env"}}]
        mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
        assert {"/etc/ssl/extra": "certs", "/scratch": "scratch", "/var/run/identity": "identity"}.items() <= (
            mounts.items()
        )
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["certs"]["secret"]["secretName"] == "ca"
        assert volumes["scratch"]["emptyDir"] == {"sizeLimit": "1Gi"}
        assert volumes["identity"]["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "s3"
        assert spec["affinity"] == POD["affinity"]
        assert spec["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]["tidepool.dev/pool"] == "unified"
        assert spec["runtimeClassName"] == RUNTIME_CLASS and spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert spec["nodeSelector"]["type"] == "kwok"
        assert engine["resources"]["limits"]["ephemeral-storage"] == "20Gi"
        assert engine["resources"]["requests"]["ephemeral-storage"] == "10Gi"
        # What "restricted" asks for is untouched by the overrides (and the namespace admitted the pod).
        for key, value in pod_security_context().items():
            assert spec["securityContext"][key] == value, key
        for container in spec["containers"] + spec.get("initContainers", []):
            for key, value in container_security_context().items():
                assert container["securityContext"][key] == value, (container["name"], key)
        assert not {"hostNetwork", "hostPID", "hostIPC"} & {k for k, v in spec.items() if v}

    (router,) = wait_until(
        lambda: [p for p in pods(control_plane, ns, "tidepool.dev/inferenceservice=overrides,tidepool.dev/pool=router")
                 if pod_is_ready(p)],
        120,
        "the router pod Ready",
    )  # fmt: skip
    assert router["spec"]["nodeSelector"] == {"type": "kwok"}
    assert ROUTER["tolerations"][0] in router["spec"]["tolerations"]
    assert router["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert router["spec"]["containers"][0]["resources"]["limits"] == {"memory": "512Mi"}
    assert "runtimeClassName" not in router["spec"] and "envFrom" not in router["spec"]["containers"][0]


def _refusal(cluster, namespace: str, body: dict[str, Any]) -> str:
    with pytest.raises(client.ApiException) as caught:
        custom_api(cluster).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    assert caught.value.status == 422, caught.value.body
    return json.loads(caught.value.body)["message"]


@pytest.mark.parametrize(
    ("where", "pod", "expected"),
    [
        (
            "spec.pod",
            {"volumes": [{"name": "host", "hostPath": {"path": "/var/lib/kubelet"}}]},
            "pod.volumes: hostPath volumes are refused (Pod Security 'restricted' forbids them)",
        ),
        # A pool declares no volumes (spec.pod's are the service's); its own overrides are held to the same rules.
        ("pools.unified.pod", {"hostNetwork": True}, "pod.hostNetwork, hostPID and hostIPC are refused"),
        ("spec.pod", {"env": [{"name": "TIDEPOOL_MASTER_ADDR", "value": "evil"}]}, "pod.env must not set a variable"),
        ("pools.unified.pod", {"env": [{"name": "HOME", "value": "/root"}]}, "the operator sets itself (HOME, HF_HOME"),
        ("spec.pod", {"hostNetwork": True}, "pod.hostNetwork, hostPID and hostIPC are refused"),
        (
            "spec.pod",
            {"volumes": [{"name": "n", "nfs": {"server": "nfs.example", "path": "/"}}]},
            "pod.volumes entries need exactly one source of: configMap, secret, emptyDir",
        ),
        (
            "spec.pod",
            {"volumes": [{"name": "w", "emptyDir": {}}], "volumeMounts": [{"name": "w", "mountPath": "/models"}]},
            "must not mount at or under a path the operator mounts",
        ),
    ],
)
def test_forbidden_overrides_are_refused_by_the_api_server(control_plane, cp_namespace, identity, where, pod, expected):
    restricted_namespace(control_plane, cp_namespace)
    body = load_example("inferenceservice-unified.yaml")
    body["metadata"]["name"] = "refused"
    if where == "spec.pod":
        body["spec"]["pod"] = pod
    else:
        body["spec"]["pools"]["unified"]["pod"] = pod
    message = _refusal(control_plane, cp_namespace, body)
    assert expected in message, message
    assert get_isvc(control_plane, cp_namespace, "refused") is None


# ---- Real GPU fleets (#39 item 6): another vendor's accelerator, pod labels and annotations, a PriorityClass,
# the service's own labels on every child, DRA claims and a scheduler of the admin's choice.
FLEET_NODE_LABEL = "tidepool.dev/test-fleet"
SERVICE_LABELS = {"team": "search", "argocd.argoproj.io/instance": "apps", "app.kubernetes.io/instance": "apps"}


def _amd_node(name: str, namespace: str) -> dict[str, Any]:
    """A KWOK node with 8 amd.com/gpu and no nvidia.com/gpu, tainted amd.com/gpu (as AMD's operator does)."""
    node = load_devcluster().gpu_node(name)
    resources = dict(node["status"]["capacity"])
    resources["amd.com/gpu"] = resources.pop("nvidia.com/gpu")
    node["status"].update(capacity=resources, allocatable=dict(resources))
    node["metadata"]["labels"][FLEET_NODE_LABEL] = namespace
    node["spec"] = {"taints": [{"key": "amd.com/gpu", "value": "present", "effect": "NoSchedule"}]}
    return node


def _fleet_isvc(name: str, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    obj = load_example("inferenceservice-unified.yaml")
    obj["metadata"].update(name=name, labels=dict(SERVICE_LABELS))
    spec = obj["spec"]
    spec.update(
        accelerator={"resourceName": "amd.com/gpu"},
        resources={**spec.get("resources", {}), "gpusPerReplica": 2, "cpu": "1", "memory": "4Gi"},
        parallelism={"tensor": 2, "pipeline": 1},
        pod={"nodeSelector": {FLEET_NODE_LABEL: namespace}, **pod},
    )
    spec["pools"]["unified"].update(replicas=1, minReplicas=1)
    spec["autoscaling"]["enabled"] = False
    spec["router"].update(nodeSelector={"type": "kwok"})
    return obj


def test_amd_gpus_labels_and_priority_reach_pods_that_schedule(control_plane, cp_namespace, operator):
    ns, node_name = cp_namespace, f"{cp_namespace[:40]}-amd"
    priority = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": f"{ns[:40]}-high"}, "value": 1000}  # fmt: skip
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(priority))
    control_plane.kubectl("create", "-f", "-", input=yaml.safe_dump(_amd_node(node_name, ns)))
    try:
        pod = {
            "labels": {"kueue.x-k8s.io/queue-name": "team-a", "cost-center": "ml"},
            "annotations": {"example.com/owner": "platform"},
            "priorityClassName": priority["metadata"]["name"],
        }
        obj = _fleet_isvc("amd", ns, pod)
        assert validate_spec(InferenceServiceSpec.model_validate(obj["spec"]), "amd") == []
        bind_claims(control_plane, ns, claims_in(obj["spec"]))
        control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))
        wait_until(lambda: is_ready(get_isvc(control_plane, ns, "amd")), 180, "amd Ready")

        (engine,) = pods(control_plane, ns, "tidepool.dev/inferenceservice=amd,tidepool.dev/pool=unified")
        assert engine["spec"]["nodeName"] == node_name and pod_is_ready(engine)  # the scheduler counted amd.com/gpu
        resources = engine["spec"]["containers"][0]["resources"]
        assert resources["limits"]["amd.com/gpu"] == "2" and "nvidia.com/gpu" not in resources["limits"]
        assert {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in engine["spec"]["tolerations"]
        assert engine["spec"]["priorityClassName"] == priority["metadata"]["name"]
        assert engine["spec"]["priority"] == 1000  # the Priority admission resolved it
        labels = engine["metadata"]["labels"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a" and labels["cost-center"] == "ml"
        assert labels["team"] == "search" and labels["app.kubernetes.io/instance"] == "amd"
        assert "argocd.argoproj.io/instance" not in labels
        assert engine["metadata"]["annotations"]["example.com/owner"] == "platform"

        # The service's labels reach every child (and the router's pods), never Argo CD's tracking labels.
        for (kind, name), child in children(control_plane, ns, "amd").items():
            if kind == "PersistentVolumeClaim":
                continue
            child_labels = child["metadata"].get("labels") or {}
            assert child_labels.get("team") == "search", (kind, name)
            assert child_labels.get("app.kubernetes.io/instance") == "amd", (kind, name)
            assert "argocd.argoproj.io/instance" not in child_labels, (kind, name)
        routers = pods(control_plane, ns, "tidepool.dev/inferenceservice=amd,tidepool.dev/pool=router")
        assert routers and all(r["metadata"]["labels"]["team"] == "search" for r in routers)
        assert not any("kueue.x-k8s.io/queue-name" in r["metadata"]["labels"] for r in routers)

        # A label changed on the service alone (no new generation) still reaches the children.
        control_plane.kubectl("label", "-n", ns, "inferenceservice", "amd", "team=ranking", "--overwrite")
        wait_until(
            lambda: all(
                (c["metadata"].get("labels") or {}).get("team") == "ranking"
                for (kind, _), c in children(control_plane, ns, "amd").items()
                if kind != "PersistentVolumeClaim"
            ),
            120,
            "the new service label on every child",
        )
    finally:
        control_plane.kubectl("delete", "node", node_name, "--wait=false", check=False)
        control_plane.kubectl("delete", "priorityclass", priority["metadata"]["name"], "--wait=false", check=False)


def test_dra_claims_and_scheduler_name_reach_the_pod_spec(control_plane, cp_namespace, operator):
    ns = cp_namespace
    versions = control_plane.kubectl("api-versions").stdout.split()
    assert "resource.k8s.io/v1" in versions, versions  # DRA is GA: the test API server serves it
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "gpu-pair", "namespace": ns},
        "spec": {
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}}
        },
    }
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(template))
    pod = {
        # No such scheduler runs: the pods stay Pending, which shows the operator did not drop the field.
        "schedulerName": "tidepool-test-scheduler",
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "gpu-pair"}],
        "resources": {"claims": [{"name": "gpus", "request": "gpu"}], "limits": {"rdma/hca": "1"}},
    }
    obj = _fleet_isvc("dra", ns, pod)
    assert validate_spec(InferenceServiceSpec.model_validate(obj["spec"]), "dra") == []
    bind_claims(control_plane, ns, claims_in(obj["spec"]))
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))
    (engine,) = wait_until(
        lambda: pods(control_plane, ns, "tidepool.dev/inferenceservice=dra,tidepool.dev/pool=unified"), 120, "dra pod"
    )
    assert engine["spec"]["schedulerName"] == "tidepool-test-scheduler" and not engine["spec"].get("nodeName")
    assert engine["spec"]["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": "gpu-pair"}]
    container = engine["spec"]["containers"][0]
    assert container["resources"]["claims"] == [{"name": "gpus", "request": "gpu"}]
    assert container["resources"]["limits"]["rdma/hca"] == "1"
    # kube-controller-manager's resourceclaim controller made the pod its claim from the template.
    claims = wait_until(
        lambda: json.loads(control_plane.kubectl("get", "resourceclaims", "-n", ns, "-o", "json").stdout)["items"],
        60,
        "a ResourceClaim from the template",
    )
    assert any(o["name"] == engine["metadata"]["name"] for c in claims for o in c["metadata"]["ownerReferences"])
