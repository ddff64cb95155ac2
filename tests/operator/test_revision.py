"""operator/revision.py: which revisions float, what a resolution is valid for, the pinned view, and the resolver's
HTTP call (httpx.MockTransport standing in for the Hub; the Secret from a fake client)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import httpx
import pytest

from tidepool.operator.api import InferenceServiceStatus, ServiceView
from tidepool.operator.builders import ClusterFeatures
from tidepool.operator.builders.engine import model_sources
from tidepool.operator.revision import (
    RESOLVE_ANNOTATION,
    Resolver,
    RevisionError,
    Wanted,
    is_commit,
    pin,
    record,
    reuse,
    spec_key,
    unresolved_status,
    wanted,
)

SHA = "0123456789abcdef0123456789abcdef01234567"
SPEC: dict[str, Any] = {
    "model": {"uri": "hf://org/model"},
    "resources": {"gpusPerReplica": 1, "cpu": "1", "memory": "4Gi"},
    "mode": "unified",
    "pools": {"unified": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4}},
}


def body(spec: dict[str, Any] = SPEC, **annotations: str) -> dict[str, Any]:
    return {"metadata": {"name": "svc", "generation": 3, "annotations": annotations}, "spec": spec}


def with_model(**model: Any) -> dict[str, Any]:
    return {**SPEC, "model": model}


@pytest.mark.parametrize(
    ("model", "floating"),
    [
        ({"uri": "hf://org/model"}, "main"),
        ({"uri": "hf://org/model", "revision": "v1.0"}, "v1.0"),
        ({"uri": "hf://org/model", "revision": "refs/pr/1"}, "refs/pr/1"),
        ({"uri": "hf://org/model", "revision": SHA}, None),  # a commit is already pinned
        ({"uri": "hf://org/model", "revision": SHA[:12]}, "0123456789ab"),  # a short id is a name, not a commit
        ({"uri": "s3://bucket/model"}, None),
        ({"uri": "pvc://claim/model"}, None),
    ],
)
def test_only_a_floating_hf_revision_is_wanted(model: dict[str, Any], floating: str | None) -> None:
    spec = with_model(**model)
    want = wanted(ServiceView.from_spec(spec), body(spec))
    assert (want.revision if want else None) == floating
    if want is not None:
        assert want.repo == "org/model" and want.request is None


def test_is_commit() -> None:
    assert is_commit(SHA) and not is_commit(SHA.upper()) and not is_commit(SHA[:39]) and not is_commit("main")


def test_the_spec_key_ignores_replica_counts_only() -> None:
    scaled = {**SPEC, "pools": {"unified": {**SPEC["pools"]["unified"], "replicas": 4}}}
    assert spec_key(scaled) == spec_key(SPEC)
    assert spec_key({**SPEC, "replicas": 3}) == spec_key(SPEC)
    changed = {**SPEC, "pools": {"unified": {**SPEC["pools"]["unified"], "maxReplicas": 8}}}
    assert spec_key(changed) != spec_key(SPEC)
    assert spec_key(with_model(uri="hf://org/model", revision="v2")) != spec_key(SPEC)


def test_a_record_is_reused_for_the_same_spec_and_request_only() -> None:
    want = wanted(ServiceView.from_spec(SPEC), body())
    assert want is not None
    recorded = record(want, SHA, 3)
    assert reuse(want, recorded) == recorded and recorded.generation == 3
    assert reuse(want, None) is None
    other_spec = Wanted(want.repo, want.revision, "different", want.request)
    assert reuse(other_spec, recorded) is None
    bumped = wanted(ServiceView.from_spec(SPEC), body(**{RESOLVE_ANNOTATION: "2"}))
    assert bumped is not None and bumped.request == "2" and reuse(bumped, recorded) is None
    # what status holds survives the round trip through the API (a restarted operator reads it back)
    status = InferenceServiceStatus.model_validate({"model": recorded.to_wire()})
    assert reuse(want, status.model) == recorded


def test_the_pinned_view_renders_the_commit_into_the_download_and_the_cache_path() -> None:
    view = pin(ServiceView.from_spec(SPEC), SHA, "svc")
    (source,), _ = model_sources(view, ClusterFeatures())
    args = source.init_container["args"]
    assert args[args.index("--revision") + 1] == SHA
    assert source.path.endswith(f"/hf/org/model/{SHA}") and args[args.index("--dest") + 1] == source.path


def test_unresolved_status_is_degraded_and_stalled_and_keeps_ready() -> None:
    previous = InferenceServiceStatus.model_validate(
        {"observedGeneration": 2, "conditions": [{"type": "Ready", "status": "True", "reason": "R", "message": "m"}]}
    )
    status = unresolved_status(previous, 3, "cannot resolve hf://org/model@main: 404", "2026-01-01T00:00:00Z")
    assert status.observed_generation == 3
    for type_, value in (("Degraded", "True"), ("Stalled", "True"), ("Reconciling", "False")):
        cond = status.condition(type_)
        assert cond is not None and (cond.status, cond.reason) == (value, "RevisionUnresolved")
    assert "404" in status.condition("Stalled").message
    assert status.condition("Ready") == previous.condition("Ready")


class SecretClient:
    def __init__(self, data: dict[str, str] | None) -> None:
        self.data, self.paths = data, []

    async def get(self, path: str) -> dict[str, Any] | None:
        self.paths.append(path)
        if self.data is None:
            return None
        return {"data": {k: base64.b64encode(v.encode()).decode() for k, v in self.data.items()}}


def resolve(handler, secret: dict[str, str] | None, secret_name: str | None = "hf") -> str:
    async def run() -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            resolver = Resolver(SecretClient(secret), http)  # type: ignore[arg-type]
            return await resolver.resolve(Wanted("org/model", "refs/pr/1", "k", None), "ns", secret_name)

    return asyncio.run(run())


def test_the_resolver_uses_the_secrets_endpoint_and_token() -> None:
    seen: list[httpx.Request] = []

    def hub(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"sha": SHA, "siblings": []})

    assert resolve(hub, {"HF_ENDPOINT": "http://mirror.local/", "HF_TOKEN": "hf_secret"}) == SHA
    (request,) = seen
    assert str(request.url) == "http://mirror.local/api/models/org/model/revision/refs%2Fpr%2F1"
    assert request.headers["Authorization"] == "Bearer hf_secret"


def test_without_a_secret_the_public_hub_is_asked_anonymously() -> None:
    seen: list[httpx.Request] = []

    def hub(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"sha": SHA})

    assert resolve(hub, None, secret_name=None) == SHA
    assert seen[0].url.host == "huggingface.co" and "Authorization" not in seen[0].headers


@pytest.mark.parametrize(
    ("response", "cause"),
    [
        (httpx.Response(401), "HTTP 401 from http://m with the token in Secret hf key HF_TOKEN"),
        (httpx.Response(404), "404 from http://m; check spec.model.uri and spec.model.revision"),
        (httpx.Response(503), "HTTP 503 from http://m"),
        (httpx.Response(200, json={"siblings": []}), "answered without a commit sha"),
        (httpx.Response(200, text="<html>"), "answered without a commit sha"),
    ],
)
def test_failures_name_their_cause(response: httpx.Response, cause: str) -> None:
    with pytest.raises(RevisionError, match="cannot resolve hf://org/model@refs/pr/1") as err:
        resolve(lambda _: response, {"HF_ENDPOINT": "http://m", "HF_TOKEN": "hf_secret"})
    assert cause in str(err.value) and "hf_secret" not in str(err.value)


def test_an_unreachable_endpoint_is_a_revision_error() -> None:
    def hub(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(RevisionError, match="http://m unreachable"):
        resolve(hub, {"HF_ENDPOINT": "http://m"})
