"""Disaggregated serving through the router: 1 prefill + 2 decode real `tidepool serve` processes (tiny model).

The router runs the hand-off (see tidepool.router.proxy); engine a of the shared
`engine_fleet` fixture, a unified replica, gives the reference output.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from router_helpers import Engines, Proc, free_port, metric_value, replica_states, wait_for, wait_ready

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox jumps over the lazy dog", "def fibonacci(n):", "Once upon a time"]


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def pd_fleet(engine_fleet: Engines) -> Iterator[tuple[Proc, dict[str, Proc], Proc]]:
    """(prefill, {kv addr: decode}, router)"""
    timeout = ("--kv-transfer-timeout", "10")
    prefill = engine_fleet.serve("prefill", "--role", "prefill", *timeout)
    decoders = {}
    for name in ("d1", "d2"):
        kv_port = free_port()
        decoders[f"127.0.0.1:{kv_port}"] = engine_fleet.serve(
            name, "--role", "decode", "--kv-port", str(kv_port), *timeout, controlled=True
        )
    flags = ["--prefill-url", prefill.url]
    for addr, proc in decoders.items():
        flags += ["--decode-url", f"{proc.url},kv={addr}"]
    router = engine_fleet.router(*flags, "--policy", "prefix-aware")
    try:
        wait_ready(prefill, *decoders.values(), router)
        wait_for(lambda: list(replica_states(router.url, "decode").values()) == ["ready"] * 2, what="decode ready")
        yield prefill, decoders, router
    finally:
        for proc in (router, prefill, *decoders.values()):
            proc.stop()


def test_disaggregated_output_is_identical_to_unified_serving(
    engine_fleet: Engines, pd_fleet: tuple[Proc, dict, Proc]
) -> None:
    _, decoders, router = pd_fleet
    unified, routed = api(engine_fleet.a.url), api(router.url)
    served_by = set()
    for prompt in PROMPTS:
        kwargs: dict[str, Any] = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        want = unified.completions.create(**kwargs).choices[0]
        raw = routed.completions.with_raw_response.create(**kwargs)
        served_by.add(raw.headers["x-tidepool-replica"])
        got = raw.parse().choices[0]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
        stream = routed.completions.create(stream=True, **kwargs)
        assert "".join(chunk.choices[0].text for chunk in stream) == want.text
    assert served_by <= {proc.url.removeprefix("http://") for proc in decoders.values()}
    messages: Any = [{"role": "user", "content": "hello there"}]
    want_chat = unified.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    got_chat = routed.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert got_chat.choices[0].message.content == want_chat.choices[0].message.content


def test_a_killed_decode_replica_never_hangs_requests_and_is_routed_around(
    engine_fleet: Engines, pd_fleet: tuple[Proc, dict, Proc]
) -> None:
    prefill, decoders, router = pd_fleet
    results: dict[int, str] = {}

    def run(i: int) -> None:
        kwargs: dict[str, Any] = dict(model="tiny", prompt=f"Tale {i}: in a land far away", max_tokens=300,
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        try:
            if i % 2:
                stream = api(router.url).completions.create(stream=True, **kwargs)
                results[i] = "".join(chunk.choices[0].text for chunk in stream)
            else:
                results[i] = api(router.url).completions.create(**kwargs).choices[0].text
        except openai.APIError as err:
            results[i] = f"error: {err!r}"

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(6)]
    for proc in decoders.values():  # requests stay in flight on both until one is killed, however fast they decode
        proc.hold()
    try:
        for thread in threads:
            thread.start()
        # Six requests on two replicas: one of them ends up holding at least two.
        wait_for(lambda: max(p.num_held() for p in decoders.values()) >= 2, timeout=90,
                 what="requests held in flight on a decode replica")  # fmt: skip
        victim = max(decoders.values(), key=lambda p: p.num_held())
        victim.proc.send_signal(signal.SIGKILL)
    finally:
        for proc in decoders.values():
            proc.hold(False)
    for thread in threads:
        thread.join(180)
        assert not thread.is_alive(), "a request hung after its decode replica was killed"
    assert len(results) == len(threads)
    survivor = next(proc for proc in decoders.values() if proc is not victim)
    for i in range(3):
        raw = api(router.url).completions.with_raw_response.create(model="tiny", prompt=f"after {i}", max_tokens=3)
        assert raw.headers["x-tidepool-replica"] == survivor.url.removeprefix("http://")
    assert replica_states(router.url, "decode")[victim.url] == "ejected"
    assert metric_value(router.url, 'tidepool_router_replicas{pool="decode",state="ready"}') == 1
    # Nothing leaks on the engines that stayed up, whatever happened to the transfers in flight.
    for proc in (prefill, survivor):
        deadline = time.monotonic() + 30
        while True:
            kv = httpx.get(f"{proc.url}/debug/kv", timeout=5).json()
            if kv["num_free_blocks"] == kv["num_blocks"] and kv["num_unfinished"] == 0:
                break
            assert time.monotonic() < deadline, f"{proc.url} KV pool not free: {kv}"
            time.sleep(0.2)
