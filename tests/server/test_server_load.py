"""Concurrency, disconnects and aborts, and the vLLM metrics as load moves (parsed with prometheus_client)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_proc import Server

from tidepool.engine import metrics_names as names


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


def test_metrics_move_with_load(server: Server) -> None:
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

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    during = scrape(server)
    while value(during, names.NUM_REQUESTS_RUNNING) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
        during = scrape(server)
    assert value(during, names.NUM_REQUESTS_RUNNING) >= 1
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


def test_stream_disconnect_frees_blocks(server: Server) -> None:
    server.wait_pool_free()
    before = scrape(server)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.api + "/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.kv()["num_free_blocks"] < server.kv()["num_blocks"]
    # Leaving the block closes the connection mid-stream.
    server.wait_pool_free()
    after = scrape(server)
    aborted = value(after, "vllm:request_success_total", finished_reason="abort") - value(
        before, "vllm:request_success_total", finished_reason="abort"
    )
    assert aborted == 1


def test_non_stream_disconnect_frees_blocks(server: Server) -> None:
    server.wait_pool_free()
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 900, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.api + "/completions", json=body, timeout=1.0)
    server.wait_pool_free()


def test_async_client_abort_frees_blocks(server: Server) -> None:
    client = openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)

    async def main() -> None:
        streams = [
            await client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": str(i)}],
                                                 max_tokens=900, stream=True, extra_body={"ignore_eos": True})
            for i in range(4)
        ]  # fmt: skip
        for stream in streams:
            async for _ in stream:
                break
            await stream.close()

    asyncio.run(main())
    server.wait_pool_free()
