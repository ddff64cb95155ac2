"""A real, throw-away Kubernetes control plane on loopback, with KWOK fake GPU nodes.

`DevCluster` starts etcd (data on tmpfs, no fsync), kube-apiserver, kube-controller-manager,
kube-scheduler and kwok from the binaries that `e2e/controlplane/build.sh` caches, with
fresh certificates (devcluster_pki.py) and an admin kubeconfig, creates N fake GPU nodes and waits
until the cluster is usable: /readyz is ok, every node is Ready and the `default`
ServiceAccount exists. `stop()` kills every process group it started and waits for them,
so no process or listening port stays behind.

Invariants: every component runs in its own process group (start_new_session) and logs to
`<state_dir>/<component>.log`; only etcd and kube-apiserver listen (controller-manager and
scheduler run with --secure-port=0, kwok without a server); the nodes carry no taint, so
ordinary pods schedule onto them.

CLI: python e2e/controlplane/devcluster.py up|down|env|status [--nodes N] [--state-dir DIR]
"""

from __future__ import annotations

import argparse
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
import devcluster_procs as procs
from devcluster_pki import SERVICE_CLUSTER_IP_RANGE, make_pki, write_kubeconfig

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
KWOK_STAGES = HERE / "kwok-stages.yaml"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm")
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPUS_PER_NODE = 8
STATE_FILE = "state.json"


class BinariesMissingError(RuntimeError):
    """The control-plane binaries are not built (or not where expected)."""


class ClusterStartError(RuntimeError):
    """A component failed to start; the message carries the tail of its log."""


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
            "Build them first (~30 min cold on 2 cores, cached after): "
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


def gpu_node(name: str) -> dict:
    """A fake GPU node KWOK will manage: 8 GPUs, NVIDIA GPU-feature-discovery labels."""
    resources = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        "nvidia.com/gpu": str(GPUS_PER_NODE),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node-role.kubernetes.io/agent": "",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": GPU_PRODUCT,
                "nvidia.com/gpu.count": str(GPUS_PER_NODE),
                "nvidia.com/gpu.memory": "81559",
            },
        },
        "spec": {},
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


class DevCluster:
    """One control plane. Use as a context manager, or start() / stop()."""

    def __init__(
        self,
        num_nodes: int = 2,
        state_dir: Path | None = None,
        bin_dir: Path | None = None,
        timeout_s: float = 60.0,
        detached: bool = False,
    ) -> None:
        self.detached = detached  # False: components die with this process (PDEATHSIG)
        self.bin_dir = bin_dir or find_bin_dir()
        self.num_nodes = num_nodes
        self.timeout_s = timeout_s
        self._own_state_dir = state_dir is None
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix="tidepool-devcluster-"))
        self.kubeconfig = self.state_dir / "admin.kubeconfig"
        self.etcd_dir: Path | None = None
        self.ports: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self.server = ""
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
        pki = make_pki(self.state_dir / "pki")
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        procs.remove_stale_etcd_dirs(shm or Path(tempfile.gettempdir()))
        self.etcd_dir = Path(tempfile.mkdtemp(prefix=procs.ETCD_DIR_PREFIX, dir=shm))
        etcd, peer, api = procs.free_port(), procs.free_port(), procs.free_port()
        self.ports = {"etcd": etcd, "etcd-peer": peer, "kube-apiserver": api}
        self.server = f"https://127.0.0.1:{api}"
        write_kubeconfig(self.kubeconfig, self.server, pki)
        kc = str(self.kubeconfig)

        self._spawn(
            "etcd",
            [
                "--name=tidepool",
                f"--data-dir={self.etcd_dir / 'data'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=tidepool=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        (self.etcd_dir / procs.OWNER_FILE).write_text(str(self.pids["etcd"]))
        # The apiserver's etcd client backs off for seconds if etcd is not up yet.
        self._wait("etcd", lambda: _http_ok(f"http://127.0.0.1:{etcd}/health"))
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api}",
                f"--tls-cert-file={pki.apiserver_crt}",
                f"--tls-private-key-file={pki.apiserver_key}",
                f"--client-ca-file={pki.ca_crt}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--allow-privileged=true",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                # Endpoints may not hold loopback addresses; nothing in-cluster needs them.
                "--endpoint-reconciler-type=none",
                "--profiling=false",
            ],
        )
        self._wait("kube-apiserver", lambda: self._get("/readyz")[0] == 200)
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={kc}",
                "--leader-elect=false",
                "--secure-port=0",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--root-ca-file={pki.ca_crt}",
                "--profiling=false",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={kc}",
                "--leader-elect=false",
                "--secure-port=0",
            ],
        )
        self._spawn(
            "kwok",
            [
                f"--kubeconfig={kc}",
                f"--config={KWOK_STAGES}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={'='.join(KWOK_ANNOTATION)}",
            ],
        )
        for i in range(self.num_nodes):
            status, body = self._request("POST", "/api/v1/nodes", gpu_node(f"kwok-gpu-{i}"))
            if status != 201:
                raise ClusterStartError(f"creating node kwok-gpu-{i}: HTTP {status} {body}")
        self._wait("kwok", self._nodes_ready)
        self._wait(
            "kube-controller-manager", lambda: self._get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
        )

    def stop(self) -> None:
        """Kill every process group started here, wait for them, remove tmpfs data."""
        procs.stop_processes(self.pids, self._procs)
        self._procs.clear()
        if self.etcd_dir is not None:
            shutil.rmtree(self.etcd_dir, ignore_errors=True)
        if self._own_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # ---- helpers ---------------------------------------------------------------
    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster; returns the CompletedProcess (text)."""
        cmd = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        out = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
        if check and out.returncode != 0:
            raise subprocess.CalledProcessError(out.returncode, cmd, out.stdout, out.stderr)
        return out

    def api_client(self):
        """A fresh `kubernetes.client.ApiClient` with the admin credentials."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def env(self) -> dict[str, str]:
        return {"KUBECONFIG": str(self.kubeconfig), "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def state(self) -> dict:
        return {
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "bin_dir": str(self.bin_dir),
            "etcd_dir": str(self.etcd_dir),
            "pids": self.pids,
            "ports": self.ports,
            "binaries": {n: os.path.realpath(self.bin_dir / n) for n in self.pids},
        }

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.state_dir / f"{name}.log", "wb")  # noqa: SIM115 (child owns it)
        try:
            proc = subprocess.Popen(
                [str(self.bin_dir / name), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                preexec_fn=None if self.detached else procs.die_with_parent,
            )
        finally:
            log.close()
        self._procs[name] = proc
        self.pids[name] = proc.pid

    def _wait(self, name: str, ready) -> None:
        """Poll ready() until true; fail with the log tail of a dead or stuck component."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            for comp, proc in self._procs.items():
                if proc.poll() is not None:
                    log = self.state_dir / f"{comp}.log"
                    raise ClusterStartError(f"{comp} exited with {proc.returncode}; tail of {log}:\n{_tail(log)}")
            try:
                if ready():
                    self.timings[name] = round(time.monotonic() - self._t0, 2)
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                log = self.state_dir / f"{name}.log"
                raise ClusterStartError(
                    f"timed out after {self.timeout_s}s waiting for {name}; tail of {log}:\n{_tail(log)}"
                )
            time.sleep(0.1)

    def _nodes_ready(self) -> bool:
        status, body = self._get("/api/v1/nodes?labelSelector=type%3Dkwok")
        if status != 200:
            return False
        ready = [
            n
            for n in body["items"]
            if any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
        ]
        return len(ready) >= self.num_nodes

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


# ---- CLI ------------------------------------------------------------------------
def _cmd_up(args: argparse.Namespace) -> int:
    state_file = args.state_dir / STATE_FILE
    if state_file.exists():
        print(f"a cluster is already recorded in {state_file}; run `down` first", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    cluster = DevCluster(num_nodes=args.nodes, state_dir=args.state_dir, detached=True)
    cluster.start()
    state_file.write_text(json.dumps(cluster.state(), indent=2))
    print(
        f"cluster up in {time.monotonic() - t0:.1f}s: {cluster.server}, "
        f"{args.nodes} GPU node(s); logs in {args.state_dir}",
        file=sys.stderr,
    )
    print(f"ready after (s): {cluster.timings}", file=sys.stderr)
    _print_env(cluster.state())
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    state_file = args.state_dir / STATE_FILE
    if not state_file.exists():
        print(f"no cluster recorded in {state_file}", file=sys.stderr)
        return 0
    state = json.loads(state_file.read_text())
    procs.stop_processes(state["pids"], binaries=state["binaries"])
    if state.get("etcd_dir", "None") != "None":
        shutil.rmtree(state["etcd_dir"], ignore_errors=True)
    state_file.unlink()
    print("cluster down", file=sys.stderr)
    return 0


def _print_env(state: dict) -> None:
    print(f"export KUBECONFIG={state['kubeconfig']}")
    print(f"export PATH={state['bin_dir']}:$PATH")


def _cmd_env(args: argparse.Namespace) -> int:
    state_file = args.state_dir / STATE_FILE
    if not state_file.exists():
        print(f"no cluster recorded in {state_file}; run `up` first", file=sys.stderr)
        return 1
    _print_env(json.loads(state_file.read_text()))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    state_file = args.state_dir / STATE_FILE
    if not state_file.exists():
        print("down")
        return 1
    state = json.loads(state_file.read_text())
    alive = {n: procs.pid_alive(p) and procs.is_binary(p, state["binaries"][n]) for n, p in state["pids"].items()}
    for name, ok in alive.items():
        print(f"{name:24} pid {state['pids'][name]:>7}  {'running' if ok else 'DEAD'}")
    return 0 if all(alive.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verb", choices=("up", "down", "env", "status"))
    parser.add_argument("--nodes", type=int, default=2, help="fake GPU nodes (default 2)")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=default_cache() / "dev-cluster",
        help="pids, kubeconfig, certs and logs (default %(default)s)",
    )
    args = parser.parse_args(argv)
    args.state_dir = args.state_dir.resolve()
    try:
        return {"up": _cmd_up, "down": _cmd_down, "env": _cmd_env, "status": _cmd_status}[args.verb](args)
    except (BinariesMissingError, ClusterStartError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
