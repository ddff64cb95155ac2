"""A real, throw-away Kubernetes cluster on this host: control plane, KWOK GPU nodes, LWS, a real node.

`DevCluster` starts etcd (data on tmpfs, no fsync), kube-apiserver, kube-controller-manager,
kube-scheduler and kwok from the binaries that `e2e/controlplane/build.sh` caches, with fresh
certificates (devcluster_pki.py) and an admin kubeconfig, creates N fake GPU nodes, runs the
LeaderWorkerSet controller (devcluster_addons.py) and, with `real_node=True`, one real node
(containerd + kubelet + kube-proxy in their own namespaces, devcluster_node.py) with cluster DNS
and NetworkPolicies enforced (kube-network-policies, devcluster_netpol.py; `network_policies=False`: off).
It waits until the cluster is usable: /readyz is ok, every node is Ready, the `default`
ServiceAccount exists. `stop()` kills every process it started (and the real node's pods and
shims), so no process, listening port, mount, network namespace or cgroup stays behind.

Invariants: every component runs in its own process group (start_new_session) and logs to
`<state_dir>/<component>.log`; without a real node only etcd, kube-apiserver and the LWS
webhook listen, on 127.0.0.1; with one, the apiserver listens on the host side of the node's
veth (pods reach it through the `kubernetes` Service), the KWOK GPU nodes carry the taint
`nvidia.com/gpu=present:NoSchedule` (GPU pods tolerate it, as on real GPU nodes; CPU pods land on
the real node, which has no GPUs), and CPU pods run for real.

CLI: devcluster_cli.py (e2e/dev-cluster up|down|env|status|...).
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
from http.client import HTTPSConnection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import devcluster_addons as addons
import devcluster_components as comp
import devcluster_netpol as netpol
import devcluster_node as node
import devcluster_procs as procs
from devcluster_addons import DevEnv
from devcluster_components import GPU_PRODUCT, GPU_TAINT, GPUS_PER_NODE, KWOK_ANNOTATION, gpu_node
from devcluster_pki import SERVICE_CLUSTER_IP_RANGE, make_pki, sign, write_kubeconfig
from devcluster_slot import acquire_slot

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
BINARIES = (
    "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm",
    "kubelet", "kube-proxy", "coredns", "pause", "lws-controller",
)  # fmt: skip
__all__ = ["GPUS_PER_NODE", "GPU_PRODUCT", "GPU_TAINT", "KWOK_ANNOTATION", "DevCluster", "gpu_node"]
STATE_FILE = "state.json"
NODE_TIMEOUT_S = 180.0  # the real node's first start imports images and sets up cgroups: slower on a busy host


class BinariesMissingError(RuntimeError):
    """The control-plane binaries are not built (or not where expected)."""


class ClusterStartError(RuntimeError):
    """A component failed to start; the message carries the tail of its log."""


class KubectlError(subprocess.CalledProcessError):
    """A kubectl command failed; unlike CalledProcessError, its message includes kubectl's stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{(self.stderr or '').strip()}"


def default_cache() -> Path:
    return Path(os.environ.get("TIDEPOOL_CACHE", Path.home() / ".cache" / "tidepool"))


def find_bin_dir() -> Path:
    """The bin dir: $TIDEPOOL_K8S_BIN_DIR, else what `build.sh --print-bin-dir` says.

    Raises BinariesMissingError naming the build command when a binary is missing.
    """
    env = os.environ.get("TIDEPOOL_K8S_BIN_DIR")
    if env:
        bin_dir = Path(env)
    else:
        out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-bin-dir"], capture_output=True, text=True)
        if out.returncode != 0:
            raise BinariesMissingError(f"build.sh --print-bin-dir failed: {out.stderr.strip()}")
        bin_dir = Path(out.stdout.strip().splitlines()[-1])
    missing = [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]
    if missing:
        raise BinariesMissingError(
            f"control-plane binaries missing in {bin_dir}: {', '.join(missing)}. "
            "Build them first (~40 min cold on 2 cores, cached after): "
            "bash e2e/controlplane/build.sh"
        )
    return bin_dir


def _http_ok(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.status == 200


def _tail(path: Path, num_lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except FileNotFoundError:
        return "(no log)"


class DevCluster:
    """One cluster. Use as a context manager, or start() / stop()."""

    def __init__(
        self,
        num_nodes: int = 2,
        state_dir: Path | None = None,
        bin_dir: Path | None = None,
        timeout_s: float = 60.0,
        detached: bool = False,
        real_node: bool = False,
        dev_env: DevEnv | None = None,
        lws: bool = True,
        network_policies: bool = True,
    ) -> None:
        self.detached = detached  # False: components die with this process (PDEATHSIG)
        self.bin_dir = bin_dir or find_bin_dir()
        self.num_nodes = num_nodes
        self.timeout_s = timeout_s
        self.real_node, self.dev_env, self.lws = real_node, dev_env, lws
        self.network_policies = network_policies  # enforced on the real node (devcluster_netpol.py)
        self._own_state_dir = state_dir is None
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix="tidepool-devcluster-"))
        self.kubeconfig = self.state_dir / "admin.kubeconfig"
        self.etcd_dir: Path | None = None
        self.ports: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self.exes: dict[str, str] = {}  # component -> executable (so a recycled pid is never signalled)
        self._procs: dict[str, subprocess.Popen] = {}
        self.server = ""
        self.node: dict | None = None  # the real node's slot record (devcluster_slot.py)
        self.dev_image = ""  # image ref of the dev engine image on the real node
        self._slot_fd: int | None = None
        self.timings: dict[str, float] = {}  # seconds from start() to each readiness step

    # ---- lifecycle -------------------------------------------------------------
    def __enter__(self) -> DevCluster:
        self.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self._t0 = time.monotonic()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        addrs = None
        if self.real_node:
            addrs = self._start_node_namespaces()
        bind = addrs.host_ip if addrs else "127.0.0.1"
        service_cidr = addrs.service_cidr if addrs else SERVICE_CLUSTER_IP_RANGE
        service_ip = addrs.service_ip if addrs else "10.96.0.1"
        pki = make_pki(self.state_dir / "pki", api_ips=(bind,), service_ip=service_ip)
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        procs.remove_stale_etcd_dirs(shm or Path(tempfile.gettempdir()))
        self.etcd_dir = Path(tempfile.mkdtemp(prefix=procs.ETCD_DIR_PREFIX, dir=shm))
        etcd, peer, api = procs.free_port(), procs.free_port(), procs.free_port()
        self.ports = {"etcd": etcd, "etcd-peer": peer, "kube-apiserver": api}
        self.server = f"https://{bind}:{api}"
        write_kubeconfig(self.kubeconfig, self.server, pki)
        kc = str(self.kubeconfig)

        self._spawn("etcd", comp.etcd_args(self.etcd_dir / "data", etcd, peer))
        (self.etcd_dir / procs.OWNER_FILE).write_text(str(self.pids["etcd"]))
        # The apiserver's etcd client backs off for seconds if etcd is not up yet.
        self._wait("etcd", lambda: _http_ok(f"http://127.0.0.1:{etcd}/health"))
        kubelet_client = sign(pki, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")
        self._spawn(
            "kube-apiserver",
            comp.apiserver_args(pki, etcd, bind, api, service_cidr, kubelet_client, real_node=addrs is not None),
        )
        self._wait("kube-apiserver", lambda: self._get("/readyz")[0] == 200)
        self._spawn("kube-controller-manager", comp.controller_manager_args(kc, pki))
        self._spawn("kube-scheduler", comp.scheduler_args(kc))
        self._spawn("kwok", comp.kwok_args(kc))
        for i in range(self.num_nodes):
            status, body = self._request("POST", "/api/v1/nodes", comp.gpu_node(f"kwok-gpu-{i}", tainted=bool(addrs)))
            if status != 201:
                raise ClusterStartError(f"creating node kwok-gpu-{i}: HTTP {status} {body}")
        if self.lws:
            self._start_lws(pki)
        if addrs:
            self._start_real_node(pki, addrs)
        self._wait("kwok", self._nodes_ready)
        self._wait(
            "kube-controller-manager", lambda: self._get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
        )

    def _start_node_namespaces(self):
        """Images first (the dev image's base may need debootstrap), then the node's slot and namespaces."""
        sys.path.insert(0, str(HERE.parent / "images"))
        import build as images

        node_dir = self.state_dir / "node"
        node_dir.mkdir(parents=True, exist_ok=True)
        self._images = [images.pause_image(self.bin_dir)]
        if self.dev_env is not None:
            dev = images.dev_image(Path(self.dev_env.mounts["tidepool-dev-venv"]), node_dir)
            self._images.append(dev)
            self.dev_image = dev.ref
        addrs, self._slot_fd = acquire_slot()
        proc = node.start_holder(addrs, node_dir, self._slot_fd, None if self.detached else procs.die_with_parent)
        holder = proc.pid
        self._procs["node-holder"], self.pids["node-holder"] = proc, holder
        self.exes["node-holder"] = os.path.realpath(shutil.which("sleep") or "/bin/sleep")
        self.node = {
            "slot": addrs.slot,
            "cgroup_root": addrs.cgroup_root,
            "netns_inode": node.netns_inode(holder),
            "host_ip": addrs.host_ip,
            "node_ip": addrs.node_ip,
            "pod_cidr": addrs.pod_cidr,
            "service_cidr": addrs.service_cidr,
            "node_name": node.NODE_NAME,
        }
        return addrs

    def _start_lws(self, pki) -> None:
        webhook, health = procs.free_port(), procs.free_port()
        self.ports.update({"lws-webhook": webhook, "lws-health": health})
        addons.install_crds(self, addons.lws_crd_files(self.bin_dir))
        self._spawn("lws-controller", addons.lws_controller_args(self.state_dir, pki, self.kubeconfig, webhook, health))
        self._wait("lws-controller", lambda: _http_ok(f"http://127.0.0.1:{health}/readyz") and procs.accepts(webhook))
        configs = addons.lws_webhook_configs(self.bin_dir, pki.ca_crt, webhook)
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": configs}))

    def _start_real_node(self, pki, addrs) -> None:
        holder, node_dir = self.pids["node-holder"], self.state_dir / "node"
        inside = node.nsenter(holder)
        health, ready = procs.free_port(), procs.free_port()
        self.ports.update({"coredns-health": health, "coredns-ready": ready})
        self._spawn("coredns", addons.coredns_args(self.state_dir, addrs.host_ip, self.kubeconfig, health, ready))
        node.write_cni_config(node_dir, addrs)
        config = node.write_containerd_config(node_dir, self._images[0].ref)
        self._spawn("containerd", [f"--config={config}"], exe="/usr/bin/containerd", wrapper=inside)
        self._wait("containerd", lambda: node.ctr(holder, "version", timeout=10).returncode == 0, NODE_TIMEOUT_S)
        for image in self._images:
            node.import_image(holder, image.archive)
            if image.archive.parent == node_dir:  # written for this import only (the dev image)
                image.archive.unlink()
        self.timings["images imported"] = round(time.monotonic() - self._t0, 2)
        self._spawn("kubelet", node.kubelet_args(node_dir, addrs, pki, self.server), wrapper=inside)
        self._spawn("kube-proxy", node.kube_proxy_args(node_dir, addrs, pki, self.server), wrapper=inside)
        if self.network_policies:
            netpol.start(self, pki, addrs, inside, node.NODE_NAME)
        self._wait("coredns", lambda: _http_ok(f"http://127.0.0.1:{ready}/ready"), NODE_TIMEOUT_S)
        self._wait("kubelet", self._real_node_ready, NODE_TIMEOUT_S)
        if self.dev_env is not None:
            docs = addons.dev_env_policy(self.dev_env)
            self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))

    def stop(self) -> None:
        """Stop the real node (pods, runtime, namespaces, cgroups), then every component; remove tmpfs data."""
        try:
            if self.node is not None:
                node.teardown(self.node, self._stop_components, self._release_slot)
                self.node = None
        finally:  # whatever the node left, the control plane still goes
            self._release_slot()
            self._stop_components(list(self.pids))
            if self.etcd_dir is not None:
                shutil.rmtree(self.etcd_dir, ignore_errors=True)
            if self._own_state_dir:
                shutil.rmtree(self.state_dir, ignore_errors=True)

    def _stop_components(self, names: list[str]) -> None:
        pids = {n: self.pids[n] for n in names if n in self.pids}
        procs.stop_processes(pids, {n: p for n, p in self._procs.items() if n in pids}, self.exes)
        for name in pids:
            self.pids.pop(name, None)
            self._procs.pop(name, None)

    def _release_slot(self) -> None:
        if self._slot_fd is not None:
            os.close(self._slot_fd)
            self._slot_fd = None

    # ---- helpers ---------------------------------------------------------------
    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster; returns the CompletedProcess (text)."""
        cmd = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        out = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
        if check and out.returncode != 0:
            raise KubectlError(out.returncode, cmd, out.stdout, out.stderr)
        return out

    def api_client(self):
        """A fresh `kubernetes.client.ApiClient` with the admin credentials."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def env(self) -> dict[str, str]:
        return {"KUBECONFIG": str(self.kubeconfig), "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def enable_dev_env(self, namespace: str, models_dir: Path | None = None) -> None:
        """Let Tidepool's pods in `namespace` run this checkout on the real node (DEV ONLY): bind the
        dev env's claims (and `tidepool-dev-models` -> models_dir) and label the namespace."""
        if self.dev_env is None:
            raise RuntimeError("this cluster was started without a dev env (DevCluster(dev_env=...))")
        docs = addons.dev_env_volumes(self.dev_env, namespace, models_dir)
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        self.kubectl("label", "namespace", namespace, "=".join(addons.DEV_ENV_LABEL), "--overwrite")

    def state(self) -> dict:
        return {
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "bin_dir": str(self.bin_dir),
            "etcd_dir": str(self.etcd_dir),
            "pids": self.pids,
            "ports": self.ports,
            "binaries": {n: self.exes[n] for n in self.pids},
            "node": self.node,
            "dev_image": self.dev_image,
            "dev_env": self.dev_env.mounts if self.dev_env else None,
        }

    def _spawn(self, name: str, args: list[str], exe: str | None = None, wrapper: list[str] | None = None) -> None:
        exe = exe or str(self.bin_dir / name)
        env = {**os.environ, "PATH": f"{os.environ.get('PATH', '')}:{node.NODE_PATH}"}
        log = open(self.state_dir / f"{name}.log", "wb")  # noqa: SIM115 (child owns it)
        try:
            proc = subprocess.Popen(
                [*(wrapper or []), exe, *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                env=env,
                preexec_fn=None if self.detached else procs.die_with_parent,
            )
        finally:
            log.close()
        self._procs[name] = proc
        self.pids[name] = proc.pid
        self.exes[name] = os.path.realpath(exe)

    def _wait(self, name: str, ready, timeout_s: float | None = None) -> None:
        """Poll ready() until true; fail with the log tail of a dead or stuck component."""
        timeout_s = max(self.timeout_s, timeout_s or 0)
        deadline = time.monotonic() + timeout_s
        while True:
            for component, proc in self._procs.items():
                if proc.poll() is not None:
                    log = self.state_dir / f"{component}.log"
                    raise ClusterStartError(f"{component} exited with {proc.returncode}; tail of {log}:\n{_tail(log)}")
            try:
                if ready():
                    self.timings[name] = round(time.monotonic() - self._t0, 2)
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                log = self.state_dir / f"{name}.log"
                raise ClusterStartError(
                    f"timed out after {timeout_s}s waiting for {name}; tail of {log}:\n{_tail(log)}"
                )
            time.sleep(0.1)

    def _nodes_ready(self) -> bool:
        status, body = self._get("/api/v1/nodes?labelSelector=type%3Dkwok")
        return status == 200 and sum(_is_ready(n) for n in body["items"]) >= self.num_nodes

    def _real_node_ready(self) -> bool:
        status, body = self._get(f"/api/v1/nodes/{node.NODE_NAME}")
        return status == 200 and _is_ready(body)

    def _get(self, path: str) -> tuple[int, dict]:
        return self._request("GET", path)

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        pki_dir = self.state_dir / "pki"
        ctx = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
        ctx.load_cert_chain(str(pki_dir / "admin.crt"), str(pki_dir / "admin.key"))
        url = urllib.parse.urlsplit(self.server)
        conn = HTTPSConnection(url.hostname, url.port, context=ctx, timeout=5)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, {"raw": raw.decode(errors="replace")}


def _is_ready(node_obj: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node_obj.get("status", {}).get("conditions", []))


if __name__ == "__main__":
    from devcluster_cli import main

    sys.exit(main())
