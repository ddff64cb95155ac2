"""API keys through the router (tidepool.common.api_key): the router checks the client's key, forwards it to the
engines unchanged, and sends its own first key on its own calls (probes, model lists); key files rotate in place.

Fake engines here sit behind the same `ApiKeyMiddleware` the real server uses and record the headers of every
request they get. The last test runs the real processes: `tidepool serve --api-key-file` behind a
`tidepool router` whose key comes from $TIDEPOOL_API_KEY, driven by the `openai` SDK.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from router_fake_engine import FakeEngine, ThreadServer, fake_tokens
from router_helpers import Servers, spawn, wait_for, wait_ready

from tidepool.common.api_key import ENV_VAR, ApiKeyMiddleware, ApiKeys
from tidepool.router.app import build_app
from tidepool.router.cli import build_config, build_parser

FIRST, SECOND = "sk-router-first", "sk-client-second"


@dataclass
class Seen:
    """What a fake engine received: every request's method, path and headers, before its key check."""

    requests: list[tuple[str, str, httpx.Headers]] = field(default_factory=list)

    def auth_of(self, method: str, path: str) -> list[str | None]:
        return [h.get("authorization") for m, p, h in self.requests if (m, p) == (method, path)]


class Recorder:
    """ASGI middleware, outside the engine's key check, that notes each request in `seen`."""

    def __init__(self, app: Any, seen: Seen) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = httpx.Headers([(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]])
            self.seen.requests.append((scope["method"], scope["path"], headers))
        await self.app(scope, receive, send)


def keyed_engine(servers: Servers, name: str, keys: ApiKeys) -> tuple[ThreadServer, Seen]:
    app = FakeEngine(name).app()
    app.add_middleware(ApiKeyMiddleware, keys=keys)  # type: ignore[arg-type]
    seen = Seen()
    app.add_middleware(Recorder, seen=seen)  # type: ignore[arg-type]
    server = ThreadServer(app)
    servers.started.append(server)
    return server, seen


def keyed_router(servers: Servers, *flags: str, key: str | None = None) -> ThreadServer:
    """An in-process router; waits (with `key` for /debug/replicas) until its one replica is ready."""
    config = build_config(build_parser().parse_args(["--health-interval", "0.1", *flags]))
    server = ThreadServer(build_app(config))
    servers.started.append(server)
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def is_ready() -> bool:
        replicas = httpx.get(f"{server.url}/debug/replicas", headers=headers, timeout=5).json()["unified"]
        return [r["state"] for r in replicas] == ["ready"]

    wait_for(is_ready, what="the replica ready")
    return server


def client_of(router: ThreadServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_router_checks_the_key_and_forwards_the_clients_unchanged(servers: Servers) -> None:
    engine, recorder = keyed_engine(servers, "e", ApiKeys([FIRST, SECOND]))
    router = keyed_router(servers, "--unified-url", engine.url, "--api-key", FIRST, "--api-key", SECOND, key=FIRST)

    with pytest.raises(openai.AuthenticationError) as wrong:
        client_of(router, "sk-wrong").completions.create(model="fake", prompt="hi", max_tokens=3)
    assert wrong.value.code == "invalid_api_key" and wrong.value.response.headers["www-authenticate"] == "Bearer"
    assert recorder.auth_of("POST", "/v1/completions") == []  # refused at the router: the engine never saw it
    missing = httpx.post(f"{router.url}/v1/completions", json={"model": "fake", "prompt": "hi"}, timeout=10)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "invalid_request_error"

    client = client_of(router, SECOND)
    answer = client.completions.create(model="fake", prompt="hi", max_tokens=3)
    assert answer.choices[0].text == " ".join(fake_tokens("hi", 0, 3))
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="fake", prompt="hi", max_tokens=3,
                                                                              stream=True))  # fmt: skip
    assert streamed == answer.choices[0].text
    assert recorder.auth_of("POST", "/v1/completions") == [f"Bearer {SECOND}"] * 2  # the client's, unchanged

    assert [m.id for m in client.models.list()] == ["fake"]
    assert f"Bearer {SECOND}" in recorder.auth_of("GET", "/v1/models")  # the client's model list: its own key
    # The router's own probes carry its first key (the engine answers its model list: adapters known).
    assert f"Bearer {FIRST}" in recorder.auth_of("GET", "/v1/models")
    replicas = httpx.get(f"{router.url}/debug/replicas", headers={"x-api-key": SECOND}, timeout=5).json()
    assert replicas["unified"][0]["adapters"] == []

    by_header = httpx.post(f"{router.url}/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2},
                           headers={"x-api-key": SECOND}, timeout=10)  # fmt: skip
    assert by_header.status_code == 200
    _, _, last = [r for r in recorder.requests if r[:2] == ("POST", "/v1/completions")][-1]
    assert last.get("x-api-key") == SECOND and "authorization" not in last

    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{router.url}{path}", timeout=5).status_code == 200, path
    assert httpx.get(f"{router.url}/debug/replicas", timeout=5).status_code == 401


def test_a_keyless_router_relays_the_engines_401(servers: Servers) -> None:
    engine, recorder = keyed_engine(servers, "e", ApiKeys([SECOND]))
    router = keyed_router(servers, "--unified-url", engine.url)  # the engine's /ready and /metrics need no key
    with pytest.raises(openai.AuthenticationError):
        client_of(router, "sk-wrong").completions.create(model="fake", prompt="hi", max_tokens=2)
    assert client_of(router, SECOND).completions.create(model="fake", prompt="hi", max_tokens=2).choices[0].text
    assert recorder.auth_of("POST", "/v1/completions") == ["Bearer sk-wrong", f"Bearer {SECOND}"]


def test_router_and_engine_follow_a_rotated_key_file(servers: Servers, tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("sk-old\n")
    engine, recorder = keyed_engine(servers, "e", ApiKeys([], key_file))
    router = keyed_router(servers, "--unified-url", engine.url, "--api-key-file", str(key_file), key="sk-old")
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2}

    def status_with(key: str) -> int:
        return httpx.post(f"{router.url}/v1/completions", json=body, headers={"x-api-key": key}, timeout=10).status_code

    assert (status_with("sk-old"), status_with("sk-new")) == (200, 401)
    fresh = tmp_path / "api-key.new"
    fresh.write_text("# rotated\nsk-new\n")
    os.replace(fresh, key_file)  # the kubelet swaps a mounted Secret the same way: a new file moved in
    wait_for(lambda: status_with("sk-new") == 200, timeout=30, what="the router and the engine to take the new key")
    assert status_with("sk-old") == 401
    # The router's own calls now carry the new key too.
    wait_for(lambda: recorder.auth_of("GET", "/v1/models")[-1] == "Bearer sk-new", timeout=30, what="probes")


@pytest.fixture
def real_service(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A real engine keyed by a file behind a real router keyed by $TIDEPOOL_API_KEY: (router URL, engine URL)."""
    key_file = tmp_path / "api-key"
    key_file.write_text(f"{SECOND}\n")
    engine = spawn(tmp_path, "engine", ["serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny",
                                        "--max-model-len", "256", "--api-key-file", str(key_file)])  # fmt: skip
    monkeypatch.setenv(ENV_VAR, SECOND)
    router = spawn(tmp_path, "router", ["router", "--health-interval", "0.2", "--unified-url", engine.url])
    monkeypatch.delenv(ENV_VAR)
    try:
        wait_ready(engine, router)
        yield router.url, engine.url
    finally:
        for proc in (router, engine):
            proc.stop()


def test_real_router_and_engine_need_the_key(real_service: tuple[str, str]) -> None:
    router_url, engine_url = real_service
    for url in (router_url, engine_url):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()
        assert httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "a"}, timeout=10).status_code == 401
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 200, (url, path)
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key=SECOND, max_retries=0, timeout=60)
    answer = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert httpx.post(f"{engine_url}/tokenize", json={"prompt": "a"}, timeout=10).status_code == 401
