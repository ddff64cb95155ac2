"""The sync pins a floating revision (operator/sync.py with operator/revision.py), on the in-memory API server:
resolved once per spec and recorded in status.model, rendered into the Deployment; not resolved again for an
unchanged spec (nor after a restart, nor for a replica change), resolved again for a spec change or an annotation
bump; a failure applies nothing and says why."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import pytest
from fake_api import NAME, NS, SPEC, FakeApi, with_controller

from tidepool.operator.controller import Controller
from tidepool.operator.k8s import ApiError
from tidepool.operator.revision import RESOLVE_ANNOTATION, Resolver

KEY = (NS, NAME)
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


class MovingHub:
    """The Hub's revision call for `org/model`: `main` points at `head`; `status` answers every call with it."""

    def __init__(self) -> None:
        self.head = COMMIT_A
        self.status: int | None = None
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        assert request.url.path == "/api/models/org/model/revision/main"
        if self.status is not None:
            return httpx.Response(self.status)
        return httpx.Response(200, json={"sha": self.head})


def resolving(hub: MovingHub, ctrl: Controller, api: FakeApi) -> None:
    http = httpx.AsyncClient(transport=httpx.MockTransport(hub))
    ctrl.services.revisions = Resolver(api, http)  # type: ignore[arg-type]


def sync(ctrl: Controller, full: bool = False) -> None:
    asyncio.run(ctrl.services.sync(KEY, full))


def init_args(api: FakeApi) -> list[str]:
    template = api.objects[("Deployment", f"{NAME}-unified")]["spec"]["template"]["spec"]
    (init,) = [c for c in template["initContainers"] if c["name"] == "fetch-model"]
    return init["args"]


def revision_of(api: FakeApi) -> str:
    args = init_args(api)
    return args[args.index("--revision") + 1]


def with_replicas(replicas: int) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["pools"]["unified"]["replicas"] = replicas
    return spec


def test_resolved_once_recorded_and_rendered_and_kept_while_main_moves() -> None:
    api, ctrl = with_controller()
    hub = MovingHub()
    resolving(hub, ctrl, api)
    sync(ctrl)
    assert revision_of(api) == COMMIT_A and init_args(api)[init_args(api).index("--dest") + 1].endswith(COMMIT_A)
    model = api.service()["status"]["model"]
    assert (model["resolvedRevision"], model["revision"], model["repo"], model["generation"]) == (
        COMMIT_A, "main", "org/model", 1,
    )  # fmt: skip
    hub.head = COMMIT_B  # upstream moves: this generation keeps its commit
    sync(ctrl)
    sync(ctrl, full=True)
    api.put_service(with_replicas(3), generation=2)  # a scale (HPA through spec.replicas) is no new spec
    sync(ctrl, full=True)
    assert hub.calls == 1 and revision_of(api) == COMMIT_A

    restarted = Controller(api, ctrl.options, [NS])  # type: ignore[arg-type]
    api.store = restarted.store
    api.put_service(with_replicas(3), generation=2)
    resolving(hub, restarted, api)
    asyncio.run(restarted.services.sync(KEY, True))
    assert hub.calls == 1 and revision_of(api) == COMMIT_A  # read back from status.model


def test_a_spec_change_or_an_annotation_bump_resolves_again() -> None:
    api, ctrl = with_controller()
    hub = MovingHub()
    resolving(hub, ctrl, api)
    sync(ctrl)
    hub.head = COMMIT_B
    api.put_service(SPEC, generation=1, annotations={RESOLVE_ANNOTATION: "1"})
    sync(ctrl)
    assert hub.calls == 2 and revision_of(api) == COMMIT_B
    assert api.service()["status"]["model"]["resolveRequest"] == "1"

    hub.head = COMMIT_A
    changed = {**SPEC, "engine": {"maxModelLen": 1024}}
    api.put_service(changed, generation=2, annotations={RESOLVE_ANNOTATION: "1"})
    sync(ctrl)
    assert hub.calls == 3 and revision_of(api) == COMMIT_A
    assert api.service()["status"]["model"]["generation"] == 2


def test_a_failure_applies_nothing_and_is_reported_then_retried() -> None:
    api, ctrl = with_controller()
    hub = MovingHub()
    hub.status = 404
    resolving(hub, ctrl, api)
    with pytest.raises(ApiError, match="RevisionUnresolved"):
        sync(ctrl)
    assert api.calls["apply"] == 0 and ("Deployment", f"{NAME}-unified") not in api.objects
    for type_ in ("Degraded", "Stalled"):
        cond = api.condition(type_)
        assert (cond["status"], cond["reason"]) == ("True", "RevisionUnresolved")
        assert "spec.model.revision" in cond["message"]
    assert api.condition("Reconciling")["status"] == "False"
    assert "model" not in api.service()["status"]

    hub.status = None  # the retry (the work queue's backoff) succeeds
    sync(ctrl)
    assert revision_of(api) == COMMIT_A and api.condition("Stalled")["status"] == "False"


def test_a_pinned_commit_or_no_resolver_asks_nothing() -> None:
    api, ctrl = with_controller({**SPEC, "model": {"uri": "hf://org/model", "revision": COMMIT_B}})
    hub = MovingHub()
    resolving(hub, ctrl, api)
    sync(ctrl)
    assert hub.calls == 0 and revision_of(api) == COMMIT_B and "model" not in api.service()["status"]

    api, ctrl = with_controller()  # --no-resolve-revisions: the pods resolve main themselves, as before
    sync(ctrl)
    assert "--revision" not in init_args(api) and "model" not in api.service()["status"]
