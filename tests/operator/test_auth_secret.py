"""The operator's side of spec.auth: the API-key Secret is read by name when due (never listed), a missing Secret
or key is reported in status (Degraded/Ready reason ApiKeySecretMissing, naming it) and as one Warning Event,
creating it later clears the problem without any watch, and the key read is what the LoRA step sends."""

from __future__ import annotations

import asyncio
import base64
import copy
from typing import Any

import pytest
from fake_api import NAME, NS, SPEC, FakeApi

from tidepool.common.api_key import ApiKeyError, read_key_file
from tidepool.operator.api import ServiceView
from tidepool.operator.api_keys import MISSING_REASON, ApiKeys, ApiKeyState, first_key
from tidepool.operator.controller import Controller, ControllerOptions
from tidepool.operator.k8s import ApiError

KEY = (NS, NAME)
AUTH_SPEC: dict[str, Any] = {**SPEC, "auth": {"apiKeySecretRef": {"name": "keys"}}}
SECRET_PATH = f"/api/v1/namespaces/{NS}/secrets/keys"


def secret(value: str | None, item: str = "api-key", name: str = "keys") -> dict[str, Any]:
    data = {} if value is None else {item: base64.b64encode(value.encode()).decode()}
    return {"kind": "Secret", "metadata": {"name": name, "namespace": NS}, "data": data}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class SecretApi(FakeApi):
    """FakeApi plus GET of Secrets (what ApiKeys reads); `fail` makes the next GETs raise."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: dict[str, dict[str, Any]] = {}
        self.gets: list[str] = []
        self.fail: ApiError | None = None

    async def get(self, path: str) -> dict[str, Any] | None:
        self.gets.append(path)
        if self.fail is not None:
            raise self.fail
        found = self.secrets.get(path)
        return copy.deepcopy(found) if found is not None else None


class Recorder:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    async def post(self, obj: Any, type_: str, reason: str, message: str, key: str | None = None) -> None:
        self.posted.append((type_, reason, message))


def body(spec: dict[str, Any] = AUTH_SPEC) -> dict[str, Any]:
    return {"metadata": {"name": NAME, "namespace": NS, "uid": "u"}, "spec": spec}


def check(keys: ApiKeys, state: ApiKeyState, spec: dict[str, Any] = AUTH_SPEC, refused: bool = False) -> Any:
    return asyncio.run(keys.check(body(spec), ServiceView.from_spec(spec), state, refused))


def setup() -> tuple[SecretApi, Recorder, Clock, ApiKeys, ApiKeyState]:
    api, events, clock = SecretApi(), Recorder(), Clock()
    keys = ApiKeys(api, events, clock, refresh_s=300.0, retry_s=30.0)  # type: ignore[arg-type]
    return api, events, clock, keys, ApiKeyState()


def test_no_auth_reads_nothing():
    api, events, _, keys, state = setup()
    outcome = check(keys, state, SPEC)
    assert (outcome.key, outcome.problem, outcome.wake_s, api.gets, events.posted) == (None, None, None, [], [])


def test_a_present_key_is_read_once_then_again_only_when_due_or_refused():
    api, events, clock, keys, state = setup()
    api.secrets[SECRET_PATH] = secret("\n  sk-new  \nsk-old\n")
    outcome = check(keys, state)
    assert (outcome.key, outcome.problem, outcome.wake_s) == ("sk-new", None, None)
    assert api.gets == [SECRET_PATH]
    clock.now += 299
    assert check(keys, state).key == "sk-new" and len(api.gets) == 1  # within refresh_s: no request
    api.secrets[SECRET_PATH] = secret("sk-rotated")
    assert check(keys, state, refused=True).key == "sk-rotated" and len(api.gets) == 2  # a pod refused the key
    clock.now += 300
    check(keys, state)
    assert len(api.gets) == 3 and events.posted == []


def test_a_missing_secret_is_reported_once_and_looked_for_again_until_it_exists():
    api, events, clock, keys, state = setup()
    outcome = check(keys, state)
    assert outcome.key is None and outcome.wake_s == 30.0
    assert "Secret keys" in outcome.problem and f"namespace {NS}" in outcome.problem
    assert events.posted == [("Warning", MISSING_REASON, outcome.problem)]
    assert check(keys, state).problem == outcome.problem and len(api.gets) == 1  # not due yet
    clock.now += 30
    assert check(keys, state).problem == outcome.problem and len(api.gets) == 2
    assert len(events.posted) == 1  # told once while it lasts
    api.secrets[SECRET_PATH] = secret("sk-1")
    clock.now += 30
    fixed = check(keys, state)
    assert (fixed.key, fixed.problem, fixed.wake_s) == ("sk-1", None, None)


def test_renaming_the_reference_reads_the_new_secret_at_once():
    api, _, _, keys, state = setup()
    api.secrets[SECRET_PATH] = secret("sk-1")
    check(keys, state)
    other = {**SPEC, "auth": {"apiKeySecretRef": {"name": "other", "key": "k"}}}
    outcome = check(keys, state, other)
    assert api.gets[-1] == f"/api/v1/namespaces/{NS}/secrets/other" and "Secret other" in outcome.problem


def test_a_forbidden_read_says_which_permission_is_missing_and_a_flaky_server_keeps_what_was_known():
    api, _, clock, keys, state = setup()
    api.fail = ApiError(403, "secrets is forbidden", "Forbidden")
    assert "may not read Secret keys" in check(keys, state).problem
    api.fail, api.secrets[SECRET_PATH] = None, secret("sk-1")
    clock.now += 30
    assert check(keys, state).key == "sk-1"
    api.fail = ApiError(500, "etcdserver: leader changed", "InternalError")
    clock.now += 300
    outcome = check(keys, state)
    assert (outcome.key, outcome.problem, outcome.wake_s) == ("sk-1", None, 30.0)


def test_first_key_names_what_is_wrong():
    assert first_key(secret("a\nb"), "api-key") == ("a", None)
    assert "has no key api-key (its keys: other)" in first_key(secret("x", item="other"), "api-key")[1]
    assert "holds no key" in first_key(secret(" \n# a comment\n"), "api-key")[1]
    assert "line 2: an API key must be printable ASCII" in first_key(secret("ok\nnot ok"), "api-key")[1]
    broken = {"metadata": {"name": "keys"}, "data": {"api-key": "%%%"}}
    assert "not UTF-8 text" in first_key(broken, "api-key")[1]


def _controller(clock: Clock) -> tuple[SecretApi, Controller]:
    """fake_api.with_controller's setup, on a FakeApi that also serves Secrets."""
    api = SecretApi()
    ctrl = Controller(api, ControllerOptions(), [NS], clock)  # type: ignore[arg-type]
    api.store = ctrl.store
    api.put_service(AUTH_SPEC)
    return api, ctrl


def test_the_controller_reports_a_missing_secret_in_status_and_clears_it_once_created():
    clock = Clock()
    api, ctrl = _controller(clock)
    asyncio.run(ctrl.services.sync(KEY))
    degraded, ready = api.condition("Degraded"), api.condition("Ready")
    assert (degraded["status"], degraded["reason"]) == ("True", MISSING_REASON)
    assert "Secret keys (spec.auth.apiKeySecretRef) not found" in degraded["message"]
    assert (ready["status"], ready["reason"]) == ("False", MISSING_REASON)
    assert [e["reason"] for e in api.events].count(MISSING_REASON) == 1

    api.secrets[SECRET_PATH] = secret("sk-1")
    for workload, pool, count in ((f"{NAME}-unified", "unified", 2), (f"{NAME}-router", "router", 2)):
        for i in range(count):
            api.add_pod(f"{workload}-p{i}", pool, api.hash_of(workload))
    clock.now += 31  # the wake-up the missing Secret asked for
    asyncio.run(ctrl.services.sync(KEY))
    assert api.condition("Degraded")["status"] == "False"
    assert api.condition("Ready")["status"] == "True"
    assert ctrl.services.states[KEY].api_key.key == "sk-1"


@pytest.mark.parametrize("text", ["sk-1\nsk-2\n", "\n# rotated 2026-12\n  sk-new  \nsk-old", "# only\n\n", "bad key\n"])
def test_the_operator_reads_the_first_key_as_the_pods_read_their_key_file(text, tmp_path):
    path = tmp_path / "keys"
    path.write_text(text)
    try:
        expected: str | None = read_key_file(path)[0]
    except ApiKeyError:
        expected = None
    assert first_key(secret(text), "api-key")[0] == expected
