"""Helpers for the operator's control-plane tests (no tests here): the chart's RBAC, a token
kubeconfig for its ServiceAccount, the `tidepool operator` subprocess, and sample objects.

The operator never runs as admin: `operator_identity()` renders the Helm chart (`helm template`),
applies its ServiceAccount and (Cluster)Role(Binding)s, mints a token with the TokenRequest API and
writes a kubeconfig holding only that token. `OperatorProcess` starts `tidepool operator` with it
(from /tmp, so the repo's `operator/` folder never shadows the stdlib), kills it with SIGKILL for
chaos, and keeps its log so a test can assert that no request was forbidden.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from devcluster_addons import install_crds
from kubernetes import client

from tidepool.operator.builders import ClusterFeatures

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tidepool"
CRD_FILE = REPO / "crds" / "tidepool.dev_inferenceservices.yaml"
EXAMPLES = REPO / "examples"
TIDEPOOL = Path(sys.executable).with_name("tidepool")
OPERATOR_NAMESPACE = "tidepool-system"
LEASE_NAME = "tidepool"  # the chart's fullname for release "tidepool": what its leader-election Role names
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
GROUP, VERSION, PLURAL = "tidepool.dev", "v1alpha1", "inferenceservices"


@dataclass
class OperatorIdentity:
    kubeconfig: Path
    service_account: str
    rbac_docs: list[dict[str, Any]]


def install_crd(cluster) -> None:
    install_crds(cluster, [CRD_FILE])  # polls: `kubectl wait` fails on a CRD that has no conditions yet


def render_chart_rbac(cluster, release: str = "tidepool") -> list[dict[str, Any]]:
    out = subprocess.run(
        [str(cluster.bin_dir / "helm"), "template", release, str(CHART), "--namespace", OPERATOR_NAMESPACE],
        capture_output=True,
        text=True,
        check=True,
    )
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    return [d for d in docs if d["kind"] in RBAC_KINDS]


def operator_identity(cluster, state_dir: Path) -> OperatorIdentity:
    """The chart's ServiceAccount with the chart's RBAC, and a kubeconfig holding only its token."""
    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    docs = render_chart_rbac(cluster)
    # OperatorProcess passes no --router-cluster-role: the default must be the chart's ClusterRole, which the
    # operator may bind (a missing bind shows as a forbidden RoleBinding in its log).
    router_role = ClusterFeatures().router_cluster_role
    assert any(d["kind"] == "ClusterRole" and d["metadata"]["name"] == router_role for d in docs), router_role
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    core = client.CoreV1Api(cluster.api_client())
    token = core.create_namespaced_service_account_token(
        sa, OPERATOR_NAMESPACE, {"spec": {"expirationSeconds": 7200}}
    ).status.token
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "dev", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "dev", "user": sa}}],
        "current-context": "operator",
    }
    path = state_dir / "operator.kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    path.chmod(0o600)
    return OperatorIdentity(path, sa, docs)


class NodeLeaseKeeper:
    """Renews the `kube-node-lease` Lease of every KWOK node every few seconds, from a thread.

    Why: the dev cluster's kwok runs without `--node-lease-duration-seconds`, so nothing renews node
    leases and its heartbeat stage fires only every 10-20 min; the node lifecycle controller then
    marks the nodes NotReady ~50 s after start, which flips every pod's Ready to False for good (the
    KWOK pod-ready stage only handles Pending pods). Tests that run longer than that need this
    (the proper fix is that kwok flag in e2e/controlplane/devcluster.py).
    """

    def __init__(self, cluster, interval_s: float = 5.0) -> None:
        import threading

        self.coord = client.CoordinationV1Api(cluster.api_client())
        self.core = client.CoreV1Api(cluster.api_client())
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-lease-keeper", daemon=True)

    def __enter__(self) -> NodeLeaseKeeper:
        self.renew()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(60)  # every call has a timeout: a renewal in flight ends well within this
        if self._thread.is_alive():  # left running it would call the API server during interpreter shutdown
            raise RuntimeError("the node-lease keeper's thread did not stop within 60 s")

    def renew(self) -> None:
        import datetime

        now = datetime.datetime.now(datetime.UTC)
        timeout = (5, 10)  # (connect, read) seconds
        for node in self.core.list_node(label_selector="type=kwok", _request_timeout=timeout).items:
            name = node.metadata.name
            body = {
                "metadata": {"name": name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now},
            }
            try:
                self.coord.patch_namespaced_lease(
                    name, "kube-node-lease", {"spec": body["spec"]}, _request_timeout=timeout
                )
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
                self.coord.create_namespaced_lease("kube-node-lease", body, _request_timeout=timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.renew()
            except Exception:  # a transient API error must not kill the keeper; the next round retries
                continue


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports below the kernel's ephemeral range, so that no outgoing connection (which
    takes its local port from that range) grabs one between this check and the server's bind, and every socket
    stays bound until all are chosen (two port-0 binds in a row may return one port). A collision killed the
    chaos test's operator at start once (its health server: address already in use)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        while len(socks) < count:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", rng.randrange(10_000, low)))
            except OSError:
                sock.close()
                continue
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class OperatorProcess:
    """`tidepool operator` as a subprocess with its production defaults (resync interval, workers, leader
    election on the chart's Lease); every start appends to the same log.

    The Lease is the one the chart's RBAC names (release "tidepool" in OPERATOR_NAMESPACE), so two
    OperatorProcesses at once contend for it as two chart replicas would."""

    def __init__(self, kubeconfig: Path, namespaces: list[str], log: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.kubeconfig, self.namespaces, self.log = kubeconfig, namespaces, log
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        self.num_starts = 0
        self.metrics_port = 0

    def start(self) -> None:
        args = [str(TIDEPOOL), "operator", "--kubeconfig", str(self.kubeconfig)]
        for ns in self.namespaces:
            args += ["-n", ns]
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}  # the token kubeconfig only
        fixed = env.get("TIDEPOOL_OPERATOR_METRICS_PORT")  # a test that reads the metrics sets it
        # Distinct ports (an operator whose liveness and metrics ports collide dies at start); one of three may
        # be the fixed metrics port, two others remain.
        liveness_port, spare = [p for p in free_ports(3) if str(p) != fixed][:2]
        self.metrics_port = int(fixed) if fixed else spare
        env["TIDEPOOL_OPERATOR_METRICS_PORT"] = str(self.metrics_port)
        args += ["--liveness", f"http://127.0.0.1:{liveness_port}/healthz"]
        args += ["--leader-election-namespace", OPERATOR_NAMESPACE, "--leader-election-id", LEASE_NAME]
        args += ["--no-resolve-revisions"]  # no Hub here; test_cp_model_revision passes --resolve-revisions
        args += list(self.extra_args)
        with open(self.log, "ab") as fh:
            fh.write(f"---- start {self.num_starts}: {' '.join(args)}\n".encode())
            fh.flush()
            self.proc = subprocess.Popen(args, cwd="/tmp", stdout=fh, stderr=subprocess.STDOUT, env=env)
        self.num_starts += 1

    def kill(self) -> None:
        """SIGKILL: no cleanup, no finalizer release; what a node failure or OOM does."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def forbidden_lines(self) -> list[str]:
        # ApiError says "HTTP 403 Forbidden: ..."; kopf logs "403, message='Forbidden'".
        return [line for line in self.log_text().splitlines() if "forbidden" in line.lower()]


def restricted_namespace(cluster, name: str) -> None:
    cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted", "--overwrite")


def claims_in(spec: dict[str, Any]) -> list[str]:
    claim = (spec.get("modelCache") or {}).get("persistentVolumeClaim") or {}
    return [claim["claimName"]] if claim.get("size") else []


def bind_claims(cluster, namespace: str, claims: list[str], storage_class: str = "") -> None:
    """Pre-bound PersistentVolumes for claims the operator creates (the dev cluster has no provisioner); a claim
    naming a StorageClass binds only to a volume of that class."""
    for claim in claims:
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"pv-{namespace}-{claim}"[:63]},
            "spec": {
                "capacity": {"storage": "1Ti"},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": storage_class,
                "claimRef": {"namespace": namespace, "name": claim},
                "csi": {"driver": "fake.csi.tidepool.dev", "volumeHandle": f"{namespace}-{claim}"},
            },
        }
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pv))


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def custom_api(cluster) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(cluster.api_client())


def get_isvc(cluster, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return custom_api(cluster).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions", []):
        if cond["type"] == type_:
            return cond
    return None


def is_ready(obj: dict[str, Any] | None) -> bool:
    cond = condition(obj, "Ready")
    status = (obj or {}).get("status") or {}
    return bool(
        cond
        and cond["status"] == "True"
        and status.get("observedGeneration") == obj["metadata"]["generation"]
        and cond.get("observedGeneration") == obj["metadata"]["generation"]
    )


CHILD_KINDS = (
    "deployments.apps,statefulsets.apps,services,configmaps,serviceaccounts,persistentvolumeclaims,"
    "poddisruptionbudgets.policy,roles.rbac.authorization.k8s.io,rolebindings.rbac.authorization.k8s.io,"
    "networkpolicies.networking.k8s.io"
)


def children(cluster, namespace: str, name: str | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """Every object of a child kind labelled as belonging to `name` (or to any InferenceService)."""
    selector = f"tidepool.dev/inferenceservice={name}" if name else "tidepool.dev/inferenceservice"
    out = cluster.kubectl("get", CHILD_KINDS, "-n", namespace, "-l", selector, "-o", "json")
    return {(item["kind"], item["metadata"]["name"]): item for item in json.loads(out.stdout)["items"]}


def pods(cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json")
    return json.loads(out.stdout)["items"]


def pod_is_ready(pod: dict[str, Any]) -> bool:
    return pod["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])
    )


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    """Like controlplane_fixture.wait_for, but raises AssertionError with the last value (usable in helpers)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last!r}")


# ---- the API server's own request counters (steady-state cost of the operator) ------------------
_SERIES = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>[0-9.eE+-]+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def apiserver_counters(cluster) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """`apiserver_request_total` and APF's `apiserver_flowcontrol_dispatched_requests_total` from the
    API server's /metrics (as admin), each as {sorted label tuple: count}."""
    text = _raw_metrics(cluster)
    wanted = ("apiserver_request_total", "apiserver_flowcontrol_dispatched_requests_total")
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {name: {} for name in wanted}
    for line in text.splitlines():
        match = _SERIES.match(line)
        if match and match["name"] in wanted:
            labels = tuple(sorted(_LABEL.findall(match["labels"])))
            out[match["name"]][labels] = float(match["value"])
    return out


def _raw_metrics(cluster) -> str:
    import ssl
    import urllib.parse
    from http.client import HTTPSConnection

    pki = cluster.state_dir / "pki"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    url = urllib.parse.urlsplit(cluster.server)
    conn = HTTPSConnection(url.hostname, url.port, context=ctx, timeout=30)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def counter_delta(before: dict, after: dict, name: str, **match: str) -> float:
    """Increase of a counter family between two `apiserver_counters` snapshots, over series matching labels."""
    total = 0.0
    for labels, value in after[name].items():
        as_dict = dict(labels)
        if all(as_dict.get(k) == v for k, v in match.items()):
            total += value - before[name].get(labels, 0.0)
    return total


def requests_by_kind(before: dict, after: dict) -> dict[str, float]:
    """`apiserver_request_total` increases by 'VERB resource' (the breakdown a reader wants)."""
    out: dict[str, float] = {}
    for labels, value in after["apiserver_request_total"].items():
        d = dict(labels)
        key = f"{d.get('verb')} {d.get('resource')}{'/' + d['subresource'] if d.get('subresource') else ''}"
        delta = value - before["apiserver_request_total"].get(labels, 0.0)
        if delta:
            out[key] = out.get(key, 0.0) + delta
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
