"""The router against fake engines (in-process): proxying, retries, stream cuts, holding, disconnects, metrics."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from router_fake_engine import fake_tokens
from router_helpers import Servers, free_port, metric_value, replica_states, wait_for

from tidepool.router.cli import main as router_main

PROMPT = "The quick brown fox"


def client(router_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0, timeout=20)


def expected(prompt: str, n: int) -> str:
    return " ".join(fake_tokens(prompt, 0, n))


def test_proxies_completions_and_chat_streaming_and_not(servers: Servers) -> None:
    _, a = servers.engine("a")
    _, b = servers.engine("b")
    router = servers.router("--unified-url", a.url, "--unified-url", b.url, "--policy", "round-robin", wait_ready=2)
    api = client(router.url)
    out = api.completions.create(model="fake", prompt=PROMPT, max_tokens=5)
    assert out.choices[0].text == expected(PROMPT, 5)
    stream = api.completions.create(model="fake", prompt=PROMPT, max_tokens=7, stream=True)
    chunks = [c.choices[0].text for c in stream]
    assert len(chunks) == 7 and "".join(chunks) == expected(PROMPT, 7)  # one event per chunk, passed through
    messages = [{"role": "user", "content": "hi"}]
    chat = api.chat.completions.create(model="fake", messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == expected("user:hi\n", 4)
    stream = api.chat.completions.create(model="fake", messages=messages, max_tokens=4, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected("user:hi\n", 4)
    assert [m.id for m in api.models.list().data] == ["fake"]
    assert metric_value(router.url, 'tidepool_router_requests_total{code="200",pool="unified",replica="'
                        f'127.0.0.1:{a.port}"}}') == 2  # fmt: skip
    assert httpx.get(f"{router.url}/ready").status_code == 200
    assert httpx.get(f"{router.url}/health").json() == {"status": "ok"}
    bad = httpx.post(f"{router.url}/v1/completions", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_5xx_and_429_are_retried_on_another_replica_then_the_last_error_is_returned(servers: Servers) -> None:
    fakes = {server: fake for fake, server in (servers.engine("a"), servers.engine("b"))}
    first, second = sorted(fakes, key=lambda s: s.url)
    router = servers.router(*(f"--unified-url={s.url}" for s in fakes), "--policy", "round-robin", wait_ready=2)
    fakes[first].script = [500]
    out = httpx.post(f"{router.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=10)
    assert out.status_code == 200 and out.json()["choices"][0]["text"] == expected(PROMPT, 3)
    assert out.headers["x-tidepool-replica"] == f"127.0.0.1:{second.port}"
    assert len(fakes[first].bodies) == 1 and len(fakes[second].bodies) == 1
    assert metric_value(router.url, 'tidepool_router_retries_total{pool="unified"}') == 1
    # Both fail (a 429 and a 503): after trying each once, the client gets the last upstream error.
    fakes[second].script, fakes[first].script = [429], [503]
    out = httpx.post(f"{router.url}/v1/completions", json={"prompt": PROMPT, "stream": True}, timeout=10)
    assert out.status_code in (429, 503) and "scripted" in out.json()["error"]["message"]
    assert metric_value(router.url, 'tidepool_router_retries_total{pool="unified"}') == 2


def test_a_dead_replica_is_retried_around_and_ejected(servers: Servers) -> None:
    _, a = servers.engine("a")
    fake_b, b = servers.engine("b")
    router = servers.router(f"--unified-url={a.url}", f"--unified-url={b.url}", "--policy", "round-robin",
                            "--health-interval", "60", wait_ready=2)  # fmt: skip
    a.stop()  # the router does not know yet: its next probe is a minute away
    for _ in range(3):
        out = httpx.post(f"{router.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=10)
        assert out.status_code == 200
    assert len(fake_b.bodies) == 3
    assert replica_states(router.url)[a.url] == "ejected"
    assert metric_value(router.url, 'tidepool_router_replicas{pool="unified",state="ejected"}') == 1


def test_a_stream_cut_after_the_first_event_ends_with_an_error_event_and_is_not_retried(servers: Servers) -> None:
    fake_a, a = servers.engine("a")
    fake_b, b = servers.engine("b")
    router = servers.router(f"--unified-url={a.url}", f"--unified-url={b.url}", "--policy", "round-robin",
                            wait_ready=2)  # fmt: skip
    first = fake_a if a.url < b.url else fake_b
    first.script = ["cut"]
    stream = client(router.url).completions.create(model="fake", prompt=PROMPT, max_tokens=5, stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="failed"):
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts == [expected(PROMPT, 1)]
    assert len(fake_a.bodies) + len(fake_b.bodies) == 1  # never retried once a byte went out
    assert metric_value(router.url, 'tidepool_router_retries_total{pool="unified"}') == 0


def test_requests_are_held_at_zero_replicas_then_503_after_the_hold_timeout(servers: Servers) -> None:
    router = servers.router(f"--unified-url=http://127.0.0.1:{free_port()}", "--hold-timeout", "0.5")
    start = time.monotonic()
    out = httpx.post(f"{router.url}/v1/chat/completions", json={"messages": []}, timeout=10)
    assert out.status_code == 503 and time.monotonic() - start >= 0.5
    error = out.json()["error"]
    assert error["code"] == "no_ready_replica" and "held for 0.5 s" in error["message"]
    assert out.headers["retry-after"] == "1"
    assert metric_value(router.url, 'tidepool_router_held_requests{pool="unified"}') == 0


def test_held_requests_are_released_when_a_replica_appears(servers: Servers) -> None:
    port = free_port()
    router = servers.router(f"--unified-url=http://127.0.0.1:{port}", "--hold-timeout", "60", "--eject-seconds", "0")
    results: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: results.append(
        httpx.post(f"{router.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)))  # fmt: skip
    sender.start()
    wait_for(lambda: metric_value(router.url, 'tidepool_router_held_requests{pool="unified"}') == 1, what="held 1")
    servers.engine("late", port)
    sender.join(20)
    assert results and results[0].status_code == 200
    assert metric_value(router.url, 'tidepool_router_held_requests{pool="unified"}') == 0


def test_client_disconnect_closes_the_upstream_request(servers: Servers) -> None:
    fake, a = servers.engine("a")
    router = servers.router(f"--unified-url={a.url}", wait_ready=1)
    fake.script = ["hang"]
    # The client leaves once the engine has the request (an event, not a client timeout that a slow router
    # could outlast before it even forwarded).
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT}),
                 headers={"Content-Type": "application/json"})  # fmt: skip
    wait_for(lambda: len(fake.bodies) == 1, what="the engine to get the request")
    conn.close()
    wait_for(lambda: fake.num_cancelled == 1, what="the engine to see the disconnect")
    fake.token_delay_s = 0.2
    body = {"prompt": PROMPT, "max_tokens": 100, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=10) as response:
        assert next(response.iter_raw()).startswith(b"data: ")  # then the client goes away mid-stream
    wait_for(lambda: fake.num_cancelled == 2, what="the engine to see the disconnect")
    inflight = lambda: httpx.get(f"{router.url}/debug/replicas").json()["unified"][0]["inflight"]  # noqa: E731
    wait_for(lambda: inflight() == 0, what="in-flight back to 0")
    assert (
        metric_value(
            router.url, f'tidepool_router_requests_total{{code="499",pool="unified",replica="127.0.0.1:{a.port}"}}'
        )
        == 1
    )


def test_router_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from tidepool.router.cli import build_config, build_parser\n"
        "from tidepool.router.app import build_app\n"
        "build_app(build_config(build_parser().parse_args(['--unified-url', 'http://h:1'])))\n"
        "assert 'torch' not in sys.modules, 'the router imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "give either --unified-url"),
        (["--unified-url", "http://h:1", "--prefill-url", "http://h:2"], "not a mix"),
        (["--prefill-url", "http://h:2", "--decode-url", "http://h:3"], "needs its KV listener"),
        (["--unified-url", "http://h:1", "--hold-timeout", "-1"], "--hold-timeout must be >= 0"),
        (["--discovery", "kubernetes", "--unified-service", "s"], "needs --namespace"),
        (["--unified-url", "h:1"], "expected http://HOST:PORT"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert router_main(flags) == 2
    assert message in capsys.readouterr().err
