"""The pause annotation, the rollout budget and the recorded operator defaults, wired into the controller's
sync (operator/sync.py + operator/rollout.py), against the in-memory API server of fake_api.py."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from pathlib import Path
from typing import Any

import yaml
from fake_api import NAME, NS, SPEC, FakeApi, with_controller

from tidepool.operator.controller import Controller
from tidepool.operator.main import build_parser, main
from tidepool.operator.rollout import PAUSED_ANNOTATION
from tidepool.operator.sync import ControllerOptions

KEY = (NS, NAME)
OTHER = (NS, "other")
ENGINE, ROUTER = f"{NAME}-unified", f"{NAME}-router"


def sync(ctrl: Controller, full: bool = False) -> None:
    asyncio.run(ctrl.services.sync(KEY, full))


def settle(api: FakeApi, workload: str, pool: str, prefix: str) -> None:
    """What the Deployment controller and the kubelet do: every replica on the current template, ready."""
    obj = api.objects[("Deployment", workload)]
    replicas = obj["spec"]["replicas"]
    for name in [n for k, n in api.objects if k == "Pod" and n.startswith(workload)]:
        api.remove_pod(name)
    for i in range(replicas):
        api.add_pod(f"{workload}-{prefix}{i}", pool, api.hash_of(workload))
    obj["status"] = {
        "observedGeneration": obj["metadata"]["generation"],
        **dict.fromkeys(("replicas", "updatedReplicas", "readyReplicas", "availableReplicas"), replicas),
    }
    api._bump(obj)
    api._echo(obj)


def ready_service(api: FakeApi, ctrl: Controller, prefix: str = "a") -> None:
    sync(ctrl)
    settle(api, ENGINE, "unified", prefix)
    settle(api, ROUTER, "router", prefix)
    sync(ctrl)
    assert api.condition("Ready")["status"] == "True"


def with_image(image: str, replicas: int | None = None) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["engine"] = {"image": image}
    if replicas is not None:
        spec["pools"]["unified"]["replicas"] = replicas
    return spec


def image_of(api: FakeApi, workload: str) -> str:
    return api.objects[("Deployment", workload)]["spec"]["template"]["spec"]["containers"][0]["image"]


def reasons(api: FakeApi) -> list[str]:
    return [e["reason"] for e in api.events]


def test_pause_applies_nothing_says_paused_and_resumes():
    api, ctrl = with_controller()
    ready_service(api, ctrl)
    applies = api.calls["apply"]
    api.put_service(with_image("example.com/engine:2"), generation=2, annotations={PAUSED_ANNOTATION: "true"})
    sync(ctrl)
    sync(ctrl, full=True)
    assert api.calls["apply"] == applies and api.calls["delete"] == 0
    progressing = api.condition("Progressing")
    assert (progressing["status"], progressing["reason"]) == ("Unknown", "Paused")
    assert "Deployment/svc-unified" in progressing["message"] and PAUSED_ANNOTATION in progressing["message"]
    assert api.service()["status"]["observedGeneration"] == 1  # generation 2 is not applied
    assert api.condition("Ready")["status"] == "True"  # still observed: serving the earlier spec
    assert reasons(api).count("Paused") == 1
    api.put_service(with_image("example.com/engine:2"), generation=2)  # the annotation removed: resume
    sync(ctrl)
    assert image_of(api, ENGINE) == "example.com/engine:2"
    assert api.service()["status"]["observedGeneration"] == 2
    assert api.condition("Progressing")["reason"] != "Paused"


def test_a_paused_new_service_creates_nothing():
    api, ctrl = with_controller(annotations={PAUSED_ANNOTATION: "true"})
    sync(ctrl)
    assert api.calls["apply"] == 0 and api.condition("Progressing")["reason"] == "Paused"


def test_without_a_slot_the_rollout_waits_scaling_does_not_and_a_freed_slot_starts_it():
    api, ctrl = with_controller()
    ready_service(api, ctrl)
    budget = ctrl.services.budget
    assert budget.limit == ctrl.options.max_concurrent_rollouts > 0
    budget.limit = 1
    assert budget.admit(OTHER, "t", 0).go  # another service rolls out
    old_image = image_of(api, ENGINE)
    api.put_service(with_image("example.com/engine:2", replicas=3), generation=2)
    sync(ctrl)
    assert image_of(api, ENGINE) == old_image  # held
    assert api.objects[("Deployment", ENGINE)]["spec"]["replicas"] == 3  # scaling never waits
    progressing = api.condition("Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "RolloutQueued")
    assert "at most 1" in progressing["message"] and "ns/other" in progressing["message"]
    assert api.service()["status"]["observedGeneration"] == 1
    sync(ctrl)  # still waiting: told once
    assert reasons(api).count("RolloutQueued") == 1 and "RollingOut" not in reasons(api)

    assert budget.observe(OTHER, "t", in_flight=False, finished=True, stalled=False, now=1) == [KEY]
    sync(ctrl)
    assert image_of(api, ENGINE) == "example.com/engine:2" and KEY in budget.rolling
    assert api.service()["status"]["observedGeneration"] == 2 and "RollingOut" in reasons(api)
    settle(api, ENGINE, "unified", "b")
    sync(ctrl)
    assert KEY in budget.rolling  # the router still rolls (its image follows the engine's)
    settle(api, ROUTER, "router", "b")
    sync(ctrl)
    assert not budget.rolling and api.condition("Ready")["status"] == "True"


def test_new_operator_defaults_roll_a_service_only_with_a_slot():
    api, ctrl = with_controller()
    services = ctrl.services
    services.features = dataclasses.replace(services.features, engine_image="example.com/engine:1")
    ready_service(api, ctrl)
    assert api.service()["status"]["operatorDefaults"]["engineImage"] == "example.com/engine:1"
    budget = services.budget
    budget.limit = 1
    budget.admit(OTHER, "t", 0)
    services.features = dataclasses.replace(services.features, engine_image="example.com/engine:2")  # upgraded
    sync(ctrl, full=True)
    assert image_of(api, ENGINE) == image_of(api, ROUTER) == "example.com/engine:1"
    assert api.condition("Progressing")["reason"] == "RolloutQueued"
    assert api.condition("Ready")["reason"] == "MinimumReplicasReady"  # the spec itself serves
    budget.forget(OTHER)
    sync(ctrl)
    assert image_of(api, ENGINE) == image_of(api, ROUTER) == "example.com/engine:2"
    assert api.service()["status"]["operatorDefaults"]["engineImage"] == "example.com/engine:2"


def test_a_service_found_mid_rollout_after_a_restart_holds_a_slot():
    api, ctrl = with_controller()
    ready_service(api, ctrl)
    api.put_service(with_image("example.com/engine:2"), generation=2)
    sync(ctrl)  # rolling now: pods of the old template still run
    restarted = Controller(api, ctrl.options, [NS])  # type: ignore[arg-type]
    for obj in api.objects.values():
        restarted.store.put(copy.deepcopy(obj))
    api.store = restarted.store
    restarted.services.budget.limit = 1
    asyncio.run(restarted.services.sync(KEY))
    assert KEY in restarted.services.budget.rolling
    assert not restarted.services.budget.admit(OTHER, "t", 0).go


def test_the_budget_is_an_operator_flag_and_a_chart_value():
    default = ControllerOptions().max_concurrent_rollouts
    assert build_parser().parse_args([]).max_concurrent_rollouts == default
    assert build_parser().parse_args(["--max-concurrent-rollouts", "0"]).max_concurrent_rollouts == 0
    assert main(["--max-concurrent-rollouts", "-1"]) == 2
    chart = Path(__file__).resolve().parents[2] / "charts" / "tidepool"
    assert yaml.safe_load((chart / "values.yaml").read_text())["operator"]["maxConcurrentRollouts"] == default
    template = (chart / "templates" / "deployment.yaml").read_text()
    assert "--max-concurrent-rollouts={{ .Values.operator.maxConcurrentRollouts }}" in template


def test_lws_installed_later_leaves_an_existing_statefulset_pool_alone():
    spec = copy.deepcopy(SPEC)
    spec["parallelism"] = {"tensor": 1, "pipeline": 2}
    spec["resources"]["gpusPerReplica"] = 2
    api, ctrl = with_controller(spec)
    sync(ctrl)
    groups = sorted(n for k, n in api.objects if k == "StatefulSet")
    assert groups == [f"{ENGINE}-g0", f"{ENGINE}-g1"]
    ctrl.services.features = dataclasses.replace(ctrl.services.features, has_lws=True)  # LWS installed
    applies = api.calls["apply"]
    sync(ctrl, full=True)
    assert api.calls["apply"] == applies and api.calls["delete"] == 0
    assert not any(k == "LeaderWorkerSet" for k, _ in api.objects)
