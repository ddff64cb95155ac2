"""The prefill→decode hand-off protocol, against fake engines that honour it; and Kubernetes discovery."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
from router_fake_engine import FakeEngine, ThreadServer, fake_tokens
from router_helpers import Servers, metric_value

from tidepool.router.discovery import KubernetesConfig, KubernetesDiscovery
from tidepool.router.pool import Endpoint

PROMPT = "Explain prefill and decode"


def disaggregated(servers: Servers) -> tuple[FakeEngine, dict[str, FakeEngine], ThreadServer]:
    producer, p = servers.engine("prefill")
    decoders = {}
    flags = ["--prefill-url", p.url]
    for name in ("d1", "d2"):
        fake, server = servers.engine(name)
        decoders[f"127.0.0.1:{server.port}"] = fake
        flags += ["--decode-url", f"{server.url},kv=127.0.0.1:{server.port}"]  # the fake's KV "listener"
    router = servers.router(*flags, wait_ready=2, pool="decode")
    return producer, decoders, router


def test_handoff_gives_the_unified_output_streaming_or_not(servers: Servers) -> None:
    producer, decoders, router = disaggregated(servers)
    api = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=20)
    want = " ".join(fake_tokens(PROMPT, 0, 6))
    raw = api.completions.with_raw_response.create(
        model="fake", prompt=PROMPT, max_tokens=6, extra_body={"min_tokens": 2}
    )
    assert raw.parse().choices[0].text == want
    stream = api.completions.create(model="fake", prompt=PROMPT, max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want
    chat = api.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.content == " ".join(fake_tokens("user:hi\n", 0, 3))

    assert len(producer.bodies) == 3
    first = producer.bodies[0]
    params = first["kv_transfer_params"]
    assert (first["stream"], first["max_tokens"], "min_tokens" in first) == (False, 1, False)
    assert params["role"] == "producer" and len(params["transfer_id"]) == 32
    consumer = decoders[params["decode_kv_addr"]]  # the decode replica the KV was pushed to answered
    assert raw.headers["x-tidepool-replica"] == params["decode_kv_addr"]
    body = consumer.bodies[0]
    assert body["kv_transfer_params"] == {"role": "consumer", "transfer_id": params["transfer_id"]}
    assert (body["max_tokens"], body["min_tokens"], body.get("stream")) == (6, 2, None)  # the client's own body
    assert sum(len(d.bodies) for d in decoders.values()) == 3
    assert all(not d.transfers for d in decoders.values())  # every transfer was claimed
    assert metric_value(router.url, 'tidepool_router_held_requests{pool="decode"}') == 0


def test_a_failed_decode_replica_retries_the_whole_handoff_elsewhere(servers: Servers) -> None:
    producer, decoders, router = disaggregated(servers)
    decoders[min(decoders)].script = [500]  # least-load picks it first (a tie, broken by URL); the retry: the other
    out = httpx.post(f"{router.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=10)
    assert out.status_code == 200 and out.json()["choices"][0]["text"] == " ".join(fake_tokens(PROMPT, 0, 4))
    ids = [b["kv_transfer_params"]["transfer_id"] for b in producer.bodies]
    addrs = [b["kv_transfer_params"]["decode_kv_addr"] for b in producer.bodies]
    assert len(ids) == 2 and ids[0] != ids[1] and addrs[0] != addrs[1]
    assert metric_value(router.url, 'tidepool_router_retries_total{pool="decode"}') == 1


def test_prefill_errors_reach_the_client_or_are_retried(servers: Servers) -> None:
    producer, decoders, router = disaggregated(servers)
    producer.script = [400]  # the client's fault: relayed, no decode call
    out = httpx.post(f"{router.url}/v1/completions", json={"prompt": PROMPT}, timeout=10)
    assert out.status_code == 400 and "scripted" in out.json()["error"]["message"]
    assert not any(d.bodies for d in decoders.values())
    producer.script = [503, 503, 503]  # the only prefill replica keeps failing: the last error after trying it
    out = httpx.post(f"{router.url}/v1/completions", json={"prompt": PROMPT}, timeout=10)
    assert out.status_code == 503 and not any(d.bodies for d in decoders.values())


def test_kubernetes_discovery_lists_endpointslices_with_the_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    seen: list[httpx.Request] = []
    healthy = True

    def api(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if not healthy:
            return httpx.Response(500, json={"kind": "Status"})
        service = request.url.params["labelSelector"].split("=", 1)[1]
        slice_ = {
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000}, {"name": "kv", "port": 14579}],
            "endpoints": [{"addresses": [f"10.0.{len(service)}.1"], "conditions": {"ready": True}}],
        }
        return httpx.Response(200, json={"items": [slice_]})

    config = KubernetesConfig("serving", {"prefill": "svc-p", "decode": "svc-dec"}, "https://api:6443", token, None)
    discovery = KubernetesDiscovery(config, transport=httpx.MockTransport(api))
    updates: dict[str, list[Endpoint]] = {}

    async def on_update(pool: str, endpoints: list[Endpoint]) -> None:
        updates[pool] = endpoints

    async def poll() -> None:
        async with discovery._client() as client:
            await discovery.poll_once(client, on_update)

    asyncio.run(poll())
    assert updates == {
        "prefill": [Endpoint("http://10.0.5.1:8000", "10.0.5.1:14579")],
        "decode": [Endpoint("http://10.0.7.1:8000", "10.0.7.1:14579")],
    }
    request = seen[0]
    assert request.url.path == "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices"
    assert request.headers["authorization"] == "Bearer secret-token"
    healthy, updates = False, {}
    asyncio.run(poll())
    assert updates == {}  # an API error keeps the last membership (no update at all)
