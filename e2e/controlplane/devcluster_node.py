"""The dev cluster's real node: containerd, kubelet and kube-proxy in a network + mount namespace.

A node here is what kind's node container would be, minus the container: a *holder* process
(`unshare --net --mount`) owns a network namespace (joined to the host by the veth of its slot,
see devcluster_slot.py) and a private mount namespace. containerd, the kubelet and kube-proxy are
started inside both with `nsenter`, so:
  - their iptables rules, the CNI bridge `cni0`, pod veths and ports (10250, 10256, ...) live in
    the node's netns: two clusters on one host never collide, and the rules vanish with the netns;
  - every mount they make (pod netns bind mounts, overlay rootfs, secret tmpfs, /run) lives in the
    node's mount namespace: the kernel drops them when the node's last process exits, so nothing
    stays mounted on the host after `down`, even after a SIGKILL;
  - /run, /var/log and /var/lib/cni are tmpfs inside the node, so runtime state never lands in
    the host's copies; the on-disk state (containerd root, kubelet root-dir, pod logs) lives
    under `<state_dir>/node/`.
  - the three kernel sysctls the kubelet insists on (vm.overcommit_memory=1, kernel.panic=10,
    kernel.panic_on_oops=1) are *shown* to it with those values through read-only bind mounts
    inside the node's mount namespace, so it never rewrites the shared host's settings.

Invariants: the node's processes are the holder, containerd (+ its shims), kubelet and kube-proxy,
all in the node's netns; pods are in the slot's cgroup root. `teardown()` kills both sets, waits,
removes the cgroups and releases the slot; a host route or link left by a SIGKILLed run is swept
by the next run that takes the slot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from devcluster_pki import Pki, sign, write_kubeconfig
from devcluster_slot import NodeAddresses, create_cgroup_root, kill_node_processes, record, remove_cgroups

NODE_NAME = "tidepool-real-0"
NODE_LABEL = ("tidepool.dev/node", "real")
SOCKET = "/run/containerd/containerd.sock"  # inside the node's mount namespace
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
# What the kubelet wants these to be (container_manager_linux.go); shown, never written.
KUBELET_SYSCTLS = {"vm/overcommit_memory": "1", "kernel/panic": "10", "kernel/panic_on_oops": "1"}

Spawn = Callable[[str, list[str]], int]  # (component name, argv) -> pid; logs to <state>/<name>.log


INSTALL_SCRIPT = Path(__file__).resolve().parents[1] / "node" / "install-deps.sh"


def real_node_problem() -> str | None:
    """Why a real node cannot start on this host (None when it can): root, the Debian packages, cgroups."""
    if os.geteuid() != 0:
        return "a real node needs root (namespaces, cgroups, veth, containerd)"
    out = subprocess.run(["bash", str(INSTALL_SCRIPT), "--check"], capture_output=True, text=True)
    if out.returncode != 0:
        return f"{out.stderr.strip()}; install them with: bash {INSTALL_SCRIPT}"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool, path=f"{os.environ.get('PATH', '')}:{NODE_PATH}") is None:
            return f"`{tool}` not found (util-linux / iproute2)"
    if not Path("/sys/fs/cgroup").is_dir():
        return "no cgroup filesystem at /sys/fs/cgroup"
    return None


def nsenter(holder_pid: int) -> list[str]:
    return ["nsenter", f"--target={holder_pid}", "--net", "--mount", "--"]


def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _holder_script(node_dir: Path) -> str:
    masks = []
    for name, value in KUBELET_SYSCTLS.items():
        fake = node_dir / "sysctl" / name.replace("/", ".")
        fake.parent.mkdir(parents=True, exist_ok=True)
        fake.write_text(value + "\n")
        masks.append(f"mount --bind -o ro {fake} /proc/sys/{name}")
    return "\n".join(
        [
            "set -e",
            "mount -t tmpfs -o mode=0755 tidepool-node /run",
            "mount -t tmpfs -o mode=0755 tidepool-node /var/log",
            "mount -t tmpfs -o mode=0755 tidepool-node /var/lib/cni",
            *masks,
            "ip link set lo up",
            "echo 1 > /proc/sys/net/ipv4/ip_forward",
            "echo ready",
            "exec sleep infinity",
        ]
    )


def start_holder(
    addrs: NodeAddresses, node_dir: Path, lock_fd: int, preexec: Callable[[], None] | None
) -> subprocess.Popen:
    """Start the namespace holder (it inherits the slot lock), join it to the host with the slot's veth."""
    node_dir.mkdir(parents=True, exist_ok=True)
    Path("/var/lib/cni").mkdir(parents=True, exist_ok=True)  # mount point of the node's tmpfs
    log = open(node_dir / "holder.log", "wb")  # noqa: SIM115 (the child owns it)
    try:
        proc = subprocess.Popen(
            ["unshare", "--net", "--mount", "--propagation", "private", "--", "sh", "-c", _holder_script(node_dir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            pass_fds=(lock_fd,),
            preexec_fn=preexec,
        )
    finally:
        log.close()
    line = proc.stdout.readline() if proc.stdout else b""
    if line.strip() != b"ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"node namespaces failed: {(node_dir / 'holder.log').read_text(errors='replace')}")
    proc.stdout.close()
    record(addrs, proc.pid, netns_inode(proc.pid), node_dir.parent)
    _veth(addrs, proc.pid)
    create_cgroup_root(addrs.cgroup_root)
    return proc


def _veth(addrs: NodeAddresses, holder_pid: int) -> None:
    inside = nsenter(holder_pid)
    steps = [
        ["ip", "link", "add", addrs.host_link, "type", "veth", "peer", "name", "eth0", "netns", str(holder_pid)],
        ["ip", "addr", "add", f"{addrs.host_ip}/30", "dev", addrs.host_link],
        ["ip", "link", "set", addrs.host_link, "up"],
        [*inside, "ip", "addr", "add", f"{addrs.node_ip}/30", "dev", "eth0"],
        [*inside, "ip", "link", "set", "eth0", "up"],
        [*inside, "ip", "route", "add", "default", "via", addrs.host_ip],
        # the host reaches pods and Services through the node, as a router would
        ["ip", "route", "add", addrs.pod_cidr, "via", addrs.node_ip, "dev", addrs.host_link],
        ["ip", "route", "add", addrs.service_cidr, "via", addrs.node_ip, "dev", addrs.host_link],
    ]
    for cmd in steps:
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")


def write_containerd_config(node_dir: Path, sandbox_image: str) -> Path:
    """containerd 1.6 (Debian): its own root on disk, state and socket on the node's /run tmpfs."""
    (node_dir / "containerd").mkdir(parents=True, exist_ok=True)
    (node_dir / "cni").mkdir(parents=True, exist_ok=True)
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    text = "\n".join(
        [
            "version = 2",
            f'root = "{node_dir / "containerd"}"',
            'state = "/run/containerd"',
            # opt writes to /opt/containerd on the host; the others probe filesystems we do not use
            'disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs",',
            '  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs",',
            '  "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp"]',
            "[grpc]",
            f'  address = "{SOCKET}"',
            f"[{cri}]",
            f'  sandbox_image = "{sandbox_image}"',
            "  disable_apparmor = true",
            # The kubelet gives sandboxes oom_score_adj -998; lowering it needs CAP_SYS_RESOURCE, which
            # some sandboxed hosts (this project's VMs) drop from every process: clamp to containerd's own.
            "  restrict_oom_score_adj = true",
            f"[{cri}.containerd]",
            '  snapshotter = "overlayfs"',
            '  default_runtime_name = "runc"',
            f"[{cri}.containerd.runtimes.runc]",
            '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]",
            "  SystemdCgroup = false",  # the kubelet uses cgroupfs: no systemd here
            f"[{cri}.cni]",
            f'  bin_dir = "{CNI_BIN_DIR}"',
            f'  conf_dir = "{node_dir / "cni"}"',
            "",
        ]
    )
    path = node_dir / "containerd.toml"
    path.write_text(text)
    return path


def write_cni_config(node_dir: Path, addrs: NodeAddresses) -> None:
    """One bridge network inside the node; host-local IPAM keeps its leases on the node's /run tmpfs."""
    conf = {
        "cniVersion": "0.4.0",
        "name": "tidepool",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,  # nothing leaves the machine; the host routes to pods directly
                "hairpinMode": True,  # a pod reaching its own Service comes back through the bridge
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": addrs.pod_cidr, "gateway": addrs.pod_gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": "/run/cni-ipam",
                },
            }
        ],
    }
    (node_dir / "cni").mkdir(parents=True, exist_ok=True)
    (node_dir / "cni" / "10-tidepool.conflist").write_text(json.dumps(conf, indent=2))


def kubelet_args(node_dir: Path, addrs: NodeAddresses, pki: Pki, server: str) -> list[str]:
    """Config and flags of the kubelet: client cert for system:node:<name>, webhook authn/authz,
    cgroupfs under the slot's cgroup root, image GC off (images are imported, never pulled)."""
    crt, key = sign(pki, "kubelet", f"system:node:{NODE_NAME}", "system:nodes")
    write_kubeconfig(node_dir / "kubelet.kubeconfig", server, pki, client=(crt, key))
    (node_dir / "resolv.conf").write_text("")  # pods get only the cluster's DNS, no host search domains
    config: dict[str, Any] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki.ca_crt)},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": addrs.cgroup_root,
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{SOCKET}",
        "clusterDomain": "cluster.local",
        "clusterDNS": [addrs.host_ip],
        "resolvConf": str(node_dir / "resolv.conf"),
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "podLogsDir": str(node_dir / "pod-logs"),
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # a shared dev machine's disk may be nearly full; evict only when it really is
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "mergeDefaultEvictionSettings": False,
        "serializeImagePulls": False,
        "shutdownGracePeriod": "0s",
    }
    path = node_dir / "kubelet.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=True))
    return [
        f"--config={path}",
        f"--kubeconfig={node_dir / 'kubelet.kubeconfig'}",
        f"--root-dir={node_dir / 'kubelet'}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={addrs.node_ip}",
        f"--node-labels={'='.join(NODE_LABEL)}",
    ]


def kube_proxy_args(node_dir: Path, addrs: NodeAddresses, pki: Pki, server: str) -> list[str]:
    """kube-proxy in iptables mode inside the node's netns; the conntrack sysctls are global, so off."""
    crt, key = sign(pki, "kube-proxy", "system:kube-proxy")  # bound to system:node-proxier by default
    write_kubeconfig(node_dir / "kube-proxy.kubeconfig", server, pki, client=(crt, key))
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(node_dir / "kube-proxy.kubeconfig")},
        "mode": "iptables",
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": addrs.pod_cidr,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": ["primary"],
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        # SNAT all Service traffic: replies return through the node's conntrack without br_netfilter
        "iptables": {"masqueradeAll": True, "localhostNodePorts": False},
    }
    path = node_dir / "kube-proxy.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=True))
    return [f"--config={path}"]


def ctr(holder_pid: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`ctr` against the node's containerd (namespace k8s.io, where the kubelet's images live)."""
    cmd = [*nsenter(holder_pid), "ctr", f"--address={SOCKET}", "--namespace=k8s.io", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def import_image(holder_pid: int, archive: Path) -> None:
    out = ctr(holder_pid, "images", "import", str(archive))
    if out.returncode != 0:
        raise RuntimeError(f"ctr images import {archive}: {out.stderr.strip() or out.stdout.strip()}")


def teardown(
    node: dict[str, Any], stop: Callable[[list[str]], None], release: Callable[[], None] | None = None
) -> None:
    """Stop the node: kube-network-policies, kubelet and kube-proxy, then every pod, containerd, its shims and
    the holder; then remove the cgroups. `stop(names)` stops those components of the cluster (SIGTERM, SIGKILL);
    `release()` closes the slot lock this process may still hold."""
    stop(["kube-network-policies", "kube-proxy", "kubelet"])
    kill_node_processes(node["cgroup_root"], None)  # pods (in the slot's cgroups) first
    stop(["containerd"])
    kill_node_processes(node["cgroup_root"], node["netns_inode"], node["node_ip"])  # shims, the holder
    stop(["node-holder"])
    remove_cgroups(node["cgroup_root"])
    if release is not None:
        release()
    # the veth (and with it the host routes) went with the netns; the record goes now
    Path("/run/tidepool-dev-nodes", f"{node['slot']}.json").unlink(missing_ok=True)
