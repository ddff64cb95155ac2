"""The router in front of two real `tidepool serve` processes (tiny model), driven by the official `openai` client.

Order matters (pytest runs a module's tests in file order): the kill test kills engine b, and
the holding test then brings b back on the same port while a request waits for it.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import openai
import pytest
from router_helpers import Engines, Proc, engine_counters, metric_value, replica_states, wait_for, wait_ready

from tidepool.router.cli import build_parser
from tidepool.router.policy import HashRing
from tidepool.router.prefix import prefix_key

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox jumps over the lazy dog", "def fibonacci(n):", "Once upon a time"]
SHARED_PREFIX = " ".join(f"rule {i}: answer briefly and cite the section you used." for i in range(8))  # ~420 chars


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(url: str, prompt: str, **kwargs: Any) -> str:
    out = api(url).completions.create(model="tiny", prompt=prompt, temperature=0, **kwargs)
    return out.choices[0].text


def router_flags(engine_fleet: Engines) -> list[str]:
    return ["--unified-url", engine_fleet.a.url, "--unified-url", engine_fleet.b.url, "--policy", "prefix-aware"]


def prompts_placed(engine_fleet: Engines, per_replica: int) -> list[str]:
    """Short prompts, `per_replica` of them hashed to each replica by the router's own key and ring (the
    replicas' ports are random, so fixed prompts could all land on one), alternating a and b."""
    args = build_parser().parse_args(router_flags(engine_fleet))
    ring = HashRing([engine_fleet.a.url, engine_fleet.b.url], args.virtual_nodes)
    placed: dict[str, list[str]] = {engine_fleet.a.url: [], engine_fleet.b.url: []}
    for i in range(10_000):
        prompt = f"Story {i}: once upon a time there was"
        target = placed[ring.lookup(prefix_key(prompt, args.prefix_block_chars, args.prefix_max_blocks) or b"")]
        if len(target) < per_replica:
            target.append(prompt)
        if all(len(group) == per_replica for group in placed.values()):
            return [p for pair in zip(*placed.values(), strict=True) for p in pair]
    raise AssertionError("no prompts hash to both replicas")


@pytest.fixture(scope="module")
def router(engine_fleet: Engines) -> Proc:
    proc = engine_fleet.router(*router_flags(engine_fleet))
    wait_ready(proc)
    wait_for(lambda: list(replica_states(proc.url).values()) == ["ready", "ready"], what="both replicas ready")
    return proc


def test_greedy_output_is_identical_to_direct_serving_streamed_or_not(engine_fleet: Engines, router: Proc) -> None:
    direct, routed = api(engine_fleet.a.url), api(router.url)
    for prompt in PROMPTS:
        want = direct.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0).choices[0]
        got = routed.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0).choices[0]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
        stream = routed.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == want.text
    messages: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    want_chat = direct.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    got_chat = routed.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
    stream = routed.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_chat.choices[0].message.content
    )
    assert [m.id for m in routed.models.list().data] == ["tiny"]


def test_requests_sharing_a_prefix_land_on_one_replica_and_hit_its_cache(engine_fleet: Engines, router: Proc) -> None:
    urls = (engine_fleet.a.url, engine_fleet.b.url)
    before = {url: engine_counters(url) for url in urls}
    landed = set()
    for i in range(6):
        raw = api(router.url).completions.with_raw_response.create(
            model="tiny", prompt=f"{SHARED_PREFIX} question {i}: why?", max_tokens=4, temperature=0
        )
        landed.add(raw.headers["x-tidepool-replica"])
    assert len(landed) == 1
    target = f"http://{landed.pop()}"
    (other,) = (url for url in urls if url != target)
    after = {url: engine_counters(url) for url in urls}
    queries = after[target]["queries"] - before[target]["queries"]
    hits = after[target]["hits"] - before[target]["hits"]
    assert after[other]["queries"] == before[other]["queries"]  # the other replica saw none of them
    assert queries > 0 and hits / queries > 0.5  # the first request misses; the next five reuse the prefix


def test_a_killed_replica_fails_or_retries_in_flight_requests_and_new_ones_avoid_it(
    engine_fleet: Engines, router: Proc
) -> None:
    prompts = prompts_placed(engine_fleet, 4)  # four on each: b has requests in flight when it is killed
    results: dict[int, tuple[str, str]] = {}

    def run(i: int) -> None:
        kwargs: dict[str, Any] = dict(model="tiny", prompt=prompts[i], max_tokens=300, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        try:
            if i % 2:
                stream = api(router.url).completions.create(stream=True, **kwargs)
                results[i] = ("ok", "".join(chunk.choices[0].text for chunk in stream))
            else:
                results[i] = ("ok", api(router.url).completions.create(**kwargs).choices[0].text)
        except openai.APIError as err:
            results[i] = ("error", repr(err))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    engine_fleet.b.hold()  # b's requests start generating and stay in flight until it is killed, however fast it is
    for thread in threads:
        thread.start()
    wait_for(lambda: engine_fleet.b.num_held() >= 2, timeout=60, what="requests held in flight on b")
    engine_fleet.b.proc.send_signal(signal.SIGKILL)
    for thread in threads:
        thread.join(180)
        assert not thread.is_alive(), "a request hung after its replica was killed"
    assert len(results) == len(prompts)
    for i, (outcome, text) in results.items():
        if outcome == "ok":  # finished on a, or on b before the kill, or retried on a: the same greedy text
            assert text == complete(engine_fleet.a.url, prompts[i], max_tokens=300, extra_body={"ignore_eos": True})
        else:
            assert "failed" in text or "Connection" in text, text
    num_errors = sum(outcome == "error" for outcome, _ in results.values())
    num_retries = metric_value(router.url, 'tidepool_router_retries_total{pool="unified"}')
    assert num_errors + num_retries >= 1  # the requests on b were cut (streams) or retried on a
    for i in range(4):
        raw = api(router.url).completions.with_raw_response.create(model="tiny", prompt=f"after {i}", max_tokens=3)
        assert raw.headers["x-tidepool-replica"] == f"127.0.0.1:{engine_fleet.a.port}"
    assert replica_states(router.url)[engine_fleet.b.url] == "ejected"


def test_a_request_held_at_zero_replicas_is_served_when_a_replica_starts(engine_fleet: Engines) -> None:
    if engine_fleet.b.proc.poll() is None:  # run alone: b is still up
        engine_fleet.b.proc.send_signal(signal.SIGKILL)
        engine_fleet.b.proc.wait(10)
    router = engine_fleet.router("--unified-url", engine_fleet.b.url, "--hold-timeout", "180", "--eject-seconds", "0")
    wait_ready(router)
    held = 'tidepool_router_held_requests{pool="unified"}'
    result: list[str] = []
    sender = threading.Thread(target=lambda: result.append(complete(router.url, PROMPTS[0], max_tokens=8)))
    sender.start()
    wait_for(lambda: metric_value(router.url, held) == 1, what="the request to be held")
    wait_ready(engine_fleet.restart_b())
    sender.join(60)
    assert result == [complete(engine_fleet.a.url, PROMPTS[0], max_tokens=8)]
    assert metric_value(router.url, held) == 0
