"""The dev cluster's real node: registered and Ready beside the KWOK GPU nodes, runs CPU pods for real
(Pod Security "restricted", non-root, read-only root filesystem), resolves cluster DNS, reaches the
API server through the `kubernetes` Service (kube-proxy), and keeps GPU pods off itself."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from rp_support import pods, wait_until

pytestmark = [pytest.mark.realpods, pytest.mark.timeout(600)]

PROBE = """
import socket, ssl, sys
ip = socket.gethostbyname("kubernetes.default.svc.cluster.local")
ctx = ssl.create_default_context(cafile="/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
with socket.create_connection((ip, 443), timeout=10) as raw:
  with ctx.wrap_socket(raw, server_hostname="kubernetes.default.svc") as tls:
    tls.sendall(b"GET /readyz HTTP/1.1\\r\\nHost: kubernetes.default.svc\\r\\nConnection: close\\r\\n\\r\\n")
    answer = tls.recv(4096).decode(errors="replace").splitlines()[0]
print(ip, answer, open("/etc/resolv.conf").read().split())
"""


def restricted_pod(name: str, image: str, command: list[str], **spec: Any) -> dict[str, Any]:
    security = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = {"name": "main", "image": image, "command": command, "securityContext": security}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def test_real_node_is_ready_beside_the_kwok_gpu_nodes(real_cluster):
    nodes = json.loads(real_cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    by_name = {n["metadata"]["name"]: n for n in nodes}
    assert set(by_name) == {"kwok-gpu-0", "tidepool-real-0"}
    real = by_name["tidepool-real-0"]
    info = real["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.36.3" and info["containerRuntimeVersion"].startswith("containerd://")
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in real["status"]["conditions"])
    assert "nvidia.com/gpu" not in real["status"]["capacity"]
    assert real["metadata"]["labels"]["tidepool.dev/node"] == "real"
    kwok = by_name["kwok-gpu-0"]
    assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in kwok["spec"]["taints"]


def test_cpu_pod_runs_for_real_with_cluster_dns_and_service_traffic(real_cluster, rp_namespace):
    """A restricted pod on the real node resolves `kubernetes.default` through CoreDNS and gets an
    HTTP answer from the API server through the Service IP, i.e. through kube-proxy's DNAT."""
    pod = restricted_pod(
        "probe", real_cluster.dev_image, ["/usr/bin/python3.11", "-c", PROBE], automountServiceAccountToken=True
    )
    real_cluster.kubectl("apply", "-n", rp_namespace, "-f", "-", input=yaml.safe_dump(pod))

    def finished() -> dict | None:
        got = json.loads(real_cluster.kubectl("get", "pod", "probe", "-n", rp_namespace, "-o", "json").stdout)
        return got if got["status"].get("phase") in ("Succeeded", "Failed") else None

    got = wait_until(finished, 300, "the probe pod to finish", interval_s=1)
    logs = real_cluster.kubectl("logs", "probe", "-n", rp_namespace).stdout
    assert got["status"]["phase"] == "Succeeded", logs
    assert got["spec"]["nodeName"] == "tidepool-real-0"
    service_ip = real_cluster.node["service_cidr"].rsplit(".", 1)[0] + ".1"
    assert logs.startswith(f"{service_ip} HTTP/1.1 "), logs  # any HTTP status: the TLS session reached the apiserver
    assert "cluster.local" in logs and real_cluster.node["host_ip"] in logs  # ClusterFirst DNS, our CoreDNS


def test_gpu_pods_go_to_kwok_nodes_and_cpu_pods_to_the_real_node(real_cluster, rp_namespace):
    gpu = restricted_pod(
        "gpu", real_cluster.dev_image, ["/usr/bin/python3.11", "-c", "pass"],
        container={"resources": {"limits": {"nvidia.com/gpu": "1"}}},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )  # fmt: skip
    cpu = restricted_pod("cpu", real_cluster.dev_image, ["/usr/bin/python3.11", "-c", "pass"])
    for pod in (gpu, cpu):
        pod["metadata"]["labels"] = {"test": "placement"}
        real_cluster.kubectl("apply", "-n", rp_namespace, "-f", "-", input=yaml.safe_dump(pod))

    def placed() -> dict[str, str] | None:
        found = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods(real_cluster, rp_namespace, "test")}
        return found if all(found.values()) and len(found) == 2 else None

    assert wait_until(placed, 120, "both pods scheduled") == {"gpu": "kwok-gpu-0", "cpu": "tidepool-real-0"}
