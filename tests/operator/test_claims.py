"""Cache claims in the plan (operator/claims.py) and in the store: kept fields, sharing, release."""

from __future__ import annotations

from typing import Any

from tidepool.operator.builders import LABEL_SERVICE
from tidepool.operator.cache import Store
from tidepool.operator.claims import released_claim, shared_claim, with_shared_claims
from tidepool.operator.reconcile import plan

KEY = ("PersistentVolumeClaim", "weights")


def _ref(name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "name": name, "uid": uid,
            "controller": False}  # fmt: skip


def _claim(service: str, *owners: tuple[str, str], rv: str = "1") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": "weights",
            "namespace": "ns",
            "resourceVersion": rv,
            "labels": {LABEL_SERVICE: service, "app.kubernetes.io/managed-by": "tidepool-operator"},
            "ownerReferences": [_ref(*o) for o in owners],
        },
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "5Gi"}}},
        "status": {"phase": "Bound", "capacity": {"storage": "5Gi"}},
    }


def test_a_second_service_joins_the_claim_without_taking_it_over():
    existing = _claim("a", ("a", "uid-a"))
    wanted_by_b = _claim("b", ("b", "uid-b"))
    del wanted_by_b["status"]
    joined = shared_claim(wanted_by_b, existing)
    assert joined["metadata"]["labels"][LABEL_SERVICE] == "a"  # filed where the caches have it
    assert [r["uid"] for r in joined["metadata"]["ownerReferences"]] == ["uid-a", "uid-b"]
    [applied] = plan([wanted_by_b], {KEY: existing}, "uid-b").apply
    assert [r["uid"] for r in applied["metadata"]["ownerReferences"]] == ["uid-a", "uid-b"]
    # Once b is an owner, nothing is left to apply: no service takes the claim back and forth.
    after = _claim("a", ("a", "uid-a"), ("b", "uid-b"))
    assert plan([wanted_by_b], {KEY: after}, "uid-b").apply == []
    assert plan([_claim("a", ("a", "uid-a"))], {KEY: after}, "uid-a").apply == []


def test_a_claim_others_own_is_released_not_deleted():
    shared = _claim("a", ("a", "uid-a"), ("b", "uid-b"))
    todo = plan([], {KEY: shared}, "uid-a")
    assert todo.prune == []
    [release] = todo.apply
    assert [r["uid"] for r in release["metadata"]["ownerReferences"]] == ["uid-b"]
    assert release["spec"] == shared["spec"] and "status" not in release
    assert [e[1] for e in todo.events] == ["ClaimReleased"]
    # Its last owner deletes it (through the prune, as any child).
    alone = _claim("a", ("a", "uid-a"))
    assert released_claim(alone, "uid-a") is None
    assert plan([], {KEY: alone}, "uid-a").prune == [alone]
    # A claim this service does not own is never touched.
    assert released_claim(_claim("b", ("b", "uid-b")), "uid-a") is None


def test_the_store_files_a_child_under_its_label_and_finds_it_by_name():
    changes: list[tuple[str, str]] = []
    store = Store(lambda ns, name, full: changes.append((ns, name)))
    store.put(_claim("a", ("a", "uid-a"), rv="1"))
    assert store.find(*KEY[:1], "ns", "weights").owner == "a"
    # Relabelled (by hand, or by an older operator): it moves, and both services hear of it.
    changes.clear()
    store.put(_claim("b", ("a", "uid-a"), rv="2"))
    assert set(changes) == {("ns", "a"), ("ns", "b")}
    assert store.children_of(("ns", "a"), "uid-a") == {} and KEY in store.children_of(("ns", "b"), "uid-a")
    assert store.find("PersistentVolumeClaim", "ns", "weights").owner == "b"
    store.put(_claim("a", ("a", "uid-a"), rv="1"))  # an older event arriving late changes nothing
    assert store.find("PersistentVolumeClaim", "ns", "weights").owner == "b"
    store.delete(_claim("b", ("a", "uid-a"), rv="3"))
    assert store.find("PersistentVolumeClaim", "ns", "weights") is None and store.count()["children"] == 0


def test_every_service_that_owns_a_shared_claim_hears_of_it():
    """The claim is filed under its creator's label; the other owners are woken for a full reconcile (their
    fast path does not see a child filed under another service), on every change and on its deletion."""
    changes: list[tuple[str, str, bool]] = []
    store = Store(lambda ns, name, full: changes.append((ns, name, full)))
    store.put(_claim("a", ("a", "uid-a"), ("b", "uid-b"), ("c", "uid-c"), rv="1"))
    assert changes == [("ns", "a", False), ("ns", "b", True), ("ns", "c", True)]
    changes.clear()
    store.put(_claim("a", ("a", "uid-a"), ("b", "uid-b"), rv="2"))  # c released it: c hears of that too
    assert changes == [("ns", "a", False), ("ns", "b", True), ("ns", "c", True)]
    changes.clear()
    store.put(_claim("a", ("b", "uid-b"), rv="3"))  # its creator released it: b owns it alone
    assert changes == [("ns", "a", False), ("ns", "b", True)]
    changes.clear()
    store.delete(_claim("a", ("b", "uid-b"), rv="4"))  # deleted by hand: b must create it again
    assert changes == [("ns", "a", False), ("ns", "b", True)]
    changes.clear()
    store.put(_claim("a", ("a", "uid-a"), rv="5"))  # a claim nobody shares wakes its service only
    assert changes == [("ns", "a", False)]


def test_a_service_sees_a_claim_filed_under_another():
    found = {KEY: _claim("a", ("a", "uid-a"))}
    observed = with_shared_claims({}, [_claim("b", ("b", "uid-b"))], lambda kind, name: found.get((kind, name)))
    assert observed[KEY]["metadata"]["labels"][LABEL_SERVICE] == "a"
    assert with_shared_claims({}, [], lambda kind, name: found.get((kind, name))) == {}
