"""Sticky workload kind on a real control plane (with the LeaderWorkerSet CRD and controller installed): a
multi-node pool that runs as StatefulSet groups keeps them when the operator finds LWS, growing by new
StatefulSet groups; only a new pool becomes a LeaderWorkerSet. Flipping would replace the pool make-before-break,
twice its GPUs, for no change of the spec.

The pool is set up as an operator without LWS leaves it: the service is created paused (the operator creates
nothing), its children are the builders' own output for a cluster without LWS (ClusterFeatures(has_lws=False)),
applied with the operator's field manager and the service as owner; then the annotation goes and the operator,
which sees LWS, takes over. The operator reads the pool's kind from its children (features.sticky_kinds) whatever
produced them, so this is the state "LWS installed after the pool was created" leaves.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from operator_kit import get_isvc, is_ready, pod_is_ready, pods, wait_until

from tidepool.operator.api import ServiceView
from tidepool.operator.builders import ClusterFeatures, desired_state
from tidepool.operator.builders.control_key import SECRET_KIND, with_key
from tidepool.operator.reconcile import owner_reference

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

PAUSED = "tidepool.dev/paused"


def service(name: str, paused: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if paused:
        meta["annotations"] = {PAUSED: "true"}
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": meta,
        "spec": {
            "model": {"uri": "hf://example/model"},
            "parallelism": {"tensor": 1, "pipeline": 2},
            "resources": {"gpusPerReplica": 2},
            "pools": {"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2}},
            "router": {"replicas": 1},
        },
    }


def workloads(cluster, ns: str, name: str) -> dict[tuple[str, str], dict[str, Any]]:
    kinds = "statefulsets.apps,leaderworkersets.leaderworkerset.x-k8s.io"
    out = cluster.kubectl("get", kinds, "-n", ns, "-l", f"tidepool.dev/inferenceservice={name}", "-o", "json")
    items = json.loads(out.stdout)["items"]  # LWS's own StatefulSets (owned by the LeaderWorkerSet) left out
    owned = [o for o in items if any(r["kind"] == "InferenceService" for r in o["metadata"].get("ownerReferences", []))]
    return {(o["kind"], o["metadata"]["name"]): o for o in owned}


def ready_groups(cluster, ns: str, name: str, groups: int) -> bool:
    found = [
        p
        for p in pods(cluster, ns, f"tidepool.dev/inferenceservice={name},tidepool.dev/pool=unified")
        if not p["metadata"].get("deletionTimestamp")
    ]
    return len(found) == 2 * groups and all(pod_is_ready(p) for p in found) and is_ready(get_isvc(cluster, ns, name))


def pre_lws_children(cluster, ns: str, obj: dict[str, Any]) -> None:
    """What an operator on a cluster without LWS applies for `obj`: StatefulSet groups and their Services."""
    meta = obj["metadata"]
    view = ServiceView.from_body(obj)
    owner = owner_reference(meta["name"], meta["uid"])
    built = desired_state(meta["name"], ns, view, ClusterFeatures(has_lws=False), owner=owner).children
    applied = [c for c in built if c["kind"] != SECRET_KIND]
    docs = yaml.safe_dump_all(applied)
    cluster.kubectl("apply", "-n", ns, "--server-side", "--field-manager=tidepool-operator", "-f", "-", input=docs)
    for secret in (c for c in built if c["kind"] == SECRET_KIND):
        cluster.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(with_key(secret, "test-key")))


def test_an_existing_statefulset_pool_keeps_its_kind_a_new_pool_gets_lws(control_plane, cp_namespace, operator):
    ns, name = cp_namespace, "groups"
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(service(name, paused=True)))
    obj = wait_until(lambda: get_isvc(control_plane, ns, name), 30, "the service")
    pre_lws_children(control_plane, ns, obj)
    before = workloads(control_plane, ns, name)
    assert list(before) == [("StatefulSet", f"{name}-unified-g0")]

    control_plane.kubectl("annotate", "inferenceservice", name, "-n", ns, f"{PAUSED}-")
    wait_until(lambda: ready_groups(control_plane, ns, name, 1), 180, "one StatefulSet group Ready")
    after = workloads(control_plane, ns, name)
    assert list(after) == list(before)  # no LeaderWorkerSet made beside it
    group = after[("StatefulSet", f"{name}-unified-g0")]
    assert group["metadata"]["uid"] == before[("StatefulSet", f"{name}-unified-g0")]["metadata"]["uid"]
    assert group["metadata"]["generation"] == before[("StatefulSet", f"{name}-unified-g0")]["metadata"]["generation"]

    control_plane.kubectl("scale", "-n", ns, f"inferenceservice/{name}", "--replicas=2")  # grows as it is
    wait_until(lambda: ready_groups(control_plane, ns, name, 2), 180, "two StatefulSet groups Ready")
    assert sorted(workloads(control_plane, ns, name)) == [
        ("StatefulSet", f"{name}-unified-g0"),
        ("StatefulSet", f"{name}-unified-g1"),
    ]

    fresh = "fresh"  # a new pool takes the cluster's kind
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(service(fresh)))
    wait_until(lambda: ready_groups(control_plane, ns, fresh, 1), 180, "the new service's group Ready")
    assert list(workloads(control_plane, ns, fresh)) == [("LeaderWorkerSet", f"{fresh}-unified")]
