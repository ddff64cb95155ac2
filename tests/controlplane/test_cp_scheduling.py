"""Scheduling onto KWOK fake GPU nodes, and owner-reference garbage collection."""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from controlplane_fixture import wait_for

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(240)]


def gpu_deployment(name: str, gpus: int, replicas: int) -> dict:
    labels = {"app": name}
    container = {
        "name": "main",
        "image": "registry.k8s.io/pause:3.10",  # never pulled: KWOK fakes the kubelet
        "resources": {
            "limits": {"nvidia.com/gpu": str(gpus)},
            "requests": {"nvidia.com/gpu": str(gpus), "cpu": "100m"},
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }


def test_gpu_deployment_runs_on_fake_gpu_nodes(control_plane, cp_namespace):
    api = control_plane.api_client()
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    apps.create_namespaced_deployment(cp_namespace, gpu_deployment("gpu-one", 1, 3))

    def ready_pods():
        pods = core.list_namespaced_pod(cp_namespace, label_selector="app=gpu-one").items
        ready = [
            p
            for p in pods
            if p.status.phase == "Running"
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        ]
        return ready if len(ready) == 3 else None

    pods = wait_for(ready_pods, 90, what="3 Running+Ready GPU pods")
    gpu_nodes = {n.metadata.name: n for n in core.list_node(label_selector="type=kwok").items}
    for pod in pods:
        node = gpu_nodes[pod.spec.node_name]
        assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
    dep = wait_for(
        lambda: (d := apps.read_namespaced_deployment("gpu-one", cp_namespace)).status.ready_replicas == 3 and d,
        60,
        what="deployment readyReplicas=3",
    )
    assert dep.status.available_replicas == 3


def test_nine_gpu_pod_stays_pending_unschedulable(control_plane, cp_namespace):
    api = control_plane.api_client()
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    apps.create_namespaced_deployment(cp_namespace, gpu_deployment("gpu-nine", 9, 1))

    def unschedulable_pod():
        for pod in core.list_namespaced_pod(cp_namespace, label_selector="app=gpu-nine").items:
            for cond in pod.status.conditions or []:
                if cond.type == "PodScheduled" and cond.reason == "Unschedulable":
                    return pod, cond
        return None

    pod, cond = wait_for(unschedulable_pod, 90, what="PodScheduled=False/Unschedulable")
    assert cond.status == "False"
    assert "Insufficient nvidia.com/gpu" in cond.message
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None


def test_deleting_owner_garbage_collects_dependents(control_plane, cp_namespace):
    core = client.CoreV1Api(control_plane.api_client())
    owner = core.create_namespaced_config_map(cp_namespace, {"metadata": {"name": "owner"}, "data": {"k": "v"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    for i in range(3):
        core.create_namespaced_config_map(
            cp_namespace, {"metadata": {"name": f"owned-{i}", "ownerReferences": [ref]}, "data": {}}
        )
    core.create_namespaced_secret(
        cp_namespace, {"metadata": {"name": "owned-secret", "ownerReferences": [ref]}, "stringData": {"a": "b"}}
    )
    core.create_namespaced_config_map(cp_namespace, {"metadata": {"name": "bystander"}})

    core.delete_namespaced_config_map("owner", cp_namespace)  # background propagation

    def dependents_gone():
        names = {c.metadata.name for c in core.list_namespaced_config_map(cp_namespace).items}
        try:
            core.read_namespaced_secret("owned-secret", cp_namespace)
            return None
        except ApiException as exc:
            if exc.status != 404:
                raise
        return names if not any(n.startswith("owned-") for n in names) else None

    names = wait_for(dependents_gone, 60, what="owned objects garbage-collected")
    assert "bystander" in names and "owner" not in names
