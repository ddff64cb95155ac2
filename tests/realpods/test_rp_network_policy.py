"""NetworkPolicies enforced for real on the dev cluster's node (kube-network-policies, devcluster_netpol.py).

Two services with the operator's default policies (`spec.networkPolicy` unset: on, `clients` = the service's
namespace): `np`, one unified replica with advisory autoscaling (so the operator's collector scrapes it and
reports what it read), and `nppp`, a pipeline-parallel pool (two rank pods that must reach each other). Two
prober pods, plain Python on the dev image (no pull), each serving TCP on the engine port itself:
`insider`, in the services' namespace but in no service, and `outsider`, in another namespace.

What is proved, each with a control that shows the path works where the policies allow it:
  - neither prober can open a TCP connection to an engine pod's port (the connection is dropped: timeout),
    while the outsider reaches the insider on that same port number (pod to pod across namespaces works,
    only the policy differs);
  - the insider reaches the router's port (`clients` unset: the namespace), the outsider does not;
  - a completion through the router's Service works (router -> engine);
  - the operator's collector, a host process admitted by `--collector-ip-blocks` (rp_support.Operator),
    scrapes the engine: status.autoscaling reports a scraped pod, and /metrics answers it from the host;
  - the pipeline-parallel pool serves a completion: its ranks reach each other under the policies.
The connect timeout is generous (a dropped SYN takes the whole timeout, a refused one returns at once).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from rp_support import (
    Operator,
    apply,
    completion,
    cpu_service,
    describe,
    engine_pods,
    get_isvc,
    install_crd,
    operator_identity,
    pod_is_ready,
    pods,
    service_url,
    wait_ready,
    wait_until,
)

from controlplane_fixture import dev_namespace

pytestmark = [pytest.mark.realpods, pytest.mark.timeout(1200)]

NAME, PP_NAME = "np", "nppp"
ENGINE_PORT, ROUTER_PORT = 8000, 8080  # operator/builders/common.py
CONNECT_TIMEOUT_S = 10.0
PROBER_LABEL = ("tidepool.dev/test", "netpol-prober")
CONNECT = """
import socket, sys
s = socket.socket()
s.settimeout(float(sys.argv[3]))
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except OSError as exc:
    print("failed", type(exc).__name__, exc)
"""


@dataclass
class Env:
    namespace: str
    other: str  # the outsider's namespace
    operator: Operator


def prober(name: str, image: str) -> dict[str, Any]:
    """A pod (Pod Security "restricted") that serves TCP on the engine port: Python's http.server."""
    security = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "runAsUser": 65534,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    command = ["python3.11", "-m", "http.server", str(ENGINE_PORT), "--directory", "/tmp"]
    container = {
        "name": "prober",
        "image": image,
        "imagePullPolicy": "Never",
        "command": command,
        "securityContext": security,
        "readinessProbe": {"tcpSocket": {"port": ENGINE_PORT}, "periodSeconds": 1},
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": dict([PROBER_LABEL])},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 1},
    }


def connect(cluster, namespace: str, pod: str, ip: str, port: int) -> str:
    """From inside `pod` (its network namespace, its pod IP), try a TCP connection; "connected" or "failed ..."."""
    out = cluster.kubectl(
        "exec", "-n", namespace, pod, "--", "python3.11", "-c", CONNECT, ip, str(port), str(CONNECT_TIMEOUT_S),
        timeout=CONNECT_TIMEOUT_S + 60,
    )  # fmt: skip
    return out.stdout.strip()


def pod_ip(cluster, namespace: str, selector: str) -> str:
    found = [p for p in pods(cluster, namespace, selector) if pod_is_ready(p)]
    assert found, f"no Ready pod for {selector}\n{describe(cluster, namespace)}"
    return found[0]["status"]["podIP"]


@pytest.fixture(scope="module")
def env(real_cluster, rp_models, tmp_path_factory) -> Iterator[Env]:
    state = tmp_path_factory.mktemp("rp-netpol")
    suffix = uuid.uuid4().hex[:6]
    other = f"rp-netpol-other-{suffix}"
    with dev_namespace(real_cluster, f"rp-netpol-{suffix}", rp_models) as ns:
        install_crd(real_cluster)
        identity = operator_identity(real_cluster, state)
        op = Operator(identity.kubeconfig, [ns], state / "operator.log")
        real_cluster.kubectl("create", "namespace", other)
        try:
            autoscaling = {"enabled": True, "mode": "advisory"}
            for obj in (
                cpu_service(NAME, real_cluster.dev_image, autoscaling=autoscaling),
                cpu_service(PP_NAME, real_cluster.dev_image, parallelism={"tensor": 1, "pipeline": 2}),
            ):
                out = apply(real_cluster, ns, obj)
                assert out.returncode == 0, out.stderr
            for namespace, name in ((ns, "insider"), (other, "outsider")):
                out = apply(real_cluster, namespace, prober(name, real_cluster.dev_image))
                assert out.returncode == 0, out.stderr
            for name in (NAME, PP_NAME):
                wait_ready(real_cluster, ns, name)
            selector = "=".join(PROBER_LABEL)
            for namespace in (ns, other):
                wait_until(lambda n=namespace: [p for p in pods(real_cluster, n, selector) if pod_is_ready(p)], 300,
                           f"the prober in {namespace} Ready")  # fmt: skip
            yield Env(ns, other, op)
        finally:
            op.stop()
            real_cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
        forbidden = op.forbidden_lines()
        assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])


def test_the_operator_writes_engine_and_router_policies_and_the_node_enforces_them(real_cluster, env):
    names = json.loads(real_cluster.kubectl("get", "networkpolicies", "-n", env.namespace, "-o", "json").stdout)
    have = {p["metadata"]["name"] for p in names["items"]}
    assert {f"{NAME}-engine", f"{NAME}-router", f"{PP_NAME}-engine", f"{PP_NAME}-router"} <= have, have
    import devcluster_netpol
    import devcluster_procs

    pid = real_cluster.pids.get(devcluster_netpol.NAME)
    assert pid is not None, "the dev cluster's real node runs no NetworkPolicy implementation"
    log = real_cluster.state_dir / f"{devcluster_netpol.NAME}.log"
    assert devcluster_procs.pid_alive(pid), f"{devcluster_netpol.NAME} died:\n{log.read_text()[-3000:]}"
    assert devcluster_netpol.queue_bound(real_cluster.pids["node-holder"]), "nothing judges the queued packets"


def test_pods_outside_the_service_cannot_connect_to_an_engine_port(real_cluster, env):
    ns, other = env.namespace, env.other
    insider_ip = pod_ip(real_cluster, ns, "=".join(PROBER_LABEL))
    # control: pod to pod across namespaces on the engine's port number works where no policy selects the target
    assert connect(real_cluster, other, "outsider", insider_ip, ENGINE_PORT) == "connected"
    for name in (NAME, PP_NAME):
        for engine in engine_pods(real_cluster, ns, name, pool="unified"):
            ip = engine["status"]["podIP"]
            for namespace, pod in ((ns, "insider"), (other, "outsider")):
                result = connect(real_cluster, namespace, pod, ip, ENGINE_PORT)
                assert result.startswith("failed"), (
                    f"{pod} ({namespace}) opened a connection to {engine['metadata']['name']} ({ip}:{ENGINE_PORT}) "
                    f"of {name}: {result}"
                )


def test_the_router_port_admits_the_services_namespace_only(real_cluster, env):
    ns, other = env.namespace, env.other
    router_ip = pod_ip(real_cluster, ns, f"tidepool.dev/inferenceservice={NAME},tidepool.dev/pool=router")
    assert connect(real_cluster, ns, "insider", router_ip, ROUTER_PORT) == "connected"
    result = connect(real_cluster, other, "outsider", router_ip, ROUTER_PORT)
    assert result.startswith("failed"), f"the outsider reached the router ({router_ip}:{ROUTER_PORT}): {result}"


def test_a_completion_through_the_router_reaches_the_engine(real_cluster, env):
    body = completion(service_url(real_cluster, env.namespace, f"{NAME}-router"), NAME, max_tokens=4, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 4


def test_the_operators_collector_scrapes_the_engines(real_cluster, env):
    ns = env.namespace

    def scraped() -> dict[str, Any] | None:
        obj = get_isvc(real_cluster, ns, NAME) or {}
        pool = (((obj.get("status") or {}).get("autoscaling") or {}).get("pools") or {}).get("unified") or {}
        return pool if (pool.get("inputs") or {}).get("podsScraped", 0) >= 1 else None

    try:
        pool = wait_until(scraped, 300, "status.autoscaling to report a scraped engine pod", interval_s=2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator errors:\n{env.operator.errors()}") from None
    assert pool["inputs"]["podsScraped"] == 1.0, pool
    # the same path by hand: the host (the collector's address block) reads an engine's /metrics
    ip = engine_pods(real_cluster, ns, NAME)[0]["status"]["podIP"]
    resp = httpx.get(f"http://{ip}:{ENGINE_PORT}/metrics", timeout=30)
    assert resp.status_code == 200 and "tidepool" in resp.text.lower()


def test_a_pipeline_parallel_pool_serves_with_the_policies_on(real_cluster, env):
    ranks = engine_pods(real_cluster, env.namespace, PP_NAME)
    assert len(ranks) == 2 and all(pod_is_ready(p) for p in ranks), describe(real_cluster, env.namespace)
    router = service_url(real_cluster, env.namespace, f"{PP_NAME}-router")
    body = completion(router, PP_NAME, max_tokens=8, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 8
