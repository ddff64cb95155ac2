"""A disaggregated service with `tensor: 2` on real pods (CPU, gloo) answers exactly as a unified one (greedy).

Issue #39 item 1: the flagship example's shape (P/D with tensor parallelism) used to crash-loop because the
engine refused P/D with TP. Here a prefill pool and a decode pool each run two tensor ranks in one pod; every
prefill rank pushes its own KV shard to the matching decode rank (the decode pod's rank r listens on the KV
port + r), the router drives the hand-off, and each greedy completion equals the unified service's.
"""

from __future__ import annotations

import pytest
from rp_support import (
    Operator,
    apply,
    completion,
    cpu_service,
    describe,
    install_crd,
    operator_identity,
    service_url,
    wait_ready,
)

pytestmark = [pytest.mark.realpods, pytest.mark.timeout(1200)]

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog and", "def fibonacci(n):"]


def test_disaggregated_tensor_parallel_service_answers_as_the_unified_one(real_cluster, rp_namespace, tmp_path):
    ns = rp_namespace
    install_crd(real_cluster)
    identity = operator_identity(real_cluster, tmp_path)
    op = Operator(identity.kubeconfig, [ns], tmp_path / "operator.log")
    try:
        unified = cpu_service("uni", real_cluster.dev_image)
        disagg = cpu_service("pdtp", real_cluster.dev_image, parallelism={"tensor": 2, "pipeline": 1})
        disagg["spec"]["mode"] = "disaggregated"
        disagg["spec"]["pools"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
        for obj in (unified, disagg):
            out = apply(real_cluster, ns, obj)
            assert out.returncode == 0, f"the API refused {obj['metadata']['name']}: {out.stderr}"
        for name in ("uni", "pdtp"):
            wait_ready(real_cluster, ns, name, timeout_s=900)
        uni_url, pd_url = service_url(real_cluster, ns, "uni-router"), service_url(real_cluster, ns, "pdtp-router")
        for prompt in PROMPTS:
            expected = completion(uni_url, "uni", prompt, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
            got = completion(pd_url, "pdtp", prompt, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
            assert got == expected, (
                f"{prompt!r}: disaggregated {got!r} != unified {expected!r}\n{describe(real_cluster, ns)}"
            )
    finally:
        op.stop()
    assert not op.forbidden_lines(), op.forbidden_lines()[:10]
