"""Concurrency, disconnects and aborts, and the vLLM metrics as load moves (parsed with prometheus_client)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_proc import Server

from tidepool.contract import metrics_names as names


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics keyed by (sample name, sorted labels)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({names.MODEL_NAME_LABEL: "tiny", **labels}.items())))
    return samples.get(key, 0.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_64_concurrent_streams(server: Server) -> None:
    max_tokens = 12
    client = openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=240)

    async def one(i: int) -> tuple[str, int, str | None]:
        stream = await client.completions.create(
            model=server.model, prompt=f"Request number {i}:", max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, usage, finish = "", 0, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage, finish

    async def main() -> list[tuple[str, int, str | None]]:
        return await asyncio.gather(*(one(i) for i in range(64)))

    before = scrape(server)
    results = asyncio.run(main())
    assert all(usage == max_tokens and finish == "length" for _, usage, finish in results)
    # Greedy: what was streamed under load equals the non-streamed result for the same prompt.
    sync = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)
    for i in (0, 31, 63):
        full = sync.completions.create(model=server.model, prompt=f"Request number {i}:", max_tokens=max_tokens,
                                       temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert results[i][0] == full.choices[0].text
    after = scrape(server)
    generated = value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    assert generated == 64 * max_tokens + 3 * max_tokens
    finished = value(after, "vllm:request_success_total", finished_reason="length") - value(
        before, "vllm:request_success_total", finished_reason="length"
    )
    assert finished == 67
    server.wait_pool_free()


@pytest.fixture(scope="module")
def held(serve_controlled: Callable[..., Server]) -> Server:
    """A server whose engine the test holds mid-generation: "while it runs" is then certain, however fast
    the machine decodes (on a fast one a 900-token request can finish before any client timeout)."""
    return serve_controlled()


def test_metrics_move_with_load(held: Server) -> None:
    server = held
    server.wait_pool_free()
    before = scrape(server)
    for family in (*names.GAUGES, *names.HISTOGRAMS):
        assert any(key[0].startswith(family) for key in before), family
    for counter in names.COUNTERS:
        if counter != names.REQUEST_SUCCESS:  # labelled by finished_reason: no sample before a request finishes
            assert any(key[0] == names.sample_total(counter) for key in before), counter
    assert value(before, names.NUM_REQUESTS_RUNNING) == 0 and value(before, names.KV_CACHE_USAGE_PERC) == 0

    # A long request in the background: while it runs, the gauges show it.
    done = threading.Event()
    result: dict[str, Any] = {}

    def long_request() -> None:
        body = {"model": "tiny", "prompt": "x " * 300, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        result["resp"] = httpx.post(server.api + "/completions", json=body, timeout=120).json()
        done.set()

    with server.holding():
        thread = threading.Thread(target=long_request)
        thread.start()
        server.wait_held(1)
        during = scrape(server)
    assert value(during, names.NUM_REQUESTS_RUNNING) == 1
    assert value(during, names.KV_CACHE_USAGE_PERC) > 0
    thread.join(120)
    assert done.is_set()
    usage = result["resp"]["usage"]
    server.wait_pool_free()
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == 200
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:prefix_cache_queries_total") >= usage["prompt_tokens"] - 16
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):  # fmt: skip
        assert delta(f"vllm:{hist}_count") == 1, hist
    assert delta("vllm:inter_token_latency_seconds_count") == 199
    assert delta("vllm:time_per_output_token_seconds_count") == 199  # vLLM's older name, read by its dashboards
    assert delta("vllm:request_generation_tokens_sum") == 200
    assert delta("vllm:iteration_tokens_total_count") >= 200
    e2e = delta("vllm:e2e_request_latency_seconds_sum")
    parts = delta("vllm:request_queue_time_seconds_sum") + delta("vllm:request_prefill_time_seconds_sum")
    assert parts + delta("vllm:request_decode_time_seconds_sum") <= e2e + 1e-6
    assert value(after, names.NUM_REQUESTS_RUNNING) == 0 and value(after, names.KV_CACHE_USAGE_PERC) == 0

    # The same prompt again hits the prefix cache.
    httpx.post(server.api + "/completions", json={"model": "tiny", "prompt": "x " * 300, "max_tokens": 1}, timeout=60)
    again = scrape(server)
    assert value(again, "vllm:prefix_cache_hits_total") - value(after, "vllm:prefix_cache_hits_total") >= 256


def _aborted_since(server: Server, before: dict) -> float:
    after = scrape(server)
    name = "vllm:request_success_total"
    return value(after, name, finished_reason="abort") - value(before, name, finished_reason="abort")


def test_stream_disconnect_frees_blocks(held: Server) -> None:
    server = held
    server.wait_pool_free()
    before = scrape(server)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with server.holding():
        with httpx.Client(timeout=60) as client, client.stream("POST", server.api + "/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: a dropped iterator closes the response, which is the disconnect
            assert next(lines).startswith("data: ")  # the first token
            server.wait_held(1)
            kv = server.kv()
            assert kv["num_running"] == 1 and kv["num_free_blocks"] < kv["num_blocks"], kv
        # Leaving the block closes the connection mid-stream; the engine still holds, so only the abort
        # can free the blocks.
        server.wait_pool_free()
    assert _aborted_since(server, before) == 1


def test_non_stream_disconnect_frees_blocks(held: Server) -> None:
    server = held
    server.wait_pool_free()
    before = scrape(server)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 900, "ignore_eos": True, "n": 2}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    with server.holding(), contextlib.closing(conn):
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        server.wait_held(2)  # both choices are generating; no answer can have been sent
        kv = server.kv()
        assert kv["num_running"] == 2 and kv["num_free_blocks"] < kv["num_blocks"], kv
        conn.close()  # the client goes away before the (non-streamed) answer
        server.wait_pool_free()
    assert _aborted_since(server, before) == 2


def test_async_client_abort_frees_blocks(held: Server) -> None:
    server = held
    server.wait_pool_free()
    before = scrape(server)
    client = openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)

    async def main() -> None:
        streams = [
            await client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": str(i)}],
                                                 max_tokens=900, stream=True, extra_body={"ignore_eos": True})
            for i in range(4)
        ]  # fmt: skip
        server.wait_held(4)  # all four generating, none can finish
        for stream in streams:
            async for _ in stream:
                break
            await stream.close()

    with server.holding():
        asyncio.run(main())
        server.wait_pool_free()  # still held: only the four aborts can free the blocks
    assert _aborted_since(server, before) == 4
