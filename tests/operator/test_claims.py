"""Cache claims (operator/claims.py) in the plan, in the store and through the controller: created, never
adopted, never pruned, deleted only as their reclaim policy says once their creator is gone."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from fake_api import NAME, NS, SPEC, FakeApi, with_controller

from tidepool.operator.builders import LABEL_SERVICE, ClusterFeatures, ServiceView, desired_state
from tidepool.operator.builders.network import ANNOTATION_CREATED_BY, ANNOTATION_RECLAIM_POLICY
from tidepool.operator.cache import Store
from tidepool.operator.claims import (
    creator_of,
    names_claim,
    reclaimable,
    released_claim,
    used_as_it_is,
    with_shared_claims,
)
from tidepool.operator.controller import Controller
from tidepool.operator.reconcile import owner_reference, plan

KEY = ("PersistentVolumeClaim", "weights")


def _ref(name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "name": name, "uid": uid,
            "controller": False}  # fmt: skip


def _claim(
    service: str | None, *owners: tuple[str, str], rv: str = "1", policy: str | None = "Retain", legacy: bool = False
) -> dict[str, Any]:
    """The claim `service` created (None: one the operator did not create; legacy: labelled by an older operator,
    without the annotations), with `owners`' references."""
    meta: dict[str, Any] = {"name": "weights", "namespace": "ns", "resourceVersion": rv, "uid": "uid-claim"}
    if service is not None:
        meta["labels"] = {LABEL_SERVICE: service, "app.kubernetes.io/managed-by": "tidepool-operator"}
        if not legacy:
            meta["annotations"] = {ANNOTATION_CREATED_BY: f"ns/{service}", ANNOTATION_RECLAIM_POLICY: policy}
    if owners:
        meta["ownerReferences"] = [_ref(*o) for o in owners]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta,
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "5Gi"}}},
        "status": {"phase": "Bound", "capacity": {"storage": "5Gi"}},
    }


def _wanted_by(service: str, storage: str = "5Gi", policy: str = "Retain") -> dict[str, Any]:
    want = _claim(service, policy=policy)
    del want["status"], want["metadata"]["uid"], want["metadata"]["resourceVersion"]
    want["spec"]["resources"]["requests"]["storage"] = storage
    return want


def _spec(**claim: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["modelCache"] = {"persistentVolumeClaim": {"claimName": "weights", **claim}}
    return spec


def sync(ctrl: Controller, full: bool = False) -> None:
    asyncio.run(ctrl.services.sync((NS, NAME), full))


def _reasons(api: FakeApi, *reasons: str) -> list[str]:
    return [e["message"] for e in api.events if e["reason"] in reasons]


# --- the builder and the pure parts -------------------------------------------------------------------------


def test_the_claim_says_who_created_it_and_is_never_owned():
    spec = _spec(size="10Gi")
    view = ServiceView.from_spec(spec)
    desired = desired_state("svc", "ns", view, ClusterFeatures(), None, owner_reference("svc", "uid-1"))
    claim = next(c for c in desired.children if c["kind"] == "PersistentVolumeClaim")
    assert claim["metadata"]["annotations"] == {ANNOTATION_CREATED_BY: "ns/svc", ANNOTATION_RECLAIM_POLICY: "Retain"}
    assert "ownerReferences" not in claim["metadata"]  # the garbage collector never takes it with the service
    assert all(c["metadata"]["ownerReferences"] for c in desired.children if c is not claim)
    spec["modelCache"]["persistentVolumeClaim"]["reclaimPolicy"] = "Delete"
    desired = desired_state("svc", "ns", ServiceView.from_spec(spec), ClusterFeatures())
    claim = next(c for c in desired.children if c["kind"] == "PersistentVolumeClaim")
    assert claim["metadata"]["annotations"][ANNOTATION_RECLAIM_POLICY] == "Delete"


def test_who_created_a_claim():
    assert creator_of(_claim("a")) == "ns/a"
    assert creator_of(_claim("a", legacy=True)) == "ns/a"  # labelled by an older operator
    assert creator_of(_claim(None)) is None
    hand_labelled = _claim(None)
    hand_labelled["metadata"]["labels"] = {LABEL_SERVICE: "a"}  # not managed by the operator
    assert creator_of(hand_labelled) is None


def test_a_missing_claim_is_created_never_applied():
    todo = plan([_wanted_by("a")], {}, "uid-a")
    assert todo.apply == [] and todo.prune == []
    assert [c["metadata"]["name"] for c in todo.claims] == ["weights"]


def test_a_claim_another_service_created_is_used_as_it_is():
    """Other size, other policy: nothing applied, no owner reference added, an Event says whose it is."""
    existing = _claim("a", policy="Delete")
    todo = plan([_wanted_by("b", storage="50Gi")], {KEY: existing}, "uid-b")
    assert todo.apply == [] and todo.claims == [] and todo.prune == []
    [(type_, reason, message)] = todo.events
    assert (type_, reason) == ("Normal", "ClaimExists")
    assert "created by InferenceService ns/a (reclaimPolicy Delete)" in message
    # A reference an older operator gave b is taken away (a's stays): b's deletion must not collect the claim.
    legacy = _claim("a", ("a", "uid-a"), ("b", "uid-b"), legacy=True)
    [release] = plan([_wanted_by("b")], {KEY: legacy}, "uid-b").apply
    assert [r["uid"] for r in release["metadata"]["ownerReferences"]] == ["uid-a"]
    assert release["spec"] == legacy["spec"] and "status" not in release


def test_its_creator_resizes_it_and_drops_the_references_an_older_operator_left():
    mine = _claim("a")
    [grown] = plan([_wanted_by("a", storage="50Gi")], {KEY: mine}, "uid-a").apply
    assert grown["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert plan([_wanted_by("a")], {KEY: mine}, "uid-a").apply == []  # as it is: nothing to do
    assert plan([_wanted_by("a", storage="1Gi")], {KEY: mine}, "uid-a").apply == []  # never shrunk
    # Labelled by an older operator, owned by a and b: a takes it as its own, annotated, with no owner reference.
    legacy = _claim("a", ("a", "uid-a"), ("b", "uid-b"), legacy=True)
    [taken] = plan([_wanted_by("a")], {KEY: legacy}, "uid-a").apply
    assert taken["metadata"]["annotations"][ANNOTATION_CREATED_BY] == "ns/a"
    assert "ownerReferences" not in taken["metadata"]


def test_a_claim_is_never_pruned():
    """Size removed (the claim leaves the desired set), or the service names another claim: kept."""
    assert plan([], {KEY: _claim("a")}, "uid-a").apply == []
    assert plan([], {KEY: _claim("a")}, "uid-a").prune == []
    # One an older operator owned through this service: its reference goes, the claim stays.
    todo = plan([], {KEY: _claim("a", ("a", "uid-a"), legacy=True)}, "uid-a")
    assert todo.prune == [] and [e[1] for e in todo.events] == ["ClaimReleased"]
    [release] = todo.apply
    assert "ownerReferences" not in release["metadata"] and release["metadata"]["labels"][LABEL_SERVICE] == "a"


def test_released_claim():
    shared = _claim("a", ("a", "uid-a"), ("b", "uid-b"))
    assert [r["uid"] for r in released_claim(shared, "uid-a")["metadata"]["ownerReferences"]] == ["uid-b"]
    assert released_claim(_claim("b", ("b", "uid-b")), "uid-a") is None  # no reference of ours: nothing to do
    assert released_claim(_claim("a"), "uid-a") is None


def test_names_claim():
    assert names_claim(_spec(), "weights")
    assert not names_claim(_spec(), "weights-2") and not names_claim(SPEC, "weights")
    assert names_claim({"model": {"uri": "pvc://weights/llama"}}, "weights")
    assert not names_claim({"model": {"uri": "pvc://weights-2/llama"}}, "weights")
    pod_volume = {"pod": {"volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "weights"}}]}}
    assert names_claim(pod_volume, "weights")
    assert names_claim({"lora": {"adapters": [{"name": "x", "source": "pvc://weights"}]}}, "weights")


def test_reclaimable():
    delete = _claim("a", policy="Delete")
    assert reclaimable([delete], {}) == [delete]  # its creator gone, nobody names it
    assert reclaimable([delete], {"a": SPEC}) == []  # its creator is still there (even naming another claim)
    assert reclaimable([delete], {"b": _spec()}) == []  # another service still uses it
    assert reclaimable([delete], {"b": SPEC}) == [delete]
    assert reclaimable([_claim("a", policy="Retain")], {}) == []
    assert reclaimable([_claim("a", legacy=True)], {}) == []  # no policy recorded: Retain
    assert reclaimable([_claim(None)], {}) == []  # not the operator's
    going = _claim("a", policy="Delete")
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert reclaimable([going], {}) == []


def test_used_as_it_is_says_whose_claim_it_is():
    assert "not created by the operator" in used_as_it_is("weights", None)
    assert "created by InferenceService ns/a (reclaimPolicy Retain)" in used_as_it_is("weights", _claim("a"))


# --- the store ----------------------------------------------------------------------------------------------


def test_the_store_files_a_claim_under_its_label_and_finds_it_by_name():
    changes: list[tuple[str, str]] = []
    store = Store(lambda ns, name, full: changes.append((ns, name)))
    store.put(_claim("a", rv="1"))
    assert store.find(*KEY[:1], "ns", "weights").owner == "a"
    changes.clear()
    store.put(_claim("b", rv="2"))  # relabelled by hand: it moves, and both services hear of it
    assert set(changes) == {("ns", "a"), ("ns", "b")}
    assert store.find("PersistentVolumeClaim", "ns", "weights").owner == "b"
    store.put(_claim("a", rv="1"))  # an older event arriving late changes nothing
    assert store.find("PersistentVolumeClaim", "ns", "weights").owner == "b"
    store.put(_claim(None, rv="3"))  # an unlabelled claim is never stored
    store.delete(_claim("b", rv="4"))
    assert store.find("PersistentVolumeClaim", "ns", "weights") is None and store.count()["children"] == 0


def test_a_service_sees_a_claim_filed_under_another():
    found = {KEY: _claim("a")}
    observed = with_shared_claims({}, [_wanted_by("b")], lambda kind, name: found.get((kind, name)))
    assert observed[KEY]["metadata"]["labels"][LABEL_SERVICE] == "a"
    assert with_shared_claims({}, [], lambda kind, name: found.get((kind, name))) == {}


# --- through the controller ---------------------------------------------------------------------------------


def test_created_once_kept_when_size_is_removed_and_created_again_when_deleted_by_hand():
    spec = _spec(size="10Gi")
    api, ctrl = with_controller(spec)
    sync(ctrl)
    claim = api.objects[KEY]
    assert claim["metadata"]["annotations"][ANNOTATION_CREATED_BY] == f"{NS}/{NAME}"
    assert "ownerReferences" not in claim["metadata"] and len(_reasons(api, "ClaimCreated")) == 1
    sync(ctrl, full=True)
    assert api.calls["create"] == 1 + len(api.events)  # the resync creates nothing more (only Events)
    del spec["modelCache"]["persistentVolumeClaim"]["size"]
    api.put_service(spec, generation=2)
    sync(ctrl)
    sync(ctrl, full=True)
    assert api.objects[KEY] == claim and api.calls["delete"] == 0
    # Deleted by hand while the spec asks the operator to create it: its watch event brings it back at once.
    api.put_service(_spec(size="10Gi"), generation=3)
    sync(ctrl)
    asyncio.run(api.delete(api.objects[KEY]))
    assert KEY not in api.objects
    sync(ctrl)
    assert KEY in api.objects


def test_an_existing_claim_is_never_adopted_and_that_is_told_once():
    api, ctrl = with_controller(_spec(size="50Gi", reclaimPolicy="Delete"))
    foreign = _claim(None)
    api.objects[KEY] = copy.deepcopy(foreign)  # made by hand: unlabelled, so the caches never see it
    sync(ctrl)
    sync(ctrl, full=True)
    sync(ctrl, full=True)
    assert api.objects[KEY] == foreign  # not patched, no owner reference, no annotation
    [told] = _reasons(api, "ClaimExists")
    assert "not created by the operator" in told
    gone = api.objects.pop(("InferenceService", NAME))
    ctrl.store.delete(gone)
    sync(ctrl)
    assert api.objects[KEY] == foreign and api.calls["delete"] == 0


def _delete_service(api: FakeApi, ctrl: Controller) -> None:
    gone = api.objects.pop(("InferenceService", NAME))
    ctrl.store.delete(gone)
    sync(ctrl)  # the key finds its service gone


def _other_service(ctrl: Controller, name: str, spec: dict[str, Any]) -> None:
    ctrl.store.put({"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService",
                    "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "resourceVersion": "1"},
                    "spec": spec})  # fmt: skip


def test_delete_policy_deletes_the_claim_once_its_creator_is_gone_and_no_one_names_it():
    api, ctrl = with_controller(_spec(size="10Gi", reclaimPolicy="Delete"))
    sync(ctrl)
    _other_service(ctrl, "other", _spec())  # shares the claim (no size: it never creates nor changes it)
    _delete_service(api, ctrl)
    assert KEY in api.objects  # still named by "other"
    ctrl.store.delete({"kind": "InferenceService", "metadata": {"name": "other", "namespace": NS}})
    asyncio.run(ctrl.services.sync((NS, "other")))
    assert KEY not in api.objects


def test_retain_keeps_the_claim_after_every_service_is_gone():
    api, ctrl = with_controller(_spec(size="10Gi"))
    sync(ctrl)
    _delete_service(api, ctrl)
    assert KEY in api.objects and api.calls["delete"] == 0


def test_a_delete_claim_whose_creator_went_while_the_operator_was_down_goes_at_start():
    """A fresh controller lists the orphaned claim: its creator's key is synced, finds it gone, reclaims."""
    api, ctrl = with_controller(_spec(size="10Gi", reclaimPolicy="Delete"))
    sync(ctrl)
    restarted = FakeApi()
    restarted.objects[KEY] = api.objects[KEY]  # the service was deleted while no operator ran
    fresh = Controller(restarted, ctrl.options, [NS])  # type: ignore[arg-type]
    restarted.store = fresh.store
    fresh.store.put(copy.deepcopy(restarted.objects[KEY]))  # the initial list
    asyncio.run(fresh.services.sync((NS, NAME)))
    assert KEY not in restarted.objects
