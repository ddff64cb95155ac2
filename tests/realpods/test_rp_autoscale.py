"""The autoscaler on real pods: it scrapes the engines' real `/metrics` (pod IPs from EndpointSlices)
and scales the pool up under a load the test sends through the router's Service.

The engine runs one sequence at a time (`maxNumSeqs: 1`), so concurrent requests queue and
`vllm:num_requests_waiting` exceeds `queueDepthTarget` however fast the machine is; the load runs
until the operator has scaled to the maximum and the new replica serves. The operator runs with its
production defaults (autoscaler interval 15 s).
"""

from __future__ import annotations

import threading

import httpx
import pytest
from rp_support import (
    Operator,
    apply,
    cpu_service,
    describe,
    engine_pods,
    get_isvc,
    install_crd,
    operator_identity,
    pod_is_ready,
    service_url,
    wait_ready,
    wait_until,
)

pytestmark = [pytest.mark.realpods, pytest.mark.timeout(900)]

NAME = "auto"
CONCURRENCY = 6


class Load:
    """CONCURRENCY clients, each sending one completion after another until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.num_ok = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(CONCURRENCY)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        body = {"model": NAME, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        with httpx.Client(timeout=300) as http:
            while not self.stop.is_set():
                try:
                    resp = http.post(f"{self.url}/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                if resp.status_code == 200:
                    self.num_ok += 1
                else:
                    self.errors.append(f"{resp.status_code} {resp.text[:200]}")

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)


def test_autoscaler_scrapes_real_metrics_and_scales_up_under_load(real_cluster, rp_namespace, tmp_path):
    ns = rp_namespace
    install_crd(real_cluster)
    identity = operator_identity(real_cluster, tmp_path)
    op = Operator(identity.kubeconfig, [ns], tmp_path / "operator.log")
    try:
        autoscaling = {"enabled": True, "queueDepthTarget": 1, "stabilization": {"upSeconds": 0, "downSeconds": 3600}}
        obj = cpu_service(
            NAME, real_cluster.dev_image, engine={"maxNumSeqs": 1}, autoscaling=autoscaling,
            pools={"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2}},
        )  # fmt: skip
        out = apply(real_cluster, ns, obj)
        assert out.returncode == 0, out.stderr
        wait_ready(real_cluster, ns, NAME)
        assert len(engine_pods(real_cluster, ns, NAME)) == 1

        load = Load(service_url(real_cluster, ns, f"{NAME}-router"))
        try:

            def scaled() -> dict | None:
                isvc = get_isvc(real_cluster, ns, NAME) or {}
                auto = (isvc.get("status") or {}).get("autoscaling") or {}
                pool = (auto.get("pools") or {}).get("unified") or {}
                return auto if pool.get("desiredReplicas") == 2 else None

            auto = wait_until(scaled, 600, "the autoscaler to ask for 2 replicas", interval_s=2)
            wait_until(
                lambda: sum(pod_is_ready(p) for p in engine_pods(real_cluster, ns, NAME)) == 2,
                600, "the second engine pod Ready", interval_s=2,
            )  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\noperator errors:\n{op.errors()}\n{describe(real_cluster, ns)}") from None
        finally:
            load.close()
        inputs = auto["pools"]["unified"]["inputs"]
        assert inputs["podsScraped"] >= 1 and inputs["queueDepth"] > 1, inputs  # real /metrics, a real queue
        assert auto["mode"] == "active" and auto["lastScaleTime"], auto
        assert load.num_ok > 0 and not load.errors, load.errors[:5]
    finally:
        op.stop()
    assert not op.forbidden_lines(), op.forbidden_lines()[:10]
