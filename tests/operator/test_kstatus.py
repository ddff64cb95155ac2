"""Reconciling and Stalled as kstatus (Flux `wait`) and Argo CD read them, from operator/status.py's build_status.

Each scenario is a status the operator computes for a generation (pure: observations in, status out), put in
an object the way the API server serves it; then the kstatus port (tests/gitops_health.py) and, where lupa
is installed, the chart's health.lua judge it. What must hold: Current (and Healthy) only once the current
generation serves with nothing of an older template left; InProgress while it rolls out, downloads or waits
for room; Failed (Argo Degraded) when something blocks it; never Reconciling and Stalled True at once.
The same judges run on real objects in tests/controlplane/test_cp_gitops_health.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from gitops_health import CURRENT, FAILED, IN_PROGRESS, TERMINATING, ArgoHealth, kstatus

from tidepool.operator.api import InferenceServiceStatus
from tidepool.operator.observe import PodProblem, PoolObservation
from tidepool.operator.pod_problems import DOWNLOAD_FAILED
from tidepool.operator.status import Outcome, build_status

NOW = "2026-12-05T00:00:00Z"
URL = "http://svc.ns.svc:8000"


def pool(desired: int = 1, *, replicas: int, ready: int, updated: int, updated_ready: int) -> PoolObservation:
    return PoolObservation(
        name="unified", desired=desired, replicas=replicas, ready=ready, updated=updated, updated_ready=updated_ready
    )


def obj(status: InferenceServiceStatus, generation: int) -> dict[str, Any]:
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "svc", "namespace": "ns", "generation": generation},
        "status": status.model_dump(by_alias=True, exclude_none=True, mode="json"),
    }


@dataclass
class Service:
    """One service's status across reconciles, as the operator carries it from one to the next."""

    status: InferenceServiceStatus = field(default_factory=InferenceServiceStatus)

    def observe(self, generation: int, unified: PoolObservation, outcome: Outcome | None = None) -> dict[str, Any]:
        self.status = build_status(
            self.status, generation, [unified], None, outcome or Outcome(), URL, "sel", "unified", NOW
        )
        return obj(self.status, generation)


def condition(o: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in o["status"]["conditions"] if c["type"] == type_)


def both_true(o: dict[str, Any]) -> bool:
    return condition(o, "Reconciling")["status"] == "True" and condition(o, "Stalled")["status"] == "True"


DOWNLOAD = PodProblem("unified", "svc-unified-new", DOWNLOAD_FAILED, "model download failed: 401 Unauthorized")


def rollout() -> list[tuple[str, dict[str, Any], str]]:
    """(step, object, kstatus expected) through a first start, a rollout and a failing download."""
    svc = Service()
    steps = [
        ("gen 1 applied, pod starting", svc.observe(1, pool(replicas=1, ready=0, updated=1, updated_ready=0)),
         IN_PROGRESS),
        ("gen 1 downloading", svc.observe(1, pool(replicas=1, ready=0, updated=1, updated_ready=0),
                                          Outcome(downloading=["pod p (since 12:00)"])), IN_PROGRESS),
        ("gen 1 serves", svc.observe(1, pool(replicas=1, ready=1, updated=1, updated_ready=1)), CURRENT),
    ]  # fmt: skip
    stale = obj(svc.status, 2)  # spec edited: the operator has not seen generation 2 yet
    steps.append(("gen 2 not observed yet", stale, IN_PROGRESS))
    steps += [
        ("gen 2 applied, new pod waits for room", svc.observe(
            2, pool(replicas=2, ready=1, updated=1, updated_ready=0),
            Outcome(pod_problems=[PodProblem("unified", "svc-unified-new", "InsufficientCapacity", "0/1 nodes")])),
         IN_PROGRESS),
        ("gen 2 new pod ready, old still there", svc.observe(2, pool(replicas=2, ready=2, updated=1, updated_ready=1)),
         IN_PROGRESS),
        ("gen 2 rolled out", svc.observe(2, pool(replicas=1, ready=1, updated=1, updated_ready=1)), CURRENT),
        ("gen 3 download fails while gen 2 serves", svc.observe(
            3, pool(replicas=2, ready=1, updated=1, updated_ready=0), Outcome(pod_problems=[DOWNLOAD])), FAILED),
        ("gen 3 download fails, nothing else left", svc.observe(
            3, pool(replicas=1, ready=0, updated=1, updated_ready=0), Outcome(pod_problems=[DOWNLOAD])), FAILED),
        ("gen 4 fixes it", svc.observe(4, pool(replicas=1, ready=1, updated=1, updated_ready=1)), CURRENT),
    ]  # fmt: skip
    return steps


@pytest.mark.parametrize(("step", "o", "expected"), rollout(), ids=[s for s, _, _ in rollout()])
def test_kstatus_is_current_exactly_when_the_generation_serves(step: str, o: dict[str, Any], expected: str) -> None:
    verdict = kstatus(o)
    assert verdict.status == expected, (step, verdict, o["status"]["conditions"])
    assert not both_true(o)
    if expected == CURRENT:  # the generation is observed and serves on its own template, nothing older left
        ready = condition(o, "Ready")
        assert ready["status"] == "True" and ready["observedGeneration"] == o["metadata"]["generation"]
        assert ready["reason"] == "MinimumReplicasReady"
    if expected == FAILED:  # the blocking cause, as Degraded tells it
        stalled = condition(o, "Stalled")
        assert stalled["reason"] == DOWNLOAD_FAILED and "401 Unauthorized" in stalled["message"]
        assert condition(o, "Reconciling")["reason"] == "Stalled"


def test_waiting_for_room_is_in_progress_not_failed_and_says_why() -> None:
    """Capacity often arrives (cluster autoscaler, scale from zero): Reconciling, never Stalled; Ready's reason."""
    problem = PodProblem("unified", "svc-unified-a", "InsufficientCapacity", "0/3 nodes are available: 3 Insufficient")
    o = Service().observe(1, pool(replicas=1, ready=0, updated=1, updated_ready=0), Outcome(pod_problems=[problem]))
    reconciling = condition(o, "Reconciling")
    assert reconciling["status"] == "True" and reconciling["reason"] == condition(o, "Ready")["reason"]
    assert "Insufficient" in reconciling["message"] and condition(o, "Stalled")["status"] == "False"
    assert kstatus(o).status == IN_PROGRESS


def test_a_workload_failure_stalls_a_wait_that_never_ends() -> None:
    """The Deployment's progress deadline turns an endless wait for room into Stalled (WorkloadFailure)."""
    stuck = PoolObservation(
        name="unified", desired=1, replicas=1, ready=0, updated=1, updated_ready=0,
        failure="Deployment svc-unified: ReplicaSet has timed out progressing",
    )  # fmt: skip
    o = Service().observe(1, stuck)
    assert (condition(o, "Stalled")["status"], condition(o, "Stalled")["reason"]) == ("True", "WorkloadFailure")
    assert kstatus(o).status == FAILED


def test_an_invalid_spec_is_failed_for_its_own_generation() -> None:
    """kstatus reads an unobserved generation as InProgress forever: the operator observes it, and stalls."""
    svc = Service()
    svc.observe(1, pool(replicas=1, ready=1, updated=1, updated_ready=1))
    svc.status = build_status(
        svc.status, 2, [], None, Outcome(spec_error="model.uri: bad", applied=False), URL, None, None, NOW
    )
    o = obj(svc.status, 2)
    assert o["status"]["observedGeneration"] == 2
    assert kstatus(o) == type(kstatus(o))(FAILED, "model.uri: bad")
    assert condition(o, "Reconciling")["status"] == "False"


def test_a_failed_adapter_leaves_the_service_current() -> None:
    """It serves the base model and the other adapters: nothing blocks the generation (Degraded says the rest)."""
    o = Service().observe(
        1, pool(replicas=1, ready=1, updated=1, updated_ready=1), Outcome(adapter_failures=["sql: 404"])
    )
    assert kstatus(o).status == CURRENT and condition(o, "Degraded")["status"] == "True"


def test_the_port_follows_kstatus_generic_rules() -> None:
    base = {"kind": "InferenceService", "metadata": {"generation": 3}}
    assert kstatus(base).status == CURRENT  # no status, no conditions: a custom resource is Current
    assert kstatus({**base, "metadata": {"generation": 3, "deletionTimestamp": NOW}}).status == TERMINATING
    behind = kstatus({**base, "status": {"observedGeneration": 2}})
    assert behind.status == IN_PROGRESS and behind.message == (
        "InferenceService generation is 3, but latest observed generation is 2"
    )
    first = [{"type": "Stalled", "status": "True", "message": "s"}, {"type": "Reconciling", "status": "True"}]
    assert kstatus({**base, "status": {"observedGeneration": 3, "conditions": first}}).status == FAILED
    assert kstatus({**base, "status": {"conditions": first[::-1]}}).status == IN_PROGRESS  # list order decides
    unknown = [{"type": "Reconciling", "status": "Unknown"}, {"type": "Ready", "status": "False"}]
    assert kstatus({**base, "status": {"conditions": unknown}}).status == CURRENT  # only True counts


ARGO_FOR = {CURRENT: "Healthy", IN_PROGRESS: "Progressing", FAILED: "Degraded"}


def test_health_lua_agrees_with_kstatus_through_the_rollout() -> None:
    health = ArgoHealth()
    for step, o, expected in rollout():
        verdict = health(o)
        assert verdict.status == ARGO_FOR[expected], (step, verdict)
        if expected == FAILED:
            assert verdict.message.startswith(f"{DOWNLOAD_FAILED}: ") and "401 Unauthorized" in verdict.message


def test_health_lua_calls_a_paused_service_suspended() -> None:
    paused = {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService",
              "metadata": {"name": "m", "generation": 2},
              "status": {"observedGeneration": 2, "conditions": [
                  {"type": "Ready", "status": "True", "reason": "MinimumReplicasReady", "message": "1/1"},
                  {"type": "Progressing", "status": "Unknown", "reason": "Paused", "message": "held: main"},
                  {"type": "Reconciling", "status": "True", "reason": "Paused", "message": "held: main"}]}}  # fmt: skip
    verdict = ArgoHealth()(paused)
    assert verdict == type(verdict)("Suspended", "Paused: held: main")
    broken = {"type": "Stalled", "status": "True", "reason": "X", "message": "m"}
    stalled = {**paused, "status": {**paused["status"], "conditions": [*paused["status"]["conditions"], broken]}}
    assert ArgoHealth()(stalled).status == "Degraded"  # a broken service is Degraded even while paused


def test_health_lua_edge_cases() -> None:
    health = ArgoHealth()
    assert health({"metadata": {"generation": 1}}).status == "Progressing"  # no status yet
    adapter = Service().observe(
        1, pool(replicas=1, ready=1, updated=1, updated_ready=1), Outcome(adapter_failures=["sql: 404"])
    )
    assert health(adapter) == type(health(adapter))("Degraded", "AdapterLoadFailed: sql: 404")
    no_reconciling = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "conditions": [
        {"type": "Ready", "status": "False", "reason": "ReplicasNotReady", "message": "0/1"}]}}  # fmt: skip
    assert health(no_reconciling) == type(health(no_reconciling))("Progressing", "ReplicasNotReady: 0/1")
