"""The router in front of engines the operator put to sleep (`autoscaling.idle: sleep`): requests are held, not failed.

A sleeping engine keeps answering `/ready` 200 (it must stay routed and alive); the router reads the sleep state
from its `/metrics` (tidepool.contract.sleep) and treats it as unready, so requests are held exactly as at zero
replicas (and counted in `tidepool_router_held_requests`, which is what the operator wakes the pool on). A request
that reaches an engine just put to sleep (before the next probe) gets the engine's 503 `sleeping`; the router marks
the replica unready and holds the retry instead of failing it.
"""

from __future__ import annotations

import threading

import openai
import pytest
from router_fake_engine import fake_tokens
from router_helpers import Servers, metric_value, replica_states, wait_for

from tidepool.contract import sleep
from tidepool.router.health import is_asleep

PROMPT = "Sleeping pools hold requests"
HELD = 'tidepool_router_held_requests{pool="unified"}'


def state_lines(current: str, extra_labels: str = "") -> str:
    return "".join(
        f'{sleep.ENGINE_SLEEP_STATE_METRIC}{{{extra_labels}{sleep.SLEEP_STATE_LABEL}="{s}"}} {int(s == current)}.0\n'
        for s in sleep.SLEEP_STATES
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm:num_requests_waiting 0\n", False),  # no sleep mode: awake
        (state_lines(sleep.AWAKE), False),
        (state_lines(sleep.WEIGHTS_OFFLOADED), True),
        (state_lines(sleep.DISCARD_ALL, 'model_name="m",'), True),
        (f'{sleep.ENGINE_SLEEP_STATE_METRIC}{{{sleep.SLEEP_STATE_LABEL}="discard_all"}} x\n', False),  # unparsable
    ],
)
def test_sleep_state_from_metrics(text: str, expected: bool) -> None:
    assert is_asleep(text) is expected


def test_requests_to_a_sleeping_pool_are_held_until_it_wakes(servers: Servers) -> None:
    engine, server = servers.engine("a")
    router = servers.router("--unified-url", server.url, "--hold-timeout", "30", wait_ready=1)
    engine.is_sleeping = True
    wait_for(lambda: replica_states(router.url) == {server.url: "unready"}, what="the sleeping replica unready")
    answers: list[str] = []
    api = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)
    worker = threading.Thread(
        target=lambda: answers.append(api.completions.create(model="fake", prompt=PROMPT, max_tokens=4).choices[0].text)
    )
    worker.start()
    try:
        wait_for(lambda: metric_value(router.url, HELD) == 1.0, what="the request held")
        assert engine.bodies == []  # nothing reached the sleeping engine
        engine.is_sleeping = False  # the operator's POST /wake_up
        worker.join(30)
    finally:
        engine.is_sleeping = False
        worker.join(30)
    assert answers == [" ".join(fake_tokens(PROMPT, 0, 4))]
    assert metric_value(router.url, HELD) == 0.0


def test_a_request_that_meets_an_engine_just_put_to_sleep_is_held_not_failed(servers: Servers) -> None:
    """The engine answers 503 `sleeping` once (slept between two probes): the only replica stays a candidate, and
    the retry is served once the replica is ready again (a failure would exclude it and answer the 503)."""
    engine, server = servers.engine("a")
    router = servers.router("--unified-url", server.url, "--hold-timeout", "30", wait_ready=1)
    engine.script = ["sleeping"]
    api = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = api.completions.create(model="fake", prompt=PROMPT, max_tokens=3)
    assert out.choices[0].text == " ".join(fake_tokens(PROMPT, 0, 3))
    assert len(engine.bodies) == 2
