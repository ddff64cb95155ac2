"""operator/rollout.py, pure: what counts as a rollout, holding one back, the budget's slots and queue, when a
workload is settled, the pause annotation, the recorded operator defaults; and sticky workload kinds
(features.sticky_kinds + the builders' `kinds`)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tidepool.operator.api import InferenceServiceSpec, ServiceView
from tidepool.operator.builders import LABEL_SPEC_HASH, ClusterFeatures, desired_state
from tidepool.operator.cache import PodInfo
from tidepool.operator.features import sticky_kinds
from tidepool.operator.reconcile import plan
from tidepool.operator.rollout import (
    QUEUED,
    RolloutBudget,
    defaults_of,
    hold,
    is_mid_rollout,
    is_paused,
    is_rollout,
    is_settled,
    steer,
    target,
    with_defaults,
)

NS, NAME = "ns", "svc"
BASE: dict[str, Any] = {
    "model": {"uri": "hf://org/model"},
    "resources": {"gpusPerReplica": 1},
    "mode": "unified",
    "pools": {"unified": {"replicas": 2, "minReplicas": 1, "maxReplicas": 8}},
}
MULTI_NODE = {**BASE, "parallelism": {"tensor": 2, "pipeline": 2}, "resources": {"gpusPerReplica": 4}}


def view(spec: dict[str, Any]) -> ServiceView:
    return ServiceView.from_spec(InferenceServiceSpec.model_validate(spec).to_wire())


def desired(spec: dict[str, Any], features: ClusterFeatures | None = None, **kw: Any):
    return desired_state(NAME, NS, view(spec), features, **kw)


def by_key(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): copy.deepcopy(o) for o in objs}


def changed(base: dict[str, Any], **fields: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    for path, value in fields.items():
        node = out
        *parents, last = path.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def template_hash(obj: dict[str, Any]) -> str:
    return obj["spec"]["template"]["metadata"]["labels"][LABEL_SPEC_HASH]


# ---- pause ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("annotations", "paused"),
    [({"tidepool.dev/paused": "true"}, True), ({"tidepool.dev/paused": "false"}, False), ({}, False),
     ({"tidepool.dev/paused": "yes"}, False)],
)  # fmt: skip
def test_only_true_pauses(annotations: dict[str, str], paused: bool):
    assert is_paused({"annotations": annotations}) is paused


# ---- what a plan changes ------------------------------------------------------------------------------------
def test_creating_or_scaling_is_not_a_rollout_a_template_change_is():
    before = by_key(desired(BASE).children)
    assert not is_rollout(plan(desired(BASE).children, {}), {})  # creation: nothing runs yet
    scaled = desired(changed(BASE, pools__unified__replicas=5)).children
    assert not is_rollout(plan(scaled, before), before)
    new_image = desired(changed(BASE, engine__image="example.com/engine:2")).children
    assert is_rollout(plan(new_image, before), before)


def test_a_mode_switch_is_a_rollout():
    before = by_key(desired(BASE).children)
    disagg = changed(
        BASE,
        mode="disaggregated",
        pools={"prefill": {"replicas": 1, "maxReplicas": 2}, "decode": {"replicas": 1, "maxReplicas": 2}},
    )
    todo = plan(desired(disagg).children, before)
    assert todo.deferred and is_rollout(todo, before)
    held = hold(todo, before)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in held.apply}
    assert ("Deployment", f"{NAME}-prefill") not in kinds and ("Deployment", f"{NAME}-decode") not in kinds
    assert held.deferred == [] and held.prune == []  # the old pool and its children stay
    assert not any("Deployment/svc-prefill" in e[2] for e in held.events)  # not told as created
    assert not is_rollout(held, before)


def test_hold_keeps_the_running_template_and_follows_replicas():
    before = by_key(desired(BASE).children)
    new = desired(changed(BASE, engine__image="example.com/engine:2", pools__unified__replicas=3)).children
    todo = plan(new, before)
    assert any(e[1] == "RollingOut" for e in todo.events)
    held = hold(todo, before)
    (deployment,) = [o for o in held.apply if o["metadata"]["name"] == f"{NAME}-unified"]
    old = before[("Deployment", f"{NAME}-unified")]
    assert deployment["spec"]["template"] == old["spec"]["template"]
    assert deployment["metadata"]["labels"][LABEL_SPEC_HASH] == template_hash(old)
    assert deployment["spec"]["replicas"] == 3  # scaling never waits
    assert not any(e[1] == "RollingOut" for e in held.events)
    assert not is_rollout(held, before)
    # The router's template changed too (its image follows the engine's): held, and unchanged otherwise.
    assert ("Deployment", f"{NAME}-router") not in {(o["kind"], o["metadata"]["name"]) for o in held.apply}


def test_hold_adds_no_group_to_a_held_statefulset_pool():
    before = by_key(desired(MULTI_NODE).children)
    grown = desired(changed(MULTI_NODE, engine__image="example.com/engine:2", pools__unified__replicas=3)).children
    held = hold(plan(grown, before), before)
    groups = sorted(o["metadata"]["name"] for o in held.apply if o["kind"] == "StatefulSet")
    assert groups == []  # g0 and g1 keep their template (nothing else differs); g2 waits for the slot
    shrunk = desired(changed(MULTI_NODE, engine__image="example.com/engine:2", pools__unified__replicas=1)).children
    pruned = [o["metadata"]["name"] for o in hold(plan(shrunk, before), before).prune if o["kind"] == "StatefulSet"]
    assert pruned == [f"{NAME}-unified-g1"]  # (one pool replica: one router, whose budget goes too)


# ---- the cluster's view ----------------------------------------------------------------------------------
def pod(name: str, spec_hash: str, pool: str = "unified", terminating: bool = False) -> PodInfo:
    return PodInfo(name, pool, spec_hash, None, 0, not terminating, terminating, "10.0.0.1", ())


def test_mid_rollout_means_pods_of_a_template_no_workload_carries():
    workloads = {k: v for k, v in by_key(desired(BASE).children).items() if k[0] == "Deployment"}
    current = template_hash(workloads[("Deployment", f"{NAME}-unified")])
    assert not is_mid_rollout(workloads, [pod("a", current), pod("b", current)])
    assert is_mid_rollout(workloads, [pod("a", current), pod("b", "old")])
    assert not is_mid_rollout(workloads, [pod("a", current), pod("b", "old", terminating=True)])


def deployment(generation: int = 2, **status: int) -> dict[str, Any]:
    return {"kind": "Deployment", "metadata": {"name": "d", "generation": generation}, "spec": {"replicas": 2},
            "status": status}  # fmt: skip


@pytest.mark.parametrize(
    ("obj", "settled"),
    [
        (deployment(observedGeneration=2, replicas=2, updatedReplicas=2, readyReplicas=2), True),
        (deployment(observedGeneration=1, replicas=2, updatedReplicas=2, readyReplicas=2), False),  # not seen yet
        (deployment(observedGeneration=2, replicas=3, updatedReplicas=2, readyReplicas=3), False),  # an old pod left
        (deployment(observedGeneration=2, replicas=2, updatedReplicas=2, readyReplicas=1), False),
        ({"kind": "StatefulSet", "metadata": {"generation": 1}, "spec": {"replicas": 2},
          "status": {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2,
                     "currentRevision": "a", "updateRevision": "b"}}, False),
        ({"kind": "LeaderWorkerSet", "metadata": {"generation": 4}, "spec": {"replicas": 1},
          "status": {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}}, True),
        ({"kind": "Deployment", "metadata": {"generation": 1}, "spec": {"replicas": 0},
          "status": {"observedGeneration": 1}}, True),
    ],
)  # fmt: skip
def test_settled(obj: dict[str, Any], settled: bool):
    assert is_settled(obj) is settled


# ---- the budget -----------------------------------------------------------------------------------------
A, B, C, D, E = (("ns", n) for n in "abcde")


def started(limit: int, known: tuple = ()) -> RolloutBudget:
    budget = RolloutBudget(limit)
    budget.start(known)
    return budget


def test_at_most_limit_roll_the_rest_queue_first_come_first_served():
    budget = started(2)
    assert budget.admit(A, "t", 0).go and budget.admit(B, "t", 1).go
    queued = budget.admit(C, "t", 2)
    assert not queued.go and queued.newly_queued and "at most 2" in queued.message and "ns/a" in queued.message
    assert not budget.admit(D, "t", 3).go
    assert not budget.admit(C, "t", 4).newly_queued  # asked again: still waiting, told once
    assert budget.observe(A, "t", in_flight=True, finished=False, stalled=False, now=5) == []  # still rolling
    assert budget.observe(A, "t", in_flight=False, finished=True, stalled=False, now=6) == [C]
    assert not budget.admit(E, "t", 7).go  # a newcomer does not jump the queue
    assert not budget.admit(D, "t", 8).go  # nor does the second in line while the first may still take the slot
    assert budget.admit(C, "t", 9).go
    assert set(budget.rolling) == {B, C} and list(budget.waiting) == [D, E]


def test_a_stalled_rollout_frees_its_slot_and_is_not_counted_again_until_its_target_changes():
    budget = started(1)
    assert budget.admit(A, "t1", 0).go
    assert not budget.admit(B, "t", 0).go
    assert budget.observe(A, "t1", in_flight=True, finished=False, stalled=True, now=1) == [B]
    assert budget.admit(B, "t", 2).go
    budget.observe(A, "t1", in_flight=True, finished=False, stalled=False, now=3)
    assert A not in budget.rolling  # the same rollout, not counted again
    assert budget.admit(A, "t1", 4).go  # nor queued: its change is already applied
    assert not budget.admit(A, "t2", 5).go  # a new target is a new rollout: it waits


def test_after_a_restart_nothing_starts_until_every_service_was_seen_and_found_rollouts_count():
    budget = started(1, known=(A, B))
    waiting = budget.admit(C, "t", 0)
    assert not waiting.go and "not yet seen" in waiting.message
    assert budget.observe(A, "t", in_flight=True, finished=False, stalled=False, now=1) == []  # mid-rollout
    assert budget.observe(B, "t", in_flight=True, finished=False, stalled=False, now=2) == []  # over the limit
    assert set(budget.rolling) == {A, B}
    budget.observe(A, "t", in_flight=False, finished=True, stalled=False, now=3)
    assert budget.observe(B, "t", in_flight=False, finished=True, stalled=False, now=4) == [C]


def test_withdraw_forget_and_no_limit():
    budget = started(1)
    budget.admit(A, "t", 0)
    budget.admit(B, "t", 0)
    budget.admit(C, "t", 0)
    assert budget.withdraw(B) == [] and list(budget.waiting) == [C]
    assert budget.forget(A) == [C]
    unlimited = started(0)
    assert all(unlimited.admit(k, "t", 0).go for k in (A, B, C, D, E)) and not unlimited.rolling


# ---- operator defaults and steering ---------------------------------------------------------------------------
def test_recorded_defaults_round_trip():
    features = ClusterFeatures(engine_image="e:1", router_image="r:1", hf_download_image=None)
    assert with_defaults(ClusterFeatures(engine_image="e:2"), defaults_of(features)) == features


def test_a_queued_service_is_built_with_its_recorded_defaults():
    old, new = ClusterFeatures(engine_image="e:1"), ClusterFeatures(engine_image="e:2")
    observed = by_key(desired(BASE, old).children)
    budget = started(1)
    budget.admit(("ns", "other"), "t", 0)

    def planned(features: ClusterFeatures):
        d = desired(BASE, features)
        return d, plan(d.children, observed)

    meta = {"name": NAME, "namespace": NS}
    queued = steer((NS, NAME), meta, defaults_of(old), new, observed, planned, budget, 1)
    assert queued.held is not None and queued.held[:2] == ("True", QUEUED)
    assert queued.is_applied  # only the operator's defaults wait: the spec itself is what runs
    assert queued.plan.apply == [] and queued.defaults == defaults_of(old)
    assert queued.plan.events[0][1] == QUEUED
    budget.forget(("ns", "other"))
    going = steer((NS, NAME), meta, defaults_of(old), new, observed, planned, budget, 2)
    assert going.held is None and going.defaults == defaults_of(new)
    images = {c["image"] for o in going.plan.apply for c in o["spec"]["template"]["spec"]["containers"]}
    assert images == {"e:2"}
    paused = steer((NS, NAME), {**meta, "annotations": {"tidepool.dev/paused": "true"}}, defaults_of(old), new,
                   observed, planned, budget, 3)  # fmt: skip
    assert paused.is_paused and paused.plan.apply == [] and paused.held is not None
    assert paused.held[:2] == ("Unknown", "Paused") and "Deployment/svc-unified" in paused.held[2]


def test_target_names_each_pool_template():
    d = desired(BASE)
    assert target(d) == target(desired(BASE)) != target(desired(changed(BASE, engine__image="x:2")))


# ---- sticky workload kind -----------------------------------------------------------------------------------
def test_an_existing_multi_node_pool_keeps_its_kind_a_new_one_takes_the_clusters():
    groups = by_key(desired(MULTI_NODE, ClusterFeatures(has_lws=False)).children)
    kinds = sticky_kinds(groups)
    assert kinds == {"unified": "StatefulSet"}
    lws = ClusterFeatures(has_lws=True)
    kept = desired(MULTI_NODE, lws, kinds=kinds).children
    assert by_key(kept).keys() == groups.keys()  # LWS installed: nothing to replace
    assert not plan(kept, groups).apply
    assert {o["kind"] for o in desired(MULTI_NODE, lws).children} >= {"LeaderWorkerSet"}  # a new pool
    on_lws = by_key(desired(MULTI_NODE, lws).children)
    assert sticky_kinds(on_lws) == {"unified": "LeaderWorkerSet"}
    disagg = changed(
        MULTI_NODE,
        mode="disaggregated",
        pools={"prefill": {"replicas": 1, "maxReplicas": 2}, "decode": {"replicas": 1, "maxReplicas": 2}},
    )
    recreated = desired(disagg, lws, kinds=kinds).children  # a mode switch recreates the pools: the new kind
    assert {o["kind"] for o in recreated if o["metadata"]["labels"].get("tidepool.dev/pool") == "prefill"} >= {
        "LeaderWorkerSet"
    }
