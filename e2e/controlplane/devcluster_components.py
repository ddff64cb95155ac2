"""Command lines of the dev cluster's control-plane components, and the KWOK GPU node object.

Pure functions of ports, paths and the PKI: `DevCluster` (devcluster.py) spawns and waits. Only etcd
and the apiserver listen; controller-manager and scheduler run with `--secure-port=0` (their fixed
default ports would collide between clusters on one host), kwok without a server.
"""

from __future__ import annotations

from pathlib import Path

from devcluster_pki import Pki

HERE = Path(__file__).resolve().parent
KWOK_STAGES = HERE / "kwok-stages.yaml"
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPUS_PER_NODE = 8


def etcd_args(data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        "--name=tidepool",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=tidepool={peer}",
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_args(
    pki: Pki,
    etcd_port: int,
    bind: str,
    port: int,
    service_cidr: str,
    kubelet_client: tuple[Path, Path],
    real_node: bool,
) -> list[str]:
    return [
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        f"--bind-address={bind}",
        f"--advertise-address={bind}",
        f"--secure-port={port}",
        f"--tls-cert-file={pki.apiserver_crt}",
        f"--tls-private-key-file={pki.apiserver_key}",
        f"--client-ca-file={pki.ca_crt}",
        f"--service-cluster-ip-range={service_cidr}",
        "--allow-privileged=true",
        "--authorization-mode=Node,RBAC",  # Node: the real node's kubelet (system:node:<name>)
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        f"--kubelet-client-certificate={kubelet_client[0]}",
        f"--kubelet-client-key={kubelet_client[1]}",
        "--kubelet-preferred-address-types=InternalIP",
        # Endpoints may not hold loopback addresses; pods need the `kubernetes` Service only when a
        # real node runs them, and then the apiserver listens on the node's veth.
        f"--endpoint-reconciler-type={'lease' if real_node else 'none'}",
        "--profiling=false",
    ]


def controller_manager_args(kubeconfig: str, pki: Pki) -> list[str]:
    return [
        f"--kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--secure-port=0",
        f"--service-account-private-key-file={pki.sa_key}",
        f"--root-ca-file={pki.ca_crt}",
        "--profiling=false",
    ]


def scheduler_args(kubeconfig: str) -> list[str]:
    return [f"--kubeconfig={kubeconfig}", "--leader-elect=false", "--secure-port=0"]


def kwok_args(kubeconfig: str) -> list[str]:
    return [
        f"--kubeconfig={kubeconfig}",
        f"--config={KWOK_STAGES}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={'='.join(KWOK_ANNOTATION)}",
    ]


def gpu_node(name: str, tainted: bool = False) -> dict:
    """A fake GPU node KWOK will manage: 8 GPUs, NVIDIA GPU-feature-discovery labels."""
    resources = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        "nvidia.com/gpu": str(GPUS_PER_NODE),
    }
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node-role.kubernetes.io/agent": "",
        "type": "kwok",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": GPU_PRODUCT,
        "nvidia.com/gpu.count": str(GPUS_PER_NODE),
        "nvidia.com/gpu.memory": "81559",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"},
            "labels": labels,
        },
        "spec": {"taints": [GPU_TAINT]} if tainted else {},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "fake",
                "kubeProxyVersion": "fake",
            },
        },
    }
