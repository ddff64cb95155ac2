"""NetworkPolicy enforcement on the dev cluster's real node: kube-network-policies, run like kube-proxy.

The binary is sigs.k8s.io/kube-network-policies, built by e2e/controlplane/build_netpol.sh into its
own cache key dir (patched: NFQUEUE through nft_compat, a --kubeconfig flag; see
kube-network-policies.patch). It runs inside the node's network + mount namespaces, so its nftables
table (`inet kube-network-policies`) and its NFQUEUE live in the node's netns and vanish with it.

What it enforces, and on what (the same as in a real cluster with this implementation):
  - the first packet of every connection from or to a pod that some NetworkPolicy selects goes to
    userspace (NFQUEUE), which accepts or drops it by the policies; replies ride conntrack;
  - pod-to-pod traffic on the node's bridge is seen too (the node's netns has
    net.bridge.bridge-nf-call-iptables=1, the per-netns default);
  - traffic *generated in the node's netns by uid 0* is accepted before any policy (upstream rule
    `meta skuid 0 accept`): the kubelet's probes always pass, as on a real node;
  - traffic from the HOST (the real-pod tier's operator and tests run there) is *forwarded* by the
    node, so it is judged by its source address, the host side of the slot's veth (`host_ip`): a
    policy admits it only through an ipBlock holding that address (the operator's
    --collector-ip-blocks, see tests/realpods/rp_support.py);
  - `--fail-open` is off: while the process is down, packets it would judge are dropped.

Invariants: `start()` returns only once the rules are in the node's netns and the queue is bound
(it reads /proc/<holder>/net/netfilter/nfnetlink_queue, i.e. the node's netns), and fails with the
log's tail if the rules were rejected (the error an unpatched build gives on a kernel without
CONFIG_NFT_QUEUE). The RBAC it needs (list/watch pods, namespaces, networkpolicies; events) is bound
to its own client-certificate user, never to the admin.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from devcluster_pki import Pki, sign, write_kubeconfig

if TYPE_CHECKING:
    from devcluster_slot import NodeAddresses

    from devcluster import DevCluster

NAME = "kube-network-policies"
USER = "system:kube-network-policies"
HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build_netpol.sh"
QUEUE_ID = 100  # its default; queues are per network namespace, so clusters never share one
METRICS_PORT = 9080  # bound on the node's IP inside the node's netns: no host port is taken
# What the controller logs when the kernel rejects its ruleset (controller.go, syncNFTablesRules).
RULES_REJECTED = '"syncing nftables rules" error='


class NetpolBinaryMissingError(RuntimeError):
    """kube-network-policies is not built (or not where expected)."""


def find_binary() -> Path:
    """$TIDEPOOL_NETPOL_BIN_DIR/kube-network-policies, else in the dir `build_netpol.sh --print-bin-dir` names."""
    env = os.environ.get("TIDEPOOL_NETPOL_BIN_DIR")
    if env:
        bin_dir = Path(env)
    else:
        out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-bin-dir"], capture_output=True, text=True)
        if out.returncode != 0:
            raise NetpolBinaryMissingError(f"build_netpol.sh --print-bin-dir failed: {out.stderr.strip()}")
        bin_dir = Path(out.stdout.strip().splitlines()[-1])
    binary = bin_dir / NAME
    if not os.access(binary, os.X_OK):
        raise NetpolBinaryMissingError(
            f"{binary} is missing: the real node enforces NetworkPolicies with it. "
            f"Build it first (~4 min cold on 2 cores, seconds with the Go caches warm): bash {BUILD_SCRIPT}"
        )
    return binary


def rbac() -> list[dict]:
    """Upstream's ClusterRole (install.yaml) plus events, bound to the binary's own user."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": NAME},
        "rules": [
            {"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["list", "watch"]},
            {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["list", "watch"]},
            {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch", "update"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": NAME},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
    }
    return [role, binding]


def args(node_dir: Path, addrs: NodeAddresses, pki: Pki, server: str, node_name: str) -> list[str]:
    """Flags: its own kubeconfig, the node's name, no NRI (containerd 1.6 has none), no DNS
    workaround chain (the kernel bug it works around is fixed in 6.12+, the flag's own help says)."""
    crt, key = sign(pki, NAME, USER)
    kubeconfig = node_dir / f"{NAME}.kubeconfig"
    write_kubeconfig(kubeconfig, server, pki, client=(crt, key))
    return [
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node_name}",
        f"--nfqueue-id={QUEUE_ID}",
        f"--metrics-bind-address={addrs.node_ip}:{METRICS_PORT}",
        "--disable-nri",
        "--netfilter-bug-1766-fix=false",
        "--fail-open=false",
    ]


def queue_bound(holder_pid: int) -> bool:
    """True once a process listens on QUEUE_ID in the node's netns (/proc/<pid>/net is that pid's netns)."""
    try:
        lines = Path(f"/proc/{holder_pid}/net/netfilter/nfnetlink_queue").read_text().splitlines()
    except FileNotFoundError:
        return False
    return any(line.split()[:1] == [str(QUEUE_ID)] for line in lines)


def start(cluster: DevCluster, pki: Pki, addrs: NodeAddresses, wrapper: list[str], node_name: str) -> None:
    """Bind its RBAC, spawn it in the node's namespaces (`wrapper`: nsenter), wait until it enforces."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rbac()}))
    binary = find_binary()
    node_dir = cluster.state_dir / "node"
    cluster._spawn(NAME, args(node_dir, addrs, pki, cluster.server, node_name), exe=str(binary), wrapper=wrapper)
    log = cluster.state_dir / f"{NAME}.log"
    holder = cluster.pids["node-holder"]

    def ready() -> bool:
        # Run() syncs the rules, then opens the queue: once it is bound, the sync's outcome is logged.
        if not queue_bound(holder):
            return False
        text = log.read_text(errors="replace")
        if RULES_REJECTED in text:
            error = text[text.index(RULES_REJECTED) :].splitlines()[:3]  # klog: a multi-line value follows
            raise RuntimeError(f"{NAME}: the kernel rejected its nftables rules (see {log}): {' '.join(error)}")
        return True

    cluster._wait(NAME, ready, 120.0)
