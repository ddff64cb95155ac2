"""A pipeline-parallel pool on real pods: `pipeline: 2` on CPU (gloo), one pod per stage.

With the LeaderWorkerSet CRD installed (the dev cluster runs the real LWS controller and its
webhooks), the operator renders a LeaderWorkerSet; the controller creates the leader and the worker
pod and injects LWS_LEADER_ADDRESS (a DNS name CoreDNS answers from the headless Service) and
LWS_WORKER_INDEX. The kubelet runs every rank's probes for real: this fails when ranks > 0 have
no endpoint their probes can pass, which KWOK's fake pods never showed.
"""

from __future__ import annotations

import json

import pytest
from rp_support import (
    Operator,
    apply,
    completion,
    cpu_service,
    describe,
    engine_pods,
    install_crd,
    operator_identity,
    pod_is_ready,
    service_url,
    wait_ready,
)

pytestmark = [pytest.mark.realpods, pytest.mark.timeout(900)]

NAME = "pp"


def test_pipeline_parallel_pool_on_cpu_passes_every_ranks_probes_and_serves(real_cluster, rp_namespace, tmp_path):
    ns = rp_namespace
    install_crd(real_cluster)
    identity = operator_identity(real_cluster, tmp_path)
    op = Operator(identity.kubeconfig, [ns], tmp_path / "operator.log")
    try:
        obj = cpu_service(NAME, real_cluster.dev_image, parallelism={"tensor": 1, "pipeline": 2})
        out = apply(real_cluster, ns, obj)
        assert out.returncode == 0, (
            f"the API refused a CPU pipeline-parallel pool (pipeline: 2, gpusPerReplica: 0): {out.stderr}"
        )
        try:
            wait_ready(real_cluster, ns, NAME, timeout_s=600)
        except AssertionError as exc:
            ranks = {p["metadata"]["name"]: pod_is_ready(p) for p in engine_pods(real_cluster, ns, NAME)}
            raise AssertionError(f"ranks and their readiness: {ranks}\n{exc}") from None
        lws = json.loads(real_cluster.kubectl("get", "leaderworkersets", "-n", ns, "-o", "json").stdout)["items"]
        assert [x["spec"]["leaderWorkerTemplate"]["size"] for x in lws] == [2]
        ranks = engine_pods(real_cluster, ns, NAME)
        assert len(ranks) == 2, describe(real_cluster, ns)
        for pod in ranks:
            assert pod["spec"]["nodeName"] == "tidepool-real-0"
            assert pod_is_ready(pod), f"rank pod {pod['metadata']['name']} did not pass its probes"
            env = {e["name"] for c in pod["spec"]["containers"] for e in c.get("env", [])}
            assert {"LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX"} <= env  # the LWS pod webhook ran
        router = service_url(real_cluster, ns, f"{NAME}-router")
        body = completion(router, NAME, max_tokens=8, ignore_eos=True)
        assert body["usage"]["completion_tokens"] == 8
    finally:
        op.stop()
    assert not op.forbidden_lines(), op.forbidden_lines()[:10]
