"""Model-cache claims on the real control plane (operator/claims.py): a cache is never lost by accident.

The operator runs as the chart's ServiceAccount, with its production defaults (a 10-minute resync: what follows is
driven by watch events), and the real garbage collector runs in kube-controller-manager. Each case fails on the
operator that pruned a claim whose `size` was removed, adopted an existing claim (owner reference) and let the
garbage collector delete a shared claim with the service that created it:
1. `size` removed while the spec still names the claim: the claim stays;
2. a claim made by hand, named with `size`: used as it is (no owner reference, no annotation, its spec as it
   was, an Event saying so) and still there after the service is deleted;
3. two services share a claim (the second without size): deleting the first keeps it and the second serving;
   with Retain it outlives both;
4. reclaimPolicy Delete: kept while another service names it, deleted once the last one is gone.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from operator_kit import bind_claims, children, condition, get_isvc, is_ready, load_example, wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

CLAIM = "weights"
CREATED_BY = "tidepool.dev/created-by"
RECLAIM_POLICY = "tidepool.dev/reclaim-policy"


def service(name: str, **claim: Any) -> dict[str, Any]:
    """The unified sample as `name`, its cache the claim `weights` (with `claim`'s fields), one replica."""
    obj = load_example("inferenceservice-unified.yaml")
    obj["metadata"]["name"] = name
    obj["spec"]["pools"]["unified"]["replicas"] = 1
    obj["spec"]["router"]["replicas"] = 1
    obj["spec"]["modelCache"] = {"persistentVolumeClaim": {"claimName": CLAIM, **claim}}
    return obj


def apply(cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def wait_ready(cluster, namespace: str, name: str, generation: int = 1) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        obj = get_isvc(cluster, namespace, name)
        return obj if is_ready(obj) and obj["metadata"]["generation"] == generation else None

    return wait_until(ready, 150, f"{name} Ready at generation {generation}")


def claim(cluster, namespace: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", "pvc", CLAIM, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def intact(cluster, namespace: str, uid: str) -> dict[str, Any]:
    """The claim, the same object (uid), not being deleted, owned by no one."""
    now = claim(cluster, namespace)
    assert now is not None, "the claim was deleted"
    meta = now["metadata"]
    assert meta["uid"] == uid, "the claim was deleted and created again (its data gone)"
    assert not meta.get("deletionTimestamp"), f"the claim is being deleted: {meta}"
    assert not meta.get("ownerReferences"), f"the claim is owned, the garbage collector may take it: {meta}"
    return now


def delete_service(cluster, namespace: str, name: str) -> None:
    """Delete the InferenceService and wait until the garbage collector has removed every child it owns."""
    cluster.kubectl("delete", "inferenceservice", name, "-n", namespace, "--wait=true", "--timeout=60s", timeout=70)
    wait_until(
        lambda: all(k[0] == "PersistentVolumeClaim" for k in children(cluster, namespace, name)),
        90,
        f"{name}'s children garbage-collected",
    )


def events_of(cluster, namespace: str, name: str, reason: str) -> list[str]:
    out = cluster.kubectl(
        "get", "events", "-n", namespace, "-o", "json",
        "--field-selector", f"involvedObject.kind=InferenceService,involvedObject.name={name},reason={reason}",
    )  # fmt: skip
    return [e["message"] for e in json.loads(out.stdout)["items"]]


def test_removing_size_never_deletes_the_claim(control_plane, cp_namespace, operator):
    ns = cp_namespace
    bind_claims(control_plane, ns, [CLAIM])
    apply(control_plane, ns, service("alpha", size="5Gi"))
    wait_ready(control_plane, ns, "alpha")
    created = intact(control_plane, ns, claim(control_plane, ns)["metadata"]["uid"])
    annotations = created["metadata"]["annotations"]
    assert annotations[CREATED_BY] == f"{ns}/alpha" and annotations[RECLAIM_POLICY] == "Retain", annotations
    wait_until(lambda: events_of(control_plane, ns, "alpha", "ClaimCreated"), 60, "a ClaimCreated Event")

    unsized = {"spec": {"modelCache": {"persistentVolumeClaim": {"size": None}}}}
    control_plane.kubectl("patch", "inferenceservice", "alpha", "-n", ns, "--type=merge", "-p", json.dumps(unsized))
    wait_ready(control_plane, ns, "alpha", generation=2)  # the generation without size is applied
    intact(control_plane, ns, created["metadata"]["uid"])
    assert claim(control_plane, ns)["spec"] == created["spec"]
    # Retain (the default): the claim outlives its service.
    delete_service(control_plane, ns, "alpha")
    intact(control_plane, ns, created["metadata"]["uid"])
    assert not operator.forbidden_lines(), operator.forbidden_lines()[:5]


def test_an_existing_claim_is_never_adopted(control_plane, cp_namespace, operator):
    ns = cp_namespace
    by_hand = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": CLAIM, "labels": {"team": "ml"}},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "3Gi"}}},
    }
    apply(control_plane, ns, by_hand)
    bind_claims(control_plane, ns, [CLAIM])
    before = wait_until(
        lambda: (c := claim(control_plane, ns)) and c.get("status", {}).get("phase") == "Bound" and c, 60, "bound"
    )
    # Other size, other access modes, reclaimPolicy Delete: none of it applies to a claim the operator did not create.
    apply(control_plane, ns, service("beta", size="20Gi", accessModes=["ReadWriteOnce"], reclaimPolicy="Delete"))
    wait_ready(control_plane, ns, "beta")
    told = wait_until(lambda: events_of(control_plane, ns, "beta", "ClaimExists"), 60, "a ClaimExists Event")
    assert "not created by the operator" in told[0], told
    after = intact(control_plane, ns, before["metadata"]["uid"])
    assert after["spec"]["resources"] == before["spec"]["resources"]
    assert after["spec"]["accessModes"] == ["ReadWriteMany"]
    assert after["metadata"].get("labels") == {"team": "ml"}
    assert not any(k.startswith("tidepool.dev/") for k in after["metadata"].get("annotations") or {})

    delete_service(control_plane, ns, "beta")
    intact(control_plane, ns, before["metadata"]["uid"])
    assert not operator.forbidden_lines(), operator.forbidden_lines()[:5]


def test_a_shared_claim_outlives_the_service_that_created_it(control_plane, cp_namespace, operator):
    """Retain: the second service (which names the claim without size) keeps serving after the first is deleted,
    and the claim outlives both."""
    ns = cp_namespace
    bind_claims(control_plane, ns, [CLAIM])
    apply(control_plane, ns, service("first", size="5Gi"))
    wait_ready(control_plane, ns, "first")
    apply(control_plane, ns, service("second"))
    wait_ready(control_plane, ns, "second")
    uid = intact(control_plane, ns, claim(control_plane, ns)["metadata"]["uid"])["metadata"]["uid"]

    delete_service(control_plane, ns, "first")
    intact(control_plane, ns, uid)
    second = get_isvc(control_plane, ns, "second")
    assert is_ready(second) and (condition(second, "Degraded") or {}).get("status") != "True", second["status"]
    delete_service(control_plane, ns, "second")
    intact(control_plane, ns, uid)
    assert not operator.forbidden_lines(), operator.forbidden_lines()[:5]


def test_reclaim_policy_delete_deletes_the_claim_after_its_last_service(control_plane, cp_namespace, operator):
    ns = cp_namespace
    bind_claims(control_plane, ns, [CLAIM])
    apply(control_plane, ns, service("maker", size="5Gi", reclaimPolicy="Delete"))
    wait_ready(control_plane, ns, "maker")
    # A second service asking for the claim with size and its own policy: it uses the claim as the first made it.
    apply(control_plane, ns, service("user", size="9Gi"))
    wait_ready(control_plane, ns, "user")
    told = wait_until(lambda: events_of(control_plane, ns, "user", "ClaimExists"), 60, "a ClaimExists Event")
    assert f"created by InferenceService {ns}/maker (reclaimPolicy Delete)" in told[0], told
    made = intact(control_plane, ns, claim(control_plane, ns)["metadata"]["uid"])
    assert made["metadata"]["annotations"][RECLAIM_POLICY] == "Delete"
    assert made["spec"]["resources"]["requests"]["storage"] == "5Gi"

    delete_service(control_plane, ns, "maker")  # its creator is gone, but "user" still names it
    intact(control_plane, ns, made["metadata"]["uid"])
    assert is_ready(get_isvc(control_plane, ns, "user"))
    delete_service(control_plane, ns, "user")

    def going() -> bool:  # one read: the claim may vanish between two
        now = claim(control_plane, ns)
        return now is None or bool(now["metadata"].get("deletionTimestamp"))

    wait_until(going, 90, "the claim deleted after its last service")
    assert not operator.forbidden_lines(), operator.forbidden_lines()[:5]
