"""The controller's reconcile against an in-memory API server and cache: what it writes, when, and the
conditions it reports (Ready only on the current template, kept during a serving rollout)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from fake_api import NAME, NS, SPEC, FakeApi, with_controller

from tidepool.operator.api import InferenceServiceSpec
from tidepool.operator.autoscaler.handlers import Autoscaler
from tidepool.operator.controller import Controller
from tidepool.operator.reconcile import contains, plan

KEY = (NS, NAME)


def sync(ctrl: Controller, full: bool = False) -> None:
    asyncio.run(ctrl.services.sync(KEY, full))


def pods_ready(api: FakeApi, workload: str, pool: str, count: int, prefix: str = "p") -> None:
    for i in range(count):
        api.add_pod(f"{workload}-{prefix}{i}", pool, api.hash_of(workload))


def test_create_then_ready_then_nothing_to_write():
    api, ctrl = with_controller()
    sync(ctrl)
    kinds = sorted(k for k, _ in api.objects if k not in ("InferenceService",))
    assert "Deployment" in kinds and "Service" in kinds and api.calls["apply"] == len(kinds)
    assert [e["reason"] for e in api.events] == ["Created"]
    status = api.service()["status"]
    assert status["observedGeneration"] == 1
    assert api.condition("Ready")["status"] == "False" and api.condition("Progressing")["status"] == "True"

    pods_ready(api, f"{NAME}-unified", "unified", 2)
    pods_ready(api, f"{NAME}-router", "router", 2)  # router.replicas defaults to 2
    applies = api.calls["apply"]
    sync(ctrl)
    assert api.calls["apply"] == applies  # the fast path: pods changed, nothing to apply
    ready = api.condition("Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == 1 and ready["reason"] == "MinimumReplicasReady"
    assert api.condition("Progressing")["status"] == "False"
    assert api.service()["status"]["pools"]["unified"] == {
        "replicas": 2,
        "readyReplicas": 2,
        "updatedReplicas": 2,
        "desiredReplicas": 2,
    }

    writes = sum(api.calls.values())
    sync(ctrl)
    sync(ctrl, full=True)  # the resync compares every child: quantities 0.5 / 1024Mi still match
    assert sum(api.calls.values()) == writes, api.calls


def test_ready_needs_the_current_template_and_is_kept_while_the_old_one_serves():
    api, ctrl = with_controller()
    sync(ctrl)
    pods_ready(api, f"{NAME}-unified", "unified", 2, prefix="old")
    pods_ready(api, f"{NAME}-router", "router", 2)  # router.replicas defaults to 2
    sync(ctrl)
    assert api.condition("Ready")["status"] == "True"

    spec = copy.deepcopy(SPEC)
    spec["engine"] = {"maxNumSeqs": 64}
    api.put_service(spec, generation=2)
    sync(ctrl)
    assert "RollingOut" in [e["reason"] for e in api.events]
    status = api.service()["status"]
    assert status["observedGeneration"] == 2  # the new template is applied
    ready = api.condition("Ready")
    # Still serving on generation 1's pods: Ready stays True, but about generation 1 (kubectl wait waits).
    assert ready["status"] == "True" and ready["observedGeneration"] == 1 and ready["reason"] == "ServingPreviousSpec"
    progressing = api.condition("Progressing")
    assert progressing["status"] == "True" and progressing["reason"] == "RollingOut"

    api.add_pod(f"{NAME}-unified-new0", "unified", api.hash_of(f"{NAME}-unified"), ready=False)
    sync(ctrl)
    assert api.condition("Ready")["observedGeneration"] == 1  # a new pod exists but is not ready

    api.add_pod(f"{NAME}-unified-new0", "unified", api.hash_of(f"{NAME}-unified"))
    sync(ctrl)
    ready = api.condition("Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == 2  # minReplicas 1 serves the new spec
    assert api.condition("Progressing")["status"] == "True"  # one old pod still to replace
    for name in (f"{NAME}-unified-old0", f"{NAME}-unified-old1"):
        api.remove_pod(name)
    api.add_pod(f"{NAME}-unified-new1", "unified", api.hash_of(f"{NAME}-unified"))
    sync(ctrl)
    assert api.condition("Progressing")["status"] == "False"


def test_not_serving_is_not_ready_and_unschedulable_pods_limit_scaling():
    api, ctrl = with_controller()
    sync(ctrl)
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes: gpu"}
    api.add_pod(f"{NAME}-unified-x", "unified", api.hash_of(f"{NAME}-unified"), ready=False, conditions=[unschedulable])
    sync(ctrl)
    ready, limited = api.condition("Ready"), api.condition("ScalingLimited")
    assert ready["status"] == "False" and ready["reason"] == "Unschedulable" and ready["observedGeneration"] == 1
    assert limited["status"] == "True" and "0/2 nodes: gpu" in limited["message"]


def test_hand_edits_are_reverted_by_the_next_event_or_resync():
    api, ctrl = with_controller()
    sync(ctrl)
    deploy = api.objects[("Deployment", f"{NAME}-unified")]
    deploy["spec"]["replicas"] = 7  # kubectl scale: generation moves, the watch delivers it
    deploy["metadata"]["generation"] += 1
    api._bump(deploy)
    api.store.put(copy.deepcopy(deploy))
    sync(ctrl)
    assert api.objects[("Deployment", f"{NAME}-unified")]["spec"]["replicas"] == 2
    assert "Scaled" in [e["reason"] for e in api.events]
    del api.objects[("RoleBinding", f"{NAME}-router")]
    api.store.delete({"kind": "RoleBinding", "metadata": {"namespace": NS, "name": f"{NAME}-router",
                      "labels": {"tidepool.dev/inferenceservice": NAME}}})  # fmt: skip
    sync(ctrl)
    assert ("RoleBinding", f"{NAME}-router") in api.objects


def test_edits_landing_while_a_reconcile_applies_are_reverted_by_the_next_one():
    """A hand edit or delete whose watch event arrives while a reconcile awaits its writes is not taken
    as verified: the next (event-triggered, not full) reconcile compares and repairs it."""
    api, ctrl = with_controller()
    sync(ctrl)
    role_key, pdb_key = ("RoleBinding", f"{NAME}-router"), ("PodDisruptionBudget", f"{NAME}-unified")
    wanted = copy.deepcopy(api.objects[role_key]["subjects"])
    assert pdb_key in api.objects
    deploy = api.objects[("Deployment", f"{NAME}-unified")]
    deploy["spec"]["replicas"] = 4  # the drift this reconcile repairs...
    deploy["metadata"]["generation"] += 1
    api._bump(deploy)
    api.store.put(copy.deepcopy(deploy))
    real_apply = api.apply
    edited: list[bool] = []

    async def apply_racing_a_hand_edit(obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
        if not edited:  # ...while two more edits arrive through the watch
            edited.append(True)
            role = api.objects[role_key]
            role["subjects"] = []
            api._bump(role)
            api.store.put(copy.deepcopy(role))
            pdb = api.objects.pop(pdb_key)
            api.store.delete({"kind": pdb["kind"], "metadata": pdb["metadata"]})
        return await real_apply(obj, force)

    api.apply = apply_racing_a_hand_edit  # type: ignore[method-assign]
    sync(ctrl)
    assert edited and api.objects[("Deployment", f"{NAME}-unified")]["spec"]["replicas"] == 2
    api.apply = real_apply  # type: ignore[method-assign]
    sync(ctrl)  # the edits' events queued the key again: not a full resync
    assert api.objects[role_key]["subjects"] == wanted
    assert pdb_key in api.objects


def test_mode_switch_keeps_the_old_pool_until_the_new_pools_serve():
    api, ctrl = with_controller()
    sync(ctrl)
    pods_ready(api, f"{NAME}-unified", "unified", 2)
    pods_ready(api, f"{NAME}-router", "router", 2)  # router.replicas defaults to 2
    sync(ctrl)
    spec = copy.deepcopy(SPEC)
    spec["mode"] = "disaggregated"
    spec["pools"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    api.put_service(spec, generation=2)
    sync(ctrl)
    assert ("Deployment", f"{NAME}-prefill") in api.objects and ("Deployment", f"{NAME}-decode") in api.objects
    assert ("Deployment", f"{NAME}-unified") in api.objects  # make before break
    assert api.calls["delete"] == 0

    def router_args() -> list[str]:
        return api.objects[("Deployment", f"{NAME}-router")]["spec"]["template"]["spec"]["containers"][0]["args"]

    assert f"--unified-service={NAME}-unified" in " ".join(router_args()).replace(" ", "=")  # still the old pool
    ready = api.condition("Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == 1  # the old pool and router serve
    pods_ready(api, f"{NAME}-prefill", "prefill", 1)
    sync(ctrl)
    assert ("Deployment", f"{NAME}-unified") in api.objects  # decode does not serve yet
    pods_ready(api, f"{NAME}-decode", "decode", 1)
    sync(ctrl)  # the new pools serve: now the router switches to them; the old pool stays until it has
    assert "--decode-service" in router_args() and ("Deployment", f"{NAME}-unified") in api.objects
    api.add_pod(f"{NAME}-router-new", "router", api.hash_of(f"{NAME}-router"))
    sync(ctrl)
    assert ("Deployment", f"{NAME}-unified") not in api.objects
    assert ("Service", f"{NAME}-unified") not in api.objects
    assert "Pruned" in [e["reason"] for e in api.events]


def test_invalid_spec_reports_once_and_applies_nothing():
    bad = {**SPEC, "model": {"uri": "file:///host/models"}}
    api, ctrl = with_controller(bad)
    sync(ctrl)
    sync(ctrl)
    assert api.calls["apply"] == 0
    degraded = api.condition("Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert [e["reason"] for e in api.events] == ["InvalidSpec"]
    # Nothing applied, yet generation 1 is observed and Stalled: kstatus reads Failed (not InProgress forever).
    assert api.service()["status"]["observedGeneration"] == 1
    assert (api.condition("Stalled")["status"], api.condition("Stalled")["reason"]) == ("True", "InvalidSpec")
    assert api.condition("Reconciling")["status"] == "False"


def test_refused_apply_is_degraded_and_keeps_the_old_generation():
    api, ctrl = with_controller()
    api.fail_apply = {"Deployment"}
    with pytest.raises(Exception, match="admission refused"):
        sync(ctrl)
    degraded = api.condition("Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ApplyFailed"
    assert api.service()["status"]["observedGeneration"] == 1  # observed, and Stalled says why it cannot serve
    assert (api.condition("Stalled")["status"], api.condition("Stalled")["reason"]) == ("True", "ApplyFailed")
    assert [e["reason"] for e in api.events][-1] == "ApplyFailed"


def test_autoscaler_replicas_come_from_status_and_survive_a_restart():
    spec = copy.deepcopy(SPEC)
    spec["autoscaling"] = {"enabled": True}
    api, ctrl = with_controller(spec)
    api.service()["status"] = {
        "autoscaling": {"mode": "active", "pools": {"unified": {"desiredReplicas": 3}}, "limited": "capped at 3"}
    }
    api.put_service(spec)
    ctrl.services.autoscaler = None  # no tick: only what status holds matters
    sync(ctrl)
    assert api.objects[("Deployment", f"{NAME}-unified")]["spec"]["replicas"] == 3  # not the spec's 2
    assert api.service()["status"]["pools"]["unified"]["desiredReplicas"] == 3
    assert api.condition("ScalingLimited")["reason"] == "CapacityOrBounds"


def test_legacy_finalizer_is_removed_so_deletes_never_wait():
    api, ctrl = with_controller(finalizers=["tidepool.dev/finalizer"], annotations={"tidepool.dev/create": "{}"})
    sync(ctrl)
    meta = api.service()["metadata"]
    assert not meta.get("finalizers") and "tidepool.dev/create" not in meta.get("annotations", {})


def test_status_write_is_conditional_on_the_resource_version():
    api, ctrl = with_controller()
    api.conflict_next_status = True
    with pytest.raises(Exception, match="409"):
        sync(ctrl)
    sync(ctrl)  # the retry reads the fresh object and succeeds
    assert api.service()["status"]["observedGeneration"] == 1


@pytest.mark.parametrize(
    ("observed", "desired", "expected"),
    [
        ({"a": 1, "b": {"c": "x", "d": 2}}, {"b": {"c": "x"}}, True),  # server defaults ignored
        ({"a": 1}, {"a": 2}, False),
        ({"a": "1"}, {"a": 1}, True),  # IntOrString
        ({"a": [1, 2]}, {"a": [1]}, False),  # list length is ours
        ({"a": [{"x": 1, "y": 2}]}, {"a": [{"x": 1}]}, True),
        ({"a": True}, {"a": "True"}, False),
        ({}, {"a": None}, False),
        ({"requests": {"cpu": "500m", "memory": "1Gi"}}, {"requests": {"cpu": "0.5", "memory": "1024Mi"}}, True),
        ({"limits": {"cpu": "500m"}}, {"limits": {"cpu": "0.6"}}, False),
        ({"emptyDir": {"sizeLimit": "1Gi"}}, {"emptyDir": {"sizeLimit": "1024Mi"}}, True),
        ({"env": [{"value": "1k"}]}, {"env": [{"value": "1000"}]}, False),  # not a quantity field
    ],
)
def test_contains(observed, desired, expected):
    assert contains(observed, desired) is expected


def test_plan_events():
    dep = {
        "kind": "Deployment",
        "metadata": {"name": "d", "labels": {"tidepool.dev/spec-hash": "a"}},
        "spec": {"replicas": 1},
    }
    changed = copy.deepcopy(dep)
    changed["metadata"]["labels"]["tidepool.dev/spec-hash"] = "b"
    changed["spec"]["replicas"] = 2
    todo = plan([changed], {("Deployment", "d"): dep})
    assert [e[1] for e in todo.events] == ["Scaled", "RollingOut"]
    assert plan([dep], {("Deployment", "d"): dep}).apply == []


def _claim(storage: str, status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    claim = {
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "weights"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": storage}}, **spec},
    }
    if status is not None:
        claim["status"] = status
    return claim


def _warnings(todo) -> list[str]:
    return [e[2] for e in todo.events if e[:2] == ("Warning", "ClaimKept")]


def test_a_claim_keeps_what_kubernetes_cannot_change_and_says_so():
    key = ("PersistentVolumeClaim", "weights")
    bound = {"phase": "Bound", "capacity": {"storage": "100Gi"}}
    existing = _claim("40Gi", bound, storageClassName="fast", volumeMode="Filesystem")
    # Growing a bound claim past what its volume holds is applied, without a Warning.
    [grown] = plan([_claim("200Gi")], {key: existing}).apply
    assert grown["spec"]["resources"]["requests"]["storage"] == "200Gi"
    # ... and the fixed fields go along as they are: an apply leaving out a field this operator set would remove it.
    assert grown["spec"]["storageClassName"] == "fast" and grown["spec"]["volumeMode"] == "Filesystem"
    assert not _warnings(plan([_claim("200Gi")], {key: existing}))
    # Growing within what the volume already holds needs no resize (a static volume could not resize at all).
    assert plan([_claim("60Gi")], {key: existing}).apply == []
    # Shrinking is never applied (the API server would refuse it at every reconcile): a Warning says so.
    smaller = plan([_claim("1Ki")], {key: existing})
    assert smaller.apply == [] and len(_warnings(smaller)) == 1
    assert "40Gi" in _warnings(smaller)[0] and "cannot shrink" in _warnings(smaller)[0]
    # A claim still Pending cannot be resized at all.
    pending = plan([_claim("60Gi")], {key: _claim("40Gi", {"phase": "Pending"})})
    assert pending.apply == [] and "until it is bound" in _warnings(pending)[0]
    # Fixed fields keep their value; a change to another field is still applied, with the kept ones.
    changed = _claim("300Gi", accessModes=["ReadWriteOnce"], storageClassName="slow")
    todo = plan([changed], {key: existing})
    [applied] = todo.apply
    assert applied["spec"]["accessModes"] == ["ReadWriteMany"] and applied["spec"]["storageClassName"] == "fast"
    assert applied["spec"]["resources"]["requests"]["storage"] == "300Gi"
    assert "accessModes" in _warnings(todo)[0] and "storageClassName fast" in _warnings(todo)[0]
    assert changed["spec"]["accessModes"] == ["ReadWriteOnce"]  # the desired object itself is left as built
    # A claim that does not exist yet is created as the spec says (created, never applied: claims.py).
    new = plan([_claim("1Ki")], {})
    assert new.apply == [] and [c["spec"]["resources"]["requests"]["storage"] for c in new.claims] == ["1Ki"]


def test_claim_kept_is_told_once_while_it_lasts():
    spec = copy.deepcopy(SPEC)
    spec["modelCache"] = {"persistentVolumeClaim": {"claimName": "weights", "size": "40Gi"}}
    api, ctrl = with_controller(spec)
    sync(ctrl)
    told: list[str] = []  # what the sync tells; the recorder aggregates it into Event objects (test_events.py)
    recorder_post = ctrl.services.events.post

    async def post(obj: Any, type_: str, reason: str, message: str, key: str | None = None) -> None:
        told.append(reason)
        await recorder_post(obj, type_, reason, message, key)

    ctrl.services.events.post = post  # type: ignore[method-assign]

    def kept() -> int:
        return told.count("ClaimKept")

    def resize(size: str, generation: int) -> None:
        spec["modelCache"]["persistentVolumeClaim"]["size"] = size
        api.put_service(spec, generation=generation)
        sync(ctrl)

    resize("10Gi", 2)  # a claim cannot shrink: kept at 40Gi, and said
    assert kept() == 1
    sync(ctrl, full=True)  # the resync finds the same: nothing new to tell
    sync(ctrl, full=True)
    assert kept() == 1
    resize("40Gi", 3)  # the spec matches the claim again
    resize("10Gi", 4)  # ... and asks to shrink it again: told again
    assert kept() == 2
    assert sum(e["reason"] == "ClaimKept" for e in api.events) == 1  # one Event object, its count held back
    assert api.objects[("PersistentVolumeClaim", "weights")]["spec"]["resources"]["requests"]["storage"] == "40Gi"


class NoMetrics:
    """A metrics source with nothing to report (the autoscaler holds, and writes its status)."""

    async def fetch(self, namespace: str, name: str, pools: Any) -> dict[str, Any]:
        return {}


def test_an_autoscaled_sync_parses_the_spec_once(monkeypatch: pytest.MonkeyPatch):
    """One ServiceView per sync, handed to the autoscaler and the builders: nobody validates the spec again."""
    spec = copy.deepcopy(SPEC)
    spec["autoscaling"] = {"enabled": True}
    api, ctrl = with_controller(spec)
    ctrl.services.autoscaler = Autoscaler(api, ctrl.store.pods_in, ctrl.events.post, NoMetrics(), 15.0, 60.0)
    sync(ctrl, full=True)  # warm: children exist
    assert api.service()["status"]["autoscaling"]["mode"] == "active"  # the autoscaler ticked
    ctrl.services.states[KEY].autoscale.next_tick = 0.0  # and ticks again in the sync below
    parsed: list[Any] = []
    original = InferenceServiceSpec.model_validate

    def counting(*args: Any, **kwargs: Any) -> Any:
        parsed.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(InferenceServiceSpec, "model_validate", counting)
    sync(ctrl, full=True)
    assert parsed == []  # the same spec as the last sync's: its view is reused, not validated again
    spec["engine"] = {"maxNumSeqs": 64}
    api.put_service(spec, generation=2)
    ctrl.services.states[KEY].autoscale.next_tick = 0.0
    sync(ctrl, full=True)
    assert len(parsed) == 1  # a new spec: parsed once, for the autoscaler and the builders alike
    assert ctrl.services.states[KEY].verified is not None
    assert api.service()["status"]["observedGeneration"] == 2


def test_a_service_has_one_state_from_first_sight_until_it_is_gone():
    api, ctrl = with_controller()
    assert KEY not in ctrl.services.states
    sync(ctrl)
    state = ctrl.services.states[KEY]
    assert state.verified is not None and state.resync_due is not None and state.status_written_at is not None
    sync(ctrl)
    assert ctrl.services.states[KEY] is state  # the same object for the service's whole life
    api.store.delete(api.objects.pop(("InferenceService", NAME)))
    sync(ctrl)
    assert KEY not in ctrl.services.states and not ctrl.services.is_known(KEY)
