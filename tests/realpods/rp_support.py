"""Helpers for the real-pod tier (no tests here): the operator as the chart's ServiceAccount with its
production defaults, CPU InferenceServices on the dev image, OpenAI requests from the host, and
control of a container's processes through the node's containerd.

Everything the tests observe is real: pods run on the dev cluster's real node (kubelet + containerd),
probes are the kubelet's, Service traffic goes through kube-proxy's rules, the router discovers
engines through EndpointSlices. The host reaches pod IPs and Service IPs through the node's veth
(routes added by the dev cluster), so the tests talk to both directly.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from controlplane.operator_kit import (
    LEASE_NAME,
    OPERATOR_NAMESPACE,
    condition,
    free_ports,
    get_isvc,
    install_crd,
    is_ready,
    operator_identity,
    pod_is_ready,
    pods,
    wait_until,
)

__all__ = ["condition", "get_isvc", "install_crd", "is_ready", "operator_identity", "pod_is_ready", "pods"]

TIDEPOOL = Path(sys.executable).with_name("tidepool")
MODEL_URI = "pvc://tidepool-dev-models/tiny-llama"
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_.]+(Error|Exception): ")


class Operator:
    """`tidepool operator` with its production defaults (no resync or autoscale interval overrides),
    as the chart's ServiceAccount, on the host."""

    def __init__(self, kubeconfig: Path, namespaces: list[str], log: Path) -> None:
        args = [str(TIDEPOOL), "operator", "--kubeconfig", str(kubeconfig)]
        for ns in namespaces:
            args += ["-n", ns]
        liveness_port, metrics_port = free_ports(2)  # distinct: a collision kills the operator at start
        args += ["--liveness", f"http://127.0.0.1:{liveness_port}/healthz"]
        # The Lease the chart's leader-election Role lets its ServiceAccount renew (production: the chart's
        # Deployment passes the same two flags).
        args += ["--leader-election-namespace", OPERATOR_NAMESPACE, "--leader-election-id", LEASE_NAME]
        # The real node enforces NetworkPolicies: this host process scrapes and calls pods from the host's address.
        args += ["--collector-ip-blocks", ",".join(host_ip_blocks(kubeconfig))]
        env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "TIDEPOOL_AUTOSCALE_INTERVAL")}
        env["TIDEPOOL_OPERATOR_METRICS_PORT"] = str(metrics_port)  # never a fixed port a neighbour may hold
        self.log = log
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(args, cwd="/tmp", stdout=fh, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def forbidden_lines(self) -> list[str]:
        return [line for line in self._lines() if "forbidden" in line.lower()]

    def errors(self, last: int = 10) -> str:
        """The operator's last ERROR lines and exception messages (a traceback's last line)."""
        picked = [line for line in self._lines() if "ERROR" in line or _EXCEPTION_LINE.match(line)]
        return "\n".join(picked[-last:])

    def _lines(self) -> list[str]:
        return (self.log.read_text(errors="replace") if self.log.exists() else "").splitlines()


def host_ip_blocks(kubeconfig: Path) -> list[str]:
    """Where the real node sees this host's traffic come from: the host side of the node's veth, which is also
    where the dev cluster's API server listens (devcluster.py), so the kubeconfig's server names it. [] for a
    loopback server (no real node)."""
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    host = httpx.URL(server).host
    return [] if ipaddress.ip_address(host).is_loopback else [f"{host}/32"]


def cpu_service(name: str, image: str, replicas: int = 1, **spec: Any) -> dict[str, Any]:
    """An InferenceService on CPU serving the tiny test model from the dev env's models claim."""
    body: dict[str, Any] = {
        "model": {"uri": MODEL_URI},
        "engine": {"image": image, "dtype": "float32", "maxModelLen": 1024},
        "resources": {"gpusPerReplica": 0},
        "pools": {"unified": {"replicas": replicas}},
    }
    for key, value in spec.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": body}


def apply(cluster, namespace: str, obj: dict[str, Any]) -> subprocess.CompletedProcess:
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=False)


def wait_ready(cluster, namespace: str, name: str, timeout_s: float = 600) -> dict[str, Any]:
    """`kubectl wait --for=condition=Ready` (what users run), then the object at that generation."""
    out = cluster.kubectl(
        "wait", "-n", namespace, "--for=condition=Ready", f"inferenceservice/{name}", f"--timeout={int(timeout_s)}s",
        check=False, timeout=timeout_s + 30,
    )  # fmt: skip
    if out.returncode != 0:
        raise AssertionError(f"{name} not Ready after {timeout_s}s: {out.stderr}\n{describe(cluster, namespace)}")
    return wait_until(lambda: (o := get_isvc(cluster, namespace, name)) and is_ready(o) and o, 60, f"{name} Ready")


def describe(cluster, namespace: str) -> str:
    """Pods, their events and engine logs: what a failed wait needs to be understood."""
    parts = [cluster.kubectl("get", "pods,svc,endpointslices", "-n", namespace, "-o", "wide", check=False).stdout]
    events = cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout
    parts.append("\n".join(events.splitlines()[-40:]))
    for pod in pods(cluster, namespace, "app.kubernetes.io/managed-by=tidepool-operator"):
        logs = cluster.kubectl("logs", "-n", namespace, pod["metadata"]["name"], "--all-containers", "--tail=30",
                               check=False).stdout  # fmt: skip
        parts.append(f"--- logs of {pod['metadata']['name']}:\n{logs}")
    return "\n".join(parts)


def engine_pods(cluster, namespace: str, name: str, pool: str = "unified") -> list[dict[str, Any]]:
    return pods(cluster, namespace, f"tidepool.dev/inferenceservice={name},tidepool.dev/pool={pool}")


def service_url(cluster, namespace: str, service: str) -> str:
    svc = json.loads(cluster.kubectl("get", "service", service, "-n", namespace, "-o", "json").stdout)
    return f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"


def completion(base_url: str, model: str, prompt: str = "Hello", max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    resp = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def container_pid(cluster, pod: dict[str, Any], container: str = "engine") -> tuple[str, int]:
    """(containerd id, host pid) of a pod's container, asked from the node's containerd."""
    import devcluster_node

    status = next(c for c in pod["status"]["containerStatuses"] if c["name"] == container)
    cid = status["containerID"].removeprefix("containerd://")
    out = devcluster_node.ctr(cluster.pids["node-holder"], "tasks", "ls")
    for line in out.stdout.splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == cid:
            return cid, int(fields[1])
    raise AssertionError(f"container {cid} of {pod['metadata']['name']} has no task: {out.stdout}")


def set_paused(cluster, cid: str, paused: bool) -> None:
    """Freeze or thaw every process of a container (runc pause: the cgroup freezer)."""
    import devcluster_node

    out = devcluster_node.ctr(cluster.pids["node-holder"], "tasks", "pause" if paused else "resume", cid)
    assert out.returncode == 0, out.stderr


def sigterm_pending(pid: int) -> bool:
    """True once SIGTERM waits in the (frozen) process's pending set: the kubelet has stopped it."""
    status = Path(f"/proc/{pid}/status").read_text()
    pending = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            pending |= int(line.split()[1], 16)
    return bool(pending & SIGTERM_BIT)


def wait_for_events(cluster, namespace: str, pod_name: str, reason: str, needle: str, timeout_s: float) -> dict:
    def find() -> dict | None:
        out = cluster.kubectl(
            "get", "events", "-n", namespace, "-o", "json", "--field-selector", f"involvedObject.name={pod_name}",
        )  # fmt: skip
        for event in json.loads(out.stdout)["items"]:
            if event.get("reason") == reason and needle in event.get("message", ""):
                return event
        return None

    return wait_until(find, timeout_s, f"event {reason} ({needle}) on {pod_name}", interval_s=2)


def elapsed_since(t0: float) -> float:
    return round(time.monotonic() - t0, 1)
