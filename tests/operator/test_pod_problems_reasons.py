"""Why a pod cannot run, told apart from what the scheduler and the kubelet write (pod_problems.py). Pure.

The messages are kube-scheduler's own format (kubernetes pkg/scheduler/framework/types.go FitError.Error:
"0/N nodes are available:" then the PreFilter message, or the per-node histogram "<count> <reason>"
sorted and joined with ", ", then "." and the PostFilter (preemption) message), with the plugins' texts:
VolumeBinding "pod has unbound immediate PersistentVolumeClaims", NodeAffinity "node(s) didn't match
Pod's node affinity/selector", NodeResourcesFit "Insufficient <resource>" / "Too many pods".
"""

from __future__ import annotations

from typing import Any

import pytest

from tidepool.operator.pod_problems import (
    EVICTED,
    INSUFFICIENT_CAPACITY,
    NO_MATCHING_NODE,
    UNBOUND_CLAIM,
    UNSCHEDULABLE,
    problems_of,
    scheduling_problem,
    termination_problem,
)

NOT_HELPFUL = "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
TAINT = "node(s) had untolerated taint {node-role.kubernetes.io/control-plane: }"
AFFINITY = "node(s) didn't match Pod's node affinity/selector"


def spec(gpus: int = 8, product: str = "NVIDIA-H100-80GB-HBM3", claim: str | None = None) -> dict[str, Any]:
    engine = {"name": "engine", "resources": {"requests": {"nvidia.com/gpu": str(gpus), "cpu": "4"}}}
    out: dict[str, Any] = {"containers": [engine], "nodeSelector": {"nvidia.com/gpu.product": product}}
    if claim:
        out["volumes"] = [{"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}}]
    return out


def test_an_unbound_claim_names_the_claim():
    message = f"0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims. {NOT_HELPFUL}"
    reason, text = scheduling_problem("Unschedulable", message, spec(claim="weights"))
    assert reason == UNBOUND_CLAIM
    assert "claim weights is not bound" in text and "StorageClass" in text
    assert "0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims" in text
    assert "preemption" not in text  # the PostFilter part says nothing about the cause


def test_a_missing_claim_is_an_unbound_claim():
    message = f'0/3 nodes are available: persistentvolumeclaim "weights" not found. {NOT_HELPFUL}'
    reason, text = scheduling_problem("Unschedulable", message, spec(claim="weights"))
    assert reason == UNBOUND_CLAIM and 'persistentvolumeclaim "weights" not found' in text


def test_a_selector_no_node_matches_names_the_selector_and_the_counts():
    message = f"0/3 nodes are available: 1 {TAINT}, 2 {AFFINITY}. {NOT_HELPFUL}"
    reason, text = scheduling_problem("Unschedulable", message, spec(product="NVIDIA-H100-80GB-HMB3"))
    assert reason == NO_MATCHING_NODE
    assert "nvidia.com/gpu.product=NVIDIA-H100-80GB-HMB3" in text  # the typo, where the admin sees it
    assert "2 of 3 nodes" in text and f"1 {TAINT}" in text


def test_a_required_node_affinity_is_named_too():
    pod = spec()
    pod.pop("nodeSelector")
    term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}
    required = {"nodeSelectorTerms": [term]}
    pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    reason, text = scheduling_problem(None, f"0/2 nodes are available: 2 {AFFINITY}.", pod)
    assert reason == NO_MATCHING_NODE and "zone In a,b" in text and "2 of 2 nodes" in text


def test_a_gpu_count_no_node_has_is_insufficient_capacity_with_the_request():
    message = f"0/3 nodes are available: 1 {TAINT}, 2 Insufficient nvidia.com/gpu. {NOT_HELPFUL}"
    reason, text = scheduling_problem("Unschedulable", message, spec(gpus=9))
    assert reason == INSUFFICIENT_CAPACITY
    assert "the pod requests nvidia.com/gpu 9" in text and "2 Insufficient nvidia.com/gpu" in text


def test_post_filter_messages_are_not_taken_for_reasons():
    """kube-scheduler 1.36 as it answered on the dev cluster: DRA's PostFilter message comes before preemption's."""
    message = (
        "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. no new claims to deallocate, preemption: 0/2 nodes"
        " are available: 2 No preemption victims found for incoming pod."
    )
    reason, text = scheduling_problem("Unschedulable", message, spec(gpus=8))
    assert reason == INSUFFICIENT_CAPACITY
    assert text == (
        "no node that matches has room (the pod requests nvidia.com/gpu 8)"
        " (0/2 nodes are available: 2 Insufficient nvidia.com/gpu)"
    )


def test_nodes_that_match_but_are_full_outrank_nodes_that_do_not_match():
    """Mixed per node: the selector is right (some nodes match), they lack room: capacity is the cause."""
    message = f"0/4 nodes are available: 2 Insufficient nvidia.com/gpu, 2 {AFFINITY}."
    reason, text = scheduling_problem("Unschedulable", message, spec())
    assert reason == INSUFFICIENT_CAPACITY and f"2 {AFFINITY}" in text  # the counts of both


def test_a_claim_outranks_everything():
    no_volume = "node(s) didn't find available persistent volumes to bind"
    message = f"0/2 nodes are available: 1 Insufficient cpu, 1 {no_volume}."
    assert scheduling_problem("Unschedulable", message, spec(claim="c"))[0] == UNBOUND_CLAIM


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("Unschedulable", f"0/3 nodes are available: 3 {TAINT}. {NOT_HELPFUL}"),  # taints: not told apart
        ("Unschedulable", "0/2 nodes: gpu"),  # not the scheduler's format: as written
        (None, "m"),
    ],
)
def test_other_causes_stay_unschedulable_with_the_schedulers_message(reason: str | None, message: str):
    assert scheduling_problem(reason, message, spec()) == (UNSCHEDULABLE, message)


def test_a_scheduler_reason_other_than_unschedulable_is_kept():
    assert scheduling_problem("SchedulingGated", "gated", spec()) == ("SchedulingGated", "gated")


def test_an_eviction_carries_the_kubelets_message():
    message = 'Usage of EmptyDir volume "model-cache" exceeds the limit "20Gi". '
    status = {"phase": "Failed", "reason": "Evicted", "message": message}
    assert termination_problem(status) == (EVICTED, f"evicted by the kubelet: {message.strip()}")
    assert termination_problem({"phase": "Failed", "reason": "Terminated"}) is None
    assert termination_problem({"phase": "Running", "reason": "Evicted"}) is None


def test_a_finished_pod_has_only_its_termination_problem():
    """An eviction during the download stops the init container with a non-zero exit: that is the
    kubelet's doing, not a failed download."""
    killed = {"name": "fetch-model", "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}
    status = {
        "phase": "Failed",
        "reason": "Evicted",
        "message": "Pod ephemeral local storage usage exceeds the total limit of containers 20Gi.",
        "initContainerStatuses": [killed],
        "conditions": [{"type": "PodScheduled", "status": "True"}],
    }
    assert [r for r, _ in problems_of(spec(), status)] == [EVICTED]
    assert problems_of(spec(), {**status, "phase": "Succeeded", "reason": None}) == []
    running = {**status, "phase": "Pending", "reason": None}
    assert [r for r, _ in problems_of(spec(), running)] == ["ModelDownloadFailed"]


def test_pending_pod_problems_classify_the_scheduled_condition():
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": f"0/2 nodes are available: 2 {AFFINITY}."}  # fmt: skip
    status = {"phase": "Pending", "conditions": [condition]}
    ((reason, _),) = problems_of(spec(), status)
    assert reason == NO_MATCHING_NODE
