"""A live engine's `/metrics` against the Gateway API Inference Extension's model-server protocol.

The protocol (gateway-api-inference-extension, docs/proposals/003-model-server-protocol) is how
Envoy-based gateways and llm-d's endpoint picker choose a replica. For a vLLM-compatible server it
reads `vllm:num_requests_waiting` and `vllm:num_requests_running` (gauges, request counts),
`vllm:kv_cache_usage_perc` (a gauge, fraction 0..1) and, optionally, `vllm:cache_config_info`
(value 1, labels `block_size` and `num_gpu_blocks`). The names are spelled out here on purpose: they
are the external protocol this test holds the engine's one source (metrics_names) to.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from serve_proc import Server

from tidepool.contract import metrics_names as names

PROTOCOL_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
PROTOCOL_CACHE_INFO = "vllm:cache_config_info"
CACHE_INFO_LABELS = ("block_size", "num_gpu_blocks")


def families(server: Server) -> dict[str, tuple[str, list[Sample]]]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def gauge(server: Server, name: str) -> float:
    kind, samples = families(server)[name]
    assert kind == "gauge", (name, kind)
    (sample,) = samples
    return sample.value


def test_the_engine_names_are_the_protocols() -> None:
    assert (names.NUM_REQUESTS_WAITING, names.NUM_REQUESTS_RUNNING, names.KV_CACHE_USAGE_PERC) == PROTOCOL_GAUGES
    assert names.CACHE_CONFIG_INFO == PROTOCOL_CACHE_INFO
    assert set(PROTOCOL_GAUGES) | {PROTOCOL_CACHE_INFO} <= set(names.GAUGES)


def test_protocol_metrics_have_their_types_and_ranges(server: Server) -> None:
    scraped = families(server)
    for name in PROTOCOL_GAUGES:
        kind, samples = scraped[name]
        assert kind == "gauge", (name, kind)
        (sample,) = samples  # one series per engine, labelled with the served model
        assert sample.labels == {names.MODEL_NAME_LABEL: server.model}, sample
        if name != names.KV_CACHE_USAGE_PERC:
            assert sample.value >= 0 and float(sample.value).is_integer(), sample  # a request count
    assert 0.0 <= gauge(server, PROTOCOL_GAUGES[2]) <= 1.0

    kind, samples = scraped[PROTOCOL_CACHE_INFO]
    assert kind == "gauge"
    (info,) = samples
    assert info.value == 1.0
    block_size, num_gpu_blocks = (int(info.labels[label]) for label in CACHE_INFO_LABELS)
    kv = server.kv()
    assert block_size >= 1 and num_gpu_blocks == kv["num_blocks"] >= 1, (info.labels, kv)


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_queue_gauges_follow_the_engine(serve_controlled: Callable[..., Server]) -> None:
    server = serve_controlled()
    server.pause()  # nothing gets scheduled: every request waits, exactly as many as were sent
    body: dict[str, Any] = {"model": server.model, "prompt": "hello there", "max_tokens": 4}
    replies: list[httpx.Response] = []

    def send() -> None:
        replies.append(httpx.post(server.api + "/completions", json=body, timeout=120))

    threads = [threading.Thread(target=send) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        _wait_for(lambda: gauge(server, PROTOCOL_GAUGES[0]) == 3, "three waiting requests in /metrics")
        assert gauge(server, PROTOCOL_GAUGES[1]) == 0
        assert 0.0 <= gauge(server, PROTOCOL_GAUGES[2]) <= 1.0
    finally:
        server.pause(False)
        for thread in threads:
            thread.join(120)
    assert [r.status_code for r in replies] == [200, 200, 200]
    server.wait_pool_free()
    # The engine loop publishes /debug/kv a moment before /metrics: wait for all three together.
    _wait_for(lambda: [gauge(server, name) for name in PROTOCOL_GAUGES] == [0, 0, 0], "idle gauges in /metrics")
