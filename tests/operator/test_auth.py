"""spec.auth in the API, the pods and the operator's own calls: every engine pod (all pools, every rank) and every
router pod mounts the named Secret key read-only and gets --api-key-file; nothing changes without spec.auth; the
LoRA client sends the key as a bearer token."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tidepool.operator.api import InferenceServiceSpec
from tidepool.operator.api.auth import API_KEY_MOUNT_DIR, API_KEY_VOLUME
from tidepool.operator.api.rules import validate_spec
from tidepool.operator.builders import ClusterFeatures, ServiceView, desired_state
from tidepool.operator.builders.auth import API_KEY_FILE_FLAG
from tidepool.operator.cache import PodInfo
from tidepool.operator.lora.client import HttpReplicaApi, Reply
from tidepool.operator.lora.sync import LoraState, LoraSync

BASE: dict[str, Any] = {
    "model": {"uri": "hf://org/model"},
    "resources": {"gpusPerReplica": 1},
    "pools": {"unified": {"replicas": 2}},
}
DISAGG: dict[str, Any] = {
    **BASE,
    "mode": "disaggregated",
    "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
}
MULTI_NODE: dict[str, Any] = {**BASE, "parallelism": {"tensor": 2, "pipeline": 2}, "resources": {"gpusPerReplica": 4}}
AUTH = {"apiKeySecretRef": {"name": "svc-keys", "key": "keys.txt"}}


def with_auth(base: dict[str, Any], auth: dict[str, Any] | None = AUTH) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    if auth is not None:
        out["auth"] = auth
    return out


def templates(s: dict[str, Any], features: ClusterFeatures | None = None) -> dict[str, dict[str, Any]]:
    """Every pod template the builders emit, by workload name (router included)."""
    out = {}
    for child in desired_state("svc", "ns", ServiceView.from_spec(s), features).children:
        if child["kind"] in ("Deployment", "StatefulSet"):
            out[child["metadata"]["name"]] = child["spec"]["template"]
        elif child["kind"] == "LeaderWorkerSet":
            out[child["metadata"]["name"]] = child["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return out


@pytest.mark.parametrize(
    ("base", "features", "workloads"),
    [
        (BASE, None, {"svc-unified", "svc-router"}),
        (DISAGG, None, {"svc-prefill", "svc-decode", "svc-router"}),
        (MULTI_NODE, None, {"svc-unified-g0", "svc-unified-g1", "svc-router"}),
        (MULTI_NODE, ClusterFeatures(has_lws=True), {"svc-unified", "svc-router"}),
    ],
    ids=["unified", "disaggregated", "statefulset-groups", "leaderworkerset"],
)
def test_every_engine_and_router_pod_mounts_the_key_and_gets_the_flag(base, features, workloads):
    found = templates(with_auth(base), features)
    assert set(found) == workloads
    for name, template in found.items():
        pod = template["spec"]
        container = pod["containers"][0]
        volume = next(v for v in pod["volumes"] if v["name"] == API_KEY_VOLUME)
        assert volume["secret"] == {
            "secretName": "svc-keys",
            "items": [{"key": "keys.txt", "path": "keys.txt"}],
            "defaultMode": 0o400,
        }, name
        assert "optional" not in volume["secret"]  # a missing Secret must stop the pod, never let it serve openly
        mount = next(m for m in container["volumeMounts"] if m["name"] == API_KEY_VOLUME)
        assert mount == {"name": API_KEY_VOLUME, "mountPath": API_KEY_MOUNT_DIR, "readOnly": True}, name
        args = container["args"]
        at = args.index(API_KEY_FILE_FLAG)
        assert args[at + 1] == f"{API_KEY_MOUNT_DIR}/keys.txt", name
        assert args.count(API_KEY_FILE_FLAG) == 1
        # the builders' ordering invariants hold with the extra volume and mount
        assert [m["mountPath"] for m in container["volumeMounts"]] == sorted(
            m["mountPath"] for m in container["volumeMounts"]
        )
        assert [v["name"] for v in pod["volumes"]] == sorted(v["name"] for v in pod["volumes"])


def test_without_auth_the_pods_are_exactly_as_before():
    for template in templates(with_auth(BASE, None)).values():
        pod = template["spec"]
        container = pod["containers"][0]
        assert API_KEY_FILE_FLAG not in container["args"]
        assert all(v["name"] != API_KEY_VOLUME for v in pod["volumes"])
        assert all(m["mountPath"] != API_KEY_MOUNT_DIR for m in container["volumeMounts"])


def test_the_default_key_is_api_key_and_user_extra_args_stay_last():
    s = with_auth({**BASE, "engine": {"extraArgs": ["--seed=7"]}}, {"apiKeySecretRef": {"name": "k"}})
    args = templates(s)["svc-unified"]["spec"]["containers"][0]["args"]
    assert args[-3:] == [API_KEY_FILE_FLAG, f"{API_KEY_MOUNT_DIR}/api-key", "--seed=7"]


def test_naming_another_secret_or_key_rolls_the_pods_and_the_key_itself_never_enters_them():
    def hashes(auth: dict[str, Any] | None) -> dict[str, str]:
        return {
            n: t["metadata"]["labels"]["tidepool.dev/spec-hash"] for n, t in templates(with_auth(BASE, auth)).items()
        }

    plain, first = hashes(None), hashes(AUTH)
    other_key = hashes({"apiKeySecretRef": {"name": "svc-keys", "key": "other"}})
    assert all(plain[n] != first[n] != other_key[n] for n in plain)
    assert first == hashes(AUTH)  # stable


def test_overrides_may_not_take_the_key_volume_or_its_directory():
    for pod in (
        {"volumes": [{"name": API_KEY_VOLUME, "emptyDir": {}}]},
        {"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": API_KEY_MOUNT_DIR}]},
    ):
        problems = validate_spec(InferenceServiceSpec.model_validate({**BASE, "pod": pod}))
        assert any("volume name the operator uses" in p or API_KEY_MOUNT_DIR in p for p in problems), problems


@pytest.mark.parametrize(
    ("auth", "fragment"),
    [
        ({}, "apiKeySecretRef"),
        ({"apiKeySecretRef": {"key": "k"}}, "name"),
        ({"apiKeySecretRef": {"name": "Bad_Name"}}, "name"),
        ({"apiKeySecretRef": {"name": "k", "key": "a/b"}}, "key"),
    ],
)
def test_bad_auth_is_refused_naming_the_field(auth, fragment):
    with pytest.raises(ValueError, match=fragment):
        InferenceServiceSpec.model_validate(with_auth(BASE, auth))


def test_a_dot_key_is_refused_by_the_rule():
    spec = InferenceServiceSpec.model_validate(with_auth(BASE, {"apiKeySecretRef": {"name": "k", "key": ".."}}))
    assert any("auth.apiKeySecretRef.key" in p for p in validate_spec(spec))


def _pod() -> PodInfo:
    return PodInfo("p0", "unified", "h", None, 0, True, False, "10.0.0.9", ())


@pytest.mark.parametrize("api_key", ["sk-one", None])
def test_the_lora_client_sends_the_key_as_a_bearer_token_on_every_call(api_key):
    seen: list[tuple[str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "a", "parent": "base", "root": "/x"}]})
        return httpx.Response(200, text="ok")

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            api = HttpReplicaApi(http, lambda ns, pod: "http://pod")
            assert await api.adapters("ns", _pod(), api_key) == {"a": "/x"}
            assert (await api.load("ns", _pod(), "a", "/x", api_key)).ok
            assert (await api.unload("ns", _pod(), "a", api_key)).ok

    asyncio.run(run())
    expected = f"Bearer {api_key}" if api_key else None
    assert seen == [(p, expected) for p in ("/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")]


def test_a_refused_key_is_a_401_reply_not_an_exception():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "Invalid API key", "type": "invalid_request_error"}})

    async def run() -> tuple[Any, Any]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            api = HttpReplicaApi(http, lambda ns, pod: "http://pod")
            return await api.load("ns", _pod(), "a", "/x", "old"), await api.adapters("ns", _pod(), "old")

    reply, listed = asyncio.run(run())
    assert (reply.status, reply.message, listed) == (401, "Invalid API key", None)


class _Replicas:
    """Replicas whose listing accepts `list_key` and whose loads accept `load_key` (protected endpoints)."""

    def __init__(self, list_key: str, load_key: str) -> None:
        self.list_key, self.load_key = list_key, load_key
        self.keys: list[str | None] = []

    async def adapters(self, namespace: str, pod: PodInfo, api_key: str | None = None) -> dict[str, str] | None:
        self.keys.append(api_key)
        return {} if api_key == self.list_key else None

    async def load(self, namespace: str, pod: PodInfo, name: str, path: str, api_key: str | None = None) -> Reply:
        self.keys.append(api_key)
        return Reply(200, "ok") if api_key == self.load_key else Reply(401, "Invalid API key")

    async def unload(self, namespace: str, pod: PodInfo, name: str, api_key: str | None = None) -> Reply:
        return Reply(200, "ok")


@pytest.mark.parametrize(
    ("list_key", "load_key", "is_refused"),
    [("sk", "sk", False), ("other", "sk", True), ("sk", "other", True)],
    ids=["accepted", "listing-refused", "load-refused"],
)
def test_the_lora_step_sends_the_services_key_and_flags_a_refused_one(list_key, load_key, is_refused):
    spec = with_auth({**BASE, "lora": {"adapters": [{"name": "a", "source": "hf://org/a"}]}})
    view = ServiceView.from_spec(spec)
    pod = PodInfo("p0", "unified", "h", None, 0, True, False, "10.0.0.9", (), is_serving=True)
    replicas, state = _Replicas(list_key, load_key), LoraState()

    async def run() -> None:
        step = LoraSync(replicas, None, lambda _: None)  # type: ignore[arg-type]
        await step.step(("ns", "svc"), view, [pod], state, "sk")
        await asyncio.gather(*state.tasks.values())  # the background load

    asyncio.run(run())
    assert replicas.keys and set(replicas.keys) == {"sk"}
    assert state.take_key_refused() is is_refused
    assert state.take_key_refused() is False  # taken once


def test_the_auth_example_is_valid_and_asks_for_what_it_documents():
    body = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "inferenceservice-auth.yaml").read_text())
    view = ServiceView.from_body(body)
    assert view.spec.auth is not None and view.spec.auth.api_key_secret_ref.name == "smollm2-api-keys"
    found = templates(view.spec.to_wire())
    assert all(API_KEY_FILE_FLAG in t["spec"]["containers"][0]["args"] for t in found.values())
